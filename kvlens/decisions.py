"""The decision log: one row per eviction or merge, saved as `decisions.parquet`.

Columns: step (0 = compression right after prefill, t = after the forward that produced token t),
layer, kv_head, action (`evict`, `merge`), position (original position of the slot acted on),
targets (positions that received it), weights (the weight each target received), prob
(Bernoulli probability, NaN if none) and draw (Bernoulli outcome 0/1, -1 if none).
"""
from __future__ import annotations

import math

import pandas as pd
import torch

COLUMNS = ["step", "layer", "kv_head", "action", "position", "targets", "weights", "prob", "draw"]


class DecisionLog:
    """Collects decisions of one run. Policies call `evict` / `merge`; the engine sets `step`."""

    def __init__(self):
        self.step = 0
        self._rows: list[tuple] = []

    def evict(self, layer: int, evicted_pos: torch.Tensor) -> None:
        """`evicted_pos` `(Hkv, n)` original positions dropped per KV head (-1 entries ignored)."""
        for head, row in enumerate(evicted_pos.tolist()):
            for p in row:
                if p >= 0:
                    self._rows.append((self.step, layer, head, "evict", p, [], [], math.nan, -1))

    def merge(self, layer: int, head: int, position: int, targets: list[int], weights: list[float],
              prob: float = math.nan, draw: int = -1) -> None:
        self._rows.append((self.step, layer, head, "merge", int(position), list(targets),
                           [float(w) for w in weights], float(prob), int(draw)))

    def __len__(self) -> int:
        return len(self._rows)

    def frame(self) -> pd.DataFrame:
        return decisions_frame(self._rows)


def decisions_frame(rows: list[tuple] | None = None) -> pd.DataFrame:
    """A typed decisions table (empty if no rows)."""
    df = pd.DataFrame(rows or [], columns=COLUMNS)
    return df.astype({"step": "int32", "layer": "int16", "kv_head": "int16", "action": "string",
                      "position": "int64", "prob": "float64", "draw": "int8"})
