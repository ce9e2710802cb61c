"""`think`: prune each KV head's least important key channels, over an eviction policy, and store the rest
only.

Xu et al., "ThinK: Thinner Key Cache by Query-Driven Pruning", 2024, https://arxiv.org/abs/2407.21018
(authors' code: SalesforceAIResearch/ThinK, `key_pruner_query_driven`). Once the `base` policy has compressed
the prompt (the authors run ThinK after SnapKV or H2O; kvpress composes `ThinKPress` after a press in
`ComposedPress`, or uses it alone: `base=full`), channel i of a KV head scores ||Q_i|| ||K_i||, the paper's
query-driven criterion ||Q_i K_i^T||_F: Q `(w, D)` the last `window` prompt queries after RoPE, K the head's
kept keys `(S, D)`, computed as the authors' code and kvpress's `ThinKPress` do, mean(Q_i^2) x mean(K_i^2)
(the same order). The `ratio` x D lowest channels (rounded down) leave each head; ties leave the lower channel
first. The kept channels are what the cache stores of each key (`kvlens.kvcache.channels`), so a pruned key
costs (1 - ratio) of its bytes; values are untouched. A query meets a pruned key on the kept channels only.

Divergences, each a parameter or noted here:
- `recent`: the prompt's newest keys kept whole: the authors' code keeps its last 32 (`recent_size`), kvpress
  none (preset `kvpress`). Later tokens' keys are kept whole in both, and here.
- GQA: a KV head's query score is the mean of its query heads' (kvpress); the authors' code repeats each KV
  head's keys for its query heads and prunes each copy by its own query head (on the paper's multi-head
  models the two are the same).
- kvpress zeroes the pruned channels and stores the keys whole (no memory saved); kvlens removes them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvlens.kvcache import CacheRows, Prompt, Step
from kvlens.policies.base import (
    Needs,
    Policy,
    PrunesKeys,
    Wrapper,
    check,
    param,
    recent_mask,
    register,
    scored_eviction_names,
)
from kvlens.policies.snapkv import SnapKV

QUERIES = (
    "think_queries"  # per layer, until the prompt's compression: (Hkv, D) the window queries' mean squares
)


@register
@dataclass(frozen=True)
class ThinK(Wrapper, PrunesKeys):
    base: Policy = param(
        SnapKV(),
        "Eviction policy that compresses the prompt first (any scored eviction policy, "
        "or full for none, kvpress's ThinKPress alone; set its parameters as base.NAME). The "
        "authors' runs: SnapKV or H2O.",
        choices=lambda: ("full", *scored_eviction_names()),
    )
    ratio: float = param(
        0.4,
        "Share of each KV head's key channels pruned, rounded down (the authors' code: 0.4; "
        "the paper's runs 0.4 and 0.5; kvpress's key_channel_compression_ratio).",
        minimum=0.0,
        maximum=1.0,
    )
    window: int = param(
        32,
        "Observation window: the last prompt queries that score the channels (the paper, "
        "its code and kvpress: 32).",
        minimum=1,
    )
    recent: int = param(
        32, "The prompt's newest keys kept with every channel (the authors' code: 32; kvpress: 0).", minimum=0
    )

    name = "think"
    description = "Over an eviction policy: keep each head's key channels that the last queries weigh most."
    paper = "https://arxiv.org/abs/2407.21018"
    kvpress = "ThinKPress"
    kvpress_differs = (
        "kvpress zeroes the pruned channels and keeps the keys whole; kvlens stores the kept channels "
        "only. kvpress prunes every prompt key (`recent=0`, preset kvpress); the authors' code keeps "
        "the newest 32 whole."
    )
    presets: ClassVar[dict[str, dict[str, Any]]] = {"kvpress": {"recent": 0}, "paper": {"recent": 32}}

    def validate(self) -> None:
        check(
            self.ratio < 1,
            f"ratio of think is the share of key channels pruned, below 1 (some must stay); "
            f"got {self.ratio}.",
        )

    def needs(self) -> Needs:
        return dataclasses.replace(self.base.needs(), pruned_keys=True)

    def observe_prefill(self, rows: CacheRows, prompt: Prompt) -> None:
        self.base.observe_prefill(rows, prompt)
        if prompt.queries is None:
            raise ValueError(
                "kvlens: think scores the channels with the prompt's queries, which were not passed"
            )
        q = prompt.queries[:, -self.window :].float().pow(2).mean(1)  # (Hq, D)
        rows.state[QUERIES] = q.view(rows.pos.shape[0], -1, q.shape[-1]).mean(1)

    def compress(self, rows: CacheRows, step: Step) -> None:
        self.base.compress(rows, step)

    def key_channels(self, rows: CacheRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's kept channels `(Hkv, K)`, ascending, by the window queries' and the kept keys' mean
        squares; the `recent` newest slots keep every channel."""
        queries = rows.state.pop(QUERIES)  # (Hkv, D)
        keys, valid = rows.keys[0].float(), rows.valid
        keys = (keys.pow(2) * valid[..., None]).sum(1) / valid.sum(-1, keepdim=True)  # (R, D)
        d = keys.shape[-1]
        pruned = int(d * self.ratio)
        order = torch.argsort(queries * keys, dim=-1, stable=True)  # lowest first, the lower channel on ties
        return order[:, pruned:].sort(-1).values, recent_mask(rows, self.recent)
