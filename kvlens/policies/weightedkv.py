"""`weightedkv`: drop the least-attended key, merge its value into its right neighbour.

Yuan et al., "WeightedKV: Attention Scores Weighted Key-Value Cache Merging for Large Language
Models", ICASSP 2025, https://arxiv.org/abs/2503.01330 (Algorithm 1). Per KV head, with average
attention `abar = Abar / n`: `j = argmin abar` among unprotected slots,
`V[j+1] <- (abar[j] V[j] + abar[j+1] V[j+1]) / (abar[j] + abar[j+1])`, key j and its statistics
dropped (the right neighbour keeps its own). Protected: the first `sink` positions and a recent
window of `int(budget * recent_ratio) - sink` slots (paper: 4 sinks and budget/2 - 4 recent).
When the prompt is compressed after prefill, the single-step rule is applied repeatedly until
the budget is reached (the paper's online algorithm, run over the prompt's slots).
`merge=False` is the paper's eviction ablation (key and value dropped).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlens.policies.base import Policy, param, register


@register
@dataclass(frozen=True)
class WeightedKV(Policy):
    sink: int = param(4, "First positions always kept (the paper keeps 4 sinks).", minimum=0)
    recent_ratio: float = param(0.5, "Share of the budget for the sinks plus the recent window (paper: half).",
                                minimum=0.0, maximum=1.0)
    merge: bool = param(True, "Merge the dropped value into its right neighbour (false = evict, the paper's "
                        "ablation).")

    name = "weightedkv"
    description = "Drop the key with the smallest average attention; merge its value into its right neighbour."
    paper = "https://arxiv.org/abs/2503.01330"
    merges = True
    merge_rule: ClassVar[str] = "convex"  # provenance: target <- (1 - w) target + w source, row by row

    def min_budget(self) -> int:
        return self.sink + 1

    def recent(self, budget: int) -> int:
        return max(1, int(budget * self.recent_ratio) - self.sink)

    def compress(self, layer, budget, log):
        if budget is None or layer.n_slots <= budget:
            return
        hkv, s = layer.pos.shape
        idx = torch.arange(s, device=layer.pos.device)
        protected = (layer.pos < self.sink) | (idx >= s - self.recent(budget))[None, :]  # (Hkv, S)
        avg = layer.abar / layer.nobs.clamp(min=1)  # (Hkv, S)
        alive = torch.ones(hkv, s, dtype=torch.bool, device=layer.pos.device)
        values = layer.values[0].clone()  # (Hkv, S, D)
        heads = torch.arange(hkv, device=idx.device)
        for _ in range(s - budget):
            score = avg.masked_fill(protected | ~alive, float("inf"))
            j = score.argmin(-1)  # (Hkv,)
            right = (alive & (idx[None, :] > j[:, None])).float().argmax(-1)  # first alive slot after j
            a_j, a_r = avg[heads, j], avg[heads, right]
            total = a_j + a_r
            w = torch.where(total > 0, a_j / total.clamp(min=1e-30), torch.full_like(total, 0.5))  # (Hkv,)
            if self.merge:
                merged = w[:, None] * values[heads, j] + (1 - w[:, None]) * values[heads, right]
                values[heads, right] = merged.to(values.dtype)
            alive[heads, j] = False
            if log is not None:
                self._log(layer, log, j, right, w)
        layer.values = values[None]
        layer.keep(alive.nonzero()[:, 1].view(hkv, budget))

    def _log(self, layer, log, j, right, w):
        heads = torch.arange(j.shape[0])
        pos_j = layer.pos[heads, j]
        if not self.merge:
            log.evict(layer.layer, pos_j[:, None])
            return
        for h, (p, t, wt) in enumerate(zip(pos_j.tolist(), layer.pos[heads, right].tolist(), w.tolist())):
            log.merge(layer.layer, h, p, [t], [wt])
