"""`pyramidkv`: per-layer budgets that shrink with depth, around any scored eviction policy.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
2024, https://arxiv.org/abs/2406.02069. Layer budgets form an arithmetic sequence, largest in the
first layer, with the same total as B in every layer. `schedule` picks the source's arithmetic
(B the run's budget, w the window, T the prompt, L layers; beta = 20 in the paper):
- `paper` (default): besides its window a layer keeps a share falling linearly from
  `max = 2 (B - w) - min` (first layer) to `min = (B - w) / beta` (last), rounded, so the total
  stays L x B; `max` is capped at T - w (and `min` raised to keep the total); a prompt shorter
  than 2 (B - w) gets B everywhere. These are the authors' KVCache-Factory rules
  (`pyramidkv_utils.py`, `PyramidKVCluster`) without their integer floors.
- `official`: the same with the code's integer arithmetic (`min = (B - w) // beta`, `steps =
  (max - min) // (L - 1)`), whose floors keep up to (L - 1) / 2 slots per layer more than B on
  average.
- `kvpress`: kvpress's `PyramidKVPress`: the window inside the share (`max = 2B - B / beta`, `min =
  B / beta`, rounded), and B everywhere unless `T >= max >= min >= w` (with SnapKV's window of 64,
  any budget under 1280 slots).
Which slots each layer keeps is the `base` policy's rule (SnapKV in the paper and kvpress), and so is
the decode protocol: SnapKV's default compresses the prompt once, as the paper and kvpress do.

Each layer's own buffers hold its own budget + 1 slots, so the memory really follows the pyramid:
`kv_entries_max` (every layer's kept slots together) stays at L x Hkv x B, while `kv_slots_max`
(the fullest layer) is the first layer's.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvlens.kvcache import CacheRows, Step
from kvlens.policies.base import Needs, ScoredEviction, Wrapper, param, register, scored_eviction_names
from kvlens.policies.snapkv import SnapKV

# `schedule` paper or official (kvpress's is its own branch of `allocate`) -> its division, and how a
# layer's share is made whole
ARITHMETIC: dict[str, tuple[Callable[[float, float], float], Callable[[float], int]]] = {
    "paper": (operator.truediv, round),
    "official": (operator.floordiv, int),
}


@register
@dataclass(frozen=True)
class PyramidKV(Wrapper):
    base: ScoredEviction = param(
        SnapKV(),
        "Policy choosing which slots each layer keeps within its budget (any "
        "scored eviction policy; set its parameters as base.NAME).",
        choices=scored_eviction_names,
    )
    beta: float = param(
        20.0,
        "How steep the pyramid is: the last layer keeps (B - window) / beta besides the window "
        "(the paper: 20).",
        minimum=1.0,
    )
    window: int = param(
        64,
        "w of the schedule, the slots every layer keeps besides its pyramid share (kvpress "
        "takes SnapKV's window, 64).",
        minimum=0,
    )
    schedule: str = param(
        "paper",
        "Arithmetic of the layer budgets: the paper's (the authors' code without its "
        "integer floors), the authors' code as written, or kvpress's.",
        choices=("paper", "official", "kvpress"),
    )

    name = "pyramidkv"
    description = "Per-layer budgets shrinking with depth (same total), slots chosen by its base policy."
    paper = "https://arxiv.org/abs/2406.02069"
    kvpress = "PyramidKVPress"
    kvpress_differs = (
        "`schedule=kvpress` is kvpress's per-layer budgets; each layer's buffers hold its own budget."
    )

    def needs(self) -> Needs:
        return dataclasses.replace(self.base.needs(), competes="model")  # per-layer budgets, decided together

    def allocate(self, budget: int, layers: Sequence[CacheRows]) -> list[int]:
        n, t, w = len(layers), layers[0].n_kept, self.window
        if self.schedule == "kvpress":
            low = budget / self.beta
            high = budget * 2 - low
            if high >= t - w:
                high = t - w
                low = budget * 2 - high
            if not t >= high >= low >= w:
                return [budget] * n
            step = (high - low) / max(n - 1, 1)
            return [round(high - i * step) for i in range(n)]
        base = budget - w
        if t < 2 * base:
            return [budget] * n
        divide, whole = ARITHMETIC[self.schedule]
        low = divide(base, self.beta)
        high = base * 2 - low
        if high >= t - w:
            high = t - w
            low = base * 2 - high
        step = divide(high - low, max(n - 1, 1))
        return [whole(high - i * step) + w for i in range(n)]

    def compress(self, rows: CacheRows, step: Step) -> None:
        self.base.compress(rows, step)  # the step carries this layer's own budget
