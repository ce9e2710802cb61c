"""`tova`: token omission via attention.

Oren et al., "Transformers are Multi-State RNNs", 2024, https://arxiv.org/abs/2401.06104.
Drops the slot with the smallest attention from the current query, averaged over all heads of
the layer, so every KV head of a layer keeps the same set (as TOVA's code does). No forced sinks
or recent window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlens.kvcache import CacheRows, Step
from kvlens.policies.base import Needs, ScoredEviction, register


@register
@dataclass(frozen=True)
class TOVA(ScoredEviction):
    """No hyperparameters: the current query's attention decides."""

    name = "tova"
    chunked_prefill = True  # its score is the newest query's attention over the slots (`--prefill-chunk`)
    description = (
        "Keep the slots with the highest attention from the current query (mean over the layer's heads)."
    )
    paper = "https://arxiv.org/abs/2401.06104"
    kvpress = "TOVAPress"
    kvpress_differs = "kvpress's press always keeps the newest token; the cross-check removes that pin."

    def needs(self) -> Needs:
        return Needs(column_sums=False)  # reads only the last prefill rows

    def score(self, rows: CacheRows, step: Step) -> torch.Tensor:
        # mean over all query heads of the layer; identical for every KV head
        attn = rows.last_attn  # (Hq, S)
        if attn is None:
            raise ValueError("kvlens: tova scores the latest query's attention, which is not recorded")
        return attn.mean(0).expand(rows.pos.shape)
