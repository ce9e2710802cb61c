"""`streaming_llm`: attention sinks + a sliding window.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
https://arxiv.org/abs/2309.17453. Keeps the first `sink` positions and the most recent slots;
drops the oldest non-sink slot. Positions are not re-indexed inside the cache (kvlens keeps true
positions for every policy), which differs from the paper's rolling positions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvlens.kvcache import CacheRows, Step
from kvlens.policies.base import NO_ATTENTION, Needs, ScoredEviction, param, register


@register
@dataclass(frozen=True)
class StreamingLLM(ScoredEviction):
    sink: int = param(
        4, "Number of first positions always kept (the attention sinks; the paper uses 4).", minimum=0
    )

    name = "streaming_llm"
    chunked_prefill = True  # its score is the position (`--prefill-chunk`)
    description = "Keep the first `sink` tokens (attention sinks) and a window of the most recent ones."
    paper = "https://arxiv.org/abs/2309.17453"
    kvpress = "StreamingLLMPress"
    kvpress_differs = (
        "kvpress compresses the prompt only; kvlens keeps the budget at every decode step too. The "
        "cross-check wraps the press in kvpress's `DecodingPress`."
    )

    def needs(self) -> Needs:
        return dataclasses.replace(NO_ATTENTION, min_budget=self.sink + 1)

    def local_window(self, budget: int) -> int:
        return budget - self.sink

    def score(self, rows: CacheRows, step: Step) -> torch.Tensor:
        return rows.pos.float()  # newest first

    def protected(self, rows: CacheRows, budget: int) -> torch.Tensor | None:
        return rows.pos < self.sink
