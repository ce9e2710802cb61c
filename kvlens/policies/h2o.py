"""`h2o`: heavy hitters + a recent window.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023, https://arxiv.org/abs/2306.14048. The budget is split into a recent
window (`recent_ratio` of it) and heavy hitters: the non-recent slots with the largest
accumulated attention `Abar` (summed over every query since the slot entered, prefill included;
a KV head's attention is the mean of its query heads').
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlens.kvcache import CacheRows, Step
from kvlens.policies.base import ScoredEviction, param, protected_window, register


@register
@dataclass(frozen=True)
class H2O(ScoredEviction):
    recent_ratio: float = param(
        0.5,
        "Share of the budget reserved for the most recent slots; the rest are "
        "heavy hitters (the paper splits the budget evenly).",
        minimum=0.0,
        maximum=1.0,
    )

    name = "h2o"
    chunked_prefill = True  # its score, the attention each slot received, accumulates chunk by chunk
    description = "Keep a recent window plus the heavy hitters with the largest accumulated attention."
    paper = "https://arxiv.org/abs/2306.14048"
    kvpress = "ObservedAttentionPress"
    kvpress_differs = (
        "kvpress's press scores the mean, not the sum, of the attention a slot received and has no "
        "recent window, so it is a different policy; the cross-check runs H2O's own score in "
        "kvpress's hooks."
    )

    def local_window(self, budget: int) -> int:
        return int(budget * self.recent_ratio)

    def score(self, rows: CacheRows, step: Step) -> torch.Tensor:
        return rows.abar

    def protected(self, rows: CacheRows, budget: int) -> torch.Tensor | None:
        return protected_window(rows, self.local_window(budget))
