"""The KV cache of a run, and `CacheRows`: the contract every policy is written against.

Storage. A `SlotStore` holds R rows (KV heads) x C slots: keys and values `(1, R, C, D)` after
RoPE, and per slot `pos` (original position, -1 when free), `abar` (attention accumulated over
every query that saw the slot, prefill rows included; a KV head's is the mean of its query
heads'), `nobs` (queries that observed it) and `valid` (False for free slots and for the padding
of heads that keep fewer slots), all `(R, C)`, plus policy statistics `extra` `(R, C, ...)` that
travel with their slots. Attention over a cache is order-free once RoPE is applied and every slot
carries its position, so slots are *not* kept in arrival order: a slot freed by an eviction
(`free`) receives the next token (`append`), with no per-step concatenation and no whole-layer
gather. Slots past the ones in use and freed slots hold zero `abar` and `nobs`.

Views. `SlotRows` is a view of a row range of a store, with the bookkeeping of the layers whose
rows they are (`LayerBook`: kept count, freed slots to reuse, run state, latest attention): one
layer's KV heads (`KVCache.layers[i]`, what the model's forward writes) or every layer's
(`KVCache.all_layers()`, `(L * Hkv, S)` at once). Both are the same class, so both implement all
of `CacheRows`, the protocol listing exactly what a policy may read and change; policies never
touch a store.

Memory. The prompt's cache is the prefill's own tensors; the first compression below `limit`
slots moves the kept slots into buffers of exactly `limit` slots (budget + the one token of a
step), so the prompt's memory is really freed; later steps write into them in place. Caches that
grow (full, budget-free policies) grow by chunks up to `limit` (the run's length). In all-layer
mode (a budgeted policy that declares `cross_layer`) those buffers are one store of L * Hkv rows
that the cache allocates itself when the first layer compresses, and each layer becomes a view of
its rows: a decode step's one eviction per head then runs once for all layers. `nbytes` is what
is allocated.

Steps. `Step` tells a policy which compression it performs: its index (0 = the prompt's, t = after
the forward that produced token t), its phase, the budget and the decision log.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from kvlens.errors import KvlensError
from kvlens.kvcache.channels import ChannelStates, seal_channels
from kvlens.kvcache.lowrank import LowRankStates, fit_rank, seal_cross_layer, seal_low_rank
from kvlens.kvcache.quantize import QuantizedStates, Storage, seal, slot_mask
from kvlens.runs.decisions import DecisionLog

GROWTH = 32  # minimum slots added when a growing cache runs out of room
STATS = {"valid": False, "pos": -1, "abar": 0.0, "nobs": 0.0}  # per-slot statistics, and a free slot's
STATES = ("keys", "values")  # (1, R, C, D); every other buffer is (R, C, ...)


class Phase(enum.Enum):
    """Which compression a policy performs: the prompt's (step 0), or a decode step's."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class Step:
    """One compression: `index` (0 = after the prompt, t = after the forward that produced token t), `phase`,
    the `budget` (slots per KV head; None for budget-free policies) and the run's decision log (None: off)."""

    index: int
    phase: Phase
    budget: int | None
    log: DecisionLog | None = None

    @property
    def prompt(self) -> bool:
        return self.phase is Phase.PREFILL


@dataclass(frozen=True)
class Prompt:
    """What a policy may read of one layer's prompt while it is prefilled (`Policy.observe_prefill`), besides
    the rows' own statistics (`abar`, `nobs`, `last_attn`)."""

    last: torch.Tensor  # (Hq, L, T) attention rows of the last L queries (L: the most any reader asked for)
    queries: torch.Tensor | None = None  # (Hq, T, D) the prompt's queries after RoPE
    positions: torch.Tensor | None = None  # (T,) their positions
    scaling: float = 1.0  # the layer's logit scale
    rotary: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = (
        None  # positions -> (cos, sin)
    )


@dataclass(frozen=True)
class Replay:
    """One replay pass of one layer (`Policy.replay_passes`, KVzip's reconstruction): tokens fed after the prompt,
    before its compression, whose keys are never cached; what `Policy.observe_replay` may read beside the rows."""

    start: int  # the prompt's positions start..end - 1 are what this pass reconstructs
    end: int
    queries: torch.Tensor  # (Hq, q, D) the pass's queries after RoPE
    keys: torch.Tensor  # (Hkv, q, D) its own keys after RoPE (causal among themselves)
    scaling: float  # the layer's logit scale
    softcap: float | None = None  # its tanh soft-capping


class Slots(NamedTuple):
    """Rows' kept slots in position order (oldest first; free and padding slots last, position -1)."""

    pos: torch.Tensor  # (R, S)
    keys: torch.Tensor  # (1, R, S, D)
    values: torch.Tensor  # (1, R, S, D)
    valid: torch.Tensor  # (R, S)


@runtime_checkable
class CacheRows(Protocol):
    """What a policy may read and change: the slots of some rows (KV heads) of the cache.

    Rows come in blocks of `kv_heads`, one block per layer in `layers`; `states` holds each
    layer's run state (counters, random generators), so policies stay immutable configuration.
    Tensors are views `[:, :n_slots]` of the rows' buffers; assigning one copies into them.
    """

    @property
    def layers(self) -> tuple[int, ...]: ...  # the model layers whose rows these are, in row order
    @property
    def kv_heads(self) -> int: ...  # rows per layer

    keys: torch.Tensor  # (1, R, S, D) after RoPE
    values: torch.Tensor  # (1, R, S, D)
    pos: torch.Tensor  # (R, S) long, -1 for a free slot
    valid: torch.Tensor  # (R, S) bool
    abar: torch.Tensor  # (R, S) float32, accumulated attention
    nobs: torch.Tensor  # (R, S) float32, queries that observed each slot
    extra: MutableMapping[str, torch.Tensor]  # name -> (R, S, ...) per-slot policy statistics
    last_attn: torch.Tensor | None  # (R * G, S) float32, the latest query's attention (G query heads per row)

    @property
    def states(self) -> list[dict[str, Any]]: ...  # per layer in `layers`: the policy's run state
    @property
    def n_slots(self) -> int: ...  # slots in use per row (free slots and padding included)
    @property
    def n_kept(self) -> int: ...  # valid slots of the fullest row
    @property
    def padded(self) -> bool: ...  # some row has a free or padding slot among its n_slots

    def kept_per_row(self) -> torch.Tensor: ...  # (R,) valid slots per row
    def position_order(self) -> torch.Tensor: ...  # (R, S) slot indices oldest first, free/padding last
    def in_position_order(self) -> Slots: ...  # the kept slots in position order (a copy, n_kept per row)
    def one_to_evict(self, budget: int) -> bool: ...  # budget + 1 slots per row, none free: one leaves
    def free(self, index: torch.Tensor) -> None: ...  # evict slots (R, E); later tokens reuse them
    def retain(self, index: torch.Tensor, valid: torch.Tensor | None = None) -> None: ...  # keep (R, S') only
    def per_layer(self, t: torch.Tensor) -> list[tuple[int, torch.Tensor]]: ...  # (R, ...) -> [(layer, rows)]


@dataclass
class LayerBook:
    """One layer's bookkeeping beside its rows' buffers."""

    layer: int
    limit: int | None = None  # most slots this layer will need (its budget + 1, or the run's length)
    state: dict[str, Any] = field(default_factory=dict)  # the policy's run state for this layer
    n_kept: int = 0  # valid slots of the fullest KV head
    holes: torch.Tensor | None = None  # (Hkv, E) slots freed by `free`, to be reused first
    pad: bool = False  # `retain` left padding (heads keeping different counts); never reused
    written: torch.Tensor | None = None  # (Hkv, q) the slots the latest `append` wrote
    # quantized storage: the latest `append`'s keys and values (Hkv, q, D) as fed
    fresh: tuple[torch.Tensor, torch.Tensor] | None = None
    last_attn: torch.Tensor | None = None  # (Hq, S) the latest query's attention


class SlotStore:
    """Buffers of R rows x C slots (see the module docstring) and the count of slots in use.

    Quantized storage (`quantize`): keys and values leave `buffers` for `packed` (`kvlens.kvcache.quantize`); reading
    them dequantizes the rows asked for into a working copy (`working`, what the model's attention and the policy
    see), and `commit` stores back the slots a policy changed in it (merges), then drops the copy. Channel-pruned
    keys (`prune_keys`, `kvlens.kvcache.channels`) are packed the same way, the values staying in `buffers`.
    """

    def __init__(self, buffers: dict[str, torch.Tensor], n: int):
        self.buffers = buffers  # keys/values (1, R, C, D) unless packed, pos/abar/nobs/valid (R, C)
        self.extra: dict[str, torch.Tensor] = {}  # name -> (R, C, ...)
        self.n = n
        self.order: torch.Tensor | None = None  # (R, n) slots in position order, when known
        self.packed: dict[str, QuantizedStates | LowRankStates | ChannelStates] | None = (
            None  # keys and/or values
        )
        self.working: dict[
            tuple[str, int, int], torch.Tensor
        ] = {}  # (name, first row, end row) -> (1, R', n, D)

    def empty_like(self, rows: int, capacity: int) -> SlotStore:
        """A store of `rows` x `capacity` free slots with this one's buffers and storage (none in use)."""
        new = SlotStore(
            {
                name: t.new_full(
                    (1, rows, capacity, t.shape[-1]) if name in STATES else (rows, capacity),
                    STATS.get(name, 0),
                )
                for name, t in self.buffers.items()
            },
            0,
        )
        if self.packed is not None:
            new.packed = {name: q.empty(rows, capacity) for name, q in self.packed.items()}
        return new

    def states(self, name: str, rows: slice) -> torch.Tensor:
        """Keys or values `(1, R', n, D)` of `rows`: a view of the buffer, or (quantized) the rows' working copy."""
        if name in self.buffers:
            return self.buffers[name][:, rows, : self.n]
        packed = self.packed or {}  # a packed name: keys and values not in the buffers
        start, stop, _ = rows.indices(self.rows)
        key = (name, start, stop)
        if key not in self.working:
            self.commit(name)
            self.working[key] = packed[name].read(slice(start, stop), self.n)[None]
        return self.working[key]

    def commit(self, name: str | None = None) -> None:
        """Store the slots changed in the working copies (of `name`, or both) and drop the copies."""
        if self.packed is None:
            return  # no working copies: the buffers are what the model and the policy see
        for key in [k for k in self.working if name is None or k[0] == name]:
            copy = self.working.pop(key)
            rows = slice(key[1], key[2])
            if copy.shape[2] != self.n:
                continue  # the slots in use changed since (a rewind): nothing a policy wrote
            stored = self.packed[key[0]].read(rows, self.n)
            changed = (copy[0] != stored).any(-1)
            if bool(changed.any()):
                self.packed[key[0]].write(rows, copy[0], changed, self.buffers["valid"][rows, : self.n])

    def quantize(self, storage: Storage, slots: int) -> None:
        """Keys and values into quantized or per-head low-rank storage (after the prompt's compression); `slots`:
        the most each row will hold (low rank's byte share is of those)."""
        valid, pos = self.buffers["valid"][:, : self.n], self.buffers["pos"][:, : self.n]
        states = {name: self.buffers.pop(name)[0, :, : self.n] for name in STATES}
        if storage.low_rank:
            x = states["keys"]
            rank = fit_rank(storage, x.shape[2], 1, max(slots, self.n), self.n, x.element_size())
            self.packed = {
                name: seal_low_rank(
                    rank,
                    t,
                    valid,
                    self.capacity,
                    bits=storage.bits,
                    group=storage.group,
                    append=storage.rank_append,
                )
                for name, t in states.items()
            }
        else:
            self.packed = {
                name: seal(storage, name, t, pos, valid, self.capacity) for name, t in states.items()
            }

    def prune_keys(self, channels: torch.Tensor, whole: torch.Tensor) -> None:
        """Keys into channel-pruned storage: each row keeps `channels` `(R, K)`, the slots `whole` `(R, n)` every
        channel (`kvlens.kvcache.channels`); values stay in the model's dtype."""
        valid = self.buffers["valid"][:, : self.n]
        self.packed = {
            "keys": seal_channels(
                channels, self.buffers.pop("keys")[0, :, : self.n], valid, whole, self.capacity
            )
        }

    @property
    def capacity(self) -> int:
        return self.buffers["pos"].shape[1]

    @property
    def rows(self) -> int:
        return self.buffers["pos"].shape[0]

    def resize(self, capacity: int) -> None:
        """Reallocate every buffer to `capacity` slots, keeping the slots in use."""
        n = self.n
        for q in (self.packed or {}).values():
            q.resize(capacity)
        for group in (self.buffers, self.extra):
            for name, t in group.items():
                axis = 2 if name in STATES and group is self.buffers else 1
                shape = list(t.shape)
                shape[axis] = capacity
                new = t.new_zeros(shape)
                new.narrow(axis, 0, n).copy_(t.narrow(axis, 0, n))
                group[name] = new

    def nbytes(self, rows: slice) -> int:
        """Bytes allocated for the keys and values of `rows`."""
        count = len(range(*rows.indices(self.rows)))
        packed = sum(q.nbytes(count) for q in (self.packed or {}).values())
        return packed + sum(
            t.numel() // t.shape[1] * count * t.element_size() for n, t in self.buffers.items() if n in STATES
        )


class ExtraView(MutableMapping[str, torch.Tensor]):
    """`SlotRows.extra`: each per-slot statistic as a `(R, S, ...)` view; assigning copies into the store."""

    def __init__(self, rows: SlotRows):
        self._rows = rows

    def __getitem__(self, name: str) -> torch.Tensor:
        store = self._rows.store
        if store is None or name not in store.extra:
            raise KeyError(name)
        return store.extra[name][self._rows.rows, : store.n]

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        store, rows = self._rows._live, self._rows.rows
        if (
            name not in store.extra
            or store.extra[name].shape[2:] != value.shape[2:]
            or store.extra[name].dtype != value.dtype
        ):
            store.extra[name] = value.new_zeros((store.rows, store.capacity, *value.shape[2:]))
        store.extra[name][rows, : store.n] = value

    def __delitem__(self, name: str) -> None:
        raise TypeError("a per-slot statistic stays for the whole run")

    def __iter__(self) -> Iterator[str]:
        store = self._rows.store
        return iter(() if store is None else store.extra)

    def __len__(self) -> int:
        store = self._rows.store
        return 0 if store is None else len(store.extra)


class RowTensor:
    """A tensor of `SlotRows` (`keys`, `pos`, ...): reading gives its view `[:, :n_slots]` of the store's
    buffer, assigning copies into it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, rows: SlotRows, owner: type | None = None) -> torch.Tensor:
        return rows._view(self.name)

    def __set__(self, rows: SlotRows, value: torch.Tensor) -> None:
        rows._assign(self.name, value)


class SlotRows:
    """A view of rows `rows` of `store`, for the layers in `books` (one, or all): implements `CacheRows`."""

    def __init__(
        self,
        books: list[LayerBook],
        store: SlotStore | None = None,
        rows: slice = slice(0, 0),
        owner: KVCache | None = None,
    ):
        self.books = books
        self.store = store
        self.rows = rows
        self.owner = owner  # the KVCache: (view, capacity) -> (store, rows) for a compressed layout

    # -- the contract: reading ---------------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(b.layer for b in self.books)

    @property
    def kv_heads(self) -> int:
        return self._n_rows() // len(self.books)

    @property
    def _live(self) -> SlotStore:
        """The rows' store, which the first `append` (the prompt's) makes."""
        if self.store is None:
            raise RuntimeError("kvlens: a layer of the cache was read before it held any token")
        return self.store

    def _n_rows(self) -> int:
        return len(range(*self.rows.indices(self._live.rows)))

    def _view(self, name: str) -> torch.Tensor:
        store = self._live
        if name in STATES:
            return store.states(name, self.rows)
        return store.buffers[name][self.rows, : store.n]

    def _assign(self, name: str, value: torch.Tensor) -> None:
        view = self._view(name)
        if view.shape != value.shape:
            raise ValueError(f"{name} must keep the cache's shape {tuple(view.shape)}")
        if view.data_ptr() != value.data_ptr():
            view.copy_(value)
        if name in ("pos", "valid"):
            self._live.order = None

    keys = RowTensor()
    values = RowTensor()
    pos = RowTensor()
    abar = RowTensor()
    nobs = RowTensor()
    valid = RowTensor()

    @property
    def extra(self) -> ExtraView:
        return ExtraView(self)

    @extra.setter
    def extra(self, values: Mapping[str, torch.Tensor]) -> None:
        for name, t in values.items():
            self.extra[name] = t

    @property
    def last_attn(self) -> torch.Tensor | None:
        rows = [b.last_attn for b in self.books if b.last_attn is not None]
        if len(rows) < len(self.books):
            return None
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    @last_attn.setter
    def last_attn(self, value: torch.Tensor | None) -> None:
        parts: list[torch.Tensor | None] = (
            [None] * len(self.books) if value is None else list(value.chunk(len(self.books)))
        )
        for book, part in zip(self.books, parts, strict=True):
            book.last_attn = part

    @property
    def states(self) -> list[dict[str, Any]]:
        return [b.state for b in self.books]

    @property
    def n_slots(self) -> int:
        return 0 if self.store is None else self.store.n

    @property
    def n_kept(self) -> int:
        return max(b.n_kept for b in self.books)

    @property
    def padded(self) -> bool:
        return any(b.holes is not None or b.pad for b in self.books)

    @property
    def capacity(self) -> int:
        return 0 if self.store is None else self.store.capacity

    @property
    def written(self) -> torch.Tensor | None:
        """`(R, q)` the slots the latest `append` wrote."""
        parts = [b.written for b in self.books if b.written is not None]
        if len(parts) < len(self.books):
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for these rows' keys and values (spare capacity included)."""
        return 0 if self.store is None else self.store.nbytes(self.rows)

    def kept_per_row(self) -> torch.Tensor:
        return self.valid.sum(-1)

    def position_order(self) -> torch.Tensor:
        """`(R, S)` slot indices sorted by position, oldest first, free and padding slots last."""
        store = self._live
        if store.order is not None and store.order.shape[1] == store.n and self._whole_store():
            return store.order
        order = torch.argsort(
            self.pos.masked_fill(~self.valid, torch.iinfo(self.pos.dtype).max), dim=-1, stable=True
        )
        if self._whole_store():
            store.order = order
        return order

    def in_position_order(self) -> Slots:
        """The kept slots in position order (a copy, `n_kept` per row): what an append-only cache would hold."""
        order = self.position_order()[:, : self.n_kept]
        idx = order[None, :, :, None].expand(1, -1, -1, self.keys.shape[-1])
        return Slots(
            self.pos.masked_fill(~self.valid, -1).gather(1, order),
            self.keys.gather(2, idx),
            self.values.gather(2, idx),
            self.valid.gather(1, order),
        )

    def one_to_evict(self, budget: int) -> bool:
        """A decode step's compression: each row holds budget + 1 slots, none free, so exactly one leaves."""
        return all(b.n_kept == budget + 1 and b.holes is None and not b.pad for b in self.books)

    def per_layer(self, t: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """`(R, ...)` -> each layer's index and its `(Hkv, ...)` rows."""
        return list(zip(self.layers, t.chunk(len(self.books)), strict=True))

    def _whole_store(self) -> bool:
        return self._n_rows() == self._live.rows

    # -- the contract: changing --------------------------------------------------------------------
    def free(self, index: torch.Tensor) -> None:
        """Evict slots `index` `(R, E)`; -1 entries pad rows that free fewer (heads keeping different counts).
        Later tokens reuse the freed slots.

        When the slots in use exceed a layer's `limit` (the prompt's cache after its first
        compression), the kept slots move into buffers of `limit` slots and the old ones are released.
        """
        store = self._live
        uneven = bool((index < 0).any())
        if store.packed is not None or uneven:  # the freed slots as a mask `(R, n)`
            gone = slot_mask(index, store.n)
        for q in (store.packed or {}).values():
            q.forget(self.rows, gone)
        if uneven:
            for name, fill in STATS.items():
                store.buffers[name][self.rows, : store.n].masked_fill_(gone, fill)
        else:
            for name, fill in STATS.items():
                store.buffers[name][self.rows].scatter_(1, index, fill)
        if store.order is not None and self._whole_store() and not self.padded and not uneven:
            gone = torch.zeros(store.order.shape, dtype=torch.bool, device=index.device).scatter_(
                1, index, True
            )
            left = torch.gather(gone, 1, store.order)  # freed slots go last, in the order they were freed
            store.order = torch.cat([store.order[~left].view(left.shape[0], -1), index], dim=1)
        else:
            store.order = None
        counts = self.valid.sum(-1).chunk(len(self.books)) if uneven else ()
        for i, (book, part) in enumerate(zip(self.books, index.chunk(len(self.books)), strict=True)):
            book.holes = first_valid(part if book.holes is None else torch.cat([book.holes, part], dim=1))
            if uneven:
                book.n_kept, book.pad = (
                    int(counts[i].max()),
                    book.pad or bool((counts[i] != counts[i][0]).any()),
                )
            else:
                book.n_kept -= part.shape[1]
        limit = self.books[0].limit
        if len(self.books) == 1 and limit is not None and store.n > limit:
            kept, valid = padded_index(self.valid)
            self.retain(kept, valid if bool((~valid).any()) else None, capacity=limit)

    def retain(
        self, index: torch.Tensor, valid: torch.Tensor | None = None, capacity: int | None = None
    ) -> None:
        """Keep slots `index` `(R, S')`, in that slot order, and free the rest (new buffers, or the rows the cache
        allocates for a compressed layout). `valid` `(R, S')` marks padding when rows keep different counts."""
        s = index.shape[1]
        capacity = max(s, capacity or s)
        d = self.keys.shape[-1]
        idx4 = index[None, :, :, None].expand(1, -1, -1, d)
        old, old_rows = self._live, self.rows
        names = list(old.buffers) + list(old.packed or {})
        kept = {
            name: torch.gather(self._view(name), 2, idx4)
            if name in STATES
            else torch.gather(self._view(name), 1, index)
            for name in names
        }
        extras = {}
        for name, t in old.extra.items():
            view = t[self.rows, : old.n]
            ix = index.view(*index.shape, *([1] * (view.dim() - 2))).expand(-1, -1, *view.shape[2:])
            extras[name] = torch.gather(view, 1, ix)
        if valid is not None:
            kept["valid"] &= valid
        if self.last_attn is not None:  # per query head: map each query head to its KV head's index
            group = self.last_attn.shape[0] // index.shape[0]
            self.last_attn = torch.gather(self.last_attn, 1, index.repeat_interleave(group, 0))
        self.store, self.rows = (
            self.owner(self, capacity)
            if self.owner is not None
            else (old.empty_like(index.shape[0], capacity), slice(0, index.shape[0]))
        )
        store = self.store
        store.n = capacity  # the spare slots are free ones, which the next tokens fill
        for name, t in kept.items():
            if name in (store.packed or {}):
                continue
            view = self._view(name)
            (view[:, :, :s] if name in STATES else view[:, :s]).copy_(t)
        if store.packed is not None and old.packed is not None:
            # the kept slots' window entries follow them; the rest is quantized again. The new store's storage is
            # the old one's kind (`empty_like`), which mypy cannot see.
            valid = self.valid
            for name, q in store.packed.items():
                q.take(self.rows, old.packed[name], old_rows, index, kept[name][0], valid)  # type: ignore[arg-type]
        for name, t in extras.items():
            self.extra[name] = torch.cat([t, t.new_zeros((t.shape[0], capacity - s, *t.shape[2:]))], dim=1)
        store.order = None
        counts = self.valid.sum(-1)
        spare = torch.arange(s, capacity, device=index.device).expand(index.shape[0], capacity - s)
        for book, part, free in zip(
            self.books, counts.chunk(len(self.books)), spare.chunk(len(self.books)), strict=True
        ):
            book.n_kept, book.pad = int(part.max()), int(part.min()) < s
            book.holes = free if capacity > s else None

    def append(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> None:
        """One layer's new tokens `(1, Hkv, q, D)` at true `positions` `(q,)`, with empty statistics.

        One token goes into a slot freed by `free` (one per head; a `retain`ed layout is never
        reordered); otherwise the tokens go after the slots in use (growing the buffers if needed). In a
        chunked prefill (`KVCache.chunked`) a chunk fills the freed slots first, so a layer never outgrows its
        budget + the chunk.
        """
        (book,) = self.books
        q = key.shape[2]
        positions = positions.to(key.device)
        if self.store is None:
            self._adopt(key, value, positions)
        elif q == 1 and book.holes is not None:
            self._fill_free(book.holes, key, value, positions)
        elif book.holes is not None and self.owner is not None and self.owner.chunked:
            self._fill_chunk(book.holes, key, value, positions)
        else:
            self._write_end(key, value, positions)
        book.n_kept += q
        book.last_attn = None  # the slots changed: the next query's attention replaces it

    def _adopt(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> None:
        """The prefill's tensors become a store of this layer's own (no copy)."""
        hkv, q = key.shape[1], key.shape[2]
        dev = key.device
        store = self.store = SlotStore(
            {
                "keys": key.contiguous(),
                "values": value.contiguous(),
                "pos": positions.view(1, q).expand(hkv, q).clone(),
                "abar": torch.zeros(hkv, q, dtype=torch.float32, device=dev),
                "nobs": torch.zeros(hkv, q, dtype=torch.float32, device=dev),
                "valid": torch.ones(hkv, q, dtype=torch.bool, device=dev),
            },
            q,
        )
        slots = torch.arange(q, device=dev).expand(hkv, q)
        store.order = slots if q == 1 or bool((positions[1:] > positions[:-1]).all()) else None
        self.rows = slice(0, hkv)
        self.books[0].written = slots

    def _fill_free(
        self, holes: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Write one token into each head's oldest freed slot (the oldest freed slot is already the first
        free one in position order, so the order stays valid). When some head has none (heads keeping
        different counts), every head gets one more slot at the end: a freed one for the heads that had theirs."""
        book, store = self.books[0], self._live
        slot, rest = holes[:, 0], holes[:, 1:]  # (Hkv,): -1 where a head has no freed slot
        if bool((slot < 0).any()):
            end = store.n
            if end == store.capacity:
                store.resize(end + GROWTH)
            store.n = end + 1
            rest = torch.cat([rest, torch.where(slot < 0, -1, end)[:, None]], dim=1)
            slot = torch.where(slot < 0, end, slot)
            store.order = None
        book.holes = first_valid(rest) if rest.shape[1] else None
        self._write_into(slot[:, None], key, value, positions)
        book.written = slot[:, None]

    def _fill_chunk(
        self, holes: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """A chunk of q tokens: the first k into the k freed slots every head has, the rest after the slots in use."""
        book, store = self.books[0], self._live
        k = min(key.shape[2], int((holes >= 0).sum(-1).min()))
        slots, rest = holes[:, :k], holes[:, k:]
        book.holes = first_valid(rest) if rest.shape[1] else None
        self._write_into(slots, key[:, :, :k], value[:, :, :k], positions[:k])
        store.order = None
        if k < key.shape[2]:
            slots = torch.cat([slots, self._write_end(key[:, :, k:], value[:, :, k:], positions[k:])], dim=1)
        book.written = slots

    def _write_into(
        self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """New tokens `(1, Hkv, k, D)` at `positions` `(k,)` into freed `slots` `(Hkv, k)` (`free` already zeroed
        their abar and nobs)."""
        store = self._live
        heads = torch.arange(slots.shape[0], device=slots.device)[:, None] + self.rows.start
        store.buffers["pos"][heads, slots] = positions
        store.buffers["valid"][heads, slots] = True
        self._write_states(slots, key, value, positions)
        for t in store.extra.values():
            t[heads, slots] = 0

    def _write_end(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """New tokens `(1, Hkv, q, D)` after the slots in use (growing the buffers if needed); returns their
        slots `(Hkv, q)`."""
        store, book = self._live, self.books[0]
        if not self._whole_store():
            raise RuntimeError(
                "kvlens: a layer of the all-layer store cannot grow (its slots are the budget's)"
            )
        hkv, q = key.shape[1], key.shape[2]
        n, need = store.n, store.n + q
        if need > store.capacity:
            grow = max(need, n + max(GROWTH, n // 16))
            limit = book.limit
            store.resize(min(grow, limit) if limit is not None and limit >= need else grow)
        b = store.buffers
        b["pos"][:, n:need] = positions
        b["valid"][:, n:need] = True  # abar, nobs and extras past the slots in use are zero
        new = torch.arange(n, need, device=key.device).expand(hkv, q)
        store.order = (
            torch.cat([store.order, new], dim=1) if store.order is not None and not self.padded else None
        )
        store.n = need
        self._write_states(new, key, value, positions)
        book.written = new
        return new

    def _write_states(
        self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """New tokens' keys and values `(1, Hkv, q, D)` into `slots` `(Hkv, q)`: into the buffers, or into packed
        storage (quantized: its full-precision window)."""
        store = self._live
        heads = torch.arange(slots.shape[0], device=slots.device)[:, None] + self.rows.start
        if store.packed is not None:
            store.commit()
            self.books[0].fresh = (key[0], value[0])
        valid = store.buffers["valid"][self.rows, : store.n]
        packed = store.packed or {}  # the names that are not in the buffers
        for name, x in (("keys", key), ("values", value)):
            if name in store.buffers:
                store.buffers[name][0, heads, slots] = x[0]
            else:
                packed[name].append(self.rows, slots, x[0], positions, valid)


def first_valid(holes: torch.Tensor) -> torch.Tensor | None:
    """Freed slots `(Hkv, E)` with each row's real ones (not -1) first, in order; columns of -1 dropped."""
    if not bool((holes < 0).any()):
        return holes
    holes = holes.gather(1, torch.sort((holes < 0).int(), dim=1, stable=True).indices)
    width = int((holes >= 0).sum(-1).max())
    return holes[:, :width] if width else None


def padded_index(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`keep` `(R, S)` bool -> ascending slot index `(R, n)` and valid `(R, n)`, n = the largest count:
    rows that keep fewer are padded with their oldest dropped slots, marked invalid (for `retain`)."""
    counts = keep.sum(-1, keepdim=True)  # (R, 1)
    n = int(counts.max())
    dropped_rank = (~keep).long().cumsum(-1)
    select = keep | (~keep & (dropped_rank <= n - counts))
    index = select.nonzero()[:, 1].view(keep.shape[0], n)
    return index, torch.gather(keep, 1, index)


class KVCache:
    """The cache handed to the model as `past_key_values`: one `SlotRows` view per layer.

    The engine sets `positions` (true token positions of the tokens being fed) before each
    forward; `update` writes them and returns the layer's slots in use (views, no copy); while `replaying`
    it writes nothing and returns the slots in use followed by the pass's own keys and values. `limit`:
    the most slots a layer will need (budget + 1, or the run's length for growing caches; per layer
    after `set_budgets`).
    `all_layers=True` (a budgeted policy declaring `cross_layer`): a compressed layer's slots go
    into the rows of one store for every layer (see the module docstring).
    """

    def __init__(self, n_layers: int, limit: int | None = None, all_layers: bool = False):
        self.all_layer_mode = all_layers
        self.shared: SlotStore | None = None
        self.books = [LayerBook(layer=i, limit=limit) for i in range(n_layers)]
        self.layers = [SlotRows([book], owner=self) for book in self.books]
        self.positions: torch.Tensor | None = None
        self.replaying = False  # a replay pass is being fed: `update` caches nothing
        self.chunked = False  # a chunked prefill: chunks fill freed slots first (`SlotRows.append`)
        self._everywhere: SlotRows | None = None

    def __call__(self, view: SlotRows, capacity: int) -> tuple[SlotStore, slice]:
        """Where a layer's compressed layout goes: its rows of the all-layer store, or a store of its own."""
        hkv = view.keys.shape[1]
        if not self.all_layer_mode or len(view.books) != 1 or capacity != view.books[0].limit:
            return view._live.empty_like(hkv, capacity), slice(0, hkv)
        if self.shared is None:
            self.shared = view._live.empty_like(hkv * len(self.layers), capacity)
        i = view.books[0].layer
        return self.shared, slice(i * hkv, (i + 1) * hkv)

    def set_budgets(self, budgets: list[int], extra: int = 1) -> None:
        """Each layer's own budget (an allocating policy's): its limit becomes that budget + `extra` (the one token
        of a decode step, or a prefill chunk)."""
        for book, budget in zip(self.books, budgets, strict=True):
            book.limit = budget + extra

    def all_layers(self) -> SlotRows | None:
        """Every layer's rows as one view, once every layer lives in the all-layer store (else None)."""
        if self.shared is None or any(view.store is not self.shared for view in self.layers):
            return None
        if self._everywhere is None:
            self._everywhere = SlotRows(self.books, self.shared, slice(0, self.shared.rows), owner=self)
        return self._everywhere

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        if self.replaying:  # a replay pass attends to the cache and to itself, and leaves nothing behind
            return torch.cat([layer.keys, key_states], 2), torch.cat([layer.values, value_states], 2)
        if self.positions is None:
            raise RuntimeError("kvlens: the engine sets the cache's positions before each forward")
        layer.append(key_states, value_states, self.positions)
        return layer.keys, layer.values

    def stores(self) -> list[SlotStore]:
        """Every store in use, once each."""
        return list({id(v.store): v.store for v in self.layers if v.store is not None}.values())

    def quantize(self, storage: Storage) -> None:
        """Keys and values into `storage` (after the prompt's compression); nothing for the model's dtype."""
        if storage.rank_layers:
            for first in range(0, len(self.layers), storage.rank_layers):
                self._seal_layers(storage, self.layers[first : first + storage.rank_layers])
        elif storage.packed:
            for store in self.stores():
                limits = [b.limit for v, b in zip(self.layers, self.books, strict=True) if v.store is store]
                store.quantize(storage, max((lim or 0) for lim in limits))

    def _seal_layers(self, storage: Storage, views: list[SlotRows]) -> None:
        """xKV's cross-layer low rank (`kvlens.kvcache.lowrank.seal_cross_layer`) over a group of adjacent layers,
        which must each have a store of their own holding the same tokens in the same slots."""
        stores = [v._live for v in views]
        first, n = stores[0], stores[0].n
        valid = first.buffers["valid"][:1, :n]
        pos = first.buffers["pos"][:1, :n].masked_fill(~valid, -1)

        def holds_them(view: SlotRows, store: SlotStore) -> bool:
            """The view has the store to itself, and each of its heads holds the first head's tokens."""
            mine = store.buffers["valid"][:, :n]
            return (
                view.rows == slice(0, store.rows)
                and store.n == n
                and torch.equal(mine, valid.expand_as(mine))
                and torch.equal(store.buffers["pos"][:, :n].masked_fill(~valid, -1), pos.expand_as(mine))
            )

        same = len({id(s) for s in stores}) == len(stores) and all(map(holds_them, views, stores))
        if not same:
            raise KvlensError(
                "Cross-layer low rank (--kv-rank-layers) shares each token's coefficients across the "
                "heads of adjacent layers (xKV), so every head must keep the same tokens, and this "
                "policy keeps different ones: leave --kv-rank-layers out for per-head low rank."
            )
        x = first.buffers["keys"]
        limit = max((v.books[0].limit or 0) for v in views)
        rank = fit_rank(storage, x.shape[-1], len(views) * x.shape[1], max(limit, n), n, x.element_size())
        for name in STATES:
            parts = seal_cross_layer(
                rank,
                [s.buffers.pop(name)[0, :, :n] for s in stores],
                valid[0],
                bits=storage.bits,
                group=storage.group,
            )
            for store, part in zip(stores, parts, strict=True):
                store.packed = {**(store.packed or {}), name: part}

    def prune_keys(self, plans: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keys into channel-pruned storage (after the prompt's compression): `plans[i]` is layer i's kept channels
        `(Hkv, K)` and its slots that keep every channel `(Hkv, n)` bool (`SlotStore.prune_keys`)."""
        for store in self.stores():
            parts = sorted(
                (
                    (view.rows.start, plan)
                    for view, plan in zip(self.layers, plans, strict=True)
                    if view.store is store
                ),
                key=lambda part: part[0],
            )
            store.prune_keys(torch.cat([c for _, (c, _) in parts]), torch.cat([w for _, (_, w) in parts]))

    def commit(self) -> None:
        """Quantized storage: store what a policy changed in the working copies (see `SlotStore`)."""
        for store in self.stores():
            store.commit()

    def mark(self) -> list[tuple[Any, ...]]:
        """What `rewind` needs to bring a cache that since only grew (no compression) back to now: each layer's
        slots in use, their positions and validity (appends may fill freed slots), its bookkeeping and its
        quantized storage (a flush quantizes tokens for good)."""
        self.commit()
        stores = [view._live for view in self.layers]
        return [
            (
                store.n,
                store.order,
                view.pos.clone(),
                view.valid.clone(),
                dataclasses.replace(book),
                None if store.packed is None else {k: q.clone() for k, q in store.packed.items()},
            )
            for view, store, book in zip(self.layers, stores, self.books, strict=True)
        ]

    def rewind(self, mark: list[tuple[Any, ...]]) -> None:
        """Forget every token appended since `mark` (e.g. one question and its answer, before the next question
        on the same compressed context)."""
        with torch.inference_mode():  # the buffers are inference tensors when the run made them
            for view, book, (n, order, pos, valid, saved, packed) in zip(
                self.layers, self.books, mark, strict=True
            ):
                store = view._live
                store.working.clear()
                store.packed = packed if packed is None else {k: q.clone() for k, q in packed.items()}
                for q in (store.packed or {}).values():
                    q.resize(store.capacity)  # the buffers may have grown since the mark
                store.n = n
                view.pos, view.valid = pos, valid
                for (
                    name,
                    fill,
                ) in STATS.items():  # the slots past `n` are free again (appends since wrote them)
                    store.buffers[name][view.rows, n:] = fill
                store.order = order
                vars(book).update(vars(saved))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].n_slots

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values (each store once)."""
        return sum(s.nbytes(slice(0, s.rows)) for s in self.stores())

    def kept_counts(self) -> torch.Tensor:
        """Valid slots per layer and KV head, `(L, Hkv)` (without padding every head keeps `n_kept`)."""
        if not any(book.pad for book in self.books):
            return torch.tensor(
                [[book.n_kept] * layer.kv_heads for book, layer in zip(self.books, self.layers, strict=True)]
            )
        return torch.stack([layer.kept_per_row() for layer in self.layers]).cpu()
