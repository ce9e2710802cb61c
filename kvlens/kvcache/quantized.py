"""`PackedStore`: a slot store whose keys and/or values leave the model's dtype buffers for packed storage, as
transformers' `QuantizedLayer` subclasses its dynamic layer.

Packed storage is KIVI's quantization (`kvlens.kvcache.kivi`), low rank (`kvlens.kvcache.lowrank`) or
channel-pruned keys (`kvlens.kvcache.channels`), one `kvlens.kvcache.packed.PackedStates` per name.
Reading keys or values dequantizes the rows asked for (`kvlens.kvcache.store.CopyingStore`): attention's read
is not kept; a policy's is a working copy `(1, R', n, D)`, and `commit` stores back the slots it changed there
(merges), then drops the copy. The statistics, and the values of channel-pruned storage, stay in the buffers.
A store becomes packed after the prompt's compression (`pack`, `prune`, `seal_layers`).
"""

from __future__ import annotations

import torch

from kvlens.errors import KvlensError
from kvlens.kvcache.channels import seal_channels
from kvlens.kvcache.kivi import seal
from kvlens.kvcache.lowrank import seal_cross_layer, seal_low_rank
from kvlens.kvcache.packed import PackedStates
from kvlens.kvcache.quantize import Storage, slot_mask
from kvlens.kvcache.rank import fit_rank
from kvlens.kvcache.store import STATES, CopyingStore, SlotStore, empty_buffers

SHARED_STORE = (
    "Cross-layer low rank (--kv-rank-layers) shares each token's coefficients across the heads of adjacent "
    "layers (xKV), so every head must keep the same tokens, and this policy keeps different ones: leave "
    "--kv-rank-layers out for per-head low rank."
)


class PackedStore(CopyingStore):
    """A `CopyingStore` (module docstring) with `packed`: name ("keys"/"values") -> its packed storage."""

    lossless = False

    def __init__(self, buffers: dict[str, torch.Tensor], n: int, packed: dict[str, PackedStates]):
        super().__init__(buffers, n)
        self.packed = packed

    @classmethod
    def of(cls, store: SlotStore, packed: dict[str, PackedStates]) -> PackedStore:
        """`store`'s slots with the `packed` names out of its buffers (their storage now holds them)."""
        new = cls({k: t for k, t in store.buffers.items() if k not in packed}, store.n, packed)
        new.extra, new.order = store.extra, store.order
        return new

    def empty_like(self, rows: int, capacity: int) -> PackedStore:
        return PackedStore(
            empty_buffers(self.buffers, rows, capacity),
            0,
            {name: q.empty(rows, capacity) for name, q in self.packed.items()},
        )

    def names(self) -> list[str]:
        return [*self.buffers, *self.packed]

    def _gather(self, name: str, rows: slice) -> torch.Tensor:
        return self.packed[name].read(rows, self.n)

    def _store_changed(self, name: str, rows: slice, copy: torch.Tensor, changed: torch.Tensor) -> None:
        self.packed[name].write(rows, copy, changed, self.buffers["valid"][rows, : self.n])

    def write_states(
        self,
        rows: slice,
        slots: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """New tokens into the buffers or the packed storage (quantized: its full-precision window); returns
        them as fed."""
        heads = torch.arange(slots.shape[0], device=slots.device)[:, None] + rows.start
        self.commit()
        valid = self.buffers["valid"][rows, : self.n]
        for name, x in (("keys", key), ("values", value)):
            if name in self.packed:
                self.packed[name].append(rows, slots, x[0], positions, valid)
            else:
                self.buffers[name][0, heads, slots] = x[0]
        return key[0], value[0]

    def forget(self, rows: slice, index: torch.Tensor) -> None:
        gone = slot_mask(index, self.n)
        for q in self.packed.values():
            q.forget(rows, gone)

    def take(
        self, rows: slice, old: SlotStore, old_rows: slice, index: torch.Tensor, kept: dict[str, torch.Tensor]
    ) -> None:
        """The kept slots' window entries follow them; the rest is quantized again. `old` is a store of the
        same kind (`empty_like`)."""
        if not isinstance(old, PackedStore):
            raise TypeError("kvlens: packed rows are taken from a packed store")
        valid = self.buffers["valid"][rows, : self.n]
        for name, q in self.packed.items():
            q.take(rows, old.packed[name], old_rows, index, kept[name][0], valid)

    def snapshot(self) -> dict[str, PackedStates]:
        self.commit()
        return {k: q.clone() for k, q in self.packed.items()}

    def restore(self, saved: object) -> None:
        if not isinstance(saved, dict):
            raise TypeError("kvlens: a packed store restores a packed snapshot")
        self.working.clear()
        self.packed = {k: q.clone() for k, q in saved.items()}
        for q in self.packed.values():
            q.resize(self.capacity)  # the buffers may have grown since the snapshot

    def resize(self, capacity: int) -> None:
        for q in self.packed.values():
            q.resize(capacity)
        super().resize(capacity)

    def nbytes(self, rows: slice) -> int:
        count = len(range(*rows.indices(self.rows)))
        return super().nbytes(rows) + sum(q.nbytes(count) for q in self.packed.values())


def pack(store: SlotStore, storage: Storage, slots: int) -> PackedStore:
    """`store`'s keys and values into quantized or per-head low-rank storage (after the prompt's compression);
    `slots`: the most each row will hold (low rank's byte share is of those)."""
    valid, pos = store.buffers["valid"][:, : store.n], store.buffers["pos"][:, : store.n]
    states = {name: store.buffers[name][0, :, : store.n] for name in STATES}
    packed: dict[str, PackedStates]
    if storage.low_rank:
        x = states["keys"]
        rank = fit_rank(storage, x.shape[2], 1, max(slots, store.n), store.n, x.element_size())
        packed = {
            name: seal_low_rank(
                rank,
                t,
                valid,
                store.capacity,
                bits=storage.bits,
                group=storage.group,
                append=storage.rank_append,
            )
            for name, t in states.items()
        }
    else:
        packed = {name: seal(storage, name, t, pos, valid, store.capacity) for name, t in states.items()}
    return PackedStore.of(store, packed)


def prune(store: SlotStore, channels: torch.Tensor, whole: torch.Tensor) -> PackedStore:
    """`store`'s keys into channel-pruned storage: each row keeps `channels` `(R, K)`, the slots `whole` `(R,
    n)` every channel (`kvlens.kvcache.channels`); values stay in the model's dtype."""
    valid = store.buffers["valid"][:, : store.n]
    keys = store.buffers["keys"][0, :, : store.n]
    return PackedStore.of(store, {"keys": seal_channels(channels, keys, valid, whole, store.capacity)})


def seal_layers(storage: Storage, stores: list[SlotStore], limit: int) -> list[PackedStore]:
    """xKV's cross-layer low rank (`kvlens.kvcache.lowrank.seal_cross_layer`) over the stores of a group of
    adjacent layers, each holding one layer's rows and the same tokens in the same slots; `limit`: the most
    slots a layer will hold."""
    first, n = stores[0], stores[0].n
    valid = first.buffers["valid"][:1, :n]
    pos = first.buffers["pos"][:1, :n].masked_fill(~valid, -1)

    def holds_them(store: SlotStore) -> bool:
        """Each of the store's heads holds the first head's tokens."""
        mine = store.buffers["valid"][:, :n]
        return (
            store.n == n
            and torch.equal(mine, valid.expand_as(mine))
            and torch.equal(store.buffers["pos"][:, :n].masked_fill(~valid, -1), pos.expand_as(mine))
        )

    if len({id(s) for s in stores}) != len(stores) or not all(map(holds_them, stores)):
        raise KvlensError(SHARED_STORE)
    x = first.buffers["keys"]
    rank = fit_rank(storage, x.shape[-1], len(stores) * x.shape[1], max(limit, n), n, x.element_size())
    parts = {
        name: seal_cross_layer(
            rank,
            [s.buffers[name][0, :, :n] for s in stores],
            valid[0],
            bits=storage.bits,
            group=storage.group,
        )
        for name in STATES
    }
    return [
        PackedStore.of(store, {name: part[i] for name, part in parts.items()})
        for i, store in enumerate(stores)
    ]
