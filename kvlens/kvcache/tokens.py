"""New tokens into one layer's rows (`SlotRows.append`): the prompt's tensors become the layer's store; later
tokens fill slots freed by evictions first, then go after the slots in use, growing the buffers by chunks."""

from __future__ import annotations

import torch

from kvlens.kvcache.store import (
    FITTED_GROWTH,
    GROWTH,
    LayerBook,
    SlotStore,
    first_valid,
    listed,
    trimmed,
)


def append(
    book: LayerBook,
    store: SlotStore | None,
    rows: slice,
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    chunked: bool,
) -> tuple[SlotStore, slice]:
    """One layer's `new` tokens: keys and values `(1, Hkv, q, D)` at true positions `(q,)`, with empty
    statistics, into its `rows` of `store` (None: the layer holds no token yet); returns the layer's store and
    rows.

    One token goes into a slot freed by `free` (one per head; a `retain`ed layout is never reordered);
    otherwise the tokens go after the slots in use (growing the buffers if needed). In a chunked prefill
    (`chunked`) a chunk fills the freed slots first, so a layer never outgrows its budget + the chunk.
    """
    key, value, positions = new
    q = key.shape[2]
    positions = positions.to(key.device)
    if store is None:
        store, rows = _adopt(book, key, value, positions), slice(0, key.shape[1])
    elif q == 1 and book.in_place:
        Writer(book, store, rows).fill_lowest_free(key, value, positions)
    elif q == 1 and book.holes is not None:
        Writer(book, store, rows).fill_free(book.holes, key, value, positions)
    elif book.holes is not None and chunked:
        Writer(book, store, rows).fill_chunk(book.holes, key, value, positions)
    else:
        Writer(book, store, rows).write_end(key, value, positions)
    book.n_kept += q
    book.last_attn = None  # the slots changed: the next query's attention replaces it
    return store, rows


def reserve_room(book: LayerBook, store: SlotStore, rows: slice, tokens: int) -> None:
    """Room for `tokens` more tokens in a layer's own store once nothing leaves it (`SlotStore.reserve`): its
    buffers hold exactly them, so they never grow by chunks; a paged layer's slots past each head's kept
    ones become that head's free slots, filled in slot order, on the pages reserved for them."""
    if len(range(*rows.indices(store.rows))) != store.rows:
        return  # rows of the all-layer store: they hold the budget
    store.reserve(tokens)
    if store.tail_padding:
        store.n = store.capacity
        book.holes = listed(~store.buffers["valid"][rows, : store.n])


def _adopt(book: LayerBook, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> SlotStore:
    """The prefill's tensors become a store of this layer's own (no copy)."""
    hkv, q = key.shape[1], key.shape[2]
    dev = key.device
    store = SlotStore(
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
    book.written = slots
    return store


class Writer:
    """Writes new tokens into a layer's `rows` of `store`, with the layer's bookkeeping `book`."""

    def __init__(self, book: LayerBook, store: SlotStore, rows: slice):
        self.book, self.store, self.rows = book, store, rows

    def fill_free(
        self, holes: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Write one token into each head's oldest freed slot (the oldest freed slot is already the first free
        one in position order, so the order stays valid). When some head has none (heads keeping different
        counts), every head gets one more slot at the end: a freed one for the heads that had theirs."""
        book, store = self.book, self.store
        slot, rest = holes[:, 0], holes[:, 1:]  # (Hkv,): -1 where a head has no freed slot
        lacking = bool((slot < 0).any())
        if lacking:
            end = self._one_more_slot()
            rest = torch.cat([rest, torch.where(slot < 0, -1, end)[:, None]], dim=1)
            slot = torch.where(slot < 0, end, slot)
            store.order = None
        # each row's freed slots stay first when every head had one: only the emptied columns go (no sort)
        book.holes = None
        if rest.shape[1]:
            book.holes = first_valid(rest) if lacking else trimmed(rest)
        self.write_into(slot[:, None], key, value, positions)
        book.written = slot[:, None]

    def fill_lowest_free(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> None:
        """Write one token into each head's lowest free slot (`LayerBook.in_place`: its invalid slots are its
        free ones). When some head has none, every head gets one more slot at the end: a free one for the
        heads that wrote theirs."""
        store = self.store
        free = ~store.buffers["valid"][self.rows, : store.n]  # (Hkv, n)
        slot = free.byte().argmax(-1)  # (Hkv,) the first free slot, 0 when none
        has = free.gather(1, slot[:, None])[:, 0]
        if not bool(has.all()):
            slot = torch.where(has, slot, self._one_more_slot())
        self.write_into(slot[:, None], key, value, positions)
        self.book.written = slot[:, None]

    def _one_more_slot(self) -> int:
        """One more slot in use for every head, at the end (growing the buffers if full); returns it."""
        end = self.store.n
        if end == self.store.capacity:
            self.store.resize(end + (FITTED_GROWTH if self.book.fitted else GROWTH))
        self.store.n = end + 1
        return end

    def fill_chunk(
        self, holes: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """A chunk of q tokens: the first k into the k freed slots every head has, the rest after the slots in
        use."""
        book, store = self.book, self.store
        k = min(key.shape[2], int((holes >= 0).sum(-1).min()))
        slots, rest = holes[:, :k], holes[:, k:]
        book.holes = first_valid(rest) if rest.shape[1] else None
        self.write_into(slots, key[:, :, :k], value[:, :, :k], positions[:k])
        store.order = None
        if k < key.shape[2]:
            slots = torch.cat([slots, self.write_end(key[:, :, k:], value[:, :, k:], positions[k:])], dim=1)
        book.written = slots

    def write_into(
        self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """New tokens `(1, Hkv, k, D)` at `positions` `(k,)` into freed `slots` `(Hkv, k)` (`free` already
        zeroed their abar and nobs)."""
        store = self.store
        heads = torch.arange(slots.shape[0], device=slots.device)[:, None] + self.rows.start
        store.buffers["pos"][heads, slots] = positions
        store.buffers["valid"][heads, slots] = True
        self.write_states(slots, key, value, positions)
        for t in store.extra.values():
            t[heads, slots] = 0

    def write_end(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """New tokens `(1, Hkv, q, D)` after the slots in use (growing the buffers if needed); returns their
        slots `(Hkv, q)`."""
        store, book = self.store, self.book
        if len(range(*self.rows.indices(store.rows))) != store.rows:
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
            torch.cat([store.order, new], dim=1)
            if store.order is not None and self.book.holes is None and not self.book.pad
            else None
        )
        store.n = need
        self.write_states(new, key, value, positions)
        book.written = new
        return new

    def write_states(
        self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """New tokens' keys and values `(1, Hkv, q, D)` into `slots` `(Hkv, q)` (`SlotStore.write_states`);
        the layer keeps them as fed when its store holds them otherwise (`LayerBook.fresh`)."""
        self.book.fresh = self.store.write_states(self.rows, slots, key, value, positions)
