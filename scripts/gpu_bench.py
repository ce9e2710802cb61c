"""The GPU run of the speed benchmark, in one command that fits a lent GPU's few minutes: every policy's speed
table on the embedded model in bf16 (`kvlens bench speed --device cuda --dtype bfloat16`), and the 8B-shaped
run (`scripts/bench_shape.py`: a random-init Llama-3.1-8B shape at 32k tokens, full against h2o, snapkv and
adakv at ratio 0.5), each with the GPU's peak memory (`torch.cuda.max_memory_allocated`).

    python scripts/gpu_bench.py [--out results/cuda] [--parts smoke,shape,table] [--model default]
        [--steps 16] [--device cuda] [--dtype bfloat16] [--resume]

- smoke: every policy of the table on 256 prompt tokens, 4 steps, on the device. A policy that fails is named
  with its error and left out of the table, so that one failure does not cost the whole lent run.
- shape: `bench_shape.py` into `OUT/bench_shape_8b.json`.
- table: `bench speed` with every policy that passed, in the every-policy lockstep at 1024, 4096 and 8160
  tokens, 3 rounds, `--steps` generated tokens per run (16: half the CPU table's, to fit the lease), written
  to `OUT/bench_speed.json` and `.csv`. Each length's ratios stream to `OUT/bench_speed.lengths.jsonl` as
  they are measured, so a lease that ends mid-table keeps the lengths it finished, and `--parts table
  --resume` goes on from there on the next lease.

The settings are sized for a lent GPU's few minutes; no GPU has timed the whole command yet. Each part's
seconds go into `OUT/gpu_bench.json` as it ends. `tests/bench/test_gpu_bench.py` runs it on the CPU (`--device
cpu --dtype float32`, the shape part with `--shape tiny`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlens.cli import main as kvlens_main  # noqa: E402
from kvlens.engine.models import load_model  # noqa: E402
from kvlens.experiments.bench.common import PolicySpec  # noqa: E402
from kvlens.experiments.bench.speed import engine_once  # noqa: E402
from kvlens.policies import policy_names  # noqa: E402
from kvlens.texts import bundled, prefix_ids  # noqa: E402
from scripts import bench_shape  # noqa: E402

PARTS = ("smoke", "shape", "table")  # the bounded parts first: the table streams what it finishes


def smoke(model_spec: str, device: str, dtype: str, tokens: int = 256, steps: int = 4) -> dict[str, str]:
    """Every registered policy on `tokens` prompt tokens and `steps` steps at half budget: the ones that fail,
    each with its error (empty when all pass)."""
    model = load_model(model_spec, device=device, dtype=dtype)
    ids = prefix_ids(model, next(iter(bundled().values())), tokens, "The text")
    failed = {}
    for name in policy_names():
        try:
            engine_once(model, PolicySpec(name), ids, steps, 0.5)
        except Exception as err:  # noqa: BLE001 - named, and the policy left out of the table
            failed[name] = f"{type(err).__name__}: {err}"
            print(f"gpu_bench: {name} failed on {device}: {failed[name]}", file=sys.stderr)
    return failed


def table(
    out: Path, model_spec: str, device: str, dtype: str, steps: int, left_out: list[str], resume: bool = False
) -> int:
    """`kvlens bench speed` on the device, every policy but `left_out`, into `out` (`resume`: going on with a
    table cut short there, `kvlens bench speed --resume`)."""
    names = [n for n in policy_names() if n not in left_out]
    return kvlens_main(
        [
            "bench",
            "speed",
            "--model",
            model_spec,
            "--device",
            device,
            "--dtype",
            dtype,
            "--steps",
            str(steps),
            "--policies",
            ";".join(names),
            "--lockstep",
            ",".join(n for n in names if n != "full"),
            "--evict-lengths",
            "1024,4096,8192",
            "--out-dir",
            str(out),
            "--no-figure",
            *(["--resume"] if resume else []),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/cuda", help="where the JSON files go")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, among {', '.join(PARTS)}")
    p.add_argument("--model", default="default", help="the table's model (the embedded one by default)")
    p.add_argument("--steps", type=int, default=16, help="generated tokens per run of the table")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shape", default="llama-8b", help="bench_shape.py's --shape")
    p.add_argument("--tokens", type=int, default=32768, help="bench_shape.py's --tokens")
    p.add_argument("--resume", action="store_true", help="the table goes on with a table cut short in --out")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not parts or set(parts) - set(PARTS):
        print(f"gpu_bench: --parts takes some of {', '.join(PARTS)}; got '{args.parts}'.", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    status: dict = {"parts": parts, "device": args.device, "dtype": args.dtype, "seconds": {}}
    rc = 0
    failed: dict[str, str] = {}
    for part in parts:
        t = time.perf_counter()
        if part == "smoke":
            failed = smoke(args.model, args.device, args.dtype)
            status["failed"] = failed
        elif part == "table":
            rc |= table(out, args.model, args.device, args.dtype, args.steps, list(failed), args.resume)
        else:
            rc |= bench_shape.main(
                [
                    "--shape",
                    args.shape,
                    "--tokens",
                    str(args.tokens),
                    "--device",
                    args.device,
                    "--dtype",
                    args.dtype,
                    "--json",
                    str(out / f"bench_shape_{args.shape.replace('llama-', '')}.json"),
                ]
            )
        status["seconds"][part] = round(time.perf_counter() - t, 1)
        print(f"gpu_bench: {part} took {status['seconds'][part]:.0f} s", flush=True)
        (out / "gpu_bench.json").write_text(json.dumps(status, indent=1) + "\n", encoding="utf-8")
    return 1 if failed or rc else 0


if __name__ == "__main__":
    raise SystemExit(main())
