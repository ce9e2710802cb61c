"""`tova`: token omission via attention.

Oren et al., "Transformers are Multi-State RNNs", 2024, https://arxiv.org/abs/2401.06104.
Drops the slot with the smallest attention from the current query, averaged over all heads of
the layer, so every KV head of a layer keeps the same set (as TOVA's code does). No forced sinks
or recent window.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvlens.policies.base import ScoredEviction, register


@register
@dataclass(frozen=True)
class TOVA(ScoredEviction):
    """No hyperparameters: the current query's attention decides."""

    name = "tova"
    description = "Keep the slots with the highest attention from the current query (mean over the layer's heads)."
    paper = "https://arxiv.org/abs/2401.06104"

    def prefill_column_sums(self) -> bool:
        return False  # reads only the last prefill rows

    def score(self, layer):
        # mean over all query heads of the layer; identical for every KV head
        return layer.last_attn.mean(0, keepdim=True).expand(layer.pos.shape[0], -1)
