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

from kvlens.policies.base import ScoredEviction, group_mean, param, recent_mask, register

HISTORY = "scissorhands_history"  # (Hkv, S, history) bool, newest step last


@register
@dataclass(frozen=True)
class Scissorhands(ScoredEviction):
    history: int = param(64, "Window of the last queries over which a slot's importance is counted.", minimum=1)
    recent_ratio: float = param(0.5, "Share of the budget kept as the most recent slots (never dropped).",
                                minimum=0.0, maximum=1.0)

    name = "scissorhands"
    description = "Keep a recent window plus the slots most often important over the last `history` queries."
    paper = "https://arxiv.org/abs/2305.17118"

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

    def local_window(self, budget: int) -> int:
        return int(budget * self.recent_ratio)

    def protected(self, layer, budget):
        return recent_mask(layer, self.local_window(budget))
