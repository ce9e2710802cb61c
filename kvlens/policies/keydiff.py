"""`keydiff`: keep the keys least similar to the mean key.

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments", 2025, https://arxiv.org/abs/2504.15364: distinctive keys draw
attention, so a slot scores minus the cosine similarity of its key to the anchor, the mean of
the row's normalised kept keys (kvpress's `KeyDiffPress`). The paper compresses block by block as
the prompt streams in (kvpress: `BlockPress`, blocks of 128); kvlens scores the whole prompt at
once, as `KeyDiffPress` alone does, and at a decode step scores the new key with the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlens.kvcache import CacheRows, Step
from kvlens.policies.base import NO_ATTENTION, Needs, ScoredEviction, register


@register
@dataclass(frozen=True)
class KeyDiff(ScoredEviction):
    """No hyperparameters: the keys' directions decide."""

    name = "keydiff"
    description = "Keep the keys least similar (cosine) to the mean normalised key of their head."
    paper = "https://arxiv.org/abs/2504.15364"
    kvpress = "KeyDiffPress"
    kvpress_differs = "kvpress compresses the prompt only; kvlens keeps the budget at every decode step too."

    def needs(self) -> Needs:
        return NO_ATTENTION

    def score(self, rows: CacheRows, step: Step) -> torch.Tensor:
        keys = rows.keys[0].float()  # (R, S, D)
        unit = F.normalize(keys, p=2, dim=-1) * rows.valid[..., None]
        anchor = unit.sum(1, keepdim=True) / rows.valid.sum(-1)[:, None, None].clamp(min=1)  # (R, 1, D)
        return -F.cosine_similarity(keys, anchor, dim=-1)
