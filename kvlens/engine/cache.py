"""Per-layer compressed KV cache with per-slot bookkeeping, in preallocated buffers that reuse freed slots.

Keys and values are stored after RoPE, `(1, Hkv, S, D)`. Attention over a cache is order-free once
RoPE is applied and every slot carries its original position, so slots are *not* kept in arrival
order: a slot freed by an eviction (`free`) receives the next token (`append`), with no per-step
concatenation and no whole-layer gather. Every slot carries (per KV head, `(Hkv, S)`): its original
position `pos` (-1 for a free slot), the attention it has accumulated `abar` (summed over every
query that saw it, prefill rows included, each KV head's score being the mean of its query heads),
the number of queries `nobs` that observed it, and a `valid` flag (False for free slots and for the
padding of heads that keep fewer slots). Policies may keep extra per-slot statistics in `extra`
(first dims `(Hkv, S)`); they travel with their slots. Per-layer run state of a policy (counters,
random generators) lives in `state`, so policy objects stay immutable configuration.

Memory: the prompt's cache is the prefill's own tensors; the first compression below `limit` slots
copies the kept slots into new buffers of exactly `limit` slots (budget + the one token of a
step), so the prompt's memory is really freed; later steps write into those buffers in place.
Caches that grow (full, budget-free policies) grow by chunks up to `limit` (the run's length).
`nbytes` is what is allocated. Slots past `n_slots` and freed slots hold zero `abar` and `nobs`, so
a token written there starts with empty statistics without clearing them again. `keep` gathers an
explicit layout (policies whose decisions depend on slot order, e.g. CORM's and KVMerger's padding,
use it and get the layout they ask for).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

GROWTH = 32  # minimum slots added when a growing cache runs out of room
STAT_BUFFERS = {"valid": False, "pos": -1, "abar": 0.0, "nobs": 0.0}  # per-slot statistics, and a free slot's


class Slots(NamedTuple):
    """A layer's slots in position order (oldest first; free and padding slots last, position -1)."""

    pos: torch.Tensor  # (Hkv, S)
    keys: torch.Tensor  # (1, Hkv, S, D)
    values: torch.Tensor  # (1, Hkv, S, D)
    valid: torch.Tensor  # (Hkv, S)


@dataclass
class LayerCache:
    """One layer's compressed cache: slot-indexed views `[:n_slots]` of preallocated buffers."""

    layer: int
    limit: int | None = None  # most slots this layer will ever need (None = unknown)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # (Hkv, S, ...) policy statistics
    state: dict[str, object] = field(default_factory=dict)  # the policy's per-layer run state (counters, RNGs)
    last_attn: torch.Tensor | None = None  # (Hq, S) float32, attention of the latest query
    prefill_rows: torch.Tensor | None = None  # (Hq, L, T) last L prefill rows, dropped after compression
    _written: torch.Tensor | range | None = None  # the slots the latest `append` wrote (a range: at the end)
    n_kept: int = 0  # valid slots of the fullest KV head
    _n: int = 0  # slots in use, free ones included
    _holes: torch.Tensor | None = None  # (Hkv, E) slots freed by `free`, to be reused first
    _pad: bool = False  # `keep` left padding (heads keeping different counts); never reused
    _buf: dict[str, torch.Tensor] = field(default_factory=dict)  # keys, values (1, Hkv, C, D); pos ... (Hkv, C)
    _views: dict[str, torch.Tensor] = field(default_factory=dict)  # `[:n]` of each buffer (made once per layout)
    _flat: torch.Tensor | None = None  # (Hkv,) offset of each head's first slot in a flattened buffer
    stacked: bool = False  # the buffers are this layer's rows of a `LayerStack`'s (set by the stack)

    # -- views -------------------------------------------------------------------------------------
    def _view(self, name: str) -> torch.Tensor | None:
        view = self._views.get(name)
        if view is None and name in self._buf:  # made on first use: a growing cache changes n every step
            t, n = self._buf[name], self._n
            view = self._views[name] = t[:, :, :n] if name in ("keys", "values") else t[:, :n]
        return view

    def _set_layout(self, buffers: dict[str, torch.Tensor], n: int) -> None:
        """New buffers and/or slot count: remake the views (a decode step's cache keeps its layout)."""
        if buffers is not self._buf:
            hkv, cap = buffers["pos"].shape
            self._flat = torch.arange(0, hkv * cap, cap, device=buffers["pos"].device)
            self.stacked = False
        self._buf, self._n, self._views = buffers, n, {}

    def _assign(self, name: str, value: torch.Tensor) -> None:
        view = self._view(name)
        if view is None or view.shape != value.shape:
            raise ValueError(f"{name} must keep the cache's shape {None if view is None else tuple(view.shape)}")
        if view.data_ptr() != value.data_ptr():
            view.copy_(value)

    keys = property(lambda self: self._view("keys"), lambda self, v: self._assign("keys", v))  # (1, Hkv, S, D)
    values = property(lambda self: self._view("values"), lambda self, v: self._assign("values", v))
    pos = property(lambda self: self._view("pos"), lambda self, v: self._assign("pos", v))  # (Hkv, S) long
    abar = property(lambda self: self._view("abar"), lambda self, v: self._assign("abar", v))  # (Hkv, S) f32
    nobs = property(lambda self: self._view("nobs"), lambda self, v: self._assign("nobs", v))  # (Hkv, S) f32
    valid = property(lambda self: self._view("valid"), lambda self, v: self._assign("valid", v))  # (Hkv, S) bool

    @property
    def written(self) -> torch.Tensor | None:
        """`(Hkv, q)` the slots the latest `append` wrote."""
        if isinstance(self._written, range):
            hkv, span = self._buf["pos"].shape[0], self._written
            self._written = torch.arange(span.start, span.stop, device=self._buf["pos"].device).expand(hkv, len(span))
        return self._written

    @property
    def n_slots(self) -> int:
        """Slots in use per KV head (free slots and padding included)."""
        return self._n

    @property
    def capacity(self) -> int:
        return 0 if "keys" not in self._buf else self._buf["keys"].shape[2]

    def position_order(self) -> torch.Tensor:
        """`(Hkv, S)` slot indices sorted by position, oldest first, free and padding slots last."""
        return torch.argsort(self.pos.masked_fill(~self.valid, torch.iinfo(self.pos.dtype).max), dim=-1, stable=True)

    def one_to_evict(self, budget: int) -> bool:
        """A decode step's compression: each head holds budget + 1 slots, none free, so exactly one leaves."""
        return self.n_kept == budget + 1 and not self.padded

    def ordered(self) -> Slots:
        """The kept slots in position order (a copy, `n_kept` per head): what an append-only cache would hold."""
        order = self.position_order()[:, : self.n_kept]
        idx = order[None, :, :, None].expand(1, -1, -1, self.keys.shape[-1])
        return Slots(self.pos.masked_fill(~self.valid, -1).gather(1, order), self.keys.gather(2, idx),
                     self.values.gather(2, idx), self.valid.gather(1, order))

    def parts(self) -> list[LayerCache]:
        """The layers whose heads these rows are (a `LayerStack` has several)."""
        return [self]

    def split(self, t: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """`(Hkv, ...)` rows -> `[(layer index, rows)]` (a `LayerStack` splits its rows by layer)."""
        return [(self.layer, t)]

    def kept(self) -> torch.Tensor:
        """Valid slots per KV head, `(Hkv,)`."""
        return self.valid.sum(-1)

    @property
    def padded(self) -> bool:
        """Some head has a free or padding slot among `[0, n_slots)` (attention must mask it)."""
        return self._holes is not None or self._pad

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values (spare capacity included)."""
        return sum(self._buf[n].numel() * self._buf[n].element_size() for n in ("keys", "values") if n in self._buf)

    # -- writing -----------------------------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> None:
        """Add new tokens `(1, Hkv, q, D)` at true `positions` `(q,)` with empty statistics.

        One token goes into a slot freed by `free` (one per head; `keep`'s layout is never
        reordered); otherwise the tokens go after the slots in use (growing the buffers if needed).
        """
        q = key.shape[2]
        positions = positions.to(key.device)
        if not self._buf:
            self._adopt(key, value, positions)
        elif q == 1 and self._holes is not None:
            self._fill_free(key, value, positions)
        else:
            self._write_end(key, value, positions)
        self.n_kept += q

    def _adopt(self, key, value, positions) -> None:
        """The prefill's tensors become the buffers (no copy)."""
        hkv, q = key.shape[1], key.shape[2]
        dev = key.device
        self._set_layout({"keys": key.contiguous(), "values": value.contiguous(),
                          "pos": positions.view(1, q).expand(hkv, q).clone(),
                          "abar": torch.zeros(hkv, q, dtype=torch.float32, device=dev),
                          "nobs": torch.zeros(hkv, q, dtype=torch.float32, device=dev),
                          "valid": torch.ones(hkv, q, dtype=torch.bool, device=dev)}, q)
        self._written = range(q)

    def _fill_free(self, key, value, positions) -> None:
        """Write one token into each head's oldest freed slot (flat `index_copy_`, no reallocation)."""
        hkv, d = key.shape[1], key.shape[3]
        slot = self._holes[:, 0]  # (Hkv,)
        self._holes = self._holes[:, 1:] if self._holes.shape[1] > 1 else None
        b = self._buf
        flat = slot + self._flat  # (Hkv,) into (Hkv * C)
        b["keys"].view(-1, d).index_copy_(0, flat, key[0, :, 0])
        b["values"].view(-1, d).index_copy_(0, flat, value[0, :, 0])
        b["pos"].view(-1).index_fill_(0, flat, positions[0])
        b["valid"].view(-1).index_fill_(0, flat, True)  # `free` already zeroed abar and nobs
        if self.extra:
            heads = torch.arange(hkv, device=slot.device)
            for t in self.extra.values():
                t[heads, slot] = 0
        self.last_attn = None  # the slots changed: the next query's attention replaces it
        self._written = slot[:, None]

    def _write_end(self, key, value, positions) -> None:
        hkv, q = key.shape[1], key.shape[2]
        n, need = self._n, self._n + q
        if need > self.capacity:
            grow = max(need, n + max(GROWTH, n // 16))
            self._resize(min(grow, self.limit) if self.limit is not None and self.limit >= need else grow)
        b = self._buf
        b["keys"][:, :, n:need] = key
        b["values"][:, :, n:need] = value
        b["pos"][:, n:need] = positions
        b["valid"][:, n:need] = True  # abar and nobs past the slots in use are zero
        for name, t in self.extra.items():
            self.extra[name] = torch.cat([t, t.new_zeros((hkv, q, *t.shape[2:]))], dim=1)
        self.last_attn = None
        self._set_layout(self._buf, need)
        self._written = range(n, need)

    def _resize(self, capacity: int) -> None:
        """Reallocate every buffer to `capacity` slots, keeping `[0, n)`."""
        n, new = self._n, {}
        for name, t in self._buf.items():
            shape = (*t.shape[:-2], capacity, t.shape[-1]) if name in ("keys", "values") else (t.shape[0], capacity)
            new[name] = t.new_zeros(shape)
            if name in ("keys", "values"):
                new[name][:, :, :n] = t[:, :, :n]
            else:
                new[name][:, :n] = t[:, :n]
        self._set_layout(new, n)

    def free(self, index: torch.Tensor) -> None:
        """Evict slots `index` `(Hkv, E)` (the same count per head); later tokens reuse them.

        When the slots in use exceed `limit` (the prompt's cache after its first compression), the
        kept slots move into new buffers of `limit` slots and the old ones are released.
        """
        for name, fill in STAT_BUFFERS.items():
            self._buf[name].scatter_(1, index, fill)
        self.queue_freed(index)
        if self.limit is not None and self._n > self.limit and not self._pad:
            kept = self.valid.nonzero()[:, 1].view(self.valid.shape[0], self.n_kept)
            self.keep(kept, capacity=self.limit)

    def queue_freed(self, index: torch.Tensor) -> None:
        """Slots `index` `(Hkv, E)` whose statistics were cleared (`STAT_BUFFERS`) leave the kept count and
        receive the next tokens (`free` does both; a `LayerStack` clears all layers at once, then calls this)."""
        self._holes = index if self._holes is None else torch.cat([self._holes, index], dim=1)
        self.n_kept -= index.shape[1]

    def share_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        """Live in `buffers`, this layer's row blocks of a `LayerStack`'s shared buffers (same slots)."""
        self._set_layout(buffers, self._n)
        self.stacked = True

    def keep(self, index: torch.Tensor, valid: torch.Tensor | None = None, capacity: int | None = None) -> None:
        """Keep slots `index` `(Hkv, S')`, in that slot order, and free the rest (new buffers).

        `valid` `(Hkv, S')` marks padding when heads keep different counts.
        """
        s = index.shape[1]
        capacity = max(s, capacity or s)
        d = self._buf["keys"].shape[-1]
        idx4 = index[None, :, :, None].expand(1, -1, -1, d)
        new = {}
        for name in self._buf:
            view = self._view(name)
            kept = torch.gather(view, 2, idx4) if name in ("keys", "values") else torch.gather(view, 1, index)
            if capacity > s:  # spare slots for the tokens to come
                spare = list(kept.shape)
                spare[-2 if name in ("keys", "values") else -1] = capacity - s
                kept = torch.cat([kept, kept.new_zeros(spare)], dim=-2 if name in ("keys", "values") else -1)
            new[name] = kept
        if valid is not None:
            new["valid"][:, :s] &= valid
        self._set_layout(new, s)
        for name, t in self.extra.items():
            ix = index.view(*index.shape, *([1] * (t.dim() - 2))).expand(-1, -1, *t.shape[2:])
            self.extra[name] = torch.gather(t, 1, ix)
        if self.last_attn is not None:
            # last_attn is per query head; map each query head to its KV head's index.
            group = self.last_attn.shape[0] // index.shape[0]
            self.last_attn = torch.gather(self.last_attn, 1, index.repeat_interleave(group, 0))
        counts = self.valid.sum(-1)
        self.n_kept = int(counts.max())
        self._holes, self._pad = None, int(counts.min()) < s
        self.prefill_rows = None


class KVCache:
    """The cache handed to the model as `past_key_values`: one `LayerCache` per layer.

    The engine sets `positions` (true token positions of the tokens being fed) before each
    forward; `update` writes them and returns the layer's slots in use (views, no copy). `limit`:
    the most slots a layer will need (budget + 1, or the run's length for growing caches).
    """

    def __init__(self, n_layers: int, limit: int | None = None):
        self.layers = [LayerCache(layer=i, limit=limit) for i in range(n_layers)]
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
        """Valid slots per layer and KV head, `(L, Hkv)` (without padding every head keeps `n_kept`)."""
        if not any(layer._pad for layer in self.layers):
            return torch.tensor([[layer.n_kept] * layer.pos.shape[0] for layer in self.layers])
        return torch.stack([layer.kept() for layer in self.layers]).cpu()
