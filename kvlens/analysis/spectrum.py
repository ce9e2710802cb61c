"""Normalised singular values of the key and value caches (WeightedKV Fig. 1).

For each layer and KV head, the singular values of the head's prefill state matrix `(T, D)`
(no centring, as the paper), divided by the largest. Keys are low-rank (fast decay), values are
not: WeightedKV's argument for dropping keys but merging values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlens.analysis.similarity import NAMES
from kvlens.analysis.states import kind_code, recorded_layers, states
from kvlens.runs.run import Run

EXACT_MAX = 512  # full SVD when min(T, D) is at most this; randomized_svd above


@dataclass
class Spectrum:
    """`values` `(L, H, r)` normalised singular values (largest = 1), `energy_top` `(L, H)` the
    share of squared singular values in the top `top` (of all, not only the r returned)."""

    kind: str
    layers: list[int]
    values: torch.Tensor
    energy_top: torch.Tensor
    top: int


def singular_values(x: torch.Tensor, components: int, seed: int = 0) -> tuple[torch.Tensor, float]:
    """Largest `components` singular values of `x` `(T, D)`, and the total energy `sum s^2`.

    Exact (`torch.linalg.svdvals`) when `min(T, D) <= 512`, else scikit-learn's
    `randomized_svd` (seeded); the total energy is the squared Frobenius norm either way.
    """
    x = x.double()
    total = float((x ** 2).sum())
    r = min(components, *x.shape)
    if min(x.shape) <= EXACT_MAX:
        return torch.linalg.svdvals(x)[:r].float(), total
    from sklearn.utils.extmath import randomized_svd

    _, s, _ = randomized_svd(x.numpy(), n_components=r, random_state=seed)
    return torch.from_numpy(s).float(), total


def spectrum(run: Run, kind: str = "key", components: int = 64, top: int = 8) -> Spectrum:
    """Normalised singular values of `kind` states per recorded layer and head (WeightedKV Fig. 1)."""
    code = kind_code(kind)
    layers = recorded_layers(run, code)
    values, energy = [], []
    for layer in layers:
        x = states(run, code, layer)  # (H, T, D)
        vs, es = [], []
        for head in x:
            s, total = singular_values(head, components)
            vs.append(s / s[0] if s[0] > 0 else s)
            es.append(float((s[:top].double() ** 2).sum()) / total if total > 0 else 0.0)
        values.append(torch.stack(vs))
        energy.append(torch.tensor(es))
    return Spectrum(NAMES[code], layers, torch.stack(values), torch.stack(energy), top)
