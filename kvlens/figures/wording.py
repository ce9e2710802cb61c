"""Optional parts of the sentences and labels kvlens shows (`", 3 failed"`, `" (published)"`): one helper
instead of a conditional expression at each."""

from __future__ import annotations


def when(cond: object, text: str) -> str:
    """`text` when `cond` is truthy, else the empty string (`text` is built either way: only for text that
    builds without `cond`)."""
    return text if cond else ""


def of_prompt(requested: object) -> str:
    """`" (0.5 of the prompt)"` for a budget asked for as a share of the prompt; nothing for one in slots."""
    if not isinstance(requested, float):
        return ""
    return f" ({requested:g} of the prompt)"


def layers_note(layers: list[int] | None) -> str:
    """`" (layers 0, 15)"` for a run that recorded some layers only; nothing for one that recorded all."""
    return when(layers, f" (layers {', '.join(map(str, layers or ()))})")
