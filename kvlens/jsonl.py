"""JSON lines (samples files, kvpress files, the streams of a run cut short): one reader."""

from __future__ import annotations

import json
from typing import Any

from kvlens.errors import KvlensError


def json_lines(text: str, path: object = "the file", *, cut_short: bool = False) -> list[tuple[int, Any]]:
    """The items of JSON-lines `text` (from `path`, named in errors), each with its line's number in the file,
    blank lines skipped. Lines end at "\\n" only, not at `splitlines()`'s other breaks: U+2028 may sit inside
    a string. A line that is not JSON is named, with its number in the file, in one sentence; with
    `cut_short`, the last non-blank line is left out instead when it is not JSON (a write interrupted
    mid-line)."""
    lines = [(number, raw) for number, raw in enumerate(text.split("\n"), 1) if raw.strip()]
    items = []
    for i, (number, raw) in enumerate(lines):
        try:
            items.append((number, json.loads(raw)))
        except json.JSONDecodeError as err:
            if cut_short and i == len(lines) - 1:
                break
            raise KvlensError(f"Line {number} of {path} is not valid JSON ({err.msg}).") from None
    return items
