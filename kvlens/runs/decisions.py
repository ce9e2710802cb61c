"""The decision log: one row per eviction or merge, saved as `decisions.parquet`.

Columns: step (0 = compression right after prefill, t = after the forward that produced token t),
layer, kv_head, action (`evict`, `merge`), position (original position of the slot acted on),
targets (positions that received it), weights (the weight each target received), prob
(Bernoulli probability, NaN if none) and draw (Bernoulli outcome 0/1, -1 if none).

Evictions and tensor-form merges are kept as the policies' tensors (one append per layer and
step, no per-row Python) and turned into rows once, when the table is built; rows keep the order
of the calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

COLUMNS = ["step", "layer", "kv_head", "action", "position", "targets", "weights", "prob", "draw"]


@dataclass(frozen=True)
class _Merges:
    """A `merges` call: per head and merged slot (Hkv, E), targets (Hkv, E, K) padded with -1."""

    step: int
    layer: int
    source: torch.Tensor
    targets: torch.Tensor
    weight: torch.Tensor
    prob: torch.Tensor
    draw: torch.Tensor


class DecisionLog:
    """Collects decisions of one run. Policies call `evict` / `merge` / `merges` with the step they act at."""

    def __init__(self):
        self._chunks: list[
            tuple[int, int, torch.Tensor] | tuple
        ] = []  # evict chunks and merge rows, in order

    def evict(self, step: int, layer: int, evicted_pos: torch.Tensor) -> None:
        """`evicted_pos` `(Hkv, n)` original positions dropped per KV head at `step` (-1 entries ignored)."""
        self._chunks.append((step, layer, evicted_pos.detach()))

    def merge(
        self,
        step: int,
        layer: int,
        head: int,
        position: int,
        targets: list[int],
        weights: list[float],
        prob: float = math.nan,
        draw: int = -1,
    ) -> None:
        self._chunks.append(
            (
                step,
                layer,
                head,
                "merge",
                int(position),
                list(targets),
                [float(w) for w in weights],
                float(prob),
                int(draw),
            )
        )

    def merges(
        self,
        step: int,
        layer: int,
        source: torch.Tensor,
        targets: torch.Tensor,
        weight: torch.Tensor,
        prob: torch.Tensor,
        draw: torch.Tensor,
    ) -> None:
        """Merges in tensor form: `source` `(Hkv, E)` positions merged, `targets` `(Hkv, E, K)` the positions
        each sent its value to (ascending, -1 pads), `weight`, `prob`, `draw` `(Hkv, E)`. One row per
        source with a target, the E sources in turn, head by head within each."""
        self._chunks.append(
            _Merges(step, layer, *(t.detach() for t in (source, targets, weight, prob, draw)))
        )

    def __len__(self) -> int:
        return sum(map(_rows_in, self._chunks))

    def frame(self) -> pd.DataFrame:
        parts = [_columns(c) for c in self._chunks]
        if not parts:
            return decisions_frame()
        columns = {k: np.concatenate([p[k] for p in parts]) for k in COLUMNS}
        return decisions_frame(columns)


def _is_evict(chunk) -> bool:
    return isinstance(chunk, tuple) and isinstance(chunk[-1], torch.Tensor)


def _rows_in(chunk) -> int:
    """The decision rows a chunk holds: its evicted positions, its merges with a target, or one merge row."""
    if _is_evict(chunk):
        return int((chunk[-1] >= 0).sum())
    if isinstance(chunk, _Merges):
        return int((chunk.targets[..., 0] >= 0).sum())
    return 1


def _columns(chunk) -> dict[str, np.ndarray]:
    if _is_evict(chunk):
        return _evict_columns(*chunk)
    if isinstance(chunk, _Merges):
        return _merge_columns(chunk)
    return _row_columns(chunk)


def _row_columns(row: tuple) -> dict[str, np.ndarray]:
    return {k: LIST_COLUMNS.get(k, np.array)([v]) for k, v in zip(COLUMNS, row)}


def _empty(n: int) -> np.ndarray:
    """n empty (immutable, shared) target or weight lists: no per-row allocation."""
    out = np.empty(n, dtype=object)
    out.fill(())
    return out


def _objects(items: list) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


LIST_COLUMNS = {"targets": _objects, "weights": _objects}  # columns of lists; the others plain arrays


def _evict_columns(step: int, layer: int, evicted_pos: torch.Tensor) -> dict[str, np.ndarray]:
    """Rows of one `evict` call, head by head, in the order the policy listed the positions."""
    pos = evicted_pos.cpu().numpy()
    heads = np.broadcast_to(np.arange(pos.shape[0])[:, None], pos.shape)
    keep = pos >= 0
    n = int(keep.sum())
    return {
        "step": np.full(n, step),
        "layer": np.full(n, layer),
        "kv_head": heads[keep],
        "action": np.full(n, "evict", dtype=object),
        "position": pos[keep],
        "targets": _empty(n),
        "weights": _empty(n),
        "prob": np.full(n, math.nan),
        "draw": np.full(n, -1),
    }


def _merge_columns(chunk: _Merges) -> dict[str, np.ndarray]:
    """Rows of one `merges` call, source by source, head by head (sources without a target left out)."""
    targets = chunk.targets.cpu().numpy().transpose(1, 0, 2)  # (E, Hkv, K)
    found = (targets >= 0).sum(-1)
    has = found > 0
    heads = np.broadcast_to(np.arange(found.shape[1])[None, :], found.shape)[has]
    rows, counts = targets[has], found[has]
    weights = chunk.weight.cpu().numpy().T[has].tolist()
    n = len(rows)
    return {
        "step": np.full(n, chunk.step),
        "layer": np.full(n, chunk.layer),
        "kv_head": heads,
        "action": np.full(n, "merge", dtype=object),
        "position": chunk.source.cpu().numpy().T[has],
        "targets": _objects([row[:f].tolist() for row, f in zip(rows, counts, strict=True)]),
        "weights": _objects([[w] * int(f) for w, f in zip(weights, counts, strict=True)]),
        "prob": chunk.prob.cpu().numpy().T[has].astype(np.float64),
        "draw": chunk.draw.cpu().numpy().T[has],
    }


def decisions_frame(columns: dict[str, np.ndarray] | None = None) -> pd.DataFrame:
    """A typed decisions table from its columns (empty without)."""
    df = pd.DataFrame(columns or {}, columns=COLUMNS)
    return df.astype(
        {
            "step": "int32",
            "layer": "int16",
            "kv_head": "int16",
            "action": "string",
            "position": "int64",
            "prob": "float64",
            "draw": "int8",
        }
    )


@dataclass(frozen=True)
class Counts:
    """How many positions left a run's cache, every layer, KV head and step together: `evicted` with nothing
    kept of them (evictions, and merges whose Bernoulli draw was 0: they moved nothing), `merged` with their
    values folded into kept slots; `drew_zero` the merges counted in `evicted`."""

    evicted: int
    merged: int
    drew_zero: int


def outcome(d: pd.DataFrame) -> pd.Series:
    """Each decision row's outcome for its position: "merged" (values folded into kept slots) or "evicted"
    (nothing kept: an eviction, or a merge whose Bernoulli draw was 0)."""
    merged = (d["action"] == "merge") & (d["draw"] != 0)
    return pd.Series(np.where(merged, "merged", "evicted"), index=d.index)


def counts(d: pd.DataFrame | None) -> Counts:
    """The eviction and merge counts of a decision log, as every page and the report state them."""
    if d is None or not len(d):
        return Counts(0, 0, 0)
    left = outcome(d)
    zero = int(((d["action"] == "merge") & (d["draw"] == 0)).sum())
    return Counts(int((left == "evicted").sum()), int((left == "merged").sum()), zero)
