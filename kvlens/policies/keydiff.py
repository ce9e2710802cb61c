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

from kvlens.kvcache import CacheRows, Step
from kvlens.policies.base import NO_ATTENTION, Needs, ScoredEviction, register
from kvlens.policies.key_norms import cached_key_norms

KEY_NORM = "keydiff_key_norm"  # per slot `(Hkv, S)` float32: its cached key's L2 norm


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
        """Minus each slot's cosine to its row's anchor `(R, S)`, as two batched products over the keys
        `(R, S, D)` (no normalised copy of them). The keys' norms are a per-slot statistic kept across decode
        steps (`cached_key_norms`): only the new keys' are computed."""
        keys = rows.keys[0].float()  # (R, S, D)
        norm = cached_key_norms(rows, KEY_NORM, step.index)  # (R, S), F.normalize's floor
        weight = rows.valid / norm / rows.valid.sum(-1, keepdim=True).clamp(min=1)  # (R, S)
        anchor = torch.bmm(weight[:, None, :], keys)  # (R, 1, D): the mean of the kept unit keys
        dot = torch.bmm(keys, anchor.transpose(1, 2))[..., 0]  # (R, S)
        scale: torch.Tensor = norm * torch.linalg.vector_norm(anchor, dim=-1)  # (R, S)
        return -dot / scale.clamp(min=1e-8)
