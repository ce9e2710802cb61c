"""`d2o`: per-layer budgets from attention density; H2O eviction whose evicted tokens merge into their most
similar kept token when the similarity passes an EMA threshold.

Wan et al., "D2O: Dynamic Discriminative Operations for Efficient Long-Context Inference of Large Language
Models", ICLR 2025, https://arxiv.org/abs/2406.13035 (v1 titled "... Efficient Generative Inference ...");
official code github.com/AIoT-MLSys-Lab/d2o
(`LLM_merge_new/LMEval_kv_token_merge/modeling_llama3_7b_13b_d2o.py`, the layer allocation in
`modeling_llama3_new.py`, defaults in `run_pred_long_bench_sample.py`).

Layer level (`allocate`, once after the prompt). The paper's density of a layer is the variance of the column
sums of its prompt attention, `F_d = Var(sum_i A_p[i, :])`; a lower variance is a denser layer, which keeps
more. Here the column sums are kvlens's `abar` `(Hkv, T)` (a KV head's is the mean of its query heads'). The
authors' code turns the layer scores `s` `(L,)`, each in [0, 1], into shares `softmax(-s)` and layer budgets
`B_l = softmax(-s)_l x L x B`; kvlens keeps that mapping, bounds each budget to [`min_budget`, max(T, B)] and
rounds so that the total is exactly L x B (largest remainders). `density` picks the score: `layers` (default)
the layer's variance (mean over its KV heads), min-max normalised across layers; `official` the authors' code
as written, each head's variance min-max normalised within the layer, then the mean over the heads (it
normalises over 32 query heads; over kvlens's 2-3 KV heads every layer scores about the same, hence not the
default). `allocation=uniform` gives every layer B (the token-level rule alone).

Token level (`compress`, per layer with its own budget B_l, at the prompt's compression and at every decode
step; equation numbers of the ICLR version, arXiv v3 §4.2).
- Eviction: H2O. Kept: the first `sink` positions (the official code pins the first 4 among its heavy
  hitters), a recent window of `int(B_l x recent_ratio)` slots (the official scripts split the budget evenly
  between heavy hitters and recent tokens) and the heavy hitters, the largest accumulated attention `abar`.
- Nearest kept token (Eq. 9): per KV head, the cosine similarity of each evicted key (after RoPE, as cached)
  to every kept key, `U` `(R, E, B_l)`; `u_i = max_j U[i, j]` and `c_i = argmax_j U[i, j]` (the oldest on
  ties). At a decode step the kept keys' norms are a per-slot statistic (`cached_key_norms`): each key's is
  computed when it is written and again after it takes a merge, so the step reads the keys once, in the
  product.
- Dynamic threshold (Eq. 10): at a layer's first compression `tau = mean_i u_i`, then `tau_t = beta * mean_i
  u_i + (1 - beta) * tau_{t-1}` (updated before it is compared, as in the official code); the mean runs over
  the layer's evicted tokens and KV heads (`threshold_scope=layer`, the official code's one threshold per
  layer) or over each head's own (`head`). An evicted token merges when `u_i >= tau_t`; the others are evicted
  (logged as evictions).
- Weighted merge (Eq. 11-12), keys and values alike, all of a step's sources of a kept token at once: `k_c <-
  w_c k_c + sum_{i -> c} w_i k_i`, `w_i = exp(u_i) / (sum_{i -> c} exp(u_i) + e)`, `w_c = e / (sum_{i -> c}
  exp(u_i) + e)` (e: the kept token's own similarity 1, exp(1)); the weights sum to 1, which is provenance's
  `set` rule (the log lists each head's merges in turn, each target's sources together, as its replay needs).
  The kept token keeps its position and statistics (`abar`, `nobs`). `merge=false` evicts every token (the
  eviction-only ablation).

Divergences from the official code, kept on purpose: it never compresses layers 0, 1 and L - 1 (kvlens holds
every layer to its budget, so the total stays L x B); it merges with `scatter_reduce(mean)` of `u_i x k_i`
including the kept token, `(k_c + sum u_i k_i) / (1 + n)`, not Eq. 12's weights; it decides per evicted index
with the mean of `u` over heads (whose i-th evicted tokens are different tokens); its EMA weights are `alpha =
belta = 0.5`, so `beta = 0.5` here is the same either way round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlens.kvcache import CacheRows, Step
from kvlens.policies.base import (
    Needs,
    Policy,
    evicted_lowest,
    log_evictions,
    param,
    protected_window,
    register,
    select_lowest,
)
from kvlens.policies.key_norms import cached_key_norms, norm_of

THRESHOLD = (
    "d2o_threshold"  # per layer: the EMA threshold tau, a 0-d tensor (scope layer) or (Hkv,) (scope head)
)
KEY_NORM = "d2o_key_norm"  # per slot `(Hkv, S)` float32: its cached key's L2 norm (`cached_key_norms`)
MERGED = "d2o_merged"  # per layer: `(Hkv, 1)` the slots the last step merged into, whose norms are due
# `threshold_scope` -> the dimension of `u` `(Hkv, E)` its similarities are averaged over (None: all)
SCOPE_DIM: dict[str, int | None] = {"layer": None, "head": -1}
CHUNK_ELEMENTS = 1 << 24  # similarity entries (rows x evicted x kept) computed at once


def layer_density(abar: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`(Hkv,)` the variance over its kept slots of each head's prompt column sums `abar` `(Hkv, T)`
    (unbiased)."""
    n = valid.sum(-1).clamp(min=2)
    x = abar.float().masked_fill(~valid, 0.0)
    mean = x.sum(-1) / valid.sum(-1).clamp(min=1)
    return ((x - mean[:, None]).masked_fill(~valid, 0.0) ** 2).sum(-1) / (n - 1)


def minmax(x: torch.Tensor) -> torch.Tensor:
    """`(x - min) / (max - min + 1e-6)`, the official code's normalisation to [0, 1]."""
    return (x - x.min()) / (x.max() - x.min() + 1e-6)


def bounded_shares(shares: list[float], total: int, lo: int, hi: int) -> list[int]:
    """Integers in [lo, hi] proportional to `shares` (clipped where a bound binds) summing to exactly `total`
    (which must lie in [n lo, n hi]): `clip(lam * share, lo, hi)` with lam found by bisection, then the
    largest remainders get the units the floors left (the smallest give them back if rounding overshot)."""
    n = len(shares)
    if not n * lo <= total <= n * hi:
        raise ValueError(f"total {total} outside [{n * lo}, {n * hi}]")

    def clip(lam: float) -> list[float]:
        return [min(hi, max(lo, lam * s)) for s in shares]

    low, high = 0.0, float(hi) / max(min(shares), 1e-300)
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if sum(clip(mid)) < total else (low, mid)
    x = clip(high)
    out = [min(hi, max(lo, math.floor(v))) for v in x]
    left = total - sum(out)
    frac = sorted(range(n), key=lambda i: (-(x[i] - out[i]), i))
    for i in frac:
        if left <= 0:
            break
        if out[i] < hi:
            out[i], left = out[i] + 1, left - 1
    for i in reversed(frac):
        if left >= 0:
            break
        if out[i] > lo:
            out[i], left = out[i] - 1, left + 1
    return out


@register
@dataclass(frozen=True)
class D2O(Policy):
    sink: int = param(
        4,
        "First positions always kept (the official code pins the first 4 among its heavy hitters).",
        minimum=0,
    )
    recent_ratio: float = param(
        0.5,
        "Share of each layer's budget for the recent window; the rest are heavy "
        "hitters by accumulated attention (the official scripts split the budget evenly).",
        minimum=0.0,
        maximum=1.0,
    )
    beta: float = param(
        0.5,
        "Weight of the new mean similarity in the EMA threshold, tau = beta x mean max "
        "similarity + (1 - beta) x previous tau (Eq. 10; the official code's 0.5 / 0.5).",
        minimum=0.0,
        maximum=1.0,
    )
    threshold_scope: str = param(
        "layer",
        "One EMA threshold per layer over all its KV heads (the official code) or one per KV head.",
        choices=("layer", "head"),
    )
    merge: bool = param(
        True,
        "Merge evicted tokens whose best cosine similarity passes the threshold into their "
        "nearest kept token (false = evict them all, the eviction-only ablation).",
    )
    allocation: str = param(
        "dynamic",
        "Layer budgets: dynamic (denser prompt attention, lower variance of its "
        "column sums, keeps more; total L x budget) or uniform (the budget everywhere).",
        choices=("dynamic", "uniform"),
    )
    density: str = param(
        "layers",
        "Layer score of the dynamic allocation: each layer's variance of its prompt "
        "attention's column sums, min-max normalised across layers, or the official code's "
        "per-head variances min-max normalised within the layer, then averaged.",
        choices=("layers", "official"),
    )

    name = "d2o"
    description = (
        "Per-layer budgets by attention density; H2O eviction, each evicted token merged into its most "
        "similar kept key when the similarity passes an EMA threshold."
    )
    paper = "https://arxiv.org/abs/2406.13035"
    merge_rule: ClassVar[str] = (
        "set"  # provenance: per step, target <- w_c target + sum_i w_i source_i, sum = 1
    )

    def needs(self) -> Needs:
        return Needs(competes="model", min_budget=self.sink + 1)  # per-layer budgets, decided together

    def local_window(self, budget: int) -> int:
        return int(budget * self.recent_ratio)

    # -- layer level
    # ---------------------------------------------------------------------------------------------
    def layer_scores(self, layers: Sequence[CacheRows]) -> torch.Tensor:
        """`(L,)` each layer's density score in [0, 1] (lower = denser = more budget), per `density`."""
        per_head = [layer_density(rows.abar, rows.valid) for rows in layers]  # L x (Hkv,)
        if self.density == "official":
            return torch.stack([minmax(v).mean() for v in per_head])
        return minmax(torch.stack([v.mean() for v in per_head]))

    def allocate(self, budget: int, layers: Sequence[CacheRows]) -> list[int]:
        n = len(layers)
        if self.allocation == "uniform" or n == 1:
            return [budget] * n
        shares = torch.softmax(-self.layer_scores(layers).double(), 0).tolist()
        return bounded_shares(shares, budget * n, self.needs().min_budget, max(layers[0].n_kept, budget))

    # -- token level
    # ---------------------------------------------------------------------------------------------
    def protected(self, rows: CacheRows, budget: int) -> torch.Tensor:
        """`(R, S)`: the local window and the sinks, which H2O's choice never evicts."""
        return protected_window(rows, self.local_window(budget)) | (rows.valid & (rows.pos < self.sink))

    def compress(self, rows: CacheRows, step: Step) -> None:
        """H2O's choice of the leaving slots `(R, E)`, then Eq. 9-12's merge of each into its nearest kept
        slot (`nearest`; a decode step's one slot per row: `_merge_one`, which needs no kept-slot list)."""
        budget = step.budget
        if budget is None or rows.n_kept <= budget:
            return
        if not self.merge or rows.n_kept - budget == 1:  # the leaving slots alone
            evicted = evicted_lowest(rows, rows.abar, self.protected(rows, budget), budget)  # (R, E)
            if self.merge:
                self._merge_one(step, rows, evicted)
                return
            if step.log is not None:
                log_evictions(step, rows, rows.pos.gather(1, evicted))
            rows.free(evicted)
            return
        keep, evicted = select_lowest(rows, rows.abar, self.protected(rows, budget), budget)
        pos_ev = rows.pos.gather(1, evicted)  # (R, E)
        u, nearest = self.nearest(rows.keys[0], keep, evicted)  # (R, E) best similarity, index into keep
        merged = u >= self.threshold(rows, u)  # (R, E)
        w, w_self = merge_weights(u, nearest, merged, keep.shape[1])
        for states in (rows.keys[0], rows.values[0]):  # (R, S, D) views of the cache: merged in place
            merge_into(states, keep, evicted, nearest, w, w_self)
        self._log(step, rows, pos_ev, rows.pos.gather(1, keep).gather(1, nearest), w, merged)
        rows.free(evicted)

    def _merge_one(self, step: Step, rows: CacheRows, evicted: torch.Tensor) -> None:
        """`compress`'s rule for one evicted slot per row `(R, 1)` (a decode step), with no kept-slot list:
        its nearest kept key (`nearest_slot`), the threshold, Eq. 12's weights of one source (`w_i = exp(u_i)
        / (exp(u_i) + e)`, `w_c = e / (exp(u_i) + e)`) and Eq. 11 on the target slot alone. The kept keys'
        norms are the layer's cached ones (`cached_key_norms`): only the new and the merged keys' are
        computed."""
        keys, values, pos = rows.keys[0], rows.values[0], rows.pos
        norms = cached_key_norms(rows, KEY_NORM, step.index, rows.state.get(MERGED))  # (R, S) a view
        u, target = nearest_slot(keys, norms, rows.valid, pos, evicted)  # (R, 1) each, u float32
        merged = u >= self.threshold(rows, u)
        eu = torch.exp(u) * merged
        denom = eu + math.e
        w, w_self = eu / denom, math.e / denom  # a source that does not merge: w = 0, w_c = 1
        pair = torch.cat([target, evicted], 1)[..., None]  # (R, 2, 1): the target slot, then its source
        weights = torch.cat([w_self, w], 1)[..., None]  # (R, 2, 1)
        for states in (keys, values):  # (R, S, D), D may differ between keys and values
            at = pair.expand(-1, -1, states.shape[-1])
            both = states.gather(1, at)  # (R, 2, D); a sum of two terms is w_c x_c + w_i x_i exactly
            new = both.float().mul_(weights).sum(1, keepdim=True)  # (R, 1, D)
            states.scatter_(1, at[:, :1], new.to(states.dtype))
        rows.state[MERGED] = target  # its norm is due at the next step
        if step.log is not None:
            self._log(step, rows, pos.gather(1, evicted), pos.gather(1, target), w, merged)
        rows.free(evicted)

    @staticmethod
    def nearest(
        keys: torch.Tensor, keep: torch.Tensor, evicted: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 9: each evicted key's best cosine similarity to the kept keys and that key's index in `keep`,
        both `(R, E)`. `keys` `(R, S, D)`; `keep` `(R, B)`, `evicted` `(R, E)` slot indices. The oldest kept
        key wins a tie (`keep` is in position order).

        The kept keys are gathered and scaled to unit length once, the evicted ones in chunks (bounded
        memory), in float32; a chunk's similarities are one product. A decode step's one evicted key per row
        goes to `nearest_slot` instead."""
        r, _, d = keys.shape
        b, e = keep.shape[1], evicted.shape[1]
        norms = norm_of(keys)  # (R, S)

        def unit(slots: torch.Tensor) -> torch.Tensor:  # (R, n) -> (R, n, D), `F.normalize`'s eps
            gathered: torch.Tensor = keys.gather(1, slots[..., None].expand(-1, -1, d)).float()
            return torch.div(gathered, norms.gather(1, slots)[..., None])

        against = unit(keep).transpose(1, 2)  # (R, D, B)
        chunk = max(1, CHUNK_ELEMENTS // max(1, r * b))
        best, where = [], []
        for lo in range(0, e, chunk):
            sim = torch.bmm(unit(evicted[:, lo : lo + chunk]), against)  # (R, e, B)
            value, at = sim.max(-1)  # the first of the best: the oldest (`keep` is in position order)
            best.append(value)
            where.append(at)
        return torch.cat(best, 1), torch.cat(where, 1)

    def threshold(self, rows: CacheRows, u: torch.Tensor) -> torch.Tensor:
        """Eq. 10: update the layer's EMA threshold with this compression's similarities `u` `(Hkv, E)` and
        return it per row `(Hkv, 1)`. The layer's run state holds it."""
        seen = u.mean(SCOPE_DIM[self.threshold_scope])
        prev = rows.state.get(THRESHOLD)
        tau = seen if prev is None else self.beta * seen + (1 - self.beta) * prev
        rows.state[THRESHOLD] = tau
        return tau.expand(u.shape[0])[:, None]

    def _log(
        self,
        step: Step,
        rows: CacheRows,
        pos_ev: torch.Tensor,
        pos_target: torch.Tensor,
        w: torch.Tensor,
        merged: torch.Tensor,
    ) -> None:
        """Merges as rows of provenance's `set` rule (all sources of one target of one head consecutive: each
        head's merges sorted by target then source, the heads in turn), then the evictions."""
        if step.log is None:
            return
        r, e = pos_ev.shape
        if bool(merged.any()):
            big = int(max(pos_ev.max(), pos_target.max())) + 1
            key = (pos_target * big + pos_ev).masked_fill(~merged, torch.iinfo(torch.long).max)
            order = torch.sort(key, dim=-1, stable=True).indices
            src = pos_ev.gather(1, order).masked_fill(~merged.gather(1, order), -1)
            tgt = pos_target.gather(1, order).masked_fill(src < 0, -1)
            wt = w.gather(1, order)
            eye = torch.eye(
                r, dtype=torch.bool, device=pos_ev.device
            )  # row h holds only its own block of columns

            def block(x: torch.Tensor, fill: float) -> torch.Tensor:
                return torch.where(eye[:, :, None], x[None, :, :], fill).reshape(r, r * e)

            source, target = block(src, -1), block(tgt, -1)
            weight = block(wt, 0.0)
            nan, none = torch.full_like(weight, float("nan")), torch.full_like(source, -1)
            step.log.merges(step.index, rows.layer, source, target[..., None], weight, nan, none)
        log_evictions(step, rows, pos_ev.masked_fill(merged, -1))


def nearest_slot(
    keys: torch.Tensor, norms: torch.Tensor, valid: torch.Tensor, pos: torch.Tensor, evicted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 9 for one evicted key per row `(R, 1)` (a decode step): its best cosine similarity to the other
    valid slots and that slot, both `(R, 1)`. `keys` `(R, S, D)` are held in place (one product, as
    attention's), their norms `norms` (`norm_of`), `valid` and `pos` `(R, S)`; the oldest position wins a
    tie (slots are not in position order)."""
    d = keys.shape[-1]
    sent = keys.gather(1, evicted[..., None].expand(-1, -1, d))  # (R, 1, D)
    sim = torch.bmm(sent, keys.transpose(1, 2)).float()[:, 0]  # (R, S)
    sim = sim / (norms.gather(1, evicted) * norms)
    if not bool(valid.all()):
        sim = sim.masked_fill(~valid, float("-inf"))
    sim = sim.scatter_(1, evicted, float("-inf"))
    value = sim.amax(-1, keepdim=True)  # (R, 1)
    oldest = pos.masked_fill(sim < value, torch.iinfo(pos.dtype).max).argmin(-1, keepdim=True)
    return value, oldest


def merge_weights(
    u: torch.Tensor, nearest: torch.Tensor, merged: torch.Tensor, kept: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 12: each source's weight `(R, E)` (0 where it does not merge) and each kept token's own weight `(R,
    B)`: `w_i = exp(u_i) / (S_c + e)`, `w_c = e / (S_c + e)`, `S_c` the sum of `exp(u_i)` over c's merged
    sources."""
    eu = torch.exp(u.float()) * merged
    denom = torch.full((u.shape[0], kept), math.e, device=u.device).scatter_add_(1, nearest, eu)
    return eu / denom.gather(1, nearest), math.e / denom


def merge_into(
    states: torch.Tensor,
    keep: torch.Tensor,
    evicted: torch.Tensor,
    nearest: torch.Tensor,
    w: torch.Tensor,
    w_self: torch.Tensor,
) -> None:
    """Eq. 11 in place on `states` `(R, S, D)` (keys or values): kept slot c <- w_c x_c + sum_{i -> c} w_i
    x_i, for a prompt's many sources per row (a decode step's one: `D2O._merge_one`)."""
    d = states.shape[-1]
    sent = states.gather(1, evicted[..., None].expand(-1, -1, d)).float() * w[..., None]  # (R, E, D)
    kidx = keep[..., None].expand(-1, -1, d)
    kept = states.gather(1, kidx).float()  # (R, B, D)
    new = kept * w_self[..., None]
    new.scatter_add_(1, nearest[..., None].expand(-1, -1, d), sent)
    states.scatter_(1, kidx, new.to(states.dtype))
