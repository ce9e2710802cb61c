"""`kvmerger`: adaptive KV merging by key similarity with Gaussian-kernel weights.

Wang et al., "Model Tells You Where to Merge: Adaptive KV Cache Merging for LLMs on Long-Context
Tasks" (KVMerger), 2024, https://arxiv.org/abs/2407.08454. The pure functions `merging_sets`
(Algorithm 1) and `gaussian_weights` (Eq. 7-8) are public so analysis code can reuse them.
"""
from __future__ import annotations

import torch

from kvlens.errors import KvlensError


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
