"""`weightedkv`: drop the least-attended key, merge its value into its right neighbour.

Yuan et al., "WeightedKV: Attention Scores Weighted Key-Value Cache Merging for Large Language
Models", ICASSP 2025, https://arxiv.org/abs/2503.01330 (Algorithm 1). Per KV head, with average
attention `abar = Abar / n`: `j = argmin abar` among unprotected slots,
`V[j+1] <- (abar[j] V[j] + abar[j+1] V[j+1]) / (abar[j] + abar[j+1])`, key j and its statistics
dropped (the right neighbour keeps its own). Protected: the first `sink` positions and a recent
window of `int(budget * recent_ratio) - sink` slots (paper: 4 sinks and budget/2 - 4 recent).
When the prompt is compressed after prefill, the single-step rule is applied repeatedly until
the budget is reached (the paper's online algorithm, run over the prompt's slots), in tensor form
with the one-at-a-time loop's decisions and arithmetic (`first_above`, `merge_in_turn`). The
selection is a scored eviction (`LeastAveraged`), so at decode steps the engine selects for every
layer at once and the merge runs per layer.
`merge=False` is the paper's eviction ablation (key and value dropped).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import torch

from kvlens.kvcache import CacheRows, Step
from kvlens.policies.base import (
    MergesEvicted,
    Needs,
    ScoredEviction,
    log_evictions,
    log_merges,
    param,
    protected_window,
    register,
)


@dataclass(frozen=True)
class LeastAveraged(ScoredEviction):
    """WeightedKV's selection: the lowest average attention `abar = Abar / n` leaves, the older first among
    equal ones (the paper's argmin); the first `sink` positions and the `recent` newest slots stay."""

    sink: int = param(4, "First positions always kept.", minimum=0)
    recent_ratio: float = param(0.5, "Share of the budget for the sinks plus the recent window.", minimum=0.0)

    name = "weightedkv-selection"
    older_leaves_first = True

    def recent(self, budget: int) -> int:
        return max(1, int(budget * self.recent_ratio) - self.sink)

    def score(self, rows: CacheRows, step: Step) -> torch.Tensor:
        return rows.abar / rows.nobs.clamp(min=1)

    def protected(self, rows: CacheRows, budget: int) -> torch.Tensor:
        return (rows.pos < self.sink) | protected_window(rows, self.recent(budget))


@register
@dataclass(frozen=True)
class WeightedKV(MergesEvicted):
    sink: int = param(4, "First positions always kept (the paper keeps 4 sinks).", minimum=0)
    recent_ratio: float = param(
        0.5,
        "Share of the budget for the sinks plus the recent window (paper: half).",
        minimum=0.0,
        maximum=1.0,
    )
    merge: bool = param(
        True, "Merge the dropped value into its right neighbour (false = evict, the paper's ablation)."
    )

    name = "weightedkv"
    description = (
        "Drop the key with the smallest average attention; merge its value into its right neighbour."
    )
    paper = "https://arxiv.org/abs/2503.01330"
    merge_rule: ClassVar[str] = "convex"  # provenance: target <- (1 - w) target + w source, row by row

    def needs(self) -> Needs:
        return Needs(min_budget=self.sink + 1)

    @cached_property
    def selector(self) -> LeastAveraged:
        return LeastAveraged(self.sink, self.recent_ratio)

    def merge_evicted(self, rows: CacheRows, keep: torch.Tensor, evicted: torch.Tensor, step: Step) -> None:
        """The single-step rule once per leaving slot: each leaving value merges into its right neighbour
        (`pairs`), weighted by the two averages."""
        self.merge_evicted_layers([rows], rows, keep, evicted, step)

    def merge_evicted_layers(
        self,
        layers: Sequence[CacheRows],
        everywhere: CacheRows,
        keep: torch.Tensor,
        evicted: torch.Tensor,
        step: Step,
    ) -> None:
        """The rule row by row, so on every layer's rows at once; each layer's decisions logged as its own."""
        avg = self.selector.score(everywhere, step)  # (R, S)
        src, dst = self.pairs(everywhere, keep, evicted, avg)
        a_j, a_r = avg.gather(1, src), avg.gather(1, dst)
        total = a_j + a_r
        w = torch.where(total > 0, a_j / total.clamp(min=1e-30), torch.full_like(total, 0.5))  # (R, E)
        if self.merge:
            merge_in_turn(everywhere.values[0], src, dst, w)
        if step.log is not None:
            n, pos = len(layers), everywhere.pos
            for rows, j, right, weight in zip(
                layers, pos.gather(1, src).chunk(n), pos.gather(1, dst).chunk(n), w.chunk(n), strict=True
            ):
                self._log(step, rows, j, right, weight)

    def pairs(
        self, rows: CacheRows, keep: torch.Tensor, evicted: torch.Tensor, avg: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(R, E)` each leaving slot (`evicted`, in position order) in its turn and its right neighbour at
        that turn; `avg` `(R, S)` the slots' averages. The averages never change, so the keys leave in the
        order of their averages (ties: the older first), each into the first rank still there at its turn
        (`first_above`). One leaving slot (a decode step): the next kept position."""
        if evicted.shape[1] == 1:
            after = torch.searchsorted(rows.pos.gather(1, keep), rows.pos.gather(1, evicted))
            return evicted, keep.gather(1, after)
        (r, s), n, leaving = rows.pos.shape, rows.n_kept, evicted.shape[1]
        perm = rows.position_order()  # (R, S) rank -> slot; "right" counts in position order
        rank = torch.arange(s, device=perm.device)
        rank_of = torch.empty_like(perm).scatter_(1, perm, rank.expand(r, s))  # slot -> rank
        turn_order = avg.gather(1, evicted).sort(stable=True).indices  # by average, the older first
        j = rank_of.gather(1, evicted).gather(1, turn_order)  # (R, E) ranks, in turn
        turns = torch.arange(leaving, device=perm.device).expand(r, -1)  # (R, E)
        turn = torch.full((r, s), leaving, device=perm.device).scatter_(1, j, turns)  # each rank's (E: never)
        right = first_above(turn.masked_fill((rank >= n)[None, :], -1), j + 1, turns, leaving)  # (R, E) ranks
        return perm.gather(1, j), perm.gather(1, right)

    def _log(
        self, step: Step, rows: CacheRows, pos_j: torch.Tensor, pos_right: torch.Tensor, w: torch.Tensor
    ) -> None:
        """Each row's decisions in turn: `pos_j` `(R, E)` left; merged into `pos_right` with weight `w` (or
        evicted)."""
        if not self.merge:
            log_evictions(step, rows, pos_j)
            return
        nan, none = torch.full_like(w, float("nan")), torch.full_like(pos_j, -1)
        log_merges(step, rows, pos_j, pos_right[..., None], w, nan, none)


def first_above(key: torch.Tensor, start: torch.Tensor, threshold: torch.Tensor, reach: int) -> torch.Tensor:
    """`(R, E)` the first index i >= `start` with `key[i] > threshold` (`key` `(R, S)`), known to lie at most
    `reach` after `start`: binary lifting over a table of window maxima (log2 reach gathers)."""
    r, s = key.shape
    top = torch.iinfo(key.dtype).max
    levels = [torch.cat([key, key.new_full((r, 1), top)], 1)]  # levels[k][i]: the max of key[i : i + 2^k]
    while 1 << len(levels) <= reach:
        span = 1 << (len(levels) - 1)
        last = levels[-1]
        levels.append(torch.maximum(last, torch.cat([last[:, span:], last.new_full((r, span), top)], 1)))
    at = start
    for k in range(len(levels) - 1, -1, -1):
        at = at + (levels[k].gather(1, at) <= threshold) * (1 << k)  # skip 2^k keys, all at or below
    return at


def merge_in_turn(values: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, w: torch.Tensor) -> None:
    """`values[dst] <- w values[src] + (1 - w) values[dst]` for each row's merges `(R, E)` in turn, in
    place (`values` `(R, S, D)`). Merges run in rounds, each round every merge whose source has received
    all it will and whose target has received the merges before it, so each reads what the one-at-a-time
    loop would read."""
    r, e = src.shape
    if e == 1:  # one merge per row (a decode step)
        d = values.shape[-1]
        a, b, wk = src[..., None].expand(-1, -1, d), dst[..., None].expand(-1, -1, d), w[..., None]
        values.scatter_(1, b, (wk * values.gather(1, a) + (1 - wk) * values.gather(1, b)).to(values.dtype))
        return
    turns = torch.arange(e, device=src.device).expand(r, -1)
    by_target = torch.argsort(dst * e + turns, dim=-1)  # (R, E) the merges grouped by target, in turn
    grouped = dst.gather(1, by_target)
    earlier = torch.where(grouped[:, 1:] == grouped[:, :-1], by_target[:, :-1], e)
    before = torch.full_like(src, e).scatter_(
        1, by_target[:, 1:], earlier
    )  # the previous merge into dst (E: none)
    last = torch.full((r, values.shape[1]), e, dtype=src.dtype, device=src.device)
    feeds = last.scatter_reduce(1, dst, turns, "amax", include_self=False).gather(
        1, src
    )  # the last merge into src
    done = torch.zeros(r, e + 1, dtype=torch.bool, device=src.device)
    done[:, e] = True
    while not bool(done[:, :e].all()):
        ready = ~done[:, :e] & done.gather(1, before) & done.gather(1, feeds)
        h, k = ready.nonzero(as_tuple=True)
        a, b, wk = src[h, k], dst[h, k], w[h, k, None]
        values[h, b] = (wk * values[h, a] + (1 - wk) * values[h, b]).to(values.dtype)
        done[:, :e] |= ready
