"""Optional parts of the sentences and labels kvlens shows (`", 3 failed"`, `" (published)"`), and defaults
of absent values: one helper each instead of a conditional expression at each."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")

# the mark of a speed target judged on its ratio in process CPU time: `kvlens bench speed` writes it after the
# target (`targets[name]["target"]`), the figures and the app read it there
IN_CPU_TIME = "(CPU time)"


def when(cond: object, text: str) -> str:
    """`text` when `cond` is truthy, else the empty string (`text` is built either way: only for text that
    builds without `cond`)."""
    return text if cond else ""


def suffix(template: str, value: object) -> str:
    """`template` filled in with `value` (a name's optional part); "" when `value` is empty (None, 0, "")."""
    if not value:
        return ""  # not `when`: `template` may not format an empty value (`"{:g}".format(None)` raises)
    return template.format(value)


def if_none(value: T | None, default: T) -> T:
    """`value`, or `default` when it is None (`default` is built either way: only for one that always builds
    and costs nothing)."""
    if value is None:
        return default
    return value


def of_prompt(requested: object) -> str:
    """`" (0.5 of the prompt)"` for a budget asked for as a share of the prompt; nothing for one in slots."""
    if not isinstance(requested, float):
        return ""
    return f" ({requested:g} of the prompt)"


def layers_note(layers: list[int] | None) -> str:
    """`" (layers 0, 15)"` for a run that recorded some layers only; nothing for one that recorded all."""
    return when(layers, f" (layers {', '.join(map(str, layers or ()))})")
