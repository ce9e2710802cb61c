"""Per-layer compressed KV cache with per-slot bookkeeping.

Keys and values are stored after RoPE, `(1, Hkv, S, D)`, in the order the tokens arrived.
Every slot carries (per KV head, `(Hkv, S)`): its original position `pos`, the attention it has
accumulated `abar` (summed over every query that saw it, prefill rows included, each KV head's
score being the mean of its query heads), the number of queries `nobs` that observed it, and a
`valid` flag: policies whose heads keep different counts pad to the longest head and mask.
Policies may keep extra per-slot statistics in `extra` (first dims `(Hkv, S)`); they travel with
their slots. Per-layer run state of a policy (counters, random generators) lives in `state`, so
policy objects stay immutable configuration. Eviction gathers into new, smaller tensors, so
`nbytes` is what is really allocated.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerCache:
    """One layer's compressed cache. All slot-indexed tensors share the slot dimension S."""

    layer: int
    keys: torch.Tensor | None = None  # (1, Hkv, S, D)
    values: torch.Tensor | None = None  # (1, Hkv, S, D)
    pos: torch.Tensor | None = None  # (Hkv, S) long, original token positions
    abar: torch.Tensor | None = None  # (Hkv, S) float32, accumulated attention
    nobs: torch.Tensor | None = None  # (Hkv, S) float32, number of queries that saw the slot
    valid: torch.Tensor | None = None  # (Hkv, S) bool, False for padding
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # (Hkv, S, ...) policy statistics
    state: dict[str, object] = field(default_factory=dict)  # the policy's per-layer run state (counters, RNGs)
    last_attn: torch.Tensor | None = None  # (Hq, S) float32, attention of the latest query
    prefill_rows: torch.Tensor | None = None  # (Hq, L, T) last L prefill rows, dropped after compression

    @property
    def n_slots(self) -> int:
        """Allocated slots per KV head (padding included)."""
        return 0 if self.keys is None else self.keys.shape[2]

    def kept(self) -> torch.Tensor:
        """Valid slots per KV head, `(Hkv,)`."""
        return self.valid.sum(-1)

    @property
    def padded(self) -> bool:
        return self.valid is not None and not bool(self.valid.all())

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def append(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> None:
        """Add new tokens `(1, Hkv, q, D)` at true `positions` `(q,)` with empty statistics."""
        hkv, q = key.shape[1], key.shape[2]
        dev = key.device
        new_pos = positions.to(dev).view(1, q).expand(hkv, q)
        zeros = torch.zeros(hkv, q, dtype=torch.float32, device=dev)
        ones = torch.ones(hkv, q, dtype=torch.bool, device=dev)
        if self.keys is None:
            self.keys, self.values = key, value
            self.pos, self.abar, self.nobs, self.valid = new_pos.clone(), zeros, zeros.clone(), ones
            return
        self.keys = torch.cat([self.keys, key], dim=2)
        self.values = torch.cat([self.values, value], dim=2)
        self.pos = torch.cat([self.pos, new_pos], dim=1)
        self.abar = torch.cat([self.abar, zeros], dim=1)
        self.nobs = torch.cat([self.nobs, zeros], dim=1)
        self.valid = torch.cat([self.valid, ones], dim=1)
        for name, t in self.extra.items():
            pad = torch.zeros((hkv, q, *t.shape[2:]), dtype=t.dtype, device=dev)
            self.extra[name] = torch.cat([t, pad], dim=1)
        if self.last_attn is not None:
            self.last_attn = torch.cat([self.last_attn, self.last_attn.new_zeros(self.last_attn.shape[0], q)], 1)

    def keep(self, index: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Keep slots `index` `(Hkv, S')` (ascending per head) and free the rest.

        `valid` `(Hkv, S')` marks padding when heads keep different counts.
        """
        d = self.keys.shape[-1]
        idx4 = index[None, :, :, None].expand(1, -1, -1, d)
        self.keys = torch.gather(self.keys, 2, idx4)
        self.values = torch.gather(self.values, 2, idx4)
        self.pos = torch.gather(self.pos, 1, index)
        self.abar = torch.gather(self.abar, 1, index)
        self.nobs = torch.gather(self.nobs, 1, index)
        kept_valid = torch.gather(self.valid, 1, index)
        self.valid = kept_valid if valid is None else kept_valid & valid
        for name, t in self.extra.items():
            ix = index.view(*index.shape, *([1] * (t.dim() - 2))).expand(-1, -1, *t.shape[2:])
            self.extra[name] = torch.gather(t, 1, ix)
        if self.last_attn is not None:
            # last_attn is per query head; map each query head to its KV head's index.
            group = self.last_attn.shape[0] // index.shape[0]
            self.last_attn = torch.gather(self.last_attn, 1, index.repeat_interleave(group, 0))
        self.prefill_rows = None


class KVCache:
    """The cache handed to the model as `past_key_values`: one `LayerCache` per layer.

    The engine sets `positions` (true token positions of the tokens being fed) before each
    forward; `update` appends them and returns the whole compressed cache of the layer.
    """

    def __init__(self, n_layers: int):
        self.layers = [LayerCache(layer=i) for i in range(n_layers)]
        self.positions: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        layer.append(key_states, value_states, self.positions)
        return layer.keys, layer.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].n_slots

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def kept_slots(self) -> torch.Tensor:
        """Valid slots per layer and KV head, `(L, Hkv)`."""
        return torch.stack([layer.kept() for layer in self.layers]).cpu()
