"""All layers' caches as one: a decode step's eviction decided and applied for every layer at once.

A decode step of a compressed cache evicts one slot per KV head in every layer, by a rule that
looks at each head alone (StreamingLLM's oldest, H2O's lowest Abar outside the recent window,
CaM's merge into the following slots). Run layer by layer, those ~20 small tensor operations cost
more than the memory the eviction saves (30 layers x 20 ops x ~5 us is ~3 ms of a ~60 ms step).
Once every layer holds exactly `budget + 1` slots, the layers' buffers become row blocks of shared
buffers (layer l owns rows `l * Hkv ... (l + 1) * Hkv - 1`), and a `LayerStack` presents them as
one layer with `L * Hkv` heads: the policy's own per-layer code runs once, on `(L * Hkv, S)`
tensors, with exactly the per-head arithmetic it does layer by layer.

Only policies that declare `cross_layer` use it (their rule reads per-head statistics only; no
per-slot `extra` tensors); the layers stay ordinary `LayerCache`s (views of the shared buffers)
for the model's forward, the recorders and every other path.
"""
from __future__ import annotations

import torch

from kvlens.engine.cache import STAT_BUFFERS, LayerCache


class LayerStack:
    """The layers of a `KVCache` as one layer of `L * Hkv` heads (see the module docstring)."""

    def __init__(self, layers: list[LayerCache]):
        self.layers = layers
        self.hkv = layers[0].pos.shape[0]
        self._buf = {name: torch.cat([layer._buf[name] for layer in layers], dim=1 if name in ("keys", "values") else 0)
                     for name in layers[0]._buf}
        self._blocks = [slice(i * self.hkv, (i + 1) * self.hkv) for i in range(len(layers))]  # each layer's rows
        for layer, block in zip(layers, self._blocks, strict=True):
            layer.share_buffers({name: t[:, block] if name in ("keys", "values") else t[block]
                                 for name, t in self._buf.items()})
        self.extra: dict[str, torch.Tensor] = {}  # used only while no layer keeps per-slot extras
        self.prefill_rows = None  # decode steps only

    @staticmethod
    def eligible(layers: list[LayerCache]) -> bool:
        """Every layer is a full fixed-capacity cache of equal shape (no free slot, no padding, no extras)."""
        first = layers[0]
        return all(layer.n_slots == layer.capacity == first.capacity and not layer.padded and not layer.extra
                   and layer.pos.shape == first.pos.shape for layer in layers)

    @property
    def valid_now(self) -> bool:
        """The layers still live in this stack's buffers (a re-layout of any layer ends the stack)."""
        return all(layer.stacked for layer in self.layers)

    keys = property(lambda self: self._buf["keys"])  # (1, L * Hkv, S, D)
    values = property(lambda self: self._buf["values"])
    pos = property(lambda self: self._buf["pos"])  # (L * Hkv, S)
    abar = property(lambda self: self._buf["abar"])
    nobs = property(lambda self: self._buf["nobs"])
    valid = property(lambda self: self._buf["valid"])

    @property
    def last_attn(self) -> torch.Tensor | None:
        """`(L * Hq, S)` every layer's latest attention rows, layer blocks in order."""
        rows = [layer.last_attn for layer in self.layers]
        return None if any(r is None for r in rows) else torch.cat(rows)

    @property
    def n_kept(self) -> int:
        return max(layer.n_kept for layer in self.layers)

    @property
    def n_slots(self) -> int:
        return self.layers[0].n_slots

    padded = False

    def one_to_evict(self, budget: int) -> bool:
        """Every layer's decode-step compression: budget + 1 slots per head, none free, one leaves."""
        return all(layer.one_to_evict(budget) and not layer.extra for layer in self.layers)

    position_order = LayerCache.position_order

    def parts(self) -> list[LayerCache]:
        """The layers whose heads these rows are, in row order."""
        return self.layers

    def split(self, t: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """`(L * Hkv, ...)` -> each layer's index and its `(Hkv, ...)` rows."""
        return [(layer.layer, t[block]) for layer, block in zip(self.layers, self._blocks, strict=True)]

    def free(self, index: torch.Tensor) -> None:
        """Evict slots `index` `(L * Hkv, E)`: statistics cleared at once, each layer queues its rows."""
        for name, fill in STAT_BUFFERS.items():
            self._buf[name].scatter_(1, index, fill)
        for layer, (_, rows) in zip(self.layers, self.split(index), strict=True):
            layer.queue_freed(rows)
