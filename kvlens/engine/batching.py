"""One decode step's eviction for every layer at once: the engine's batching of a `ScoredEviction`.

When a policy's selection competes within each KV head and it compresses at every decode step
(`batchable`), the cache holds every layer's rows in one store, and a step's selection can run once for all of
them `(L * Hkv, S)`. The policy still sees one layer: each layer's `score` and `protected` `(Hkv, S)` are
stacked here, then one `select_lowest` and one `free` run on the all-layer view, and each layer's evictions
are logged as its own. That is the policy's own `ScoredEviction.compress` (final), row for row
(`tests/engine/test_layer_batching.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvlens.kvcache import Step
from kvlens.kvcache.views import SlotRows
from kvlens.policies import Policy, ScoredEviction, select_lowest


def batchable(policy: Policy) -> bool:
    """Whether a decode step's compression may run once on every layer's rows: a scored eviction whose
    selection competes within each KV head (`Needs.competes`) and that compresses at decode steps (the
    all-layer store holds the budget, it cannot grow)."""
    return isinstance(policy, ScoredEviction) and policy.competes == "head" and policy.needs().decode_steps


def evict_all_layers(
    policy: ScoredEviction, everywhere: SlotRows, layers: Sequence[SlotRows], step: Step
) -> None:
    """`policy.compress` on every layer of `layers` (one-layer views of the store `everywhere` views whole),
    as one selection: rows over the budget keep `policy.keeps(budget)` slots; else each layer's
    `no_selection`."""
    if step.budget is None or everywhere.n_kept <= step.budget:
        for rows in layers:
            policy.no_selection(rows, step)
        return
    chosen = dataclasses.replace(step, budget=policy.keeps(step.budget))
    score = torch.cat([policy.score(rows, chosen) for rows in layers])  # (L * Hkv, S)
    protected = [p for rows in layers if (p := policy.protected(rows, chosen.budget)) is not None]
    mask = torch.cat(protected) if len(protected) == len(layers) else None
    _, evicted = select_lowest(everywhere, score, mask, chosen.budget)
    if step.log is not None:
        positions = everywhere.pos.gather(1, evicted)
        for rows, part in zip(layers, positions.chunk(len(layers)), strict=True):
            step.log.evict(step.index, rows.layer, part)
    everywhere.free(evicted)
