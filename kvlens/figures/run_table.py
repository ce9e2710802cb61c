"""The runs table: one row per run directory, read from its run.json alone (no tensors are loaded).

`run_table([(path, source), ...])` gives a DataFrame (the prompt's first words, its text group, policy,
parameters, budget, KV storage, model, tokens, perplexity, KL, perturbation, peak KV, saved date, path) and
the sentences of the folders it could not read; `filter_table(frame, text, policies)` narrows it. In a
notebook:

    frame, skipped = run_table([(p, "shipped") for p in Path("cached_runs").iterdir()])
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from kvlens.errors import KvlensError
from kvlens.figures.plots import model_label, storage_label
from kvlens.figures.wording import of_prompt, when
from kvlens.policies import changed_params
from kvlens.runs.meta import RunMeta
from kvlens.runs.run import RUN_JSON, read_meta

COLUMNS = [
    "name",
    "source",
    "prompt",
    "text",
    "policy",
    "params",
    "budget",
    "storage",
    "model",
    "mode",
    "prompt tokens",
    "new tokens",
    "ppl",
    "KL",
    "perturbation",
    "peak KV (MiB)",
    "level",
    "saved",
    "path",
]
SEARCHED = [
    "name",
    "source",
    "prompt",
    "policy",
    "params",
    "budget",
    "storage",
    "model",
    "mode",
    "level",
]  # what the text filter reads


def _budget(meta: RunMeta) -> str:
    slots = meta.budget.slots
    if slots is None:
        return "none"
    return f"{slots} slots" + of_prompt(meta.budget.requested)


PROMPT_WORDS = 6


def _first_words(prompt: str) -> str:
    words = prompt.split()
    return " ".join(words[:PROMPT_WORDS]) + when(len(words) > PROMPT_WORDS, " …")


def run_row(path: str | Path, source: str) -> dict:
    """The table row of one run directory (a KvlensError if its run.json is not a valid manifest)."""
    path = Path(path)
    meta = read_meta(path)
    policy = meta.policy
    name = policy.name
    params = changed_params(name, policy.params)
    metrics = meta.metrics
    peak = metrics.get("kv_bytes_peak")
    return {
        "name": path.name,
        "source": source,
        "prompt": _first_words(meta.prompt),
        "text": tuple(meta.prompt_tokens),  # replaced by its group's letter in `run_table`
        "policy": name,
        "params": ", ".join(f"{k}={v}" for k, v in params.items()),
        "budget": _budget(meta),
        "storage": storage_label(meta.storage, short=True),
        "model": model_label(meta.model.spec),
        "mode": meta.mode,
        "prompt tokens": len(meta.prompt_tokens),
        "new tokens": len(meta.tokens),
        "ppl": metrics.get("ppl"),
        "KL": metrics.get("kl"),
        "perturbation": metrics.get("perturbation_used"),
        "peak KV (MiB)": peak / 2**20 if isinstance(peak, (int, float)) else None,
        "level": str(meta.record.level),
        "saved": datetime.fromtimestamp((path / RUN_JSON).stat().st_mtime, UTC).replace(tzinfo=None),
        "path": str(path),
    }


def run_table(entries: Iterable[tuple[str | Path, str]]) -> tuple[pd.DataFrame, list[str]]:
    """Rows of the `(path, source)` run directories in order, and one sentence per directory left out."""
    rows, skipped = [], []
    for path, source in entries:
        try:
            rows.append(run_row(path, source))
        except (KvlensError, OSError) as err:
            skipped.append(str(err))
    groups: dict[tuple, str] = {}
    for row in rows:  # runs on the same prompt tokens share a letter: their metrics compare
        row["text"] = groups.setdefault(row["text"], _letter(len(groups)))
    return pd.DataFrame(rows, columns=COLUMNS).astype(
        {"ppl": float, "KL": float, "perturbation": float, "peak KV (MiB)": float}
    ), skipped


def _letter(i: int) -> str:
    """A, B, ..., Z, AA, AB, ..."""
    return ("" if i < 26 else _letter(i // 26 - 1)) + chr(ord("A") + i % 26)


def filter_table(frame: pd.DataFrame, text: str = "", policies: Iterable[str] = ()) -> pd.DataFrame:
    """The rows whose text columns hold every word of `text` (any case) and whose policy is in `policies`
    (all policies when empty); the index is reset so row numbers are positions."""
    keep = pd.Series(True, index=frame.index)
    policies = list(policies)
    if policies:
        keep &= frame["policy"].isin(policies)
    haystack = frame[SEARCHED].astype(str).agg(" ".join, axis=1).str.lower()
    for word in text.lower().split():
        keep &= haystack.str.contains(word, regex=False)
    return frame[keep].reset_index(drop=True)
