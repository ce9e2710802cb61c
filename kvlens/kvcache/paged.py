"""`PagedStore`: a slot store whose keys and values live in pages, so heads that keep different counts
(Ada-KV, KVzip) hold their own slots only, not a layout padded to the layer's fullest head.

Keys and values are each a pool of pages `(P, PAGE, D)`; a page table `(R, ceil(C / PAGE))` names the page
of each row's slots s .. s + PAGE - 1 (-1: none allocated), so slot s of row r is entry s % PAGE of page
`table[r, s // PAGE]`. Page 0 holds zeros and is never allocated: an entry of -1 reads it. The statistics
(`pos`, `abar`, `nobs`, `valid`, `extra`) stay `(R, C)` buffers.

- Reading (`kvlens.kvcache.store.CopyingStore`): attention's reads are gathered `(1, R', n, D)` and not kept;
  a policy reading keys or values gets a working copy (zeros where no page is allocated), and `commit` writes
  back the valid slots it changed there, then drops the copy.
- Writing a slot allocates its page; when none is spare, the pages none of whose slots is valid are
  reclaimed first. The pool grows by at least one page per row and never shrinks: `nbytes` counts all of it,
  page 0 included.
- `SlotRows.retain` lays a paged row out with its kept slots first, so a head's padding needs no page; a
  layer's store becomes paged there (`LayerBook.paged`).
- Once nothing leaves (a policy that compresses the prompt only), `reserve` lays each row's pages out as one
  run of the pool with pages for the tokens to come: a decode step's attention then reads each head's keys
  and values in place (`segment`, `kvlens.engine.attention.decode_segments`), with no gather.
"""

from __future__ import annotations

import torch

from kvlens.kvcache.store import STATES, CopyingStore, SlotStore, empty_buffers

PAGE = 4  # slots per page: a head's own budget wastes 1.5 slots on average (3.5 at 8, 0.6 % of a 1024-token
# prompt's bytes at half budget); decode steps read 4-slot pages no slower than 8-slot ones


class PagedStore(CopyingStore):
    """A `CopyingStore` (module docstring) with `pools`: name ("keys"/"values") -> `(P, PAGE, D)`, and `table`
    `(R, ceil(C / PAGE))` page ids."""

    tail_padding = True

    def __init__(self, buffers: dict[str, torch.Tensor], n: int, pools: dict[str, torch.Tensor]):
        super().__init__(buffers, n)
        self.pools = pools
        self.table = torch.full((self.rows, _pages(self.capacity)), -1, device=buffers["pos"].device)
        self.spare: list[int] = []  # released page ids, reused first (page 0 holds zeros, never allocated)
        self.segments: list[tuple[int, int]] | None = (
            None  # `reserve`'s layout: each row's (first entry, pages)
        )

    @classmethod
    def like(cls, store: SlotStore, rows: int, capacity: int) -> PagedStore:
        """An empty paged store of `rows` x `capacity` slots with `store`'s statistics, dtype, head size."""
        stats = {k: t for k, t in store.buffers.items() if k not in STATES}
        pools = {}
        for name in STATES:
            x = store.states(name, slice(0, 1))
            pools[name] = x.new_zeros((1, PAGE, x.shape[-1]))
        return cls(empty_buffers(stats, rows, capacity), 0, pools)

    def empty_like(self, rows: int, capacity: int) -> PagedStore:
        return PagedStore(
            empty_buffers(self.buffers, rows, capacity),
            0,
            {name: p.new_zeros((1, *p.shape[1:])) for name, p in self.pools.items()},
        )

    def names(self) -> list[str]:
        return [*self.buffers, *STATES]

    def _gather(self, name: str, rows: slice) -> torch.Tensor:
        """`(R', n, D)` of `rows` gathered from the pages (page 0, zeros, where none is allocated)."""
        table = self._page_ids(rows)
        pool = self.pools[name]
        pages = pool.index_select(0, table.flatten())  # (R' * T, PAGE, D): faster than indexing with `table`
        return pages.view(table.shape[0], -1, pool.shape[-1])[:, : self.n]

    def _page_ids(self, rows: slice) -> torch.Tensor:
        """`(R', T)` the pages of `rows`' first n slots (page 0, zeros, where none is allocated)."""
        return self.table[rows, : _pages(self.n)].clamp(min=0)

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` more slots per row once nothing leaves (a policy done with the prompt):
        each row's pages laid out one after another in a new pool, followed by pages for its `tokens` next
        slots, so that its slots 0 .. n_r - 1 are entries `segments[r][0]` .. + n_r - 1 of the flat pool
        (`segment`), read with no gather. Needs each row's valid slots first (`retain`'s layout); nothing
        changes otherwise."""
        self.commit()
        valid = self.buffers["valid"][:, : self.n]
        counts = valid.sum(-1)
        if not bool((valid == (torch.arange(self.n, device=valid.device) < counts[:, None])).all()):
            return
        pages = -(-(counts + tokens) // PAGE)  # (R,)
        starts = 1 + pages.cumsum(0) - pages  # page 0 holds zeros
        capacity = int(pages.max()) * PAGE
        if capacity > self.capacity:
            super().resize(capacity)
        col = torch.arange(_pages(self.capacity), device=pages.device)[None]
        table = torch.where(col < pages[:, None], starts[:, None] + col, -1)
        old = torch.nn.functional.pad(self.table, (0, table.shape[1] - self.table.shape[1]), value=-1)
        moved = (old >= 0) & (table >= 0)
        for name, pool in self.pools.items():
            new = pool.new_zeros((1 + int(pages.sum()), *pool.shape[1:]))
            new[table[moved]] = pool[old[moved]]
            self.pools[name] = new
        self.table, self.spare = table, []
        self.segments = list(zip((starts * PAGE).tolist(), pages.tolist(), strict=True))

    def flat_pool(self, name: str) -> torch.Tensor:
        """The pool of `name` as `(P * PAGE, D)` (a view)."""
        pool = self.pools[name]
        return pool.view(-1, pool.shape[-1])

    def segment(self, name: str, row: int, n: int) -> torch.Tensor:
        """`(n, D)` keys or values of `row`'s first n slots, a view of the pool laid out by `reserve`."""
        if self.segments is None:
            raise RuntimeError("kvlens: a paged store's rows are segments only after `reserve`")
        start, pages = self.segments[row]
        if n > pages * PAGE:
            raise RuntimeError(f"kvlens: row {row} holds {pages * PAGE} reserved slots, not {n}")
        return self.flat_pool(name)[start : start + n]

    def _store_changed(self, name: str, rows: slice, copy: torch.Tensor, changed: torch.Tensor) -> None:
        r, s = changed.nonzero(as_tuple=True)
        self._write(r + rows.start, s, {name: copy[r, s]})

    def _write(self, r: torch.Tensor, s: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
        """Slots `s` `(k,)` of rows `r` `(k,)` get `states` (name -> `(k, D)`), their pages allocated first
        when needed."""
        col = s // PAGE
        page = self.table[r, col]
        missing = page < 0
        if bool(missing.any()):
            self._allocate(torch.unique(r[missing] * self.table.shape[1] + col[missing]), page[~missing])
            page = self.table[r, col]
        at = s % PAGE
        for name, x in states.items():
            self.pools[name][page, at] = x

    def _allocate(self, where: torch.Tensor, writing: torch.Tensor) -> None:
        """A page for each entry of the table named in `where` `(k,)` (row x columns + column): a spare one,
        else one reclaimed (`_reclaim`; not the pages `writing` `(w,)` the same write fills), else the pool
        grows."""
        k = where.shape[0]
        self.segments = None  # a page outside the reserved layout
        if len(self.spare) < k:
            self._reclaim(writing)
        if len(self.spare) < k:
            size = self.pools["keys"].shape[0]
            grow = max(k - len(self.spare), self.rows)
            for name, pool in self.pools.items():
                self.pools[name] = torch.cat([pool, pool.new_zeros((grow, *pool.shape[1:]))])
            self.spare.extend(range(size, size + grow))
        ids, self.spare = self.spare[:k], self.spare[k:]
        page = torch.tensor(ids, device=self.table.device)
        for pool in self.pools.values():
            pool[page] = 0
        self.table.view(-1)[where] = page

    def _reclaim(self, writing: torch.Tensor) -> None:
        """The pages none of whose slots is valid (their slots freed since they were written) become spare,
        except those in `writing` `(w,)`. Freeing slots releases nothing by itself: a decode step's eviction
        is refilled by the next token, so pages are looked for only when one is needed."""
        held = torch.nn.functional.pad(
            self.buffers["valid"][:, : self.n], (0, self.table.shape[1] * PAGE - self.n)
        )
        empty = (self.table >= 0) & ~held.view(*self.table.shape, PAGE).any(-1)
        empty &= ~torch.isin(self.table, writing)
        if bool(empty.any()):
            self.spare.extend(self.table[empty].tolist())
            self.table.masked_fill_(empty, -1)

    def write_states(
        self,
        rows: slice,
        slots: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """New tokens' keys and values `(1, R', q, D)` into `slots` `(R', q)` of `rows`."""
        self.commit()
        r = (torch.arange(slots.shape[0], device=slots.device)[:, None] + rows.start).expand_as(slots)
        self._write(
            r.flatten(), slots.flatten(), {"keys": key[0].flatten(0, 1), "values": value[0].flatten(0, 1)}
        )

    def take(
        self, rows: slice, old: SlotStore, old_rows: slice, index: torch.Tensor, kept: dict[str, torch.Tensor]
    ) -> None:
        """The kept valid slots' keys and values (`kept`, `(1, R', S, D)`) into pages; padding gets none."""
        r, s = kept["valid"].nonzero(as_tuple=True)
        self._write(r + rows.start, s, {name: kept[name][0][r, s] for name in STATES})

    def snapshot(self) -> torch.Tensor:
        self.commit()
        return self.table.clone()

    def restore(self, saved: object) -> None:
        """The page table of `snapshot`: pages allocated since are released (the appends since only wrote
        slots that were free then)."""
        if not isinstance(saved, torch.Tensor):
            raise TypeError("kvlens: a paged store restores a page table")
        self.working.clear()
        self.segments = None
        self.table = torch.nn.functional.pad(saved, (0, self.table.shape[1] - saved.shape[1]), value=-1)
        held = set(self.table[self.table >= 0].tolist())
        self.spare = [p for p in range(1, self.pools["keys"].shape[0]) if p not in held]

    def resize(self, capacity: int) -> None:
        super().resize(capacity)
        self.table = torch.nn.functional.pad(
            self.table, (0, _pages(capacity) - self.table.shape[1]), value=-1
        )

    def nbytes(self, rows: slice) -> int:
        """Bytes of the whole pool (spare pages included) for every row, else of the pages `rows` hold."""
        pages = (
            self.pools["keys"].shape[0]
            if len(range(*rows.indices(self.rows))) == self.rows
            else int((self.table[rows] >= 0).sum())
        )
        return pages * sum(PAGE * p.shape[-1] * p.element_size() for p in self.pools.values())


def _pages(capacity: int) -> int:
    return -(-capacity // PAGE)
