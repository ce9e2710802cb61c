"""`adakv`: one budget per layer, shared across its KV heads by their scores, with a floor per head.

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient
LLM Inference", 2024, https://arxiv.org/abs/2407.11550. A layer keeps Hkv x B slots in all: each
head's `alpha` x B best slots (by the `base` policy's score; at least one) are safe, the base's
protected slots too, and of the rest the layer's lowest scores leave, whichever head they belong
to (kvpress's `AdaKVPress`, alpha = 0.2 as in the authors' GQA experiments; the official code
blends each head's count with the floor, (1 - alpha) n_h + alpha B, a different rule). Ties
leave the newest position first, then the lower head. Decoding follows the base's protocol: with
SnapKV's default (`decoding=once`, the paper's and kvpress's) the prompt is compressed once and the
cache grows by one slot per generated token; with a base that compresses at decode steps
(`base.decoding=rolling`, or a decode-time scorer such as H2O) each step's Hkv new slots make Hkv
slots leave, chosen the same way.

Heads keep different counts, so each layer's keys and values are held in pages of 4 slots
(`kvlens.kvcache.paged`): a head holds its own kept slots, not its fullest head's count.
`kv_entries_max` counts the kept entries (L x Hkv x B), `kv_bytes_*` the allocated pages, which
are what is really held. With packed storage (`--kv-bits`, `--kv-rank`) the buffers are padded
to the fullest head instead, the padding masked. kvpress's AdaKV frees nothing: it keeps every key
and masks the evicted ones with fake keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvlens.kvcache import CacheRows, Step
from kvlens.policies.base import (
    Needs,
    ScoredEviction,
    Wrapper,
    free_logged,
    lowest_of_all_rows,
    param,
    register,
    scored_eviction_names,
)
from kvlens.policies.snapkv import SnapKV


@register
@dataclass(frozen=True)
class AdaKV(Wrapper):
    base: ScoredEviction = param(
        SnapKV(),
        "Policy whose scores the heads of a layer compete with (any scored "
        "eviction policy; set its parameters as base.NAME).",
        choices=scored_eviction_names,
    )
    alpha: float = param(
        0.2,
        "Floor: each head keeps at least alpha x budget of its best slots (kvpress and the "
        "authors' GQA runs: 0.2).",
        minimum=0.0,
        maximum=1.0,
    )

    name = "adakv"
    description = (
        "A layer's budget shared across its heads by a top-k over all their scores (per-head floor)."
    )
    paper = "https://arxiv.org/abs/2407.11550"
    kvpress = "AdaKVPress"
    kvpress_differs = (
        "kvpress keeps every key and masks the evicted ones, so its memory is the full cache's; "
        "kvlens frees them (each head holding its own slots, in pages)."
    )

    def needs(self) -> Needs:
        return dataclasses.replace(self.base.needs(), competes="layer")

    def compress(self, rows: CacheRows, step: Step) -> None:
        budget = step.budget
        if budget is None or not (step.prompt or self.base.needs().decode_steps):
            return
        valid = rows.valid
        r, s = valid.shape
        leaving = int(valid.sum()) - budget * r
        if leaving <= 0:
            return
        score = self.base.score(rows, step).float().masked_fill(~valid, float("inf"))
        protected = self.base.protected(rows, budget)
        if protected is not None:
            score = score.masked_fill(protected, float("inf"))
        safe = max(int(self.alpha > 0), int(budget * self.alpha))  # at least one slot when alpha > 0
        if safe:
            score = score.scatter(
                1, score.masked_fill(~valid, float("-inf")).topk(min(safe, s), dim=-1).indices, float("inf")
            )
        free_logged(step, rows, lowest_of_all_rows(rows, score, leaving))
