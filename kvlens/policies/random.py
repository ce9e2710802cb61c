"""`random`: evict uniformly random slots (the floor any policy must beat).

Scores are uniform draws from one generator per layer and run, seeded by `seed` and the layer, so
a run is reproducible and layers differ. kvpress's `RandomPress` reseeds at every call, so all its
layers draw the same numbers; it keeps no window either, as here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlens.kvcache import CacheRows, Step
from kvlens.policies.base import NO_ATTENTION, Needs, ScoredEviction, param, register

GENERATOR = "random_generator"  # per layer: the run's generator


@register
@dataclass(frozen=True)
class Random(ScoredEviction):
    seed: int = param(0, "Seed of the uniform scores (one generator per layer and run).", minimum=0)

    name = "random"
    description = "Evict uniformly random slots (a seeded floor)."
    paper = ""
    kvpress = "RandomPress"
    kvpress_differs = "kvpress reseeds at every call, so all layers draw alike; kvlens draws per layer."

    def needs(self) -> Needs:
        return NO_ATTENTION

    def score(self, rows: CacheRows, step: Step) -> torch.Tensor:
        seed = self.seed * 1_000_003 + rows.layer
        gen = rows.state.setdefault(GENERATOR, torch.Generator().manual_seed(seed))
        return torch.rand(rows.pos.shape, generator=gen).to(rows.pos.device)
