"""The bundled texts: ten State of the Union addresses (`kvlens/data/state_union/`), by id, and prompt
prefixes.

A text id is the file's stem (`1961-Kennedy`). Every part of kvlens that uses the bundled
texts (benchmarks, sweeps, multi-text analyses, the app's Run page) reads them from here.
"""

from __future__ import annotations

from pathlib import Path

from kvlens.errors import KvlensError

DIR = Path(__file__).resolve().parent / "data" / "state_union"


def ids() -> list[str]:
    """The bundled text ids, sorted (by year)."""
    return sorted(p.stem for p in DIR.glob("*.txt"))


def path(text_id: str) -> Path:
    """The file of one bundled text."""
    if text_id not in ids():
        raise KvlensError(f"There is no bundled text '{text_id}'; the bundled texts are {', '.join(ids())}.")
    return DIR / f"{text_id}.txt"


def read(text_id: str) -> str:
    """One bundled text."""
    return path(text_id).read_text(encoding="utf-8")


def bundled(count: int | None = None, min_chars: int = 0) -> dict[str, str]:
    """The first `count` bundled texts (all by default) of at least `min_chars` characters, by id."""
    texts = {i: t for i in ids() if len(t := read(i)) >= min_chars}
    if not texts:
        raise KvlensError(f"No bundled text has at least {min_chars} characters.")
    return dict(list(texts.items())[:count])


def prefix_ids(model, text: str, tokens: int, label: str = "the text") -> list[int]:
    """The first `tokens` token ids of `text` (`model` is a `kvlens.engine.models.LoadedModel`)."""
    ids_ = list(model.tokenizer(text).input_ids)
    if len(ids_) < tokens:
        raise KvlensError(f"{label} has {len(ids_)} tokens, fewer than the {tokens} asked for.")
    return ids_[:tokens]
