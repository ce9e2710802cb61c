"""Quantized KV storage: KIVI's asymmetric group quantization, packed (Liu et al., ICML 2024, "KIVI: A Tuning-Free
Asymmetric 2bit Quantization for KV Cache", Sec. 3-4).

`Storage` is a run's storage axis, independent of its policy. `bits` None keeps the model's dtype; 2, 4 or 8 store
keys and values as codes packed 8 // bits to a byte, with a float16 zero point (the group's minimum) and scale per
group: scale = (max - min) / (2^bits - 1), code = round((x - min) / scale) clamped, x^ = code * scale + min.
- scheme "kivi" (the paper's): keys per channel in groups of `group` consecutive slots, values per token in groups
  of `group` channels; the newest tokens stay in full precision: keys until `residual` of them have arrived, then
  those are quantized at once (KIVI's R, a multiple of `group`), values in a sliding window of the newest `residual`
  (KIVI Algorithm 1 and its code: the prompt's last `T mod R` keys and last `R` values stay in full precision).
- scheme "token": keys and values per token (groups of `group` channels), both in a sliding window of `residual`.

Slots are reused after evictions (see `kvlens.kvcache.cache`), so a key group can mix old and new tokens: a group is
quantized again, from its members' current (dequantized) values, whenever one of its slots changes (a new token
flushed from the full-precision window, a policy's merge). KIVI never evicts, so it never does this; with no
eviction the groups are KIVI's exactly. Re-quantizing a group whose range did not change gives back the same codes.

`QuantizedStates` holds one of keys or values for R rows (KV heads) x C slots: codes `(R, C, D * bits / 8)` uint8,
zero points and scales `(R, ceil(C / group), D)` (per channel) or `(R, C, D / group)` (per token) float16, and the
full-precision window: values `(R, W, D)` in the model's dtype, their slots and positions `(R, W)` (slot -1: empty).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlens.errors import KvlensError

BITS = (2, 4, 8)
SCHEMES = ("kivi", "token")
APPENDS = ("project", "full")


@dataclass(frozen=True)
class Storage:
    """How a run stores its keys and values (see the module docstring); `bits=None`: the model's dtype."""

    bits: int | None = None
    scheme: str = "kivi"
    group: int = 64  # transformers' QuantizedCache default (q_group_size=64); KIVI's paper mostly 32
    residual: int = (
        0  # KIVI's R (32-128 in the paper): off by default, see docs/experiments.md, "Quantized storage"
    )
    rank: int | None = (
        None  # low-rank storage (`kvlens.kvcache.lowrank`): coefficients per slot, at this rank
    )
    rank_share: float | None = (
        None  # ... or the largest rank whose bytes are at most this share of the full cache's
    )
    rank_layers: int | None = None  # xKV: one SVD per group of this many adjacent layers (None: per KV head)
    rank_append: str = "project"  # later tokens projected onto the basis, or held at "full" width

    def __post_init__(self):
        if self.rank is not None and self.rank_share is not None:
            raise KvlensError("Give --kv-rank or --kv-rank-share, not both.")
        if self.rank is not None and self.rank < 1:
            raise KvlensError(f"--kv-rank must be at least 1 (got {self.rank}).")
        if self.rank_share is not None and not 0 < self.rank_share <= 1:
            raise KvlensError(
                f"--kv-rank-share must be in (0, 1], a share of the full cache's bytes "
                f"(got {self.rank_share})."
            )
        if not self.low_rank and (self.rank_layers is not None or self.rank_append != "project"):
            raise KvlensError(
                "--kv-rank-layers and --kv-rank-append need low-rank storage: add --kv-rank or "
                "--kv-rank-share."
            )
        if self.rank_layers is not None and self.rank_layers < 1:
            raise KvlensError(f"--kv-rank-layers must be at least 1 (got {self.rank_layers}).")
        if self.rank_append not in APPENDS:
            raise KvlensError(
                f"--kv-rank-append must be one of {', '.join(APPENDS)} (got {self.rank_append!r})."
            )
        if self.rank_layers is not None and self.rank_append == "project":
            raise KvlensError(
                "Cross-layer low rank (--kv-rank-layers) needs --kv-rank-append full: a new token's "
                "shared coefficients need the keys of every layer of its group, and the first layer "
                "attends before the last has computed its own."
            )
        if self.low_rank and self.bits is not None and self.residual:
            raise KvlensError(
                "--kv-residual does not apply to low-rank storage, whose quantized coefficients have "
                "no full-precision window (use --kv-rank-append full for full-width new tokens)."
            )
        if self.bits is not None and self.bits not in BITS:
            raise KvlensError(f"--kv-bits must be one of {', '.join(map(str, BITS))} (got {self.bits}).")
        if self.scheme not in SCHEMES:
            raise KvlensError(f"--kv-scheme must be one of {', '.join(SCHEMES)} (got {self.scheme!r}).")
        if self.group < 1 or self.residual < 0:
            raise KvlensError("--kv-group must be at least 1 and --kv-residual at least 0.")
        if self.scheme == "kivi" and self.residual % self.group:
            raise KvlensError(
                f"KIVI's full-precision window (--kv-residual {self.residual}) must be a multiple of "
                f"its group size (--kv-group {self.group}): keys leave it a whole group at a time."
            )

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def low_rank(self) -> bool:
        return self.rank is not None or self.rank_share is not None

    @property
    def packed(self) -> bool:
        """Keys and values leave the model's dtype buffers (quantized or low-rank)."""
        return self.quantized or self.low_rank

    def check(self, head_dim: int, kv_heads: int = 1) -> None:
        """Refuse, in one sentence, a rank above what a factor can hold (the head size, or per group of layers
        their `kv_heads` heads' channels), quantized coefficients that do not pack or tile into groups, or a group
        that does not tile a head's `head_dim` channels (groups of channels: KIVI's values, both for the token
        scheme); a group of `head_dim` or more is one group per token."""
        width = head_dim * kv_heads * self.rank_layers if self.rank_layers else head_dim
        if self.rank is not None and self.rank > width:
            what = f"the {self.rank_layers} layers' channels" if self.rank_layers else "the model's head size"
            raise KvlensError(
                f"--kv-rank {self.rank} is above {what} ({width}); a rank of {width} stores every channel."
            )
        if (
            self.rank is not None
            and self.quantized
            and not (
                self.rank % (8 // self.bits) == 0 and (self.rank <= self.group or self.rank % self.group == 0)
            )
        ):
            packs = f"a multiple of {8 // self.bits} (to pack at {self.bits} bits), " if self.bits < 8 else ""
            raise KvlensError(
                f"--kv-rank {self.rank} does not fit quantized coefficients in groups of --kv-group "
                f"{self.group}: pick {packs}at most the group or a multiple of it."
            )
        if self.quantized and not self.low_rank and head_dim % min(self.group, head_dim):
            fits = ", ".join(str(g) for g in (8, 16, 32, 64, 128) if g <= head_dim and head_dim % g == 0)
            raise KvlensError(
                f"--kv-group {self.group} does not divide the model's head size ({head_dim}): groups "
                f"of channels must tile it; pick {fits or head_dim}."
            )

    def along(self, name: str) -> str:
        """How `name` ("keys"/"values") is grouped: "slots" (per channel, groups of slots) or "channels"."""
        return "slots" if self.scheme == "kivi" and name == "keys" else "channels"

    def window(self, name: str) -> str:
        """How `name` leaves the full-precision window: "block" (all at once, KIVI's keys) or "slide" (oldest)."""
        return "block" if self.along(name) == "slots" else "slide"

    @classmethod
    def of(cls, described: dict | None) -> Storage:
        """The storage a run.json or a grid cell recorded (`describe()`'s dict; None: the model's dtype)."""
        return cls(
            **{
                k: v
                for k, v in (described or {}).items()
                if k
                in ("bits", "scheme", "group", "residual", "rank", "rank_share", "rank_layers", "rank_append")
            }
        )

    def describe(self) -> dict:
        """What run.json records: `{"bits": None}` for the model's dtype, with the rank for low-rank storage (and
        the coefficients' bits and group when quantized)."""
        if self.low_rank:
            return {
                "bits": self.bits,
                "rank": self.rank,
                "rank_share": self.rank_share,
                "rank_layers": self.rank_layers,
                "rank_append": self.rank_append,
                **({"group": self.group} if self.quantized else {}),
            }
        if not self.quantized:
            return {"bits": None}
        return {
            "bits": self.bits,
            "scheme": self.scheme,
            "group": self.group,
            "residual": self.residual,
            "scale_dtype": "float16",
        }


def slot_mask(slots: torch.Tensor, n: int) -> torch.Tensor:
    """`(R, n)` bool: the slots named in `slots` `(R, E)` (-1 entries name none)."""
    mask = torch.zeros(slots.shape[0], n + 1, dtype=torch.bool, device=slots.device)
    return mask.scatter_(1, slots.masked_fill(slots < 0, n), True)[:, :n]


def _grid16(lo: torch.Tensor, hi: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float16 zero point and scale of groups with float32 range [lo, hi] whose grid lo16 + k * scale16,
    k = 0..top, still covers [lo, hi]: lo16 rounds down and scale16 up (rounding both to nearest loses up to
    |lo| * 2^-11, many steps of a narrow group far from zero, e.g. values 100.0-101.0 at 8 bits). A constant
    group keeps the nearest float16 and scale 0."""
    spread = hi > lo
    lo16 = lo.half()
    lo16 = torch.where(
        spread & (lo16.float() > lo), torch.nextafter(lo16, torch.full_like(lo16, float("-inf"))), lo16
    )
    scale16 = torch.where(spread, (hi - lo16.float()) / top, 0).half()
    short = lo16.float() + scale16.float() * top < hi
    return lo16, torch.where(short, torch.nextafter(scale16, torch.full_like(scale16, float("inf"))), scale16)


def quantize(
    x: torch.Tensor, bits: int, group: int, along: str, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x` `(R, n, D)` -> codes `(R, n, D)` uint8, zero points and scales float16: `(R, n / group, D)` along "slots"
    (n a multiple of `group`; `valid` `(R, n)`: only valid slots set a group's range) or `(R, n, D / group)` along
    "channels". A group without a valid member, or constant, gets scale 0 (codes 0, x^ = its minimum)."""
    r, n, d = x.shape
    top = 2**bits - 1
    xf = x.float()
    if along == "slots":
        g = xf.view(r, n // group, group, d)
        if valid is None:
            lo, hi = g.amin(2), g.amax(2)
        else:
            m = valid.view(r, n // group, group, 1)
            lo = g.masked_fill(~m, float("inf")).amin(2)
            hi = g.masked_fill(~m, float("-inf")).amax(2)
            empty = ~m.any(2)
            lo, hi = lo.masked_fill(empty, 0), hi.masked_fill(empty, 0)
        lo16, scale16 = _grid16(lo, hi, top)
        lo_x, sc_x = lo16.float()[:, :, None], scale16.float()[:, :, None]
    else:
        width = min(group, d)
        g = xf.view(r, n, d // width, width)
        lo, hi = g.amin(-1), g.amax(-1)
        lo16, scale16 = _grid16(lo, hi, top)
        lo_x, sc_x = lo16.float()[..., None], scale16.float()[..., None]
    codes = torch.where(sc_x > 0, ((g - lo_x) / sc_x.clamp(min=1e-30)).round(), 0).clamp_(0, top)
    return codes.to(torch.uint8).view(r, n, d), lo16, scale16


def dequantize(
    codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, group: int, along: str, dtype: torch.dtype
) -> torch.Tensor:
    """Codes `(R, n, D)` and their group's zero points and scales (see `quantize`) -> `(R, n, D)` in `dtype`."""
    r, n, d = codes.shape
    c = codes.float()
    if along == "slots":
        out = c.view(r, n // group, group, d) * scale.float()[:, :, None] + lo.float()[:, :, None]
    else:
        width = min(group, d)
        out = c.view(r, n, d // width, width) * scale.float()[..., None] + lo.float()[..., None]
    return out.view(r, n, d).to(dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes `(..., D)` uint8 below 2^bits -> `(..., D * bits / 8)` uint8: 8 // bits codes a byte, low bits first."""
    per = 8 // bits
    if per == 1:
        return codes
    c = codes.view(*codes.shape[:-1], codes.shape[-1] // per, per).int()
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: `(..., D * bits / 8)` -> codes `(..., D)` uint8."""
    per = 8 // bits
    if per == 1:
        return packed
    shifts = torch.arange(per, device=packed.device, dtype=torch.uint8) * bits
    return ((packed[..., None] >> shifts) & (2**bits - 1)).flatten(-2)


class QuantizedStates:
    """One of a store's keys or values, quantized and packed, with its full-precision window (module docstring).

    Rows are KV heads; `read` dequantizes, `write` stores changed slots, `append` adds new tokens to the window
    (flushing it as the scheme says), `forget` drops freed slots from the window.
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

    def clone(self) -> QuantizedStates:
        new = object.__new__(QuantizedStates)
        vars(new).update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()})
        return new

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
        slot = self.window_slot[rows]
        if slot.numel() and bool((slot >= 0).any()):
            r, e = (slot >= 0).nonzero(as_tuple=True)
            out[r, slot[r, e]] = self.window[rows][r, e]
        return out

    def in_window(self, rows: slice, n: int) -> torch.Tensor:
        """`(R', n)` bool: the slots held in full precision."""
        return slot_mask(self.window_slot[rows], n)

    def roundtrip(self, rows: slice, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`x` `(R', n, D)` (e.g. the original values of the rows' slots) as this storage would hold them now: the
        window's slots unchanged, the rest quantized and dequantized in this layout (the perturbation meter's
        storage-only error)."""
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
        """Store the `changed` `(R', n)` slots of `x` `(R', n, D)` (every slot's current value; `valid` `(R', n)`):
        in the window where a slot is there, else quantized (per-channel groups from their members' values)."""
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
        xs = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
        members = valid & ~self.in_window(rows, n)
        members = torch.nn.functional.pad(members, (0, pad)) if pad else members
        touched = torch.nn.functional.pad(changed, (0, pad)) if pad else changed
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
        """Fill `rows` (empty) with `other`'s slots `index` `(R', S)` of `other_rows`, whose current values are `x`
        `(R', S, D)`: window entries follow their slots, the other kept slots are quantized again in their new
        groups; `valid` `(R', >= S)` of the new slots."""
        s = index.shape[1]
        old = other.window_slot[other_rows]
        if old.numel():
            n_old = int(index.max()) + 1 if index.numel() else 0
            n_old = max(n_old, int(old.max()) + 1)
            inverse = torch.full((index.shape[0], n_old + 1), -1, dtype=torch.long, device=index.device)
            inverse.scatter_(1, index, torch.arange(s, device=index.device).expand_as(index).contiguous())
            new = torch.where(old >= 0, torch.gather(inverse, 1, old.masked_fill(old < 0, n_old)), -1)
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
        out = (slot >= 0) & torch.gather(gone, 1, slot.clamp(min=0).clamp(max=gone.shape[1] - 1))
        if bool(out.any()):
            self.window_slot[rows] = slot.masked_fill(out, -1)
            self.window_pos[rows] = self.window_pos[rows].masked_fill(out, -1)

    def _store_tokens(self, r: torch.Tensor, s: torch.Tensor, x: torch.Tensor) -> None:
        """Per-token groups: quantize tokens `x` `(E, D)` into rows `r` and slots `s` `(E,)` (absolute rows)."""
        codes, lo, scale = quantize(x[None], self.bits, self.group, "channels")
        self.codes[r, s] = pack(codes[0], self.bits)
        self.lo[r, s], self.scale[r, s] = lo[0], scale[0]

    def append(
        self, rows: slice, slots: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """New tokens: slots `(R', q)`, values `(R', q, D)`, positions `(q,)`, one at a time into the window, which
        flushes as the scheme says; `valid` `(R', n)` (the new slots included) for the per-channel groups' ranges."""
        for j in range(slots.shape[1]):
            self._append_one(rows, slots[:, j], x[:, j], positions[j], valid)

    def _append_one(self, rows, slot, x, position, valid) -> None:
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
        values = (
            self.read(rows, valid.shape[1]) if self.along == "slots" else None
        )  # the leaving ones as they are
        self.window_slot[rows] = slot.masked_fill(leaving, -1)  # out of the window, so that they are stored
        self.window_pos[rows] = self.window_pos[rows].masked_fill(leaving, -1)
        if values is None:  # along channels: the leaving tokens are stored from the window
            self._store_tokens(r + (rows.start or 0), slots, self.window[rows][r, e])
        else:
            changed = torch.zeros(values.shape[:2], dtype=torch.bool, device=values.device)
            changed[r, slots] = True
            self.write(rows, values, changed, valid)


def seal(storage: Storage, name: str, x: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, capacity: int):
    """A prompt's compressed keys or values `x` `(R, n, D)` (positions and validity `(R, n)`) into quantized storage
    (low-rank storage: `kvlens.kvcache.lowrank`): the window takes each row's newest valid tokens (KIVI's prefill:
    the last `n mod R` keys, the last `R` values) and the rest is quantized."""
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
