"""`scissorhands`: persistence of importance.

Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache
Compression at Test Time", NeurIPS 2023, https://arxiv.org/abs/2305.17118. Over the last
`history` queries, count how often a slot was important (`A_t[j] >= 1/n_slots`, a KV head's
attention being the mean of its query heads'); drop the non-recent slots with the lowest count,
ties broken by smaller accumulated attention `Abar`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlens.policies.base import ScoredEviction, check_int, check_share, group_mean, recent_mask

HISTORY = "scissorhands_history"  # (Hkv, S, history) bool, newest step last


@dataclass
class Scissorhands(ScoredEviction):
    """history: queries over which importance is counted; recent_ratio: share of the budget kept recent."""

    history: int = 64
    recent_ratio: float = 0.5

    name = "scissorhands"
    description = "Keep a recent window plus the slots most often important over the last `history` queries."
    paper = "https://arxiv.org/abs/2305.17118"

    def __post_init__(self):
        check_int("history", self.history, 1)
        check_share("recent_ratio", self.recent_ratio)

    def prefill_rows(self) -> int:
        return self.history

    def observe_prefill(self, layer, rows):
        hkv, s = layer.pos.shape
        g = rows.shape[0] // hkv
        length = rows.shape[1]
        kv_rows = rows.view(hkv, g, length, -1).mean(1)  # (Hkv, L, T)
        n_seen = torch.arange(s - length + 1, s + 1, device=rows.device, dtype=torch.float32)  # query i sees i+1 slots
        important = kv_rows >= (1.0 / n_seen)[None, :, None]
        hist = torch.zeros(hkv, s, self.history, dtype=torch.bool, device=rows.device)
        hist[:, :, self.history - length:] = important.transpose(1, 2)
        layer.extra[HISTORY] = hist

    def observe(self, layer, probs):
        att = group_mean(probs)  # (Hkv, S)
        n_slots = layer.valid.sum(-1, keepdim=True).float()
        important = (att >= 1.0 / n_slots) & layer.valid
        hist = layer.extra[HISTORY]
        layer.extra[HISTORY] = torch.cat([hist[:, :, 1:], important[:, :, None]], dim=2)

    def score(self, layer):
        count = layer.extra[HISTORY].sum(-1).float()
        tie = layer.abar / (layer.abar.max() + 1.0)  # in [0, 1): breaks ties only
        return count + tie

    def protected(self, layer, budget):
        return recent_mask(layer, int(budget * self.recent_ratio))
