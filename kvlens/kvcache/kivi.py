"""KIVI's quantized storage of one of a store's keys or values: `QuantizedStates` (Liu et al., ICML 2024,
"KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", Sec. 3-4), with the quantizer of
`kvlens.kvcache.quantize`; a `kvlens.kvcache.packed.PackedStates`.

`QuantizedStates` holds one of keys or values for R rows (KV heads) x C slots: codes `(R, C, D * bits / 8)`
uint8, zero points and scales `(R, ceil(C / group), D)` (per channel) or `(R, C, D / group)` (per token)
float16, and the full-precision window: values `(R, W, D)` in the model's dtype, their slots and positions
`(R, W)` (slot -1: empty). Slots are reused after evictions, so a key group is quantized again whenever one of
its slots changes (see `kvlens.kvcache.quantize`).
"""

from __future__ import annotations

import torch

from kvlens.kvcache.packed import PackedStates, follow, leaving, overlay
from kvlens.kvcache.quantize import Storage, dequantize, pack, quantize, slot_mask, unpack


class QuantizedStates(PackedStates):
    """One of a store's keys or values, quantized and packed, with its full-precision window (module
    docstring).

    Rows are KV heads; `read` dequantizes, `write` stores changed slots, `append` adds new tokens to the
    window (flushing it as the scheme says), `forget` drops freed slots from the window.
    """

    def __init__(
        self,
        storage: Storage,
        name: str,
        rows: int,
        capacity: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if storage.bits is None:
            raise ValueError("kvlens: quantized storage needs its bits")
        self.storage, self.name, self.dtype = storage, name, dtype
        self.bits, self.group = storage.bits, storage.group
        self.along, self.mode = storage.along(name), storage.window(name)
        self.dim = dim
        self.codes = torch.zeros(rows, 0, dim * self.bits // 8, dtype=torch.uint8, device=device)
        self._alloc_params(0, device)  # zero points `lo` and `scale`
        self.resize(capacity)
        w = storage.residual
        self.window = torch.zeros(rows, w, dim, dtype=dtype, device=device)  # full-precision values
        self.window_slot = torch.full((rows, w), -1, dtype=torch.long, device=device)  # -1: empty entry
        self.window_pos = torch.full((rows, w), -1, dtype=torch.long, device=device)

    def _alloc_params(self, capacity: int, device: torch.device) -> None:
        rows = self.codes.shape[0]
        shape = (
            (rows, -(-capacity // self.group), self.dim)
            if self.along == "slots"
            else (rows, capacity, self.dim // min(self.group, self.dim))
        )
        self.lo = torch.zeros(shape, dtype=torch.float16, device=device)
        self.scale = torch.zeros(shape, dtype=torch.float16, device=device)

    @property
    def capacity(self) -> int:
        return self.codes.shape[1]

    def resize(self, capacity: int) -> None:
        """Room for at least `capacity` slots, keeping the codes (a last per-channel group may be partial)."""
        if capacity <= self.capacity:
            return
        old = (self.codes, self.lo, self.scale)
        self.codes = old[0].new_zeros(old[0].shape[0], capacity, old[0].shape[2])
        self.codes[:, : old[0].shape[1]] = old[0]
        self._alloc_params(capacity, old[0].device)
        self.lo[:, : old[1].shape[1]] = old[1]
        self.scale[:, : old[2].shape[1]] = old[2]

    def nbytes(self, rows: int) -> int:
        """Bytes of `rows` rows: packed codes, zero points and scales, and the full-precision window."""
        per_row = sum(t[0].numel() * t.element_size() for t in (self.codes, self.lo, self.scale, self.window))
        return per_row * rows

    def empty(self, rows: int, capacity: int) -> QuantizedStates:
        """Storage of the same kind for `rows` rows of `capacity` free slots."""
        return QuantizedStates(
            self.storage, self.name, rows, capacity, self.dim, self.dtype, self.codes.device
        )

    # -- reading --------------------------------------------------------------------------------------------
    def read(self, rows: slice, n: int) -> torch.Tensor:
        """`(R', n, D)` the rows' first `n` slots dequantized, the window's slots in full precision."""
        codes = unpack(self.codes[rows, :n], self.bits)
        if self.along == "slots":
            end = -(-n // self.group) * self.group
            codes = torch.nn.functional.pad(codes, (0, 0, 0, end - n))
            lo, scale = self.lo[rows, : end // self.group], self.scale[rows, : end // self.group]
        else:
            lo, scale = self.lo[rows, :n], self.scale[rows, :n]
        out = dequantize(codes, lo, scale, self.group, self.along, self.dtype)[:, :n]
        return overlay(out, self.window_slot[rows], self.window[rows])

    def in_window(self, rows: slice, n: int) -> torch.Tensor:
        """`(R', n)` bool: the slots held in full precision."""
        return slot_mask(self.window_slot[rows], n)

    def roundtrip(self, rows: slice, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`x` `(R', n, D)` (e.g. the original values of the rows' slots) as this storage would hold them now:
        the window's slots unchanged, the rest quantized and dequantized in this layout (the perturbation
        meter's storage-only error)."""
        n = x.shape[1]
        window = self.in_window(rows, n)
        if self.along == "channels":
            y = dequantize(*quantize(x, self.bits, self.group, "channels"), self.group, "channels", x.dtype)
        else:
            pad = -(-n // self.group) * self.group - n
            members = torch.nn.functional.pad(valid & ~window, (0, pad))
            xs = torch.nn.functional.pad(x, (0, 0, 0, pad))
            y = dequantize(
                *quantize(xs, self.bits, self.group, "slots", members), self.group, "slots", x.dtype
            )[:, :n]
        return torch.where(window[..., None], x, y)

    # -- writing ---------------------------------------------------------------------------------------------
    def write(self, rows: slice, x: torch.Tensor, changed: torch.Tensor, valid: torch.Tensor) -> None:
        """Store the `changed` `(R', n)` slots of `x` `(R', n, D)` (every slot's current value; `valid` `(R',
        n)`): in the window where a slot is there, else quantized (per-channel groups from their members'
        values)."""
        n = x.shape[1]
        slot = self.window_slot[rows]
        if slot.numel():
            live = slot >= 0
            safe = slot.clamp(min=0)
            hit = live & torch.gather(changed, 1, safe)
            if bool(hit.any()):
                self.window[rows] = torch.where(
                    hit[..., None],
                    torch.gather(x, 1, safe[..., None].expand(-1, -1, self.dim)),
                    self.window[rows],
                )
            changed = changed & ~self.in_window(rows, n)
        if not bool(changed.any()):
            return
        if self.along == "channels":
            r, s = changed.nonzero(as_tuple=True)
            self._store_tokens(r + (rows.start or 0), s, x[r, s])
            return
        end = -(-n // self.group) * self.group
        pad = end - n
        xs = _padded(x, pad)
        members = _padded(valid & ~self.in_window(rows, n), pad)
        touched = _padded(changed, pad)
        touched = touched.view(x.shape[0], end // self.group, self.group).any(-1)  # (R', groups)
        codes, lo, scale = quantize(xs, self.bits, self.group, "slots", members)
        old_codes = unpack(self.codes[rows, :n], self.bits)
        keep = touched[:, :, None].expand(-1, -1, self.group).reshape(x.shape[0], end)[:, :n]
        self.codes[rows, :n] = pack(torch.where(keep[..., None], codes[:, :n], old_codes), self.bits)
        self.lo[rows, : end // self.group] = torch.where(
            touched[..., None], lo, self.lo[rows, : end // self.group]
        )
        self.scale[rows, : end // self.group] = torch.where(
            touched[..., None], scale, self.scale[rows, : end // self.group]
        )

    def take(
        self,
        rows: slice,
        other: QuantizedStates,
        other_rows: slice,
        index: torch.Tensor,
        x: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:
        """Fill `rows` (empty) with `other`'s slots `index` `(R', S)` of `other_rows`, whose current values
        are `x` `(R', S, D)`: window entries follow their slots, the other kept slots are quantized again in
        their new groups; `valid` `(R', >= S)` of the new slots."""
        s = index.shape[1]
        old = other.window_slot[other_rows]
        if old.numel():
            new = follow(old, index)
            self.window_slot[rows] = new
            self.window_pos[rows] = other.window_pos[other_rows].masked_fill(new < 0, -1)
            self.window[rows] = other.window[other_rows]
        valid = valid[:, :s]
        self.write(rows, x, valid.clone(), valid)

    def forget(self, rows: slice, gone: torch.Tensor) -> None:
        """Freed slots `gone` `(R', n)` bool leave the window."""
        slot = self.window_slot[rows]
        if not slot.numel():
            return
        out = leaving(slot, gone)
        if bool(out.any()):
            self._leave(rows, out)

    def _leave(self, rows: slice, out: torch.Tensor) -> None:
        """Window entries `out` `(R', W)` bool leave the window."""
        self.window_slot[rows] = self.window_slot[rows].masked_fill(out, -1)
        self.window_pos[rows] = self.window_pos[rows].masked_fill(out, -1)

    def _store_tokens(self, r: torch.Tensor, s: torch.Tensor, x: torch.Tensor) -> None:
        """Per-token groups: quantize tokens `x` `(E, D)` into rows `r` and slots `s` `(E,)` (absolute
        rows)."""
        codes, lo, scale = quantize(x[None], self.bits, self.group, "channels")
        self.codes[r, s] = pack(codes[0], self.bits)
        self.lo[r, s], self.scale[r, s] = lo[0], scale[0]

    def append(
        self, rows: slice, slots: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """New tokens: slots `(R', q)`, values `(R', q, D)`, positions `(q,)`, one at a time into the window,
        which flushes as the scheme says; `valid` `(R', n)` (the new slots included) for the per-channel
        groups' ranges."""
        for j in range(slots.shape[1]):
            self._append_one(rows, slots[:, j], x[:, j], positions[j], valid)

    def _append_one(
        self, rows: slice, slot: torch.Tensor, x: torch.Tensor, position: torch.Tensor, valid: torch.Tensor
    ) -> None:
        n = valid.shape[1]
        w = self.window_slot.shape[1]
        r = torch.arange(slot.shape[0], device=x.device)
        base = rows.start or 0
        if w == 0:  # no window: quantized at once
            if self.along == "channels":
                self._store_tokens(r + base, slot, x)
                return
            values = self.read(rows, n)
            values[r, slot] = x.to(self.dtype)
            changed = torch.zeros(values.shape[:2], dtype=torch.bool, device=x.device)
            changed[r, slot] = True
            self.write(rows, values, changed, valid)
            return
        wslot, wpos = self.window_slot[rows], self.window_pos[rows]
        stale = wslot == slot[:, None]  # a slot reused while its old token was still in the window
        if bool(stale.any()):
            self.window_slot[rows] = wslot.masked_fill(stale, -1)
            wslot = self.window_slot[rows]
        full = (wslot >= 0).all(-1)
        if self.mode == "slide" and bool(full.any()):  # the oldest leaves the window, quantized
            oldest = wpos.masked_fill(wslot < 0, torch.iinfo(torch.long).max).argmin(-1)
            self._flush(rows, full[:, None] & (torch.arange(w, device=x.device) == oldest[:, None]), valid)
            wslot = self.window_slot[rows]
        entry = (wslot < 0).int().argmax(-1)  # the first empty entry of each row
        self.window[r + base, entry] = x.to(self.dtype)
        self.window_slot[r + base, entry] = slot
        self.window_pos[r + base, entry] = position
        if self.mode == "block":
            full = (self.window_slot[rows] >= 0).all(-1)
            if bool(full.any()):
                self._flush(rows, full[:, None].expand(-1, w), valid)

    def _flush(self, rows: slice, leaving: torch.Tensor, valid: torch.Tensor) -> None:
        """Window entries `leaving` `(R', W)` bool are quantized into their slots and leave the window."""
        slot = self.window_slot[rows]
        leaving = leaving & (slot >= 0)
        r, e = leaving.nonzero(as_tuple=True)
        slots = slot[r, e]  # a copy: `slot` is a view of the window, cleared below
        if self.along == "channels":  # the leaving tokens are stored from the window
            self._store_tokens(r + (rows.start or 0), slots, self.window[rows][r, e])
            self._leave(rows, leaving)
            return
        values = self.read(rows, valid.shape[1])  # the leaving ones as they are
        self._leave(rows, leaving)  # out of the window, so that they are stored
        changed = torch.zeros(values.shape[:2], dtype=torch.bool, device=values.device)
        changed[r, slots] = True
        self.write(rows, values, changed, valid)


def _padded(t: torch.Tensor, pad: int) -> torch.Tensor:
    """`t` `(R', n, ...)` with `pad` zero slots after its `n` (`t` itself, no copy, when `pad` is 0)."""
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) if pad else t


def seal(
    storage: Storage, name: str, x: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, capacity: int
) -> QuantizedStates:
    """A prompt's compressed keys or values `x` `(R, n, D)` (positions and validity `(R, n)`) into quantized
    storage (low-rank storage: `kvlens.kvcache.lowrank`): the window takes each row's newest valid tokens
    (KIVI's prefill: the last `n mod R` keys, the last `R` values) and the rest is quantized."""
    r, n, d = x.shape
    states = QuantizedStates(storage, name, r, capacity, d, x.dtype, x.device)
    count = valid.sum(-1)  # (R,)
    w = storage.residual
    if w:
        take = count % w if states.mode == "block" else count.clamp(max=w)  # (R,)
        newest = pos.masked_fill(~valid, -1).sort(-1, descending=True)  # newest first
        k = min(w, n)
        chosen = torch.arange(k, device=x.device)[None] < take[:, None]  # (R, k)
        slots = newest.indices[:, :k]
        states.window_slot[:, :k] = slots.masked_fill(~chosen, -1)
        states.window_pos[:, :k] = newest.values[:, :k].masked_fill(~chosen, -1)
        states.window[:, :k] = torch.gather(x, 1, slots[..., None].expand(-1, -1, d)).to(x.dtype)
    states.write(slice(0, r), x, valid.clone(), valid)
    return states
