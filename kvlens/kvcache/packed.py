"""`PackedStates`: what every packed storage of a store's keys or values implements, as transformers'
`QuantizedLayer` declares what its quantization backends implement.

The variants: KIVI's quantization (`kvlens.kvcache.kivi.QuantizedStates`), low rank
(`kvlens.kvcache.lowrank.LowRankStates`) and channel-pruned keys (`kvlens.kvcache.channels.ChannelStates`);
`kvlens.kvcache.quantized.PackedStore` holds one per packed name and calls only what is declared here.

Shapes: R rows (the store's (layer x KV head) rows) x C slots (`capacity`); a call reads or changes the rows
`rows`, R' of them, over their first n slots (the slots in use, free ones included); D the head size. Each
variant keeps some slots in full precision (KIVI's window, low rank's full-width tokens, channel pruning's
whole keys): an entry table `(R, W)` of their slots, -1 for an empty entry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Self

import torch


class PackedStates(ABC):
    """One of a store's keys or values in packed storage, for R rows x `capacity` slots (module docstring)."""

    # -- layout ----------------------------------------------------------------------------------------------
    @abstractmethod
    def empty(self, rows: int, capacity: int) -> Self:
        """Storage of the same kind and settings, with no slot stored (`take` fills it).

        Args:

        - `rows`: its rows R.
        - `capacity`: its slots C.

        Returns: a new storage of this variant.
        """

    @property
    @abstractmethod
    def capacity(self) -> int:
        """The slots C each row has packed room for."""

    @abstractmethod
    def resize(self, capacity: int) -> None:
        """Room for `capacity` slots per row, keeping what is stored (never shrinks; low rank's storage that
        holds later tokens at full width keeps its capacity).

        Args:

        - `capacity`: the slots C wanted.
        """

    @abstractmethod
    def nbytes(self, rows: int) -> int:
        """The bytes this storage allocates for some of its rows.

        Args:

        - `rows`: how many rows to count.

        Returns: their bytes: packed data, per-row parameters and full-precision entries.
        """

    def clone(self) -> Self:
        """A copy whose tensors are copies too (but those `_shared_tensors` names)."""
        new = object.__new__(type(self))
        same = self._shared_tensors()
        vars(new).update(vars(self))
        vars(new).update(
            {k: v.clone() for k, v in vars(self).items() if isinstance(v, torch.Tensor) and k not in same}
        )
        return new

    def _shared_tensors(self) -> tuple[str, ...]:
        """Attributes that `clone` shares with the copy instead of copying (none)."""
        return ()

    # -- reading ---------------------------------------------------------------------------------------------
    @abstractmethod
    def read(self, rows: slice, n: int) -> torch.Tensor:
        """The rows' slots as attention reads them.

        Args:

        - `rows`: the rows R'.
        - `n`: the slots to read, from slot 0.

        Returns: `(R', n, D)` in the model's dtype: packed slots unpacked, full-precision ones as held.
        """

    @abstractmethod
    def in_window(self, rows: slice, n: int) -> torch.Tensor:
        """Which of the rows' slots are held in full precision.

        Args:

        - `rows`: the rows R'.
        - `n`: the slots asked about, from slot 0.

        Returns: `(R', n)` bool.
        """

    @abstractmethod
    def roundtrip(self, rows: slice, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Values as this storage would hold them now (the perturbation meter's storage-only error).

        Args:

        - `rows`: the rows R'.
        - `x`: `(R', n, D)` values of the rows' slots (e.g. the ones originally written).
        - `valid`: `(R', n)` bool, the slots in use.

        Returns: `(R', n, D)` in `x`'s dtype, `x` where a slot is held in full precision, else packed and
        unpacked.
        """

    # -- writing ---------------------------------------------------------------------------------------------
    @abstractmethod
    def write(self, rows: slice, x: torch.Tensor, changed: torch.Tensor, valid: torch.Tensor) -> None:
        """Store the slots that changed (a policy's merges, the prompt at sealing).

        Args:

        - `rows`: the rows R'.
        - `x`: `(R', n, D)` every slot's current value.
        - `changed`: `(R', n)` bool, the slots to store.
        - `valid`: `(R', n)` bool, the slots in use.
        """

    @abstractmethod
    def take(
        self,
        rows: slice,
        other: Self,
        other_rows: slice,
        index: torch.Tensor,
        x: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:
        """Fill empty rows with another storage's kept slots, in a new layout (a compaction).

        Args:

        - `rows`: the rows R' to fill (empty).
        - `other`: the storage of the same variant that holds them now.
        - `other_rows`: its rows, R' of them.
        - `index`: `(R', S)` long, the slots of `other` that become slots 0..S-1 here.
        - `x`: `(R', S, D)` their current values.
        - `valid`: `(R', >= S)` bool, the new slots in use.
        """

    @abstractmethod
    def forget(self, rows: slice, gone: torch.Tensor) -> None:
        """Freed slots give back their full-precision entries (the slots are reused later).

        Args:

        - `rows`: the rows R'.
        - `gone`: `(R', n)` bool, the freed slots.
        """

    @abstractmethod
    def append(
        self, rows: slice, slots: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """Store new tokens (a decode step's, a chunk of the prompt's).

        Args:

        - `rows`: the rows R'.
        - `slots`: `(R', q)` long, each new token's slot.
        - `x`: `(R', q, D)` their values.
        - `positions`: `(q,)` long, their positions.
        - `valid`: `(R', n)` bool, the slots in use, the new ones included.
        """


def leaving(slot: torch.Tensor, gone: torch.Tensor) -> torch.Tensor:
    """`(R', W)` bool: the entries of an entry table `slot` `(R', W)` (-1: empty) whose slot is `gone` `(R',
    n)` bool."""
    return (slot >= 0) & torch.gather(gone, 1, slot.clamp(min=0, max=gone.shape[1] - 1))


def follow(old: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """An entry table `old` `(R', W)` (-1: empty) after the slots `index` `(R', S)` move to slots 0..S-1: each
    entry's new slot, -1 where its slot was not kept or the entry was empty."""
    s = index.shape[1]
    n_old = int(index.max()) + 1 if index.numel() else 0
    n_old = max(n_old, int(old.max()) + 1)
    inverse = torch.full((index.shape[0], n_old + 1), -1, dtype=torch.long, device=index.device)
    inverse.scatter_(1, index, torch.arange(s, device=index.device).expand_as(index).contiguous())
    return torch.where(old >= 0, torch.gather(inverse, 1, old.masked_fill(old < 0, n_old)), -1)


def overlay(out: torch.Tensor, slot: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """`out` `(R', n, D)` with the full-precision entries `held` `(R', W, D)` written over their slots `slot`
    `(R', W)` (-1: empty entry); in place."""
    if slot.numel() and bool((slot >= 0).any()):
        r, e = (slot >= 0).nonzero(as_tuple=True)
        out[r, slot[r, e]] = held[r, e]
    return out
