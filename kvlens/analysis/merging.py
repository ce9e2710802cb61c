"""KVMerger's merging sets seen from recorded keys (Fig. 3b, 3d), using the policy's own functions.

`merging_sets` (Algorithm 1) and `gaussian_weights` (Eq. 7-8) come from
`kvlens.policies.kvmerger`, so the analysis shows exactly what the policy would do.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kvlens.analysis.attention_stats import aggregated_attention
from kvlens.analysis.states import head_states, recorded_layers, states
from kvlens.errors import KvlensError
from kvlens.policies.kvmerger import SIGMA_RULES, KVMerger, gaussian_weights, merging_sets
from kvlens.runs.run import Run

# KVMerger (arXiv 2407.08454) defines the Gaussian kernel's sigma in two usable ways (its §5.2 sentence, "the
# mean value of g_pi", is circular): where each rule comes from, and the policy's default drawn first
SIGMA_SOURCES = {"mean_distance": ("σ = mean ‖k_p − k_i‖", "§6.3"), "eq7": ("σ from Eq. 7", "§5.2")}
POLICY_RULE = next(f.default for f in fields(KVMerger) if f.name == "sigma_rule")
RULES = (POLICY_RULE, *(r for r in SIGMA_RULES if r != POLICY_RULE))


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
    Gaussian weights `(n,)` per sigma: a rule name (`eq7`, `mean_distance`) or a fixed value."""

    layer: int
    head: int
    threshold: float
    positions: list[int]
    pivot: int
    weights: dict[str | float, torch.Tensor]

    @staticmethod
    def label(sigma: str | float) -> str:
        """How a sigma is named in figures: the rule and the paper section defining it, or the value."""
        if isinstance(sigma, str):
            name, section = SIGMA_SOURCES[sigma]
            return f"{name} ({section}{', default' if sigma == POLICY_RULE else ''})"
        return f"σ = {sigma:g}"


def gaussian_set(run: Run, layer: int, head: int, threshold: float = 0.75, position: int | None = None,
                 sigmas: tuple[str | float | None, ...] = RULES) -> GaussianSet:
    """Gaussian-kernel weights of the merging set holding `position` (default: the largest set).

    Sets come from Algorithm 1 over the head's prefill keys; the pivot is the member with the
    largest aggregated attention (the recorded prefill statistic, else recomputed from q and k).
    `sigmas`: rule names or positive values (None is Eq. 7, as in `gaussian_weights`); by default
    both rules, the policy's default first.
    """
    check_threshold(threshold)
    if not sigmas:
        raise KvlensError("Name at least one sigma: a rule (mean_distance, eq7) or a positive value.")
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
    weights = {("eq7" if s is None else s): gaussian_weights(keys[idx], p, s) for s in sigmas}
    return GaussianSet(layer, head, threshold, chosen, chosen[p], weights)
