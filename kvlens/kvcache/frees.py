"""Slots leaving one layer's rows (`SlotRows.free`): named by index into a list of holes that later tokens
refill, or marked and freed where they lie; and the layouts a free may call for (fitted, paged, compacted).

Listed holes (`LayerBook.holes`) keep the order the slots were freed in, so a refilled slot keeps a position
order valid (the eviction policies with a budget). A compacting layer (`LayerBook.compacts`: no budget, CORM)
given marked slots frees them in place instead (`LayerBook.in_place`): their statistics are cleared where they
lie and the next token takes each head's lowest free slot (`kvlens.kvcache.tokens`), with no list to keep.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvlens.kvcache.quantize import slot_mask
from kvlens.kvcache.store import (
    GROWTH,
    HOLES,
    STATS,
    LayerBook,
    SlotStore,
    freed,
    padded_index,
    padded_slots,
    without,
)


class SlotRows(Protocol):
    """What a free reads and changes of the rows it is given (`kvlens.kvcache.views.SlotRows`)."""

    books: list[LayerBook]
    store: SlotStore | None
    rows: slice
    valid: torch.Tensor  # (R, n) bool

    @property
    def padded(self) -> bool: ...
    @property
    def n_slots(self) -> int: ...
    def whole_store(self) -> bool: ...
    def retain(
        self, index: torch.Tensor, valid: torch.Tensor | None = None, capacity: int | None = None
    ) -> None: ...


def free(view: SlotRows, index: torch.Tensor) -> None:
    """Evict slots `index` `(R, E)` of `view` (-1 entries pad rows that free fewer), or those marked `(R, S)`
    bool. Marked slots of a layer that `frees_in_place` go to `free_marked`, as does every later free of
    that layer; the others become listed holes (`free_listed`)."""
    if index.dtype == torch.bool:
        if frees_in_place(view):
            free_marked(view, index)
            return
        index = padded_slots(index)
    elif view.books[0].in_place:
        free_marked(view, slot_mask(index, view.n_slots))
        return
    free_listed(view, index)


def frees_in_place(view: SlotRows) -> bool:
    """Whether marked slots can be freed in place (`LayerBook.in_place`): one compacting layer whose keys
    and values are plain buffers (not packed, where a slot's place decides its quantization group; not in
    pages)."""
    store = view.store
    assert store is not None
    return len(view.books) == 1 and view.books[0].compacts and store.lossless and not store.tail_padding


def free_marked(view: SlotRows, gone: torch.Tensor) -> None:
    """The slots marked in `gone` `(R, n)` leave a layer that `frees_in_place`: their statistics are cleared
    where they lie; the layer is compacted once mostly holes (`HOLES`)."""
    store, (book,) = view.store, view.books
    assert store is not None
    clear(view, store, gone)
    store.order = None
    recount(book, view.valid.sum(-1))
    book.holes, book.in_place = None, True
    if holey(book, store):
        relayout(view, book.n_kept + GROWTH)


def free_listed(view: SlotRows, index: torch.Tensor) -> None:
    """Slots `index` `(R, E)` (-1 pads) leave; each layer lists them as holes, in the order freed.

    When the slots in use exceed a layer's `limit` (the prompt's cache after its first compression), the
    kept slots move into buffers of `limit` slots (or of its fullest head's count, when heads keep different
    counts) and the old ones are released. Once fitted, a layer whose fullest head outgrows the limit is
    refitted only when its free slots exceed `GROWTH`, not at every step. A layer whose heads come to keep
    different counts moves into pages when its book says so (`LayerBook.paged`). A layer whose slots in use
    are mostly freed ones (a budget-free policy frees in place, and tokens refill one per step) is compacted,
    when its book says so (`LayerBook.compacts`), to its kept slots once they exceed `HOLES` times its
    fullest head's count, so a step attends to the kept slots, not the prompt's.
    """
    store = view.store
    assert store is not None
    uneven = bool((index < 0).any())
    store.forget(view.rows, index)
    if uneven:
        clear(view, store, slot_mask(index, store.n))
    else:
        for name, fill in STATS.items():
            store.buffers[name][view.rows].scatter_(1, index, fill)
    if store.order is not None and view.whole_store() and not view.padded and not uneven:
        store.order = without(store.order, index)
    else:
        store.order = None
    counts = view.valid.sum(-1).chunk(len(view.books)) if uneven else ()
    for i, (book, part) in enumerate(zip(view.books, index.chunk(len(view.books)), strict=True)):
        if store.tail_padding:  # a paged row's free slots are its invalid ones, refilled lowest first
            book.holes = freed(part, ~view.valid.chunk(len(view.books))[i])
        elif book.holes is None and not uneven:  # every row frees as many: already in order
            book.holes = part
        else:
            book.holes = freed(part if book.holes is None else torch.cat([book.holes, part], dim=1), None)
        if uneven:
            recount(book, counts[i])
        else:
            book.n_kept -= part.shape[1]
    (book, *more), limit = view.books, view.books[0].limit
    if more:
        return
    outgrown = limit is not None and store.n > limit and (not book.fitted or store.n > book.n_kept + GROWTH)
    to_pages = book.pad and book.paged and not store.tail_padding
    if outgrown or to_pages:
        relayout(view, limit)
    elif book.compacts and holey(book, store):
        relayout(view, book.n_kept + GROWTH)  # room to grow


def clear(view: SlotRows, store: SlotStore, gone: torch.Tensor) -> None:
    """The statistics of the slots marked in `gone` `(R, n)` become a free slot's (`STATS`)."""
    for name, fill in STATS.items():
        store.buffers[name][view.rows, : store.n].masked_fill_(gone, fill)


def recount(book: LayerBook, counts: torch.Tensor) -> None:
    """A layer's kept count and padding from its heads' valid slots `counts` `(Hkv,)`."""
    book.n_kept, book.pad = int(counts.max()), book.pad or bool((counts != counts[0]).any())


def holey(book: LayerBook, store: SlotStore) -> bool:
    """Whether a layer's slots in use are mostly freed ones: more than `HOLES` times its fullest head's kept
    count + `GROWTH` (a compacting layer is then laid out again)."""
    return store.n > HOLES * book.n_kept + GROWTH


def relayout(view: SlotRows, capacity: int | None) -> None:
    """Lay one layer's kept slots out again in `capacity` slots (`SlotRows.retain`), padding the heads that
    keep fewer."""
    kept, valid = padded_index(view.valid)
    padding = valid if bool((~valid).any()) else None
    view.retain(kept, padding, capacity=capacity)
