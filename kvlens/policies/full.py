"""`full`: keep everything. The reference every other policy is measured against."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvlens.kvcache import CacheRows, Step
from kvlens.policies.base import NO_ATTENTION, Needs, Policy, register


@register
@dataclass(frozen=True)
class Full(Policy):
    """Keeps every slot; its logits equal the model's own forward pass."""

    name = "full"
    chunked_prefill = True  # never compresses (`--prefill-chunk`)
    description = "Keep every key and value (the uncompressed reference)."
    paper = ""

    def needs(self) -> Needs:
        return dataclasses.replace(NO_ATTENTION, budget_free=True)

    def compress(self, rows: CacheRows, step: Step) -> None:
        return None
