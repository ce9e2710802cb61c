"""`kvmerger`: adaptive KV merging by key similarity with Gaussian-kernel weights.

Wang et al., "Model Tells You Where to Merge: Adaptive KV Cache Merging for LLMs on Long-Context
Tasks" (KVMerger), 2024, https://arxiv.org/abs/2407.08454. The pure functions `merging_sets`
(Algorithm 1) and `gaussian_weights` (Eq. 7-8) are public so analysis code can reuse them.

The policy: after prefill, per KV head, keep the `recent_ratio` newest slots and the `keep_ratio`
slots with the largest aggregated attention `Abar` (column sums of the attention map); group the
rest into merging sets; per set the pivot is its slot with the largest `Abar`, and the merged key
and value `sum_i w_i k_i`, `sum_i w_i v_i` replace the pivot's (it keeps its position and its own
statistics). Generated tokens are appended. Budget-free: heads keep different counts, the layer
is padded to the longest head, and the reached size is reported per layer and head
(`steps/kv_slots`). `remerge_every` > 0 re-runs the merge during decoding (not in the paper).

Shares: the paper's "Implementation details" (§6.1) keep recent 0.17 and attention top-k 0.12 of the
states for its 50 % budget, 0.08 and 0.02 for 35 % (printed "0.17%", ..., read as shares: 0.17 %
of a 4k-token context would be 7 tokens); presets `budget50` and `budget35`. The budget reached
still depends on how many keys are similar enough to merge (threshold 0.75, as in the paper).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlens.engine.cache import CacheRows, Step, padded_index
from kvlens.errors import KvlensError
from kvlens.policies.base import Policy, param, register


def merging_sets(keys: torch.Tensor, threshold: float, candidates: torch.Tensor | None = None) -> list[list[int]]:
    """Algorithm 1: partition candidate keys `(T, D)` into sets of consecutive positions.

    Scans right to left; the anchor is the current set's rightmost key, and key i joins the set
    while `cos(k_i, k_anchor) > threshold`, otherwise it starts a new set (and becomes its
    anchor). `candidates` `(T,)` bool marks the keys that may be merged (default all); a
    non-candidate ends the current set, so sets never span a kept key. Every candidate belongs
    to exactly one set (singletons included); sets are returned left to right, each ascending.
    """
    t = keys.shape[0]
    if candidates is None:
        candidates = torch.ones(t, dtype=torch.bool, device=keys.device)
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)  # (T, D)
    cand = candidates.tolist()
    sets: list[list[int]] = []
    current: list[int] = []
    anchor = -1
    for i in range(t - 1, -1, -1):
        if not cand[i]:
            if current:
                sets.append(current[::-1])
            current, anchor = [], -1
            continue
        if current and float(unit[i] @ unit[anchor]) > threshold:
            current.append(i)
            continue
        if current:
            sets.append(current[::-1])
        current, anchor = [i], i
    if current:
        sets.append(current[::-1])
    return sets[::-1]


SIGMA_RULES = ("eq7", "mean_distance")


def gaussian_weights(keys_of_set: torch.Tensor, pivot_index: int, sigma: float | str | None = None) -> torch.Tensor:
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
    k = keys_of_set.float()
    dist2 = ((k - k[pivot_index]) ** 2).sum(-1)  # (n,)
    if rule == "eq7":
        sigma = float(dist2.sum()) / (2 ** 0.5 * n)
    elif rule == "mean_distance":
        sigma = float(dist2.sqrt().sum()) / max(n - 1, 1)
    else:
        sigma = float(rule)
    if sigma == 0:
        return torch.full((n,), 1.0 / n)
    logits = -dist2 / (2 * sigma ** 2)
    return torch.softmax(logits, dim=0)  # normalised exp(logits), stable


COMPRESSIONS = "kvmerger_compressions"  # per layer: compress calls so far in this run


@register
@dataclass(frozen=True)
class KVMerger(Policy):
    threshold: float = param(0.75, "Cosine similarity a key needs with its set's anchor to join the merging set.",
                             minimum=-1.0, maximum=1.0)
    recent_ratio: float = param(0.1, "Share of the slots kept unmerged as the recent window.",
                                minimum=0.0, maximum=1.0)
    keep_ratio: float = param(0.1, "Share of the slots kept unmerged as top-k by aggregated attention "
                              "(sinks and heavy hitters).", minimum=0.0, maximum=1.0)
    sigma: float = param(0.0, "Gaussian kernel width (0 = computed by sigma_rule).", minimum=0.0)
    sigma_rule: str = param("mean_distance", "How sigma is computed per merging set when sigma is 0: the mean "
                            "l2 distance from the pivot (§6.3, the rule the paper's sigma ablation uses) or Eq. 7's "
                            "formula (squared distances: near-uniform weights).", choices=SIGMA_RULES)
    remerge_every: int = param(0, "Also re-merge every this many decode steps (0 = only after prefill, the "
                               "paper's setting).", minimum=0)

    name = "kvmerger"
    description = ("After prefill, merge runs of similar consecutive keys into their most attended one "
                   "(Gaussian weights).")
    paper = "https://arxiv.org/abs/2407.08454"
    budget_free = True
    merges = True
    merge_rule: ClassVar[str] = "set"  # provenance: per step, target <- w_p target + sum_i w_i source_i
    presets: ClassVar[dict[str, dict]] = {"budget50": {"recent_ratio": 0.17, "keep_ratio": 0.12},
                                          "budget35": {"recent_ratio": 0.08, "keep_ratio": 0.02}}

    def compress(self, rows: CacheRows, step: Step) -> None:
        count = rows.states[0].get(COMPRESSIONS, 0)
        for state in rows.states:
            state[COMPRESSIONS] = count + 1
        if count and not (self.remerge_every and count % self.remerge_every == 0):
            return
        r = rows.pos.shape[0]
        keys, values = rows.keys[0].clone(), rows.values[0].clone()  # (R, S, D)
        keep = rows.valid.clone()  # (R, S)
        for h in range(r):
            layer, head = rows.layers[h // rows.kv_heads], h % rows.kv_heads
            for members in self._head_sets(rows, h):
                pivot = members[int(torch.argmax(rows.abar[h, members]))]
                w = gaussian_weights(rows.keys[0, h, members], members.index(pivot), self.sigma or self.sigma_rule)
                w = w.to(keys.dtype)  # (n,)
                keys[h, pivot] = w @ rows.keys[0, h, members]
                values[h, pivot] = w @ rows.values[0, h, members]
                keep[h, [m for m in members if m != pivot]] = False
                if step.log is not None:
                    for m, wm in zip(members, w.tolist()):
                        if m != pivot:
                            step.log.merge(step.index, layer, head, int(rows.pos[h, m]), [int(rows.pos[h, pivot])],
                                           [wm])
        if bool((keep == rows.valid).all()):
            return
        rows.keys, rows.values = keys[None], values[None]
        index, valid = padded_index(keep)
        rows.retain(index, valid)

    def _head_sets(self, rows, h: int) -> list[list[int]]:
        """Merging sets of two or more slots of row h (slot indices, ascending)."""
        valid = rows.valid[h]  # (S,)
        n = int(valid.sum())
        order = torch.nonzero(valid).flatten()  # valid slots, oldest first
        candidates = valid.clone()
        n_recent = int(n * self.recent_ratio)
        if n_recent:
            candidates[order[n - n_recent:]] = False
        n_top = int(n * self.keep_ratio)
        if n_top:
            score = rows.abar[h].masked_fill(~candidates, float("-inf"))
            candidates[torch.topk(score, min(n_top, int(candidates.sum()))).indices] = False
        return [m for m in merging_sets(rows.keys[0, h], self.threshold, candidates) if len(m) > 1]
