"""Slot storage: `SlotStore`, the buffers of R rows (KV heads) x C slots behind the cache's views.

Keys and values `(1, R, C, D)` after RoPE, and per slot `pos` (original position, -1 when free), `abar`
(attention accumulated over every query that saw the slot, prefill rows included; a KV head's is the mean of
its query heads'), `nobs` (queries that observed it) and `valid` (False for free slots and for the padding of
heads that keep fewer slots), all `(R, C)`, plus policy statistics `extra` `(R, C, ...)` that travel with
their slots. Slots past the ones in use and freed slots hold zero `abar` and `nobs`. Compressed storage of the
keys and values is a `CopyingStore` (pages: `kvlens.kvcache.paged.PagedStore`; quantized, low-rank or
channel-pruned: `kvlens.kvcache.quantized.PackedStore`); `SlotStore` holds them in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

GROWTH = 32  # minimum slots added when a growing cache runs out of room
HOLES = 1.25  # compacted: a layer using more slots than this times its fullest head's kept ones + GROWTH
FITTED_GROWTH = 8  # slots added when a fitted layer's fullest head outgrows its buffers (uneven heads)
STATS = {"valid": False, "pos": -1, "abar": 0.0, "nobs": 0.0}  # per-slot statistics, and a free slot's
STATES = ("keys", "values")  # (1, R, C, D); every other buffer is (R, C, ...)


def slot_axis(name: str) -> int:
    """The slot dimension of buffer `name`: 2 for keys and values `(1, R, C, D)`, else 1."""
    return 1 + (name in STATES)


@dataclass
class LayerBook:
    """One layer's bookkeeping beside its rows' buffers."""

    layer: int
    limit: int | None = None  # most slots this layer will need (its budget + 1, or the run's length)
    state: dict[str, Any] = field(default_factory=dict)  # the policy's run state for this layer
    n_kept: int = 0  # valid slots of the fullest KV head
    holes: torch.Tensor | None = None  # (Hkv, E) slots freed by `free`, to be reused first
    pad: bool = False  # `retain` left padding (heads keeping different counts): each head's own free slots
    fitted: bool = False  # `retain` fitted the buffers to the kept slots (the prompt's memory is freed)
    paged: bool = False  # a padded layout goes into pages (`kvlens.kvcache.paged`)
    compacts: bool = False  # freed in place (no budget): laid out again once mostly holes (`HOLES`)
    # its free slots are its invalid ones below `n`, refilled lowest first, with no list of holes: set once
    # marked slots are freed on a compacting layer (`SlotRows.free` given a mask)
    in_place: bool = False
    written: torch.Tensor | None = None  # (Hkv, q) the slots the latest `append` wrote
    # quantized storage: the latest `append`'s keys and values (Hkv, q, D) as fed
    fresh: tuple[torch.Tensor, torch.Tensor] | None = None
    last_attn: torch.Tensor | None = None  # (Hq, S) the latest query's attention


class SlotStore:
    """Buffers of R rows x C slots (see the module docstring) and the count `n` of slots in use."""

    # paged: `retain` puts a row's padding after its kept slots, and freed slots are reused lowest first
    tail_padding = False
    lossless = True  # keys and values read back exactly as written (not quantized, low-rank or pruned)

    def __init__(self, buffers: dict[str, torch.Tensor], n: int):
        self.buffers = buffers  # keys/values (1, R, C, D) unless packed, pos/abar/nobs/valid (R, C)
        self.extra: dict[str, torch.Tensor] = {}  # name -> (R, C, ...)
        self.n = n
        self.order: torch.Tensor | None = None  # (R, n) slots in position order, when known

    @property
    def capacity(self) -> int:
        return self.buffers["pos"].shape[1]

    @property
    def rows(self) -> int:
        return self.buffers["pos"].shape[0]

    def empty_like(self, rows: int, capacity: int) -> SlotStore:
        """A store of `rows` x `capacity` free slots with this one's buffers and storage (none in use)."""
        return SlotStore(empty_buffers(self.buffers, rows, capacity), 0)

    def names(self) -> list[str]:
        """Every per-slot tensor the store holds: keys, values and the statistics."""
        return list(self.buffers)

    def states(self, name: str, rows: slice) -> torch.Tensor:
        """Keys or values `(1, R', n, D)` of `rows`: a view of the buffer."""
        return self.buffers[name][:, rows, : self.n]

    def read(self, name: str, rows: slice) -> torch.Tensor:
        """Keys or values `(1, R', n, D)` of `rows` for attention, which changes nothing: `states` unless a
        store keeps working copies (it then reads without keeping one)."""
        return self.states(name, rows)

    def commit(self, name: str | None = None) -> None:
        """Store what a policy changed in the keys and values it read: nothing to do, it changed the
        buffers."""

    def write_states(
        self,
        rows: slice,
        slots: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """New tokens' keys and values `(1, R', q, D)` at `positions` `(q,)` into `slots` `(R', q)` of `rows`;
        returns them `(R', q, D)` as fed when the store holds them otherwise (None: as fed)."""
        heads = torch.arange(slots.shape[0], device=slots.device)[:, None] + rows.start
        for name, x in (("keys", key), ("values", value)):
            self.buffers[name][0, heads, slots] = x[0]
        return None

    def forget(self, rows: slice, index: torch.Tensor) -> None:
        """Slots `index` `(R', E)` of `rows` were freed (-1 entries name none): nothing else holds them."""

    def take(
        self, rows: slice, old: SlotStore, old_rows: slice, index: torch.Tensor, kept: dict[str, torch.Tensor]
    ) -> None:
        """`rows` (empty) receive `old`'s slots `index` `(R', S)` of `old_rows`, whose tensors are `kept`: the
        buffers are copied by the view; nothing else to fill."""

    def snapshot(self) -> object:
        """What `restore` needs to bring the storage outside the buffers back (none here)."""
        return None

    def restore(self, saved: object) -> None:
        """Undo what happened to the storage outside the buffers since `snapshot` (none here)."""

    def resize(self, capacity: int) -> None:
        """Reallocate every buffer to `capacity` slots, keeping the slots in use."""
        n = self.n
        for group in (self.buffers, self.extra):
            for name, t in group.items():
                axis = 1 + (name in STATES and group is self.buffers)  # extras are (R, C, ...)
                shape = list(t.shape)
                shape[axis] = capacity
                new = t.new_zeros(shape)
                new.narrow(axis, 0, n).copy_(t.narrow(axis, 0, n))
                group[name] = new

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` more tokens once no slot is freed any more: the buffers sized to hold exactly
        them beside the fullest row's kept slots (the others' free slots take theirs first)."""
        need = int(self.buffers["valid"][:, : self.n].sum(-1).max()) + tokens  # n = 0: 0 + tokens
        if need > self.capacity:
            self.resize(need)

    def nbytes(self, rows: slice) -> int:
        """Bytes allocated for the keys and values of `rows`."""
        count = len(range(*rows.indices(self.rows)))
        return sum(
            t.numel() // t.shape[1] * count * t.element_size() for n, t in self.buffers.items() if n in STATES
        )


class CopyingStore(SlotStore):
    """A `SlotStore` holding keys or values outside its buffers (pages, packed storage): a policy that
    reads them (`states`) gets a working copy `(1, R', n, D)` gathered from there, and `commit` stores back
    the valid slots it changed, then drops the copy; attention's `read` gathers without keeping one. A
    subclass says how to gather (`_gather`) and to store the changed slots (`_store_changed`)."""

    def __init__(self, buffers: dict[str, torch.Tensor], n: int):
        super().__init__(buffers, n)
        self.working: dict[tuple[str, int, int], torch.Tensor] = {}  # (name, first row, end row) -> copy

    def _gather(self, name: str, rows: slice) -> torch.Tensor:
        """`(R', n, D)`: the slots in use of `rows` (a slice with a start and a stop)."""
        raise NotImplementedError

    def _store_changed(self, name: str, rows: slice, copy: torch.Tensor, changed: torch.Tensor) -> None:
        """Store the `changed` `(R', n)` valid slots of `copy` `(R', n, D)`."""
        raise NotImplementedError

    def states(self, name: str, rows: slice) -> torch.Tensor:
        """Keys or values `(1, R', n, D)` of `rows`: a view of the buffer, else the rows' working copy."""
        if name in self.buffers:
            return super().states(name, rows)
        start, stop, _ = rows.indices(self.rows)
        key = (name, start, stop)
        if key not in self.working:
            self.commit(name)
            self.working[key] = self._gather(name, slice(start, stop))[None]
        return self.working[key]

    def read(self, name: str, rows: slice) -> torch.Tensor:
        """Keys or values `(1, R', n, D)` of `rows` for attention: the working copy when a policy holds one,
        else gathered and not kept (nothing to commit)."""
        if name in self.buffers:
            return super().states(name, rows)
        start, stop, _ = rows.indices(self.rows)
        copy = self.working.get((name, start, stop))
        return copy if copy is not None else self._gather(name, slice(start, stop))[None]

    def commit(self, name: str | None = None) -> None:
        """Store the valid slots changed in the working copies (of `name`, or all) and drop the copies."""
        for key in [k for k in self.working if name is None or k[0] == name]:
            copy = self.working.pop(key)[0]
            rows = slice(key[1], key[2])
            if copy.shape[1] != self.n:
                continue  # the slots in use changed since (a rewind): nothing a policy wrote
            stored = self._gather(key[0], rows)
            changed = (copy != stored).any(-1) & self.buffers["valid"][rows, : self.n]
            if bool(changed.any()):
                self._store_changed(key[0], rows, copy, changed)


def empty_buffers(buffers: dict[str, torch.Tensor], rows: int, capacity: int) -> dict[str, torch.Tensor]:
    """Free buffers of `rows` x `capacity` slots shaped and typed like `buffers`."""
    return {
        name: t.new_full(
            (1, rows, capacity, t.shape[-1]) if name in STATES else (rows, capacity), STATS.get(name, 0)
        )
        for name, t in buffers.items()
    }


def first_valid(holes: torch.Tensor) -> torch.Tensor | None:
    """Freed slots `(Hkv, E)` with each row's real ones (not -1) first, in order; columns of -1 dropped."""
    if not bool((holes < 0).any()):
        return holes
    return trimmed(holes.gather(1, torch.sort((holes < 0).int(), dim=1, stable=True).indices))


def trimmed(holes: torch.Tensor) -> torch.Tensor | None:
    """Freed slots `(Hkv, E)` already with each row's real ones first: the columns no row uses dropped (None
    when none is left)."""
    width = int((holes >= 0).sum(-1).max())
    return holes[:, :width] if width else None


def freed(holes: torch.Tensor, free: torch.Tensor | None) -> torch.Tensor | None:
    """Rows' freed slots `(R, E)` (-1 entries name none) as they will refill them: in slot order when `free`
    `(R, n)` bool marks every free slot in use (a paged row's: each is one), listed from that mask in O(n)
    with no sort; else the slots `holes` in the order they were freed (`first_valid`). None when there are
    none."""
    if free is None:
        return first_valid(holes)
    return listed(free)


def listed(free: torch.Tensor) -> torch.Tensor | None:
    """The slots marked in `free` `(R, n)` bool as holes, each row's in slot order `(R, E)` (-1 pads), in O(n)
    with no sort; None when there are none."""
    slots = padded_slots(free)
    return slots if slots.shape[1] else None


def without(order: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A position order `order` `(R, S)` after slots `index` `(R, E)` are freed: the rest in their order,
    then the freed slots in the order they were freed (refilled first, by the newest tokens). One freed slot
    per row (a decode step) is found by comparison, not a boolean mask."""
    if index.shape[1] == 1:
        place = (order == index).int().argmax(-1, keepdim=True)  # (R, 1) its place in the order
        stay = torch.arange(order.shape[1] - 1, device=order.device).expand(order.shape[0], -1)
        return torch.cat([order.gather(1, stay + (stay >= place)), index], dim=1)
    gone = torch.zeros(order.shape, dtype=torch.bool, device=index.device).scatter_(1, index, True)
    left = torch.gather(gone, 1, order)
    return torch.cat([order[~left].view(left.shape[0], -1), index], dim=1)


def padded_slots(gone: torch.Tensor) -> torch.Tensor:
    """`gone` `(R, S)` bool -> each row's marked slots `(R, E)`, ascending, -1 padded (for `free`).

    Each marked slot's place is its rank among its row's marks (a running count), so the slots are scattered
    into place in O(S), with no sort; the unmarked ones all land in one spare column, dropped."""
    r, s = gone.shape
    width = int(gone.sum(-1).max())  # 0 when s = 0 (R >= 1 rows)
    place = torch.where(gone, gone.cumsum(-1) - 1, width)  # (R, S): a mark's rank, else the spare column
    slots = torch.full((r, width + 1), -1, dtype=torch.long, device=gone.device)
    slots.scatter_(1, place, torch.arange(s, device=gone.device).expand(r, s))
    return slots[:, :width]


def padded_index(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`keep` `(R, S)` bool -> ascending slot index `(R, n)` and valid `(R, n)`, n = the largest count:
    rows that keep fewer are padded with their oldest dropped slots, marked invalid (for `retain`)."""
    counts = keep.sum(-1, keepdim=True)  # (R, 1)
    n = int(counts.max())
    dropped_rank = (~keep).long().cumsum(-1)
    select = keep | (~keep & (dropped_rank <= n - counts))
    index = select.nonzero()[:, 1].view(keep.shape[0], n)
    return index, torch.gather(keep, 1, index)
