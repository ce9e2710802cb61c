"""Independent reference values from Hugging Face optimum-quanto for
`tests/cross_checks/test_quantize_reference.py`.

    python scripts/crosscheck_quanto.py [--venv DIR] [--torch-index URL]

This script builds its own virtualenv (default `~/.cache/kvlens/quanto-venv`, never inside the repository),
installs the pinned optimum-quanto and torch there (`--torch-index`, e.g.
https://download.pytorch.org/whl/cpu, where a plain install would pull CUDA wheels), re-runs itself inside it
and writes `tests/data/quanto_reference.json`: how the test tensor is built (seed and recipe, not the tensor),
per case the relative Frobenius and max abs error of quanto's quantize-dequantize round trip and a slice of
its dequantized values with each element's quantization step, quanto's versions and this command. CI never
installs quanto.

The cases: a KV-shaped float tensor x `(R, n, D)` = (3, 128, 64) (rows: KV heads; per-channel scales and
offsets, three outlier channels, like real keys; see `build_x`), in float32 and float16, bits 2, 4, 8, group
sizes 32 and 64, both groupings. kvlens `along="slots"` (per channel, `group` consecutive tokens: KIVI's keys)
is quanto's `axis=-1`; kvlens `along="channels"` (per token, `group` consecutive channels: KIVI's values,
kvlens's "token" scheme) is quanto's `axis=0`.

What optimum-quanto 0.2.7 does, read from its source (`tensor/optimizers/max_optimizer.py`,
`tensor/optimizers/affine_optimizer.py`, `tensor/grouped.py`, `library/quantize.py`, `tensor/qbits.py`,
`tensor/weights/quantization.py`, `tensor/packed.py`), and how transformers' `QuantoQuantizedLayer` calls it
(`cache_utils.py`: `scale, zeropoint = MaxOptimizer()(t, qtype, axis, q_group_size)`, then `quantize_weight(t,
qtype, axis, scale, zeropoint, q_group_size)` and `.dequantize()`, on `(B, H, T, D)` states):
- Same rule. `MaxOptimizer`: scale = (max - min) / (qmax - qmin) with qmin = -2^(b-1), qmax = 2^(b-1) - 1,
  i.e. (max - min) / (2^b - 1), and shift = -min; `quantize_affine` (float shift): code = round((x + shift) /
  scale) clamped to [0, 2^b - 1] (`torch.round`: half to even, as kvlens); dequantize: scale * code - shift.
  That is kvlens's code = round((x - min) / scale), x^ = code * scale + min, with the same min-max range per
  group.
- Zero point: a float, -min (transformers never passes `zeropoint=True`, which would round shift / scale to an
  integer uint8 zero point). kvlens's is a float too, +min.
- Precision of scale and zero point: quanto keeps them in x's dtype (float32 here; float16/bfloat16 for a
  model's states) and does all the arithmetic in that dtype, x + shift included. kvlens computes in float32
  and stores min and scale as float16 always, min rounded down and scale up so that [min16, min16 + top *
  scale16] still covers [min, max]; its codes are computed from those float16 values (so x^ is consistent with
  what is stored). For float32 input this is the only difference: codes may differ by one where (x - min) /
  scale lies near a rounding boundary, and x^ by the float16 rounding of min and scale (under 2^-11 relative
  each, so at most about 0.12 step at 8 bits). Where |min| is large against the group's range, float16 cannot
  hold min finely: every value stays within half a stored step, but that step grows (at 8 bits every value of
  a group spanning -3001.3..-3000.3 comes back within 0.87 of a step of its range, (max - min) / 255; rounding
  min to nearest put some 220 steps off). quanto in float32 is exact there; in float16 or bfloat16 states it
  rounds its shift too.
- Grouping. quanto's `group(t, axis, group_size)` works on the flattened tensor. axis=0: `t.reshape(-1,
  group_size)`, min/max over each row: groups of `group_size` consecutive elements in memory, i.e. for a
  contiguous `(..., T, D)` state, consecutive channels of one token, and for group_size > D a group spans
  group_size / D consecutive tokens (kvlens: one group per token, width min(group, D)). axis=-1: `t.reshape(G,
  group_size, D).permute(1, 2, 0).reshape(group_size, D * G)`, min/max over dim 0: per channel d, groups of
  `group_size` consecutive rows of the `(B*H*T, D)` matrix; scale/shift `(1, D * G)`, column d * G + g. Groups
  run across the flattened B, H, T, so with T not a multiple of group_size a group straddles two heads (and
  quanto raises unless B*H*T is a multiple); kvlens groups each row's slots separately (n a multiple of
  `group`, padded, invalid slots masked out of the range). With T a multiple of group_size, as here, the
  groups are the same.
- transformers' defaults, axis_key = axis_value = 0, are per token (groups of channels) for keys too, not
  KIVI's per-channel keys (the class docstring's "per-channel" means quanto's axis 0); KIVI's keys are
  axis_key=-1. transformers accepts nbits 2 and 4 only for quanto (its qint2/qint4 `WeightQBitsTensor`).
- 8 bits: quanto's qint8 weights (`quantize_weight` -> `WeightQBytesTensor`) are symmetric (absmax scale, no
  shift) and refuse a group size, so there is no 8-bit affine grouped path in quanto's API. The 8-bit cases
  use quanto's own primitives with the same calls: `MaxOptimizer()(x, qint8, axis, group)` (scale over 255
  levels, shift = -min), `torch.ops.quanto.quantize_affine(x, bits=8, ...)`, and `QBitsDequantizer`'s formula
  (scale * code - shift, then `ungroup`). For 2 and 4 bits the script asserts that this primitive path equals
  `quantize_weight(...).dequantize()` exactly.
- A constant group: quanto's scale is 0 and the code (x + shift) / 0 = 0 / 0 = NaN, cast to uint8 (undefined
  in C++; 0 on x86), but x^ = 0 * code + min = min exactly. kvlens gives scale 0, code 0, x^ = min.
- Packing (storage only, not the values): quanto packs 2/4-bit codes along the grouped tensor's first
  dimension, planar (byte j holds rows j, j + rows/k, ... at bit offsets 0, b, ...); kvlens packs along the
  last dimension, 8 // b consecutive codes to a byte, low bits first.
- transformers' `QuantizedLayer` re-quantizes the whole dequantized cache at every flush of its residual
  window (a KV state is quantized again and again); kvlens re-quantizes only groups whose members changed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "quanto_reference.json"
VENV = Path.home() / ".cache" / "kvlens" / "quanto-venv"
PINS = ["optimum-quanto==0.2.7", "torch==2.13.0"]
SHAPE, SEED, OUTLIERS = (3, 128, 64), 0, (3, 17, 40)
BITS, GROUPS, DTYPES = (2, 4, 8), (32, 64), ("float32", "float16")
AXIS = {"slots": -1, "channels": 0}  # kvlens `along` -> quanto axis
# the slice of x^ stored per case: rows x tokens x channels, across group boundaries and outlier channels
SLICE = {"rows": [0, 2], "tokens": [0, 31, 32, 63, 64, 127], "channels": [0, 3, 31, 32, 40, 63]}
RECIPE = (
    "g = torch.Generator().manual_seed(SEED); "
    "scale = (0.25 + 1.5 * torch.arange(D) / D) * (0.75 + 0.5 * torch.rand(D, generator=g)); "
    "scale[OUTLIERS] *= 10; bias = torch.randn(D, generator=g); slope = 2 * torch.randn(D, generator=g); "
    "x = torch.randn(R, n, D, generator=g) * scale + bias + torch.linspace(-1, 1, n)[:, None] * slope  "
    "(float32; the float16 cases: x.half())"
)


def build_x(torch):
    """The test tensor, float32 `SHAPE` (RECIPE; `tests/cross_checks/test_quantize_reference.py` builds the
    same): like keys, per-channel offsets and scales (growing with the channel index, three outlier channels)
    and a slow drift along the positions, so that consecutive tokens and neighbouring channels are alike and a
    group of other members (strided tokens, interleaved channels) has another range."""
    r, n, d = SHAPE
    g = torch.Generator().manual_seed(SEED)
    scale = (0.25 + 1.5 * torch.arange(d) / d) * (0.75 + 0.5 * torch.rand(d, generator=g))
    scale[list(OUTLIERS)] *= 10
    bias = torch.randn(d, generator=g)
    slope = 2 * torch.randn(d, generator=g)
    return torch.randn(r, n, d, generator=g) * scale + bias + torch.linspace(-1, 1, n)[:, None] * slope


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--venv", type=Path, default=VENV, help="virtualenv for optimum-quanto (built if missing)"
    )
    parser.add_argument("--torch-index", help="pip --index-url for torch (e.g. the CPU wheels' index)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        return reference()
    python = args.venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(args.venv)], check=True)
        torch_pin = [p for p in PINS if p.startswith("torch")]
        index = ["--index-url", args.torch_index] if args.torch_index else []
        subprocess.run([str(python), "-m", "pip", "install", "-q", *index, *torch_pin, "numpy"], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PINS], check=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # quanto's own stack only
    subprocess.run([str(python), __file__, "--inside"], check=True, env=env)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


def roundtrip(x, bits: int, group: int, axis: int):
    """quanto's quantize-dequantize of `x` with transformers' `QuantoQuantizedLayer` calls (8 bits: the same
    primitives, see the module docstring) -> (x^, each element's step (its group's scale), the codes)."""
    import torch
    from optimum.quanto import MaxOptimizer, qint2, qint4, qint8, quantize_weight
    from optimum.quanto.tensor import ungroup

    qtype = {2: qint2, 4: qint4, 8: qint8}[bits]
    scale, shift = MaxOptimizer()(x, qtype, axis, group)
    codes = torch.ops.quanto.quantize_affine(
        x, bits=bits, axis=axis, group_size=group, scale=scale, shift=shift
    )
    y = ungroup(scale * codes - shift, axis=axis, orig_shape=x.shape)  # `QBitsDequantizer` with a float shift
    step = ungroup(scale.expand(codes.shape), axis=axis, orig_shape=x.shape)
    if bits in (2, 4):
        q = quantize_weight(x, qtype, axis, scale, shift, group)
        assert type(q).__name__ == "WeightQBitsTensor", type(q)
        assert torch.equal(q.dequantize(), y), "the primitive path must be quantize_weight's"
    assert y.dtype == x.dtype
    return y, step, ungroup(codes, axis=axis, orig_shape=x.shape)


def reference() -> int:
    """Inside the quanto virtualenv: every case's round trip, written as JSON."""
    from importlib.metadata import version

    import torch

    x32 = build_x(torch)
    idx = torch.meshgrid(*(torch.tensor(SLICE[k]) for k in ("rows", "tokens", "channels")), indexing="ij")
    cases = {}
    for dtype in DTYPES:
        x = x32.to(getattr(torch, dtype))
        for along, axis in AXIS.items():
            for bits in BITS:
                for group in GROUPS:
                    y, step, codes = roundtrip(x, bits, group, axis)
                    err = y.double() - x.double()
                    cases[f"{along}-{bits}bit-g{group}-{dtype}"] = {
                        "along": along,
                        "quanto_axis": axis,
                        "bits": bits,
                        "group": group,
                        "dtype": dtype,
                        "rel_error": float(err.norm() / x.double().norm()),
                        "max_abs_error": float(err.abs().max()),
                        "max_code": int(codes.max()),
                        "slice": y[idx].tolist(),
                        "step": step[idx].tolist(),
                    }
    const = torch.full((1, 64, 64), 1.3)  # one value: every group constant
    const_y, _, const_codes = roundtrip(const, 2, 32, -1)
    result = {
        "command": "python scripts/crosscheck_quanto.py",
        "versions": {p: version(p) for p in ("optimum-quanto", "torch")},
        "x": {
            "shape": list(SHAPE),
            "seed": SEED,
            "outliers": list(OUTLIERS),
            "recipe": RECIPE,
            "sum": float(x32.double().sum()),
            "abs_sum": float(x32.double().abs().sum()),
            "first": x32[0, 0, :4].tolist(),
        },
        "slice": SLICE,
        "error": "rel_error = ||x^ - x||_F / ||x||_F, max_abs_error = max |x^ - x|, "
        "in float64 from x's dtype",
        "constant_group": {
            "value": 1.3,
            "bits": 2,
            "group": 32,
            "axis": -1,
            "exact": bool(torch.equal(const_y, const)),
            "codes": sorted(set(const_codes.flatten().tolist())),
        },
        "cases": cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    head = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in result.items() if k != "cases"]
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in cases.items())  # one line per case
    OUT.write_text("{\n" + "\n".join(head) + '\n "cases": {\n' + body + "\n }\n}\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
