"""Low-rank KV storage: each KV head's keys or values as rank-r coefficients over a basis of the prompt's own.

After the prompt's compression, each row's (KV head's) kept keys `X` `(n, D)` are factored by a truncated SVD,
`X ~ X V V^T` with `V` `(D, r)` the top-r right singular vectors; the store keeps the coefficients `X V` `(n, r)`
and the basis `V`, so a slot costs r numbers instead of D, plus D x r per head. By Eckart-Young the squared
reconstruction error is the energy of the discarded singular values. The basis is computed on the prompt's rows
after RoPE, per (layer, KV head), as xKV (Chang et al. 2025, "xKV: Cross-Layer SVD for KV-Cache Compression")
does on the prompt's own keys and values; Palu (Chang et al. 2024, "Palu: Compressing KV-Cache with Low-Rank
Projection") instead factors the projection weights offline, before RoPE. Later tokens (and a policy's merges)
are projected onto the basis.

`LowRankStates` holds one of keys or values for R rows x C slots: coefficients `(R, C, r)` and basis `(R, D, r)`,
in the model's dtype. It has the interface of `kvlens.engine.quantize.QuantizedStates`, so the cache treats both
storages alike (`SlotStore.packed`).
"""
from __future__ import annotations

import torch


class LowRankStates:
    """One of a store's keys or values at rank `rank` (module docstring)."""

    def __init__(self, rank: int, rows: int, capacity: int, dim: int, dtype: torch.dtype, device: torch.device):
        self.rank, self.dim, self.dtype = rank, dim, dtype
        self.coef = torch.zeros(rows, capacity, rank, dtype=dtype, device=device)
        self.basis = torch.zeros(rows, dim, rank, dtype=dtype, device=device)

    def empty(self, rows: int, capacity: int) -> LowRankStates:
        """Storage of the same kind for `rows` rows of `capacity` free slots (bases come with `take`)."""
        return LowRankStates(self.rank, rows, capacity, self.dim, self.dtype, self.coef.device)

    @property
    def capacity(self) -> int:
        return self.coef.shape[1]

    def resize(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        old = self.coef
        self.coef = old.new_zeros(old.shape[0], capacity, self.rank)
        self.coef[:, : old.shape[1]] = old

    def nbytes(self, rows: int) -> int:
        """Bytes of `rows` rows: coefficients and basis."""
        return rows * (self.coef[0].numel() + self.basis[0].numel()) * self.coef.element_size()

    def clone(self) -> LowRankStates:
        new = object.__new__(LowRankStates)
        vars(new).update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()})
        return new

    def fit(self, rows: slice, x: torch.Tensor, valid: torch.Tensor) -> None:
        """Each row's basis from its valid slots of `x` `(R', n, D)` (`valid` `(R', n)`): the top `rank` right
        singular vectors, in float32."""
        members = torch.where(valid[..., None], x.float(), 0.0)
        _, _, vh = torch.linalg.svd(members, full_matrices=False)  # (R', min(n, D), D)
        basis = vh[:, : self.rank].transpose(1, 2)
        if basis.shape[2] < self.rank:  # fewer slots than the rank: the rest of the basis stays zero
            basis = torch.nn.functional.pad(basis, (0, self.rank - basis.shape[2]))
        self.basis[rows] = basis.to(self.dtype)

    # -- the storage interface (`kvlens.engine.quantize.QuantizedStates`'s) --------------------------------
    def read(self, rows: slice, n: int) -> torch.Tensor:
        """`(R', n, D)` the rows' first `n` slots, reconstructed."""
        return torch.matmul(self.coef[rows, :n].float(), self.basis[rows].float().transpose(1, 2)).to(self.dtype)

    def in_window(self, rows: slice, n: int) -> torch.Tensor:
        """`(R', n)`: no slot is held at full rank."""
        return torch.zeros(self.coef[rows].shape[0], n, dtype=torch.bool, device=self.coef.device)

    def roundtrip(self, rows: slice, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`x` `(R', n, D)` as this storage holds it: projected onto the rows' bases."""
        basis = self.basis[rows].float()
        return torch.matmul(torch.matmul(x.float(), basis), basis.transpose(1, 2)).to(x.dtype)

    def write(self, rows: slice, x: torch.Tensor, changed: torch.Tensor, valid: torch.Tensor) -> None:
        """Store the `changed` `(R', n)` slots of `x` `(R', n, D)`, projected onto the rows' bases."""
        n = x.shape[1]
        coef = torch.matmul(x.float(), self.basis[rows].float()).to(self.dtype)
        self.coef[rows, :n] = torch.where(changed[..., None], coef, self.coef[rows, :n])

    def take(self, rows: slice, other: LowRankStates, other_rows: slice, index: torch.Tensor, x: torch.Tensor,
             valid: torch.Tensor) -> None:
        """Fill `rows` (empty) with `other`'s slots `index` `(R', S)` of `other_rows`, whose values are `x`
        `(R', S, D)`: the rows keep their bases."""
        self.basis[rows] = other.basis[other_rows]
        valid = valid[:, : index.shape[1]]
        self.write(rows, x, valid.clone(), valid)

    def forget(self, rows: slice, gone: torch.Tensor) -> None:
        """Freed slots need nothing: their coefficients are overwritten when the slots are reused."""

    def append(self, rows: slice, slots: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
               valid: torch.Tensor) -> None:
        """New tokens `x` `(R', q, D)` into `slots` `(R', q)`, projected onto the rows' bases."""
        heads = torch.arange(slots.shape[0], device=slots.device)[:, None] + (rows.start or 0)
        self.coef[heads, slots] = torch.matmul(x.float(), self.basis[rows].float()).to(self.dtype)


def seal_low_rank(rank: int, x: torch.Tensor, valid: torch.Tensor, capacity: int) -> LowRankStates:
    """A prompt's compressed keys or values `x` `(R, n, D)` (validity `(R, n)`) at rank `rank`."""
    r, n, d = x.shape
    states = LowRankStates(min(rank, d), r, capacity, d, x.dtype, x.device)
    states.fit(slice(0, r), x, valid)
    states.write(slice(0, r), x, valid.clone(), valid)
    return states
