"""Attention scores as the cache's readers compute them: a layer's `AttentionSpec`, the one softmax pipeline
(`softmax_weights`) and a KV head's attention as the mean of its query heads' (`group_mean`).

Pure math over tensors, shared by the engine's attention function (`kvlens.engine.attention`) and the policies
(KVzip's replay scores), so that both compute the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer attends: logit scale, tanh soft-capping of the logits, sliding window (None = off)."""

    scaling: float
    softcap: float | None = None
    window: int | None = None

    @property
    def plain(self) -> bool:
        """Causal softmax attention that SDPA computes as is."""
        return self.softcap is None and self.window is None


def softmax_weights(
    scores: torch.Tensor, spec: AttentionSpec, hidden: torch.Tensor | None = None, scaled: bool = False
) -> torch.Tensor:
    """The one attention pipeline: float32 logits `(..., q, S)` -> weights, in place. The layer's scale
    (unless `scaled`: it was applied to the queries), tanh soft-capping (`softcap * tanh(s / softcap)`), -inf
    where `hidden` (bool, broadcasting to `(..., q, k)` over the last k keys; None: every key seen), softmax.
    """
    scores = layer_logits(scores, spec, scaled)
    if hidden is not None:
        scores[..., scores.shape[-1] - hidden.shape[-1] :].masked_fill_(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1)


def layer_logits(scores: torch.Tensor, spec: AttentionSpec, scaled: bool = False) -> torch.Tensor:
    """float32 products `(..., S)` -> the layer's logits, in place: its scale (unless `scaled`), then tanh
    soft-capping. `softmax_weights`'s first half, for a rule that needs the logits themselves (KVzip's
    log-space scores)."""
    if not scaled:
        scores.mul_(spec.scaling)
    if spec.softcap is not None:
        scores.div_(spec.softcap).tanh_().mul_(spec.softcap)
    return scores


def group_mean(probs: torch.Tensor) -> torch.Tensor:
    """A KV head's attention is the mean of its query heads': `(R, G, ...)` -> `(R, ...)`."""
    return probs.mean(1)
