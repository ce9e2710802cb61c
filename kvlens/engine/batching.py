"""One decode step's eviction for every layer at once: the engine's batching of a `ScoredEviction`, and of
a `MergesEvicted` over one.

When a policy's selection competes within each KV head and it compresses at every decode step
(`batchable`), the cache holds every layer's rows in one store, and a step's selection can run once for all of
them `(L * Hkv, S)`. The policy still sees one layer: each layer's `score` and `protected` `(Hkv, S)` are
stacked here, then one `select_lowest` and one `free` run on the all-layer view; each layer's evictions are
logged as its own, or merged by the policy (`MergesEvicted.merge_evicted_layers`: layer by layer, or on every
layer's rows at once where its rule allows, as CaM's decode step and WeightedKV's).
That is the policy's own final `compress`, row for row (`tests/engine/test_layer_batching.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvlens.kvcache import Step
from kvlens.kvcache.views import SlotRows
from kvlens.policies import MergesEvicted, Policy, ScoredEviction, evicted_lowest, select_lowest


def selector(policy: Policy) -> Policy:
    """The policy whose selection decides what leaves: a merging policy's `selector`, else the policy."""
    if isinstance(policy, MergesEvicted):
        return policy.selector
    return policy


def batchable(policy: Policy) -> bool:
    """Whether a decode step's compression may run once on every layer's rows: its selection is a scored
    eviction's that competes within each KV head (`Needs.competes`), at decode steps (the all-layer store
    holds the budget, it cannot grow)."""
    chooser = selector(policy)
    return isinstance(chooser, ScoredEviction) and policy.competes == "head" and policy.needs().decode_steps


def evict_all_layers(policy: Policy, everywhere: SlotRows, layers: Sequence[SlotRows], step: Step) -> None:
    """`policy.compress` on every layer of `layers` (one-layer views of the store `everywhere` views whole),
    as one selection: rows over the budget keep `keeps(budget)` slots (a merging policy: its selector's
    selection at the budget, then its `merge_evicted_layers`); else each layer's `no_selection`."""
    chooser = selector(policy)
    assert isinstance(chooser, ScoredEviction)  # `batchable`
    merging = isinstance(policy, MergesEvicted)
    if step.budget is None or everywhere.n_kept <= step.budget:
        if not merging:
            for rows in layers:
                chooser.no_selection(rows, step)
        return
    budget = step.budget
    if not merging:
        budget = chooser.keeps(budget)
    chosen = dataclasses.replace(step, budget=budget)
    score = torch.cat([chooser.score(rows, chosen) for rows in layers])  # (L * Hkv, S)
    protected = [p for rows in layers if (p := chooser.protected(rows, chosen.budget)) is not None]
    mask = torch.cat(protected) if len(protected) == len(layers) else None
    rule = (chosen.budget, chooser.older_leaves_first)
    if isinstance(policy, MergesEvicted):
        keep, evicted = select_lowest(everywhere, score, mask, *rule)
        policy.merge_evicted_layers(layers, everywhere, keep, evicted, chosen)
    else:  # the kept slots are not needed
        evicted = evicted_lowest(everywhere, score, mask, *rule)
        if step.log is not None:
            for rows, leaving in zip(layers, evicted.chunk(len(layers)), strict=True):
                step.log.evict(step.index, rows.layer, rows.pos.gather(1, leaving))
    everywhere.free(evicted)
