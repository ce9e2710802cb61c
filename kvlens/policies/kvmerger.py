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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlens.errors import KvlensError
from kvlens.policies.base import Policy, param, register
from kvlens.policies.corm import padded_keep


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


def gaussian_weights(keys_of_set: torch.Tensor, pivot_index: int, sigma: float | None = None) -> torch.Tensor:
    """Eq. 7-8: normalised Gaussian-kernel weights `(n,)` of a set's keys `(n, D)` around its pivot.

    `g_i = exp(-||k_p - k_i||^2 / (2 sigma^2))`, `w_i = g_i / sum_j g_j`. With `sigma=None`,
    sigma follows the paper's formula (Eq. 7): `sigma = sum_i ||k_p - k_i||^2 / (sqrt(2) n)`.
    The paper's sentence instead says sigma is "the mean value of g_pi"; that is circular (g
    depends on sigma), so the formula is implemented and sigma is exposed for other choices.
    When every key equals the pivot (or n = 1), sigma is 0 and the weights are uniform.
    """
    n = keys_of_set.shape[0]
    if not 0 <= pivot_index < n:
        raise KvlensError(f"The pivot index {pivot_index} is outside the merging set of {n} keys.")
    if sigma is not None and not sigma > 0:
        raise KvlensError(f"sigma must be a positive number or None (the paper's formula); got {sigma!r}.")
    k = keys_of_set.float()
    dist2 = ((k - k[pivot_index]) ** 2).sum(-1)  # (n,)
    if sigma is None:
        sigma = float(dist2.sum()) / (2 ** 0.5 * n)
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
    sigma: float = param(0.0, "Gaussian kernel width (0 = the paper's Eq. 7 formula).", minimum=0.0)
    remerge_every: int = param(0, "Also re-merge every this many decode steps (0 = only after prefill, the "
                               "paper's setting).", minimum=0)

    name = "kvmerger"
    description = "After prefill, merge runs of similar consecutive keys into their most attended one (Gaussian weights)."
    paper = "https://arxiv.org/abs/2407.08454"
    budget_free = True
    merges = True
    merge_rule: ClassVar[str] = "set"  # provenance: per step, target <- w_p target + sum_i w_i source_i

    def compress(self, layer, budget, log):
        step = layer.state.get(COMPRESSIONS, 0)
        layer.state[COMPRESSIONS] = step + 1
        if step and not (self.remerge_every and step % self.remerge_every == 0):
            return
        hkv = layer.pos.shape[0]
        keys, values = layer.keys[0].clone(), layer.values[0].clone()  # (Hkv, S, D)
        keep = layer.valid.clone()  # (Hkv, S)
        for h in range(hkv):
            for members in self._head_sets(layer, h):
                pivot = members[int(torch.argmax(layer.abar[h, members]))]
                w = gaussian_weights(layer.keys[0, h, members], members.index(pivot), self.sigma or None)
                w = w.to(keys.dtype)  # (n,)
                keys[h, pivot] = w @ layer.keys[0, h, members]
                values[h, pivot] = w @ layer.values[0, h, members]
                keep[h, [m for m in members if m != pivot]] = False
                if log is not None:
                    for m, wm in zip(members, w.tolist()):
                        if m != pivot:
                            log.merge(layer.layer, h, int(layer.pos[h, m]), [int(layer.pos[h, pivot])], [wm])
        if bool((keep == layer.valid).all()):
            return
        layer.keys, layer.values = keys[None], values[None]
        index, valid = padded_keep(keep)
        layer.keep(index, valid)

    def _head_sets(self, layer, h: int) -> list[list[int]]:
        """Merging sets of two or more slots of KV head h (slot indices, ascending)."""
        valid = layer.valid[h]  # (S,)
        n = int(valid.sum())
        order = torch.nonzero(valid).flatten()  # valid slots, oldest first
        candidates = valid.clone()
        n_recent = int(n * self.recent_ratio)
        if n_recent:
            candidates[order[n - n_recent:]] = False
        n_top = int(n * self.keep_ratio)
        if n_top:
            score = layer.abar[h].masked_fill(~candidates, float("-inf"))
            candidates[torch.topk(score, min(n_top, int(candidates.sum()))).indices] = False
        return [m for m in merging_sets(layer.keys[0, h], self.threshold, candidates) if len(m) > 1]
