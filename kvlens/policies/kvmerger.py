"""`kvmerger`: adaptive KV merging by key similarity with Gaussian-kernel weights.

Wang et al., "Model Tells You Where to Merge: Adaptive KV Cache Merging for LLMs on Long-Context
Tasks" (KVMerger), 2024, https://arxiv.org/abs/2407.08454. The pure functions `merging_sets`
(Algorithm 1) and `gaussian_weights` (Eq. 7-8) are public so analysis code can reuse them; the policy
runs them on every row and set of a layer at once (`set_anchors`, `set_weights`).

The policy: after prefill, per KV head, keep the `recent_ratio` newest slots and the `keep_ratio`
slots with the largest aggregated attention `Abar` (column sums of the attention map); group the
rest into merging sets; per set the pivot is its slot with the largest `Abar`, and the merged key
and value `sum_i w_i k_i`, `sum_i w_i v_i` replace the pivot's (it keeps its position and its own
statistics). Generated tokens are appended. Budget-free: heads keep different counts, each head's
keys and values are held in pages (`kvlens.kvcache.paged`; padded to the longest head with packed
storage), and the reached size is reported per layer and head
(`steps/kv_slots`). `remerge_every` > 0 re-runs the merge during decoding (not in the paper).

Shares: the paper's "Implementation details" (§6.1) keep recent 0.17 and attention top-k 0.12 of the
states for its 50 % budget, 0.08 and 0.02 for 35 % (printed "0.17%", ..., read as shares: 0.17 %
of a 4k-token context would be 7 tokens); presets `budget50` and `budget35`. The budget reached
still depends on how many keys are similar enough to merge (threshold 0.75, as in the paper).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvlens.errors import KvlensError
from kvlens.kvcache import CacheRows, Step, padded_index
from kvlens.policies.base import Needs, Policy, log_merges, param, register


def merging_sets(
    keys: torch.Tensor, threshold: float, candidates: torch.Tensor | None = None
) -> list[list[int]]:
    """Algorithm 1: partition candidate keys `(T, D)` into sets of consecutive positions.

    Scans right to left; the anchor is the current set's rightmost key, and key i joins the set
    while `cos(k_i, k_anchor) > threshold`, otherwise it starts a new set (and becomes its
    anchor). `candidates` `(T,)` bool marks the keys that may be merged (default all); a
    non-candidate ends the current set, so sets never span a kept key. Every candidate belongs
    to exactly one set (singletons included); sets are returned left to right, each ascending.
    """
    if candidates is None:
        candidates = torch.ones(keys.shape[0], dtype=torch.bool, device=keys.device)
    anchor, run = set_anchors(keys[None], threshold, candidates[None])
    last = anchor[0].nonzero().flatten()
    return [list(range(a - n, a + 1)) for a, n in zip(last.tolist(), run[0, last].tolist(), strict=True)]


def set_anchors(
    keys: torch.Tensor, threshold: float, candidates: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 on every row of keys `(R, T, D)` at once (`candidates` `(R, T)`): the anchors `(R, T)` bool
    and `run` `(R, T)`, how many keys the set anchored at each key holds left of it (the consecutive
    candidates before it whose cosine with it is above `threshold`). The set anchored at a is a - run[a] .. a.

    `run` is counted one distance at a time while some scan goes on; the anchors are the chain from the newest
    candidate through each set's next anchor (the newest candidate left of it), found by pointer doubling.
    """
    r, t, _ = keys.shape
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    run = torch.zeros(r, t, dtype=torch.long, device=keys.device)
    going = candidates.clone()  # (R, T) the scans that have not stopped at this distance
    for d in range(1, t):
        going[:, :d] = False
        going[:, d:] &= candidates[:, :-d] & ((unit[:, d:] * unit[:, :-d]).sum(-1) > threshold)
        if not bool(going.any()):
            break
        run += going
    index = torch.arange(t, device=keys.device)
    newest = torch.where(candidates, index, -1).cummax(-1).values  # (R, T) the newest candidate at or before
    left = index - run - 1  # the key left of each set
    jump = torch.where(
        left >= 0, newest.gather(1, left.clamp(min=0)), -1
    )  # (R, T) the next anchor (-1: none)
    jump = torch.cat([jump.masked_fill(jump < 0, t), jump.new_full((r, 1), t)], 1)  # (R, T + 1), t: none
    anchor = torch.zeros(r, t + 1, dtype=torch.bool, device=keys.device)
    anchor.scatter_(1, newest[:, -1:].masked_fill(newest[:, -1:] < 0, t), True)
    for _ in range(t.bit_length()):  # after k rounds: the first 2^k anchors of the chain
        anchor.scatter_(1, torch.where(anchor, jump, t), True)
        jump = jump.gather(1, jump)
    return anchor[:, :t], run


SIGMA_RULES = ("eq7", "mean_distance")


def gaussian_weights(
    keys_of_set: torch.Tensor, pivot_index: int, sigma: float | str | None = None
) -> torch.Tensor:
    """Eq. 7-8: normalised Gaussian-kernel weights `(n,)` of a set's keys `(n, D)` around its pivot.

    `g_i = exp(-||k_p - k_i||^2 / (2 sigma^2))`, `w_i = g_i / sum_j g_j`. The paper defines sigma
    three ways: Eq. 7's formula `sum_i ||k_p - k_i||^2 / (sqrt(2) n)` (`sigma="eq7"` or None); §5.2's
    sentence, "the mean value of g_pi", circular (g depends on sigma), so not implemented; and §6.3,
    "the mean of l_2 distance between the pivotal state and all the remaining states"
    (`"mean_distance"`: the mean of `||k_p - k_i||` over the n - 1 other keys). Eq. 7 is in squared
    distance units, so on keys far apart sigma is much larger than the distances and the weights
    are near-uniform (the "average merging" of the paper's Table 4). A positive number is used as
    sigma. When every key equals the pivot (or n = 1), sigma is 0 and the weights are uniform.
    """
    n = keys_of_set.shape[0]
    if not 0 <= pivot_index < n:
        raise KvlensError(f"The pivot index {pivot_index} is outside the merging set of {n} keys.")
    rule = "eq7" if sigma is None else sigma
    if isinstance(rule, str):
        if rule not in SIGMA_RULES:
            raise KvlensError(f"sigma must be a positive number, eq7 or mean_distance; got {sigma!r}.")
    elif not rule > 0:
        raise KvlensError(f"sigma must be a positive number, eq7 or mean_distance; got {sigma!r}.")
    sets = torch.zeros(n, dtype=torch.long, device=keys_of_set.device)
    return set_weights(keys_of_set, sets, torch.tensor([pivot_index], device=keys_of_set.device), rule)


def set_weights(
    keys: torch.Tensor, sets: torch.Tensor, pivot: torch.Tensor, rule: float | str
) -> torch.Tensor:
    """`gaussian_weights` of M sets at once: their members' keys `(K, D)`, `sets` `(K,)` the set of each
    (0..M-1), `pivot` `(M,)` the index in `keys` of each set's pivot, `rule` a checked sigma. Returns float32
    `(K,)`."""
    k = keys.float()
    dist2 = ((k - k[pivot][sets]) ** 2).sum(-1)  # (K,)
    n = torch.bincount(sets, minlength=len(pivot)).float()  # (M,)
    if rule == "eq7":
        sigma = per_set(dist2, sets, len(n)) / (2**0.5 * n)
    elif rule == "mean_distance":
        sigma = per_set(dist2.sqrt(), sets, len(n)) / (n - 1).clamp(min=1)
    else:
        sigma = torch.full_like(n, float(rule))
    logits = -dist2 / (2 * sigma**2)[sets]  # a softmax within each set
    top = torch.full_like(n, float("-inf")).scatter_reduce(0, sets, logits, "amax")
    g = (logits - top[sets]).exp()
    uniform = (1 / n)[sets]  # sigma 0: every key equals the pivot
    return torch.where((sigma == 0)[sets], uniform, g / per_set(g, sets, len(n))[sets])


def per_set(x: torch.Tensor, sets: torch.Tensor, m: int) -> torch.Tensor:
    """`(M, ...)` the sums of `x` `(K, ...)` over each of the M sets (`sets` `(K,)`)."""
    return torch.zeros((m, *x.shape[1:]), dtype=x.dtype, device=x.device).index_add_(0, sets, x)


COMPRESSIONS = "kvmerger_compressions"  # per layer: compress calls so far in this run


@register
@dataclass(frozen=True)
class KVMerger(Policy):
    threshold: float = param(
        0.75,
        "Cosine similarity a key needs with its set's anchor to join the merging set.",
        minimum=-1.0,
        maximum=1.0,
    )
    recent_ratio: float = param(
        0.1, "Share of the slots kept unmerged as the recent window.", minimum=0.0, maximum=1.0
    )
    keep_ratio: float = param(
        0.1,
        "Share of the slots kept unmerged as top-k by aggregated attention (sinks and heavy hitters).",
        minimum=0.0,
        maximum=1.0,
    )
    sigma: float = param(0.0, "Gaussian kernel width (0 = computed by sigma_rule).", minimum=0.0)
    sigma_rule: str = param(
        "mean_distance",
        "How sigma is computed per merging set when sigma is 0: the mean "
        "l2 distance from the pivot (§6.3, the rule the paper's sigma ablation uses) or Eq. 7's "
        "formula (squared distances: near-uniform weights).",
        choices=SIGMA_RULES,
    )
    remerge_every: int = param(
        0,
        "Also re-merge every this many decode steps (0 = only after prefill, the paper's setting).",
        minimum=0,
    )

    name = "kvmerger"
    description = (
        "After prefill, merge runs of similar consecutive keys into their most attended one "
        "(Gaussian weights)."
    )
    paper = "https://arxiv.org/abs/2407.08454"
    merge_rule: ClassVar[str] = "set"  # provenance: per step, target <- w_p target + sum_i w_i source_i
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "budget50": {"recent_ratio": 0.17, "keep_ratio": 0.12},
        "budget35": {"recent_ratio": 0.08, "keep_ratio": 0.02},
    }

    def needs(self) -> Needs:
        """The prompt's column sums; attention rows and decode steps only when it re-merges while decoding
        (the paper merges once, after prefill)."""
        again = self.remerge_every > 0
        return Needs(decode_rows=again, prefill_rows=0, decode_steps=again, budget_free=True)

    def compress(self, rows: CacheRows, step: Step) -> None:
        """Merge every row's sets of two or more slots at their pivots, all at once: the M sets' K members in
        one flat order (row by row, set by set, ascending), the order of the decision log."""
        count = rows.state.get(COMPRESSIONS, 0)
        rows.state[COMPRESSIONS] = count + 1
        if count and not (self.remerge_every and count % self.remerge_every == 0):
            return
        keys, values = rows.keys[0], rows.values[0]  # (R, S, D), merged in place
        anchor, run = set_anchors(keys, self.threshold, self._candidates(rows))
        row, last = (anchor & (run > 0)).nonzero(as_tuple=True)  # (M,) the sets of two or more, row by row
        if not len(row):
            return
        size = run[row, last] + 1
        sets = torch.repeat_interleave(
            torch.arange(len(row), device=row.device), size
        )  # (K,) each member's set
        first = size.cumsum(0) - size  # (M,) the place of each set's first member
        members = torch.arange(len(sets), device=row.device)
        heads, slots = (
            row[sets],
            (last - size + 1)[sets] + members - first[sets],
        )  # (K,) the members, in order
        abar = rows.abar[heads, slots]
        best = torch.full(size.shape, float("-inf"), device=row.device).scatter_reduce(0, sets, abar, "amax")
        most = members.masked_fill(
            abar != best[sets], len(sets)
        )  # the places of each set's most attended members
        pivot = torch.full_like(size, len(sets)).scatter_reduce(
            0, sets, most, "amin"
        )  # (M,) the first of them
        set_keys = keys[heads, slots]  # (K, D)
        w = set_weights(set_keys, sets, pivot, self.sigma or self.sigma_rule).to(keys.dtype)  # (K,)
        target = slots[pivot]  # (M,)
        for cache, merged in (
            (keys, set_keys),
            (values, values[heads, slots]),
        ):  # each set's sum, at its pivot
            cache[row, target] = per_set(w.float()[:, None] * merged.float(), sets, len(row)).to(cache.dtype)
        gone = members != pivot[sets]
        pos = rows.pos
        self._log(step, rows, heads[gone], pos[heads, slots][gone], pos[row, target][sets][gone], w[gone])
        keep = rows.valid.clone()
        keep[heads[gone], slots[gone]] = False
        rows.retain(*padded_index(keep))

    def _candidates(self, rows: CacheRows) -> torch.Tensor:
        """`(R, S)` the slots that may merge: valid, less each row's `recent_ratio` newest and `keep_ratio`
        largest `Abar` (slots are in position order: this cache only grows and is re-laid out by `retain`)."""
        valid = rows.valid
        counts = valid.sum(-1).tolist()
        recent = torch.tensor([int(n * self.recent_ratio) for n in counts], device=valid.device)
        candidates = valid & (valid.sum(-1, keepdim=True) - valid.cumsum(-1) >= recent[:, None])
        tops = [
            min(int(n * self.keep_ratio), c) for n, c in zip(counts, candidates.sum(-1).tolist(), strict=True)
        ]
        for k in set(tops) - {0}:  # rows of one size at once (a layer's rows share it after the prompt)
            chosen = torch.tensor([i for i, t in enumerate(tops) if t == k], device=valid.device)
            score = rows.abar[chosen].masked_fill(~candidates[chosen], float("-inf"))
            candidates[chosen[:, None], torch.topk(score, k).indices] = False
        return candidates

    def _log(
        self,
        step: Step,
        rows: CacheRows,
        row: torch.Tensor,
        source: torch.Tensor,
        target: torch.Tensor,
        w: torch.Tensor,
    ) -> None:
        """The merges, row by row, set by set, in position order: `source` `(K,)` positions merged into
        `target` with weight `w`, in rows `row`: one column per merge, filled in its row only
        (`DecisionLog.merges` lists the columns in turn)."""
        if step.log is None:
            return
        r, k = rows.pos.shape[0], len(row)
        at = (row, torch.arange(k, device=row.device))
        sources = torch.full((r, k), -1, dtype=source.dtype, device=row.device).index_put_(at, source)
        targets = torch.full((r, k), -1, dtype=target.dtype, device=row.device).index_put_(at, target)
        weights = torch.zeros(r, k, device=row.device).index_put_(at, w.float())
        log_merges(
            step,
            rows,
            sources,
            targets[..., None],
            weights,
            torch.full_like(weights, float("nan")),
            torch.full_like(sources, -1),
        )
