"""Analyses over several texts or lengths: they run the model themselves (the rest of the package only reads runs).

- `merging_ratio_over_texts`: KVMerger Fig. 3b (layer-wise merging-set compression ratio, one
  curve per text: the paper's claim is that the curves coincide).
- `corm_over_lengths`: CORM Fig. 4 (compression rate CORM reaches against sequence length,
  averaged over texts).
Texts default to the bundled State of the Union addresses (`kvlens.texts`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvlens.analysis.merging import MergingRatio, merging_ratio
from kvlens.engine.loop import RunOptions, run
from kvlens.engine.models import LoadedModel
from kvlens.policies import make_policy
from kvlens.runs.run import Run
from kvlens.texts import prefix_ids


def record_states(model: LoadedModel, ids: list[int], layers: list[int] | None = None) -> Run:
    """A full-cache run over `ids` with prefill states recorded (one generated token)."""
    opts = RunOptions(max_new_tokens=1, record="states", record_layers=layers, log_decisions=False)
    return run(model, make_policy("full"), ids, prefill=len(ids), steps=1, teacher=False, opts=opts)


def merging_ratio_over_texts(model: LoadedModel, texts: dict[str, str], tokens: int = 1024,
                             threshold: float = 0.75,
                             on_text: Callable[[str], None] | None = None) -> dict[str, MergingRatio]:
    """KVMerger Fig. 3b: `merging_ratio` of the first `tokens` tokens of each text, by label."""
    out = {}
    for label, text in texts.items():
        if on_text:
            on_text(label)
        out[label] = merging_ratio(record_states(model, prefix_ids(model, text, tokens, label)), threshold)
    return out


@dataclass
class CormLengths:
    """`ratio` `(texts, lengths)`: share of the prompt's KV entries CORM removed after prefill."""

    lengths: list[int]
    labels: list[str]
    ratio: torch.Tensor
    params: dict

    def mean(self) -> list[float]:
        return self.ratio.mean(0).tolist()


def corm_over_lengths(model: LoadedModel, texts: dict[str, str], lengths: list[int], params: dict | None = None,
                      on_text: Callable[[str], None] | None = None) -> CormLengths:
    """CORM Fig. 4: for each text and length n, prefill its first n tokens under `corm` and report
    `1 - kept entries / n`, averaged over layers and KV heads (the policy's step-0 compression
    uses the last `window` prefill rows as its recent messages)."""
    resolved = make_policy("corm", params).params()  # validates before any run
    rows = []
    for label, text in texts.items():
        if on_text:
            on_text(label)
        ids = prefix_ids(model, text, max(lengths), label)
        row = []
        for n in lengths:
            r = run(model, make_policy("corm", params), ids[:n], prefill=n, steps=1, teacher=False,
                    opts=RunOptions(max_new_tokens=1, log_decisions=False))
            kept = r.tensor("steps/kv_slots")[0].float()  # (L, Hkv) after the prefill compression
            row.append(1 - float(kept.mean()) / n)
        rows.append(row)
    return CormLengths(list(lengths), list(texts), torch.tensor(rows), resolved)
