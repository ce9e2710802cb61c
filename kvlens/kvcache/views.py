"""`SlotRows`: a view of a row range of a `SlotStore`, the object a policy is handed; it implements
`CacheRows`.

A view holds the bookkeeping of the layers whose rows they are (`LayerBook`: kept count, freed slots to reuse,
run state, latest attention): one layer's KV heads (`KVCache.layers[i]`, what the model's forward writes) or
every layer's (`KVCache.all_layers()`, `(L * Hkv, S)` at once). Both are the same class, so both implement all
of `CacheRows`; policies never touch a store. Tensors read `[:, :n_slots]` views `(1, R, S, D)` or `(R, S)` of
the store's buffers; assigning one copies into them.

Attention over a cache is order-free once RoPE is applied and every slot carries its position, so slots are
*not* kept in arrival order: a slot freed by an eviction (`free`) receives the next token (`append`,
`kvlens.kvcache.tokens`), with no per-step concatenation and no whole-layer gather. The first compression
below a layer's `limit` moves the kept slots into buffers of exactly `limit` slots (`retain`), so the prompt's
memory is really freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch

from kvlens.kvcache import frees, tokens
from kvlens.kvcache.paged import PagedStore
from kvlens.kvcache.store import (
    STATES,
    LayerBook,
    SlotStore,
    listed,
    slot_axis,
)

# (view, capacity, padded: its heads keep different counts) -> (store, rows)
Layout = Callable[["SlotRows", int, bool], tuple[SlotStore, slice]]


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
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def _names(self) -> dict[str, torch.Tensor]:
        """The store's per-slot statistics: none while the rows have no store (`None`, before any token)."""
        names: dict[str, torch.Tensor] = getattr(self._rows.store, "extra", {})
        return names


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
        *,
        owner: Layout,
    ):
        self.books = books
        self.store = store
        self.rows = rows
        # the KVCache, where a compressed layout goes, held weakly: it holds its views, and a cycle would keep
        # every finished run's cache alive until Python's cycle collector happens to run (a view that outlives
        # its cache, a standalone layer, lays itself out in a store of its own: `own_layout`)
        self._owner = weakref.ref(owner)

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

    def _joined(self, parts: list[torch.Tensor | None]) -> torch.Tensor | None:
        """The books' `parts` (one each) as one tensor along rows: None unless every book has one; a lone
        book's own (no copy)."""
        held = [p for p in parts if p is not None]
        if len(held) < len(self.books):
            return None
        return held[0] if len(held) == 1 else torch.cat(held)

    @property
    def last_attn(self) -> torch.Tensor | None:
        return self._joined([b.last_attn for b in self.books])

    @last_attn.setter
    def last_attn(self, value: torch.Tensor | None) -> None:
        parts: list[torch.Tensor | None] = (
            [None] * len(self.books) if value is None else list(value.chunk(len(self.books)))
        )
        for book, part in zip(self.books, parts, strict=True):
            book.last_attn = part

    @property
    def layer(self) -> int:
        """The model layer of a one-layer view (`CacheRows.layer`)."""
        (book,) = self.books
        return book.layer

    @property
    def state(self) -> dict[str, Any]:
        """The policy's run state of a one-layer view (`CacheRows.state`)."""
        (book,) = self.books
        return book.state

    @property
    def n_slots(self) -> int:
        return 0 if self.store is None else self.store.n

    @property
    def n_kept(self) -> int:
        return max(b.n_kept for b in self.books)

    @property
    def padded(self) -> bool:
        return any(b.holes is not None or b.pad or b.in_place for b in self.books)

    @property
    def capacity(self) -> int:
        return 0 if self.store is None else self.store.capacity

    @property
    def written(self) -> torch.Tensor | None:
        """`(R, q)` the slots the latest `append` wrote."""
        return self._joined([b.written for b in self.books])

    @property
    def nbytes(self) -> int:
        """Bytes allocated for these rows' keys and values (spare capacity included)."""
        return 0 if self.store is None else self.store.nbytes(self.rows)

    def kept_per_row(self) -> torch.Tensor:
        return self.valid.sum(-1)

    def position_order(self) -> torch.Tensor:
        """`(R, S)` slot indices sorted by position, oldest first, free and padding slots last."""
        store = self._live
        if store.order is not None and store.order.shape[1] == store.n:
            return store.order[self.rows]
        order = torch.argsort(
            self.pos.masked_fill(~self.valid, torch.iinfo(self.pos.dtype).max), dim=-1, stable=True
        )
        if self.whole_store():
            store.order = order
        return order

    def whole_store(self) -> bool:
        """Whether these rows are all of their store's."""
        return self._n_rows() == self._live.rows

    # -- the contract: changing --------------------------------------------------------------------
    def free(self, index: torch.Tensor) -> None:
        """Evict slots `index` `(R, E)`, -1 entries padding rows that free fewer (heads keeping different
        counts), or those marked `(R, S)` bool; later tokens reuse them (`kvlens.kvcache.frees`)."""
        frees.free(self, index)

    def retain(
        self, index: torch.Tensor, valid: torch.Tensor | None = None, capacity: int | None = None
    ) -> None:
        """Keep slots `index` `(R, S')`, in that slot order, and free the rest (new buffers, or the rows the
        cache allocates for a compressed layout). `valid` `(R, S')` marks padding when rows keep different
        counts; a store with `tail_padding` (paged) receives each row's kept slots first, then its padding."""
        s = index.shape[1]
        capacity = max(s, capacity or s)
        d = self.keys.shape[-1]
        old, old_rows = self._live, self.rows
        layout = self._owner() or own_layout  # the cache's choice; once it is gone, a store of its own
        store, rows = layout(self, capacity, valid is not None)
        if valid is not None and store.tail_padding:
            tail = torch.sort((~valid).int(), dim=1, stable=True).indices
            index, valid = index.gather(1, tail), valid.gather(1, tail)
        idx4 = index[None, :, :, None].expand(1, -1, -1, d)
        kept = {
            name: torch.gather(self._view(name), 2, idx4)
            if name in STATES
            else torch.gather(self._view(name), 1, index)
            for name in old.names()
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
        self.store, self.rows = store, rows
        store.n = capacity  # the spare slots are free ones, which the next tokens fill
        for name, t in kept.items():
            if name in store.buffers:
                self._view(name).narrow(slot_axis(name), 0, s).copy_(t)
        store.take(self.rows, old, old_rows, index, kept)  # storage outside the buffers (packed keys, values)
        for name, t in extras.items():
            self.extra[name] = torch.cat([t, t.new_zeros((t.shape[0], capacity - s, *t.shape[2:]))], dim=1)
        store.order = None
        counts = self.valid.sum(-1)
        for book, part, valid in zip(
            self.books, counts.chunk(len(self.books)), self.valid.chunk(len(self.books)), strict=True
        ):
            book.n_kept, book.pad = int(part.max()), int(part.min()) < s
            # a head's padding, then the spare slots: its next tokens' slots (in place: its invalid ones)
            book.holes = None if book.in_place else listed(~valid)
            book.fitted = True

    def append(
        self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, chunked: bool = False
    ) -> None:
        """One layer's new tokens `(1, Hkv, q, D)` at true `positions` `(q,)`, with empty statistics
        (`kvlens.kvcache.tokens.append`; `chunked`: a chunked prefill's chunk fills the freed slots first)."""
        (book,) = self.books
        self.store, self.rows = tokens.append(book, self.store, self.rows, (key, value, positions), chunked)


def own_layout(view: SlotRows, capacity: int, padded: bool) -> tuple[SlotStore, slice]:
    """A compressed layout in a store of the layer's own, `capacity` slots a row: paged when its book pages
    and its heads keep different counts (`padded`), else buffers like its current ones."""
    hkv = view.keys.shape[1]
    if view.books[0].paged and padded and not view._live.tail_padding:
        return PagedStore.like(view._live, hkv, capacity), slice(0, hkv)
    return view._live.empty_like(hkv, capacity), slice(0, hkv)
