"""`qfilter`: keep the keys aligned with the main direction of the queries.

Godey et al., "Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression", 2025,
https://arxiv.org/abs/2503.02812: queries concentrate along one direction per head, so a key's
expected attention follows its projection on it. Each KV head has a filter f (`kvlens qfilters
--model SPEC` computes them once from the bundled texts and caches them; `kvlens.engine.qfilters`
says how) and a slot scores -<f, k> with its key after RoPE (kvpress's `QFilterPress`, which
downloads the authors' filters from the hub instead). No attention needed; as kvpress, no window.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvlens.kvcache import CacheRows, Step
from kvlens.policies.base import NO_ATTENTION, Needs, ScoredEviction, register

FILTERS = "qfilters"  # per layer (Hkv, D), put in the run state by the engine (`Needs.model_data`)


@register
@dataclass(frozen=True)
class QFilter(ScoredEviction):
    """No hyperparameters: the model's filters decide."""

    name = "qfilter"
    description = "Keep the keys most aligned with the queries' main direction (the model's Q-Filters)."
    paper = "https://arxiv.org/abs/2503.02812"
    kvpress = "QFilterPress"
    kvpress_differs = (
        "kvlens computes the Q-Filters from the bundled texts (`kvlens qfilters`); kvpress "
        "downloads the authors', so the two are not compared."
    )

    def needs(self) -> Needs:
        return dataclasses.replace(NO_ATTENTION, model_data=(FILTERS,), tokenizer=True)

    def score(self, rows: CacheRows, step: Step) -> torch.Tensor:
        filters: torch.Tensor = rows.state[FILTERS]  # (Hkv, D)
        return -(rows.keys[0].float() * filters.float()[:, None, :]).sum(-1)
