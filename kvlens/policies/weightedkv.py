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

from kvlens.engine.cache import CacheRows, Step
from kvlens.policies.base import Policy, log_evictions, log_merges, param, register


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

    def compress(self, rows: CacheRows, step: Step) -> None:
        budget = step.budget
        if budget is None or rows.n_kept <= budget:
            return
        r, s = rows.pos.shape
        n = rows.n_kept
        perm = rows.position_order()  # (R, S) rank -> slot; "right" and "recent" count in position order
        pos = rows.pos.gather(1, perm)
        rank = torch.arange(s, device=pos.device)
        protected = (pos < self.sink) | (rank >= n - self.recent(budget))[None, :]  # (R, S) by rank
        avg = (rows.abar / rows.nobs.clamp(min=1)).gather(1, perm)  # (R, S) by rank
        alive = (rank < n)[None, :].expand(r, s).clone()
        values = rows.values[0]  # (R, S, D) by slot, a view of the cache: merged in place
        heads = torch.arange(r, device=pos.device)
        for _ in range(n - budget):
            score = avg.masked_fill(protected | ~alive, float("inf"))
            j = score.argmin(-1)  # (Hkv,)
            right = (alive & (rank[None, :] > j[:, None])).float().argmax(-1)  # first alive rank after j
            a_j, a_r = avg[heads, j], avg[heads, right]
            total = a_j + a_r
            w = torch.where(total > 0, a_j / total.clamp(min=1e-30), torch.full_like(total, 0.5))  # (Hkv,)
            if self.merge:
                slot_j, slot_r = perm[heads, j], perm[heads, right]
                merged = w[:, None] * values[heads, slot_j] + (1 - w[:, None]) * values[heads, slot_r]
                values[heads, slot_r] = merged.to(values.dtype)
            alive[heads, j] = False
            self._log(step, rows, pos[heads, j], pos[heads, right], w)
        dropped = (~alive[:, :n]).nonzero()[:, 1].view(r, n - budget)
        rows.free(perm.gather(1, dropped))

    def _log(self, step, rows, pos_j, pos_right, w):
        """One decision per row: `pos_j` `(R,)` left; merged into `pos_right` with weight `w` (or evicted)."""
        if not self.merge:
            log_evictions(step, rows, pos_j[:, None])
            return
        nan, none = torch.full_like(w, float("nan")), torch.full_like(pos_j, -1)
        log_merges(step, rows, pos_j[:, None], pos_right[:, None, None], w[:, None], nan[:, None], none[:, None])
