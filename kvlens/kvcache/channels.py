"""Channel-pruned key storage: each KV head's keys stored as its kept channels only (ThinK).

Xu et al. 2024, "ThinK: Thinner Key Cache by Query-Driven Pruning", https://arxiv.org/abs/2407.21018: a KV
head keeps K of its D key channels (`kvlens.policies.think` chooses them); a slot's key costs K numbers
instead of D, plus the channel indices per head. Attention with a pruned key is the query restricted to the
kept channels: a decode step's attention computes its logits there (`logits`, no key rebuilt); `read` puts
zeros in the pruned ones, which add nothing to q.k. Some slots keep their whole key: the prompt's newest ones
and every later token, as the authors' code keeps its recent window and the tokens it generates unpruned;
their pruned channels are held apart (`whole`), so such a slot costs D numbers in all.

`ChannelStates` holds the keys of R rows x C slots: the kept channels `(R, C, K)` in the model's dtype,
each row's channels `(R, D)` (long: the K kept ones ascending, then the pruned ones ascending) and the
pruned channels of whole keys `(R, W, D - K)` with their slots `(R, W)` (-1: an empty entry; W grows as
tokens arrive). It is a `kvlens.kvcache.packed.PackedStates`, so the cache treats it like the other packed
storages (`kvlens.kvcache.quantized.PackedStore`).
"""

from __future__ import annotations

import torch

from kvlens.kvcache.packed import PackedStates, follow, leaving
from kvlens.kvcache.quantize import slot_mask

GROWTH = 8  # whole-key entries added when every one is taken


class ChannelStates(PackedStates):
    """A store's keys with each row's kept channels only (module docstring)."""

    def __init__(self, order: torch.Tensor, k: int, capacity: int, dtype: torch.dtype):
        r, d = order.shape
        self.dim, self.k, self.dtype = d, k, dtype
        self.order = order  # (R, D): kept channels, then pruned ones
        self.kept = torch.zeros(r, capacity, k, dtype=dtype, device=order.device)
        self.whole = torch.zeros(r, 0, d - k, dtype=dtype, device=order.device)
        self.whole_slot = torch.full((r, 0), -1, dtype=torch.long, device=order.device)

    def empty(self, rows: int, capacity: int) -> ChannelStates:
        """Storage of the same kind for `rows` rows of `capacity` free slots (channels come with `take`)."""
        return ChannelStates(self.order.new_zeros(rows, self.dim), self.k, capacity, self.dtype)

    @property
    def channels(self) -> torch.Tensor:
        """`(R, K)` each row's kept channels, ascending."""
        return self.order[:, : self.k]

    @property
    def capacity(self) -> int:
        return self.kept.shape[1]

    def resize(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        old = self.kept
        self.kept = old.new_zeros(old.shape[0], capacity, old.shape[2])
        self.kept[:, : old.shape[1]] = old

    def nbytes(self, rows: int) -> int:
        """Bytes of `rows` rows: the kept channels, the channel indices and the whole keys' pruned
        channels."""
        return rows * sum(t[0].numel() * t.element_size() for t in (self.kept, self.order, self.whole))

    def _index(self, rows: slice, n: int, kept: bool = True) -> torch.Tensor:
        """`(R', n, K)` the rows' kept channels for n slots each (`kept=False`: the pruned ones, `(R', n, D -
        K)`)."""
        order = self.order[rows]
        return (order[:, : self.k] if kept else order[:, self.k :])[:, None, :].expand(-1, n, -1)

    # -- the storage interface (`PackedStates`') ---------------------------------------------------------
    def read(self, rows: slice, n: int) -> torch.Tensor:
        """`(R', n, D)` the rows' first `n` slots: the kept channels, zeros elsewhere; whole keys as they
        are."""
        kept = self.kept[rows, :n]
        out = kept.new_zeros(kept.shape[0], n, self.dim).scatter_(2, self._index(rows, n), kept)
        slot = self.whole_slot[rows]
        r, e = (slot >= 0).nonzero(as_tuple=True)
        out[r[:, None], slot[r, e][:, None], self.order[rows][r, self.k :]] = self.whole[rows][r, e]
        return out

    def logits(self, rows: slice, n: int, query: torch.Tensor) -> torch.Tensor:
        """`(R', G, n)` float32 each query's dot product with the rows' first `n` keys, on the kept channels
        plus, for whole keys, the pruned ones: what `read`'s keys give, with no key rebuilt (the paper's
        attention on the pruned cache). `query` `(R', G, D)`: each row's group of query heads."""
        order = self.order[rows][:, None, :].expand(-1, query.shape[1], -1)
        kept = self.kept[rows, :n].to(query.dtype)
        out = torch.bmm(torch.gather(query, 2, order[..., : self.k]), kept.transpose(1, 2)).float()
        slot = self.whole_slot[rows]
        if not slot.numel():
            return out
        whole = torch.bmm(torch.gather(query, 2, order[..., self.k :]), self.whole[rows].to(query.dtype).mT)
        spare = out.new_zeros(out.shape[0], out.shape[1], 1)  # where the empty entries (-1) land
        at = slot.masked_fill(slot < 0, n)[:, None, :].expand(-1, query.shape[1], -1)
        return torch.cat([out, spare], 2).scatter_add_(2, at, whole.float())[..., :n]

    def in_window(self, rows: slice, n: int) -> torch.Tensor:
        """`(R', n)` bool: the slots whose whole key is stored."""
        return slot_mask(self.whole_slot[rows], n)

    def roundtrip(self, rows: slice, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`x` `(R', n, D)` as this storage holds it: the pruned channels zero, except for whole keys."""
        n = x.shape[1]
        mask = torch.zeros_like(x, dtype=torch.bool).scatter_(2, self._index(rows, n), True)
        return torch.where(mask | self.in_window(rows, n)[..., None], x, 0)

    def write(self, rows: slice, x: torch.Tensor, changed: torch.Tensor, valid: torch.Tensor) -> None:
        """Store the `changed` `(R', n)` slots of `x` `(R', n, D)`: whole where the slot's key is, else its
        kept channels."""
        n = x.shape[1]
        slot = self.whole_slot[rows]
        if slot.numel():
            safe = slot.clamp(min=0, max=n - 1)
            hit = (slot >= 0) & torch.gather(changed, 1, safe)
            pruned = torch.gather(
                torch.gather(x, 1, safe[..., None].expand(-1, -1, self.dim)),
                2,
                self._index(rows, slot.shape[1], kept=False),
            )
            self.whole[rows] = torch.where(hit[..., None], pruned.to(self.dtype), self.whole[rows])
        kept = torch.gather(x, 2, self._index(rows, n)).to(self.dtype)
        self.kept[rows, :n] = torch.where(changed[..., None], kept, self.kept[rows, :n])

    def take(
        self,
        rows: slice,
        other: ChannelStates,
        other_rows: slice,
        index: torch.Tensor,
        x: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:
        """Fill `rows` (empty) with `other`'s slots `index` `(R', S)` of `other_rows`, whose keys are `x`
        `(R', S, D)`: the rows keep their channels, whole keys follow their slots."""
        self.order[rows] = other.order[other_rows]
        old = other.whole_slot[other_rows]
        if old.numel():
            self._room(old.shape[1])
            self.whole_slot[rows, : old.shape[1]] = follow(old, index)
            self.whole[rows, : old.shape[1]] = other.whole[other_rows]
        valid = valid[:, : index.shape[1]]
        self.write(rows, x, valid.clone(), valid)

    def forget(self, rows: slice, gone: torch.Tensor) -> None:
        """Freed slots `gone` `(R', n)` bool give back their whole-key entries."""
        slot = self.whole_slot[rows]
        if slot.numel():
            self.whole_slot[rows] = slot.masked_fill(leaving(slot, gone), -1)

    def append(
        self, rows: slice, slots: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """New tokens `x` `(R', q, D)` into `slots` `(R', q)`, with their whole keys (positions unused)."""
        heads = torch.arange(slots.shape[0], device=slots.device)[:, None] + (rows.start or 0)
        self.kept[heads, slots] = torch.gather(x, 2, self._index(rows, x.shape[1])).to(self.dtype)
        self.keep_whole(rows, slots, x)

    def keep_whole(self, rows: slice, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Hold the pruned channels of the whole keys `x` `(R', q, D)` of `slots` `(R', q)` (-1: none for that
        row): the j-th goes into its row's j-th free entry (a -1 leaves that entry free)."""
        x = torch.gather(x, 2, self._index(rows, x.shape[1], kept=False)).to(self.dtype)
        q = slots.shape[1]
        free = self.whole_slot[rows] < 0
        short = q - int(free.sum(-1).min()) if free.shape[1] else q
        if short > 0:
            self._room(self.whole_slot.shape[1] + GROWTH * -(-short // GROWTH))
            free = self.whole_slot[rows] < 0
        rank = free.cumsum(-1) - 1  # each free entry's rank among its row's
        place = torch.where(free & (rank < q), rank, q)
        width = free.shape[1]
        entry = slots.new_zeros(slots.shape[0], q + 1)
        entry = entry.scatter_(1, place, torch.arange(width, device=slots.device).expand_as(place))[:, :q]
        self.whole_slot[rows].scatter_(1, entry, slots)
        self.whole[rows].scatter_(1, entry[..., None].expand_as(x), x)

    def _room(self, width: int) -> None:
        """At least `width` whole-key entries per row."""
        w = self.whole_slot.shape[1]
        if width > w:
            self.whole = torch.cat(
                [self.whole, self.whole.new_zeros(self.whole.shape[0], width - w, self.dim - self.k)], 1
            )
            self.whole_slot = torch.cat(
                [self.whole_slot, self.whole_slot.new_full((self.whole_slot.shape[0], width - w), -1)], 1
            )


def seal_channels(
    channels: torch.Tensor, x: torch.Tensor, valid: torch.Tensor, whole: torch.Tensor, capacity: int
) -> ChannelStates:
    """A prompt's compressed keys `x` `(R, n, D)` (validity `(R, n)`) with each row's `channels` `(R, K)` kept
    (ascending); the slots of `whole` `(R, n)` bool keep every channel."""
    r, n, d = x.shape
    pruned = torch.ones(r, d, dtype=torch.bool, device=x.device).scatter_(1, channels, False)
    order = torch.cat([channels, pruned.nonzero()[:, 1].view(r, d - channels.shape[1])], dim=1)
    states = ChannelStates(order, channels.shape[1], capacity, x.dtype)
    states.write(slice(0, r), x, valid.clone(), valid)
    width = int(whole.sum(-1).max())  # rows R >= 1: no slot (n = 0) gives 0
    if width:
        slots = torch.where(whole, torch.arange(n, device=x.device), n).sort(-1).values[:, :width]
        slots = slots.masked_fill(slots == n, -1)
        states.keep_whole(
            slice(0, r), slots, torch.gather(x, 1, slots.clamp(min=0)[..., None].expand(-1, -1, d))
        )
    return states
