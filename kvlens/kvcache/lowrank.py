"""Low-rank KV storage: keys or values as rank-r coefficients over a basis from an SVD of the prompt's own
rows.

Per head (the default): after the prompt's compression, each row's (layer's KV head's) kept keys `X` `(n, D)`
are factored by a truncated SVD, `X ~ (X V) V^T` with `V` `(D, r)` the top-r right singular vectors; the store
keeps the coefficients `X V` `(n, r)` and the basis `V`. Palu (Chang et al. 2024, "Palu: Compressing KV-Cache
with Low-Rank Projection", Sec. 3) stores such per-head latents but takes its projection from the weights,
offline. Cross-layer (`layers` = G; xKV, Chang et al. 2025, "xKV: Cross-Layer SVD for KV-Cache Compression",
Sec. 3, and its code's `grouped_layer_merging`/`fake_svd`): the kept rows of the KV heads of G adjacent layers
are concatenated along channels, `X` `(n, G * Hkv * D)`, and factored by one SVD per group; the coefficients
`X V` `(n, r)` are stored once and shared by the group's heads and layers, each head keeping its `(D, r)`
slice of `V`. Either way, by Eckart-Young the squared reconstruction error is the energy of the discarded
singular values.

Where this differs from the papers:
- keys are factored after RoPE (the cache's own); xKV factors them before RoPE and applies it again on
  reading.
- the coefficients are `U S`; xKV splits `sqrt(S)` between its two factors (only quantization sees it).
- later tokens (`append`): "project" (the default; Palu: a new token's latent is its projection onto the
  basis) or "full" (xKV's code: decode tokens join its cache uncompressed), held at full width beside the
  coefficients and counted in the bytes. Cross-layer needs "full": a token's shared coefficients need every
  layer of its group, and the first layer attends before the last computes its keys. A policy's merges are
  projected (per head) or held at full width (cross-layer: the other layers still read the shared
  coefficients).
- `bits`: the coefficients are quantized per token in groups of `group` channels with
  `kvlens.kvcache.quantize`'s asymmetric quantizer (Palu quantizes its latents, xKV's `fake_svd` its token
  factor; both after a Hadamard transform, which is not applied here); bases and full-width tokens stay in the
  model's dtype.

`LowRankStates` holds one of keys or values for R rows x C slots: coefficients `(R, C, r)` (cross-layer: `(1,
C, r)`, the same tensor in every layer of the group, its bytes counted by the first), or their codes `(R, C, r
* bits / 8)` uint8 with float16 zero points and scales `(R, C, r / group)`; bases `(R, D, r)`; full-width
tokens `(R, W, D)` with their slots `(R, W)` (-1: a free entry). It is a `kvlens.kvcache.packed.PackedStates`,
so the cache treats it like the other packed storages (`kvlens.kvcache.quantized.PackedStore`).
"""

from __future__ import annotations

import torch

from kvlens.errors import KvlensError
from kvlens.kvcache.packed import PackedStates, leaving, overlay
from kvlens.kvcache.quantize import dequantize, pack, quantize, unpack
from kvlens.kvcache.rank import coefficient_slots, top_vectors


class LowRankStates(PackedStates):
    """One of a store's keys or values at rank `rank` (module docstring)."""

    def __init__(
        self,
        rank: int,
        rows: int,
        capacity: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        bits: int | None = None,
        group: int = 64,
        append: str = "project",
        shared: bool = False,
    ):
        self.rank, self.dim, self.dtype, self.bits, self.appending = rank, dim, dtype, bits, append
        self.width = min(group, rank)  # coefficients per quantization group
        self.shared, self.owner = (
            shared,
            True,
        )  # coefficients shared by a group's layers (never written); owner:
        # this storage counts their bytes
        coef_rows = 1 if shared else rows
        self.coef_names: tuple[str, ...] = ("coef",)  # the coefficients' tensors
        if bits is None:
            self.coef = torch.zeros(coef_rows, capacity, rank, dtype=dtype, device=device)
        else:
            self.coef_names = ("coef", "lo", "scale")
            self.coef = torch.zeros(coef_rows, capacity, rank * bits // 8, dtype=torch.uint8, device=device)
            self.lo = torch.zeros(coef_rows, capacity, rank // self.width, dtype=torch.float16, device=device)
            self.scale = torch.zeros_like(self.lo)
        self.basis = torch.zeros(rows, dim, rank, dtype=dtype, device=device)
        self.wide = torch.zeros(rows, 0, dim, dtype=dtype, device=device)  # full-width tokens
        self.wide_slot = torch.full((rows, 0), -1, dtype=torch.long, device=device)

    def empty(self, rows: int, capacity: int) -> LowRankStates:
        """Storage of the same kind for `rows` rows of `capacity` free slots (bases come with `take`)."""
        return LowRankStates(
            self.rank,
            rows,
            capacity,
            self.dim,
            self.dtype,
            self.basis.device,
            bits=self.bits,
            group=self.width,
            append=self.appending,
        )

    @property
    def capacity(self) -> int:
        return self.coef.shape[1]

    def resize(self, capacity: int) -> None:
        """Room for `capacity` slots of coefficients; with "full" appends, later slots are full width
        instead."""
        if capacity <= self.capacity or self.shared or self.appending == "full":
            return
        for name in self.coef_names:
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], capacity, old.shape[2])
            new[:, : old.shape[1]] = old
            setattr(self, name, new)

    def nbytes(self, rows: int) -> int:
        """Bytes of `rows` rows: coefficients (shared ones by their owner only), bases and full-width
        tokens."""
        coef: list[torch.Tensor] = [getattr(self, name) for name in self.coef_names]
        per_row = sum(t[0].numel() * t.element_size() for t in [self.basis, self.wide])
        if self.shared:
            return rows * per_row + self.owner * sum(t.numel() * t.element_size() for t in coef)
        return rows * (per_row + sum(t[0].numel() * t.element_size() for t in coef))

    def _shared_tensors(self) -> tuple[str, ...]:
        """A copy keeps shared coefficients shared (they are never written)."""
        return self.coef_names if self.shared else ()

    def sharing(self) -> LowRankStates:
        """Another layer's storage over these shared coefficients (their bytes counted by this one's)."""
        new = self.clone()
        new.owner = False
        return new

    def fit(self, rows: slice, x: torch.Tensor, valid: torch.Tensor) -> None:
        """Each row's basis from its valid slots of `x` `(R', n, D)` (`valid` `(R', n)`): the top `rank` right
        singular vectors, in float32."""
        self.basis[rows] = top_vectors(torch.where(valid[..., None], x.float(), 0.0), self.rank).to(
            self.dtype
        )

    # -- coefficients
    # ------------------------------------------------------------------------------------------
    def _coefficients(self, rows: slice, n: int) -> torch.Tensor:
        """`(R', n, r)` float32 coefficients of the rows' first `n` slots (zero past the ones stored)."""
        r = self.basis[rows].shape[0]
        m = min(n, self.capacity)
        held = slice(None) if self.shared else rows  # shared coefficients: their one row
        c = self.coef[held, :m]
        if self.bits:
            lo, scale = self.lo[held, :m], self.scale[held, :m]
            c = dequantize(unpack(c, self.bits), lo, scale, self.width, "channels", torch.float32)
        c = c.float().expand(r, -1, -1)
        return torch.nn.functional.pad(c, (0, 0, 0, n - m))

    def _store(self, heads: torch.Tensor, slots: torch.Tensor, coef: torch.Tensor) -> None:
        """Coefficients `coef` `(E, r)` into absolute rows `heads` and slots `slots` `(E,)` (quantized if
        set)."""
        if not self.bits:
            self.coef[heads, slots] = coef.to(self.dtype)
            return
        codes, lo, scale = quantize(coef[None], self.bits, self.width, "channels")
        self.coef[heads, slots] = pack(codes[0], self.bits)
        self.lo[heads, slots], self.scale[heads, slots] = lo[0], scale[0]

    def _project(self, rows: slice, x: torch.Tensor) -> torch.Tensor:
        """`x` `(R', n, D)` -> its coefficients `(R', n, r)` on the rows' bases, float32."""
        return torch.matmul(x.float(), self.basis[rows].float())

    # -- full-width tokens
    # -------------------------------------------------------------------------------------
    def _widen(self, rows: slice, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Hold `x` `(R', q, D)` at full width for `slots` `(R', q)` (-1: none; distinct in a row): a slot
        already held keeps its entry, the others take the rows' free entries in order (the entries grow as
        needed)."""
        live = slots >= 0
        if not bool(live.any()):
            return
        match = (self.wide_slot[rows][:, None, :] == slots[:, :, None]) & live[..., None]  # (R', q, W)
        held = match.any(-1)
        fresh = live & ~held
        short = int((fresh.sum(-1) - (self.wide_slot[rows] < 0).sum(-1)).max())
        if short > 0:
            self._grow(short)
            match = torch.nn.functional.pad(match, (0, short))
        free_first = torch.sort((self.wide_slot[rows] >= 0).int(), dim=-1, stable=True).indices  # (R', W)
        entry = torch.where(
            held,
            match.int().argmax(-1),
            torch.gather(free_first, 1, (fresh.long().cumsum(-1) - 1).clamp(min=0)),
        )
        r, j = live.nonzero(as_tuple=True)
        self.wide[r + (rows.start or 0), entry[r, j]] = x[r, j].to(self.dtype)
        self.wide_slot[r + (rows.start or 0), entry[r, j]] = slots[r, j]

    def _grow(self, more: int) -> None:
        self.wide = torch.nn.functional.pad(self.wide, (0, 0, 0, more))
        self.wide_slot = torch.nn.functional.pad(self.wide_slot, (0, more), value=-1)

    # -- the storage interface (`PackedStates`') ---------------------------------------------------------
    def read(self, rows: slice, n: int) -> torch.Tensor:
        """`(R', n, D)` the rows' first `n` slots, reconstructed (full-width ones as held)."""
        out = torch.matmul(self._coefficients(rows, n), self.basis[rows].float().transpose(1, 2)).to(
            self.dtype
        )
        return overlay(out, self.wide_slot[rows], self.wide[rows])

    def in_window(self, rows: slice, n: int) -> torch.Tensor:
        """`(R', n)` bool: the slots held at full width."""
        slot = self.wide_slot[rows]
        width = max(n, int(slot.max()) + 1) if slot.numel() else n  # slots past `n` are not asked for
        mask = torch.zeros(slot.shape[0], width + 1, dtype=torch.bool, device=slot.device)
        return mask.scatter_(1, slot.masked_fill(slot < 0, width), True)[:, :n]

    def roundtrip(self, rows: slice, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`x` `(R', n, D)` as this storage would hold it: full-width slots unchanged, the rest projected onto
        the rows' bases (per head, coefficients quantized if set) or, cross-layer, as the shared coefficients
        hold it."""
        n = x.shape[1]
        if self.shared:
            y = self.read(rows, n)
        else:
            coef = self._project(rows, x)
            if self.bits:
                coef = dequantize(
                    *quantize(coef, self.bits, self.width, "channels"), self.width, "channels", torch.float32
                )
            y = torch.matmul(coef, self.basis[rows].float().transpose(1, 2)).to(x.dtype)
        return torch.where(self.in_window(rows, n)[..., None], x, y)

    def write(self, rows: slice, x: torch.Tensor, changed: torch.Tensor, valid: torch.Tensor) -> None:
        """Store the `changed` `(R', n)` slots of `x` `(R', n, D)`: full-width ones (and, cross-layer, every
        one) at full width, the rest projected onto the rows' bases."""
        n = x.shape[1]
        wide = self.in_window(rows, n) | self.shared
        if bool((changed & wide).any()):
            slots = torch.arange(n, device=x.device).expand_as(changed).masked_fill(~(changed & wide), -1)
            self._widen(rows, slots, x)
        r, s = (changed & ~wide).nonzero(as_tuple=True)
        if r.numel():
            self._store(r + (rows.start or 0), s, self._project(rows, x)[r, s])

    def take(
        self,
        rows: slice,
        other: LowRankStates,
        other_rows: slice,
        index: torch.Tensor,
        x: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:
        """Fill `rows` (empty) with `other`'s slots `index` `(R', S)` of `other_rows`, whose values are `x`
        `(R', S, D)`: the rows keep their bases, full-width slots stay full width."""
        if other.shared:
            raise KvlensError(
                "Cross-layer low-rank storage (--kv-rank-layers) cannot follow a layer's slots into a "
                "new layout (a chunked prefill or a budget's compaction): leave --kv-rank-layers out."
            )
        self.basis[rows] = other.basis[other_rows]
        valid = valid[:, : index.shape[1]]
        held = torch.gather(other.in_window(other_rows, int(index.max()) + 1), 1, index) & valid
        slots = torch.arange(index.shape[1], device=index.device).expand_as(index)
        self._widen(rows, slots.masked_fill(~held, -1), x)
        r, s = (valid & ~held).nonzero(as_tuple=True)
        if r.numel():
            self._store(r + (rows.start or 0), s, self._project(rows, x)[r, s])

    def forget(self, rows: slice, gone: torch.Tensor) -> None:
        """Freed slots `gone` `(R', n)` leave the full-width entries (coefficients are overwritten on
        reuse)."""
        slot = self.wide_slot[rows]
        if not slot.numel():
            return
        out = leaving(slot, gone)
        if bool(out.any()):
            self.wide_slot[rows] = slot.masked_fill(out, -1)

    def append(
        self, rows: slice, slots: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """New tokens `x` `(R', q, D)` into `slots` `(R', q)`: projected onto the rows' bases ("project"), or
        held at full width ("full"); a reused slot's old full-width entry goes either way."""
        self.forget(rows, torch.zeros_like(valid).scatter_(1, slots, True))
        if self.appending == "full":
            self._widen(rows, slots, x)
            return
        heads = torch.arange(slots.shape[0], device=slots.device)[:, None] + (rows.start or 0)
        self._store(heads.expand_as(slots).flatten(), slots.flatten(), self._project(rows, x).flatten(0, 1))


def seal_low_rank(
    rank: int,
    x: torch.Tensor,
    valid: torch.Tensor,
    capacity: int,
    *,
    bits: int | None = None,
    group: int = 64,
    append: str = "project",
) -> LowRankStates:
    """A prompt's compressed keys or values `x` `(R, n, D)` (validity `(R, n)`) at rank `rank`, per head;
    `capacity` slots of coefficients (append "full": the `n` sealed ones only)."""
    r, n, d = x.shape
    slots = coefficient_slots(append, capacity, n)
    states = LowRankStates(
        min(rank, d), r, slots, d, x.dtype, x.device, bits=bits, group=group, append=append
    )
    states.fit(slice(0, r), x, valid)
    states.write(slice(0, r), x, valid.clone(), valid)
    return states


def seal_cross_layer(
    rank: int, xs: list[torch.Tensor], valid: torch.Tensor, *, bits: int | None = None, group: int = 64
) -> list[LowRankStates]:
    """A group of adjacent layers' compressed keys or values, `xs` one `(Hkv, n, D)` per layer, every head
    holding the same tokens (validity `(n,)`), as xKV stores them (module docstring): one `LowRankStates` per
    layer over the same coefficients `(1, n, r)`, the first owning them; later tokens at full width."""
    g, (h, n, d), dtype = len(xs), xs[0].shape, xs[0].dtype
    joined = torch.where(
        valid[:, None], torch.stack(xs).permute(2, 0, 1, 3).reshape(n, g * h * d).float(), 0.0
    )
    rank = min(rank, g * h * d)
    bases = top_vectors(joined[None], rank)[0]  # (G * Hkv * D, r)
    first = LowRankStates(
        rank, h, n, d, dtype, xs[0].device, bits=bits, group=group, append="full", shared=True
    )
    slots = valid.nonzero()[:, 0]
    first._store(torch.zeros_like(slots), slots, torch.matmul(joined, bases)[slots])
    out = [first, *(first.sharing() for _ in range(g - 1))]
    for states, basis in zip(out, bases.view(g, h, d, rank), strict=True):
        states.basis = basis.to(dtype).contiguous()
    return out
