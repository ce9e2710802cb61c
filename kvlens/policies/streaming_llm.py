"""`streaming_llm`: attention sinks + a sliding window.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
https://arxiv.org/abs/2309.17453. Keeps the first `sink` positions and the most recent slots;
drops the oldest non-sink slot. Positions are not re-indexed inside the cache (kvlens keeps true
positions for every policy), which differs from the paper's rolling positions.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvlens.policies.base import ScoredEviction, check_int


@dataclass
class StreamingLLM(ScoredEviction):
    """sink: number of first positions always kept (the attention sinks)."""

    sink: int = 4

    name = "streaming_llm"
    description = "Keep the first `sink` tokens (attention sinks) and a window of the most recent ones."
    paper = "https://arxiv.org/abs/2309.17453"
    needs_attention = False

    def __post_init__(self):
        check_int("sink", self.sink, 0)

    def min_budget(self) -> int:
        return self.sink + 1

    def prefill_rows(self) -> int:
        return 0

    def score(self, layer):
        return layer.pos.float()  # newest first

    def protected(self, layer, budget):
        return layer.pos < self.sink
