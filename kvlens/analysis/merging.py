"""KVMerger's merging sets seen from recorded keys (Fig. 3b, 3d), using the policy's own functions.

`merging_sets` (Algorithm 1) and `gaussian_weights` (Eq. 7-8) come from
`kvlens.policies.kvmerger`, so the analysis shows exactly what the policy would do.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlens.analysis.attention_stats import aggregated_attention
from kvlens.analysis.states import head_states, recorded_layers, states
from kvlens.errors import KvlensError
from kvlens.policies.kvmerger import gaussian_weights, merging_sets
from kvlens.runs import Run


def check_threshold(threshold: float) -> None:
    if not -1 <= threshold <= 1:
        raise KvlensError(f"The cosine-similarity threshold must lie in [-1, 1]; got {threshold}.")


@dataclass
class MergingRatio:
    """`ratio` `(L, Hkv)`: share of a prompt's keys that merging removes, `1 - sets / T`."""

    layers: list[int]
    threshold: float
    ratio: torch.Tensor

    def per_layer(self) -> torch.Tensor:
        return self.ratio.mean(1)  # (L,)


def merging_ratio(run: Run, threshold: float = 0.75) -> MergingRatio:
    """KVMerger Fig. 3b for one text: layer-wise compression ratio of Algorithm 1 on all prefill keys.

    Every key is a candidate (the figure studies the set identification alone, before the
    policy's recent window and top-k are set aside). Ratio = share of keys that disappear when
    each merging set becomes one state: `1 - number of sets / T`, per KV head.
    """
    check_threshold(threshold)
    layers = recorded_layers(run, "k")
    rows = []
    for layer in layers:
        k = states(run, "k", layer)  # (Hkv, T, D)
        rows.append(torch.tensor([1 - len(merging_sets(head, threshold)) / k.shape[1] for head in k]))
    return MergingRatio(layers, threshold, torch.stack(rows))


@dataclass
class GaussianSet:
    """KVMerger Fig. 3d: one merging set's token `positions` `(n,)`, its `pivot` position, and the
    Gaussian weights `(n,)` per sigma (`None` = the paper's formula)."""

    layer: int
    head: int
    threshold: float
    positions: list[int]
    pivot: int
    weights: dict[float | None, torch.Tensor]


def gaussian_set(run: Run, layer: int, head: int, threshold: float = 0.75, position: int | None = None,
                 sigmas: tuple[float | None, ...] = (None,)) -> GaussianSet:
    """Gaussian-kernel weights of the merging set holding `position` (default: the largest set).

    Sets come from Algorithm 1 over the head's prefill keys; the pivot is the member with the
    largest aggregated attention (the recorded prefill statistic, else recomputed from q and k).
    """
    check_threshold(threshold)
    keys = head_states(run, "key", layer, head)  # (T, D)
    sets = merging_sets(keys, threshold)
    if position is None:
        chosen = max(sets, key=len)
    else:
        if not 0 <= position < keys.shape[0]:
            raise KvlensError(f"Token {position} is out of range: the prompt has tokens 0 to {keys.shape[0] - 1}.")
        chosen = next(s for s in sets if position in s)
    abar = aggregated_attention(run, layer)[head]  # (T,)
    idx = torch.tensor(chosen)
    p = int(abar[idx].argmax())
    weights = {s: gaussian_weights(keys[idx], p, s) for s in sigmas}
    return GaussianSet(layer, head, threshold, chosen, chosen[p], weights)
