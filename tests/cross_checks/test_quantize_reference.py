"""kvlens's quantized KV storage (`kvlens.kvcache.quantize`) against Hugging Face optimum-quanto, and by hand.

The reference values come from `scripts/crosscheck_quanto.py` (its own virtualenv with optimum-quanto; the
file records the versions and the command; its docstring lists exactly where quanto's scheme differs from
kvlens's); this test needs no quanto. Both are asymmetric min-max quantizers, scale (max - min) / (2^b - 1),
code round((x - min) / scale), on the same groups: kvlens `along="slots"` is quanto's axis -1 (per channel,
groups of consecutive tokens), `along="channels"` its axis 0 (per token, groups of consecutive channels). They
differ in the precision of min and scale (kvlens float16, quanto x's dtype), so codes may differ by one near a
rounding boundary.

- The relative Frobenius error of the round trip is within a factor {factor} of quanto's in every case
  (measured ratio: 0.9986-1.0034 in float32, 0.9776-1.0006 in float16, where quanto also computes in float16).
  On this tensor quanto's own errors differ by 1.14x or more between group sizes 32 and 64, by 1.56x or more
  between the two groupings; kvlens broken (in a scratch copy) to one bit fewer gave ratios 1.95-3.6, rounding
  by floor 1.8-2.0, half the group size along slots 0.81, groups of strided tokens up to 1.09.
- Element-wise, on a slice across group boundaries and outlier channels, kvlens's and quanto's x^ agree within
  one step of the element's group (quanto's scale, `step`) where a code differs by one, plus float16 rounding:
  2^-10 (top * step + |x^|), top = 2^b - 1, the size of the group's range and of the value (kvlens's float16
  min and scale; quanto's float16 arithmetic, x + shift and scale * code, in the float16 cases). Measured: at
  most 0.999 step in float32, 1.016 step in float16, so a code off by two, or a step of another group, fails
  (interleaved channel groups, which leave the error ratio at 0.97-1.003, gave gaps of 3 steps).
- By hand: 2-bit codes, zero points, scales and x^ of a tiny tensor along both axes, ties rounding half to
  even (both use `torch.round`), packing, and a constant group.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvlens.kvcache.quantize import dequantize, pack, quantize, unpack
from tests.conftest import TEST_DATA

REFERENCE = json.loads((TEST_DATA / "quanto_reference.json").read_text(encoding="utf-8"))
ERROR_FACTOR = 1.05  # twice the largest measured deviation of the error ratio from 1 (docstring)
__doc__ = __doc__.format(factor=ERROR_FACTOR)


def build_x() -> torch.Tensor:
    """The reference tensor, float32 `(R, n, D)`: the recipe `scripts/crosscheck_quanto.py` records."""
    spec = REFERENCE["x"]
    r, n, d = spec["shape"]
    g = torch.Generator().manual_seed(spec["seed"])
    scale = (0.25 + 1.5 * torch.arange(d) / d) * (0.75 + 0.5 * torch.rand(d, generator=g))
    scale[spec["outliers"]] *= 10
    bias = torch.randn(d, generator=g)
    slope = 2 * torch.randn(d, generator=g)
    return torch.randn(r, n, d, generator=g) * scale + bias + torch.linspace(-1, 1, n)[:, None] * slope


X = build_x()


def roundtrip(x: torch.Tensor, bits: int, group: int, along: str) -> torch.Tensor:
    codes, lo, scale = quantize(x, bits, group, along)
    return dequantize(codes, lo, scale, group, along, x.dtype)


def test_the_tensor_is_the_references():
    spec = REFERENCE["x"]
    assert float(X.double().sum()) == pytest.approx(spec["sum"], rel=1e-12)
    assert float(X.double().abs().sum()) == pytest.approx(spec["abs_sum"], rel=1e-12)
    assert X[0, 0, :4].tolist() == spec["first"]
    assert len(REFERENCE["cases"]) == 24  # 2 groupings x bits 2, 4, 8 x groups 32, 64 x float32, float16
    assert {c["bits"] for c in REFERENCE["cases"].values()} == {2, 4, 8}


@pytest.mark.parametrize("case", sorted(REFERENCE["cases"]))
def test_error_within_a_factor_of_quantos(case):
    spec = REFERENCE["cases"][case]
    x = X.to(getattr(torch, spec["dtype"]))
    y = roundtrip(x, spec["bits"], spec["group"], spec["along"])
    assert y.shape == x.shape and y.dtype == x.dtype
    rel = float((y.double() - x.double()).norm() / x.double().norm())
    ratio = rel / spec["rel_error"]
    assert 1 / ERROR_FACTOR <= ratio <= ERROR_FACTOR, (
        f"kvlens's error {rel:.5f} vs quanto's {spec['rel_error']:.5f}"
    )


@pytest.mark.parametrize("case", sorted(REFERENCE["cases"]))
def test_dequantized_values_within_one_step_of_quantos(case):
    spec, where = REFERENCE["cases"][case], REFERENCE["slice"]
    x = X.to(getattr(torch, spec["dtype"]))
    y = roundtrip(x, spec["bits"], spec["group"], spec["along"])
    idx = torch.meshgrid(*(torch.tensor(where[k]) for k in ("rows", "tokens", "channels")), indexing="ij")
    mine = y[idx].double()
    theirs = torch.tensor(spec["slice"], dtype=torch.float64)
    step = torch.tensor(spec["step"], dtype=torch.float64)
    assert bool((step > 0).all())
    gap = (mine - theirs).abs()
    allowed = step + 2**-10 * ((2 ** spec["bits"] - 1) * step + theirs.abs())  # + float16 rounding, docstring
    assert bool((gap <= allowed).all()), f"largest gap {float((gap / step).max()):.3f} step"


# -- by hand
# -------------------------------------------------------------------------------------------------------- (1,
# 8, 4): along "slots", group 4, per channel: tokens 0-3 and 4-7 are two groups of each channel.
HAND = torch.tensor(
    [
        [
            [0.0, -3.0, 1.0, 5.0],
            [1.0, 0.5, 1.25, 5.0],
            [2.0, 1.5, 1.75, 5.0],
            [3.0, 3.0, 2.5, 5.0],
            [10.0, 0.25, -8.0, 2.0],
            [-2.0, 0.5, -7.0, 3.0],
            [4.0, 1.0, -6.5, 2.0],
            [0.0, 1.0, -5.0, 3.0],
        ]
    ]
)
# 2 bits: scale = (max - min) / 3. Per group (tokens 0-3, then 4-7), channels 0..3:
#   0-3: min 0, -3, 1, 5; scale 1, 2, 0.5, 0 (constant)
#   4-7: min -2, 0.25, -8, 2; scale 4, 0.25, 1, 1/3 -> float16 rounded up, 0.33349609375 (1366 / 4096),
#        so that min + 3 * scale reaches the max
HAND_LO = [[[0.0, -3.0, 1.0, 5.0], [-2.0, 0.25, -8.0, 2.0]]]
HAND_SCALE = [[[1.0, 2.0, 0.5, 0.0], [4.0, 0.25, 1.0, 0.33349609375]]]
# code = round((x - min) / scale), half to even: channel 1 (x + 3) / 2 = 1.75, 2.25 -> 2, 2; channel 2 (x - 1)
# / 0.5 = 0.5, 1.5 -> 0, 2; channel 0 of 4-7 (x + 2) / 4 = 1.5, 0.5 -> 2, 0; channel 3 of 4-7 1 / 0.3335 =
# 2.9985 -> 3
HAND_CODES = [
    [
        [0, 0, 0, 0],
        [1, 2, 0, 0],
        [2, 2, 2, 0],
        [3, 3, 3, 0],
        [3, 0, 0, 0],
        [0, 1, 1, 3],
        [2, 3, 2, 0],
        [0, 3, 3, 3],
    ]
]
# x^ = code * scale + min; 3 * 1366 / 4096 + 2 = 3.00048828125 (the float16 scale, not 3)
HAND_X = [
    [
        [0.0, -3.0, 1.0, 5.0],
        [1.0, 1.0, 1.0, 5.0],
        [2.0, 1.0, 2.0, 5.0],
        [3.0, 3.0, 2.5, 5.0],
        [10.0, 0.25, -8.0, 2.0],
        [-2.0, 0.5, -7.0, 3.00048828125],
        [6.0, 1.0, -6.0, 2.0],
        [-2.0, 1.0, -5.0, 3.00048828125],
    ]
]


def test_two_bit_codes_by_hand_per_channel():
    codes, lo, scale = quantize(HAND, 2, 4, "slots")
    assert codes.dtype == torch.uint8 and lo.dtype == scale.dtype == torch.float16
    assert lo.tolist() == HAND_LO and scale.tolist() == HAND_SCALE  # (R, n / group, D)
    assert codes.tolist() == HAND_CODES
    assert dequantize(codes, lo, scale, 4, "slots", torch.float32).tolist() == HAND_X


def test_two_bit_codes_by_hand_per_token():
    """The same numbers transposed, `(1, 4, 8)` along "channels", group 4: each token's channels 0-3 and 4-7
    are the groups above, so everything comes out transposed (written out)."""
    codes, lo, scale = quantize(HAND.transpose(1, 2).contiguous(), 2, 4, "channels")
    assert lo.tolist() == [[[0.0, -2.0], [-3.0, 0.25], [1.0, -8.0], [5.0, 2.0]]]  # (R, n, D / group)
    assert scale.tolist() == [[[1.0, 4.0], [2.0, 0.25], [0.5, 1.0], [0.0, 0.33349609375]]]
    assert codes.tolist() == [
        [
            [0, 1, 2, 3, 3, 0, 2, 0],
            [0, 2, 2, 3, 0, 1, 3, 3],
            [0, 0, 2, 3, 0, 1, 2, 3],
            [0, 0, 0, 0, 0, 3, 0, 3],
        ]
    ]
    assert dequantize(codes, lo, scale, 4, "channels", torch.float32).tolist() == [
        [
            [0.0, 1.0, 2.0, 3.0, 10.0, -2.0, 6.0, -2.0],
            [-3.0, 1.0, 1.0, 3.0, 0.25, 0.5, 1.0, 1.0],
            [1.0, 1.0, 2.0, 2.5, -8.0, -7.0, -6.0, -5.0],
            [5.0, 5.0, 5.0, 5.0, 2.0, 3.00048828125, 2.0, 3.00048828125],
        ]
    ]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(
        0, 2**bits, (2, 3, 16), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8
    )
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 16 * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)


def test_pack_layout_by_hand():
    """8 // bits consecutive codes to a byte, the first in the low bits."""
    assert pack(torch.tensor([[0, 1, 2, 3]], dtype=torch.uint8), 2).tolist() == [[0b11100100]]  # 228
    assert pack(torch.tensor([[1, 15, 7, 0]], dtype=torch.uint8), 4).tolist() == [[0xF1, 0x07]]
    assert pack(torch.tensor([[200, 7]], dtype=torch.uint8), 8).tolist() == [[200, 7]]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("along", ["slots", "channels"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_constant_group_dequantizes_exactly(bits, along, dtype):
    """Scale 0, code 0, x^ = the stored minimum: exact for any value float16 holds (float16 and bfloat16
    states in float16's range; 1.3 in float32 comes back as float16's 1.3, where quanto, keeping x's dtype, is
    exact)."""
    x = torch.full((2, 8, 8), -1.3, dtype=dtype)
    x[1] = 0.0
    x[0, 4:, 4:] = 3.0  # other groups' values do not leak in
    codes, lo, scale = quantize(x, bits, 4, along)
    assert bool((scale == 0).all()) and bool((codes == 0).all())
    y = dequantize(codes, lo, scale, 4, along, dtype)
    if dtype == torch.float32:
        assert torch.equal(y, x.half().float())
        assert not torch.equal(y, x) and float((y - x).abs().max()) <= 1.3 * 2**-11
        assert REFERENCE["constant_group"]["exact"], "quanto keeps a float32 constant exactly"
    else:
        assert torch.equal(y, x)
