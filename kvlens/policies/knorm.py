"""`knorm`: keep the keys of lowest L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP
2024, https://arxiv.org/abs/2406.11430: keys of low norm draw high attention, so the score of a
slot is minus its key's norm (after RoPE, as cached), computed in float32; no attention needed.
As kvpress's `KnormPress`: no protected sinks or window. At a decode step the new key is scored
with the others (kvpress's `DecodingPress` does the same at its compression steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlens.kvcache import CacheRows, Step
from kvlens.policies.base import NO_ATTENTION, Needs, ScoredEviction, register


@register
@dataclass(frozen=True)
class KNorm(ScoredEviction):
    """No hyperparameters: the key norms decide."""

    name = "knorm"
    description = "Keep the keys with the lowest L2 norm (low-norm keys draw attention)."
    paper = "https://arxiv.org/abs/2406.11430"
    kvpress = "KnormPress"
    kvpress_differs = "kvpress compresses the prompt only; kvlens keeps the budget at every decode step too."

    def needs(self) -> Needs:
        return NO_ATTENTION

    def score(self, rows: CacheRows, step: Step) -> torch.Tensor:
        norm: torch.Tensor = torch.linalg.vector_norm(rows.keys[0], dim=-1, dtype=torch.float32)  # (R, S)
        return -norm
