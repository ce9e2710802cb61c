"""Slot provenance: which original positions, with what weights, a cache slot holds.

Derived by replaying a run's decision log (`decisions.parquet`), so every run that logs
decisions carries its provenance. A merging policy declares how its merge rows combine
(`merge_rule` on the class):
- `add` (CaM): each target keeps its value and adds `w * V_source` (Eq. 15).
- `convex` (WeightedKV): row by row, `target <- (1 - w) target + w source`.
- `set` (KVMerger): rows of one step into one target (the pivot) combine at once,
  `target <- (1 - sum w) target + sum w_i source_i` (the pivot's own weight is `1 - sum w`).
An `evict` row drops the position. Provenance describes values (and keys too for KVMerger and D2O).
"""

from __future__ import annotations

from collections import defaultdict

import pandas as pd

from kvlens.errors import KvlensError
from kvlens.policies import policy_class

Prov = dict[int, float]  # source position -> weight


def replay(decisions: pd.DataFrame, rule: str) -> dict[tuple[int, int], dict[int, Prov]]:
    """`(layer, kv_head)` -> {slot position: {source position: weight}} for every slot that absorbed a merge.

    Slots not listed hold only themselves (weight 1) or were dropped.
    """
    if rule not in ("add", "convex", "set"):
        raise KvlensError(f"Unknown merge rule '{rule}'; expected add, convex or set.")
    state: dict[tuple[int, int], dict[int, Prov]] = defaultdict(dict)
    pending: list[tuple] = []  # `set` rows of the current (step, layer, head, target)
    for row in decisions.itertuples(index=False):
        key = (int(row.layer), int(row.kv_head))
        group = (int(row.step), key, int(row.targets[0]) if row.action == "merge" else -1)
        if pending and group != (pending[0][0], pending[0][1], pending[0][3]):
            _apply_set(state, pending)
            pending = []
        slots = state[key]
        source = int(row.position)
        if row.action != "merge":
            slots.pop(source, None)
            continue
        if rule == "set":
            pending.append((int(row.step), key, source, int(row.targets[0]), float(row.weights[0])))
            continue
        src = slots.pop(source, {source: 1.0})
        for target, w in zip(row.targets, row.weights):
            t = int(target)
            prov = slots.get(t, {t: 1.0})
            scale = 1.0 if rule == "add" else 1.0 - float(w)
            merged = {p: v * scale for p, v in prov.items()}
            for p, v in src.items():
                merged[p] = merged.get(p, 0.0) + float(w) * v
            slots[t] = merged
    if pending:
        _apply_set(state, pending)
    return {k: v for k, v in state.items() if v}


def _apply_set(state, pending) -> None:
    _, key, _, target, _ = pending[0]
    slots = state[key]
    total = sum(w for *_, w in pending)
    merged = {p: v * (1.0 - total) for p, v in slots.get(target, {target: 1.0}).items()}
    for _, _, source, _, w in pending:
        for p, v in slots.pop(source, {source: 1.0}).items():
            merged[p] = merged.get(p, 0.0) + w * v
    slots[target] = merged


def table(run) -> pd.DataFrame:
    """Provenance of a run's merged slots: columns layer, kv_head, slot, source, weight."""
    rule = policy_class(run.meta.policy.name).merge_rule
    rows: list[tuple[int, int, int, int, float]] = []
    if rule is not None and run.decisions is not None and len(run.decisions):
        for (layer, head), slots in sorted(replay(run.decisions, rule).items()):
            for slot, prov in sorted(slots.items()):
                rows.extend((layer, head, slot, src, w) for src, w in sorted(prov.items()))
    return pd.DataFrame(rows, columns=["layer", "kv_head", "slot", "source", "weight"])
