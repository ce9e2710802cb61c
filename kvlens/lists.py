"""Comma-separated lists typed by users (`--prefill 256,512`, `--depths 0,0.5,1`, layers `0,15,29`): one
parser."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvlens.errors import KvlensError

_NOUNS: dict[Callable[..., Any], str] = {int: "integers", float: "numbers"}


def parse_list(
    text: str, what: str, kind: Callable = int, minimum: float | None = None, maximum: float | None = None
) -> list:
    """The values of `text` as `kind` (int, float, or a parser such as `parse_budget` that raises
    `KvlensError`), each within [minimum, maximum]; `what` names the setting in the error sentence."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise KvlensError(f"{what} needs at least one value; got '{text}'.")
    try:
        values = [kind(x) for x in items]
    except KvlensError:
        raise
    except ValueError:
        raise KvlensError(
            f"{what} takes comma-separated {_NOUNS.get(kind, 'values')}; got '{text}'."
        ) from None
    for v in values:
        if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
            bounds = f"in [{minimum}, {maximum}]"
            if minimum is None:
                bounds = f"at most {maximum}"
            elif maximum is None:
                bounds = f"at least {minimum}"
            raise KvlensError(f"{what} takes values {bounds}; got {v}.")
    return values
