"""Quantized KV storage: KIVI's asymmetric group quantization, packed (Liu et al., ICML 2024, "KIVI: A
Tuning-Free Asymmetric 2bit Quantization for KV Cache", Sec. 3-4).

`Storage` is a run's storage axis, independent of its policy. `bits` None keeps the model's dtype; 2, 4 or 8
store keys and values as codes packed 8 // bits to a byte, with a float16 zero point (the group's minimum) and
scale per group: scale = (max - min) / (2^bits - 1), code = round((x - min) / scale) clamped, x^ = code *
scale + min.
- scheme "kivi" (the paper's): keys per channel in groups of `group` consecutive slots, values per token in
  groups of `group` channels; the newest tokens stay in full precision: keys until `residual` of them have
  arrived, then those are quantized at once (KIVI's R, a multiple of `group`), values in a sliding window of
  the newest `residual` (KIVI Algorithm 1 and its code: the prompt's last `T mod R` keys and last `R` values
  stay in full precision).
- scheme "token": keys and values per token (groups of `group` channels), both in a sliding window of
  `residual`.

Slots are reused after evictions (see `kvlens.kvcache.views`), so a key group can mix old and new tokens: a
group is quantized again, from its members' current (dequantized) values, whenever one of its slots changes (a
new token flushed from the full-precision window, a policy's merge). KIVI never evicts, so it never does this;
with no eviction the groups are KIVI's exactly. Re-quantizing a group whose range did not change gives back
the same codes.

This module holds the storage axis and the quantizer (`quantize`, `dequantize`, `pack`, `unpack`); the packed
storage of a store's keys or values is `kvlens.kvcache.kivi.QuantizedStates` (a
`kvlens.kvcache.packed.PackedStates`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlens.errors import KvlensError

BITS = (2, 4, 8)
SCHEMES = ("kivi", "token")
APPENDS = ("project", "full")
ALONG = {("kivi", "keys"): "slots"}  # (scheme, name) grouped per channel, in groups of slots; else "channels"
WINDOWS = {"slots": "block", "channels": "slide"}  # how a grouping leaves the full-precision window


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

    def __post_init__(self) -> None:
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
        their `kv_heads` heads' channels), quantized coefficients that do not pack or tile into groups, or a
        group that does not tile a head's `head_dim` channels (groups of channels: KIVI's values, both for the
        token scheme); a group of `head_dim` or more is one group per token."""
        width, what = head_dim, "the model's head size"
        if self.rank_layers:
            width, what = head_dim * kv_heads * self.rank_layers, f"the {self.rank_layers} layers' channels"
        if self.rank is not None and self.rank > width:
            raise KvlensError(
                f"--kv-rank {self.rank} is above {what} ({width}); a rank of {width} stores every channel."
            )
        if (
            self.rank is not None
            and self.bits is not None
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
        return ALONG.get((self.scheme, name), "channels")

    def window(self, name: str) -> str:
        """How `name` leaves the full-precision window: "block" (all at once, KIVI's keys) or "slide"
        (oldest)."""
        return WINDOWS[self.along(name)]

    @classmethod
    def of(cls, described: dict[str, Any] | None) -> Storage:
        """The storage a run.json or a grid cell recorded (`describe()`'s dict; None: the model's dtype)."""
        return cls(
            **{
                k: v
                for k, v in (described or {}).items()
                if k
                in ("bits", "scheme", "group", "residual", "rank", "rank_share", "rank_layers", "rank_append")
            }
        )

    def describe(self) -> dict[str, Any]:
        """What run.json records: `{"bits": None}` for the model's dtype, with the rank for low-rank storage
        (and the coefficients' bits and group when quantized)."""
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
    """`x` `(R, n, D)` -> codes `(R, n, D)` uint8, zero points and scales float16: `(R, n / group, D)` along
    "slots" (n a multiple of `group`; `valid` `(R, n)`: only valid slots set a group's range) or `(R, n, D /
    group)` along "channels". A group without a valid member, or constant, gets scale 0 (codes 0, x^ = its
    minimum)."""
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
    """Codes `(R, n, D)` and their group's zero points and scales (see `quantize`) -> `(R, n, D)` in
    `dtype`."""
    r, n, d = codes.shape
    c = codes.float()
    if along == "slots":
        out = c.view(r, n // group, group, d) * scale.float()[:, :, None] + lo.float()[:, :, None]
    else:
        width = min(group, d)
        out = c.view(r, n, d // width, width) * scale.float()[..., None] + lo.float()[..., None]
    return out.view(r, n, d).to(dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes `(..., D)` uint8 below 2^bits -> `(..., D * bits / 8)` uint8: 8 // bits codes a byte, low bits
    first."""
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
    codes: torch.Tensor = ((packed[..., None] >> shifts) & (2**bits - 1)).flatten(-2)
    return codes
