"""Measure how far stored float references move across ATen kernel sets and thread counts.

    python scripts/float_envelope.py [--configs default:1,default:2,avx2:1,avx2:2] [--out FILE.json]

Each configuration (`ATEN_CPU_CAPABILITY:OMP_NUM_THREADS`) re-runs, in a fresh process, every
golden case (`tests/data/golden_runs.json`) and every kvpress case
(`tests/data/kvpress_reference.json`), and reports the largest absolute and relative deviation
of the per-step NLL (and of the perturbation summaries) from the stored values, and whether
every decision and kept count is identical. The tolerances of `tests/cross_checks/test_golden_runs.py` and
`tests/cross_checks/test_kvpress_crosscheck.py` are set from this measurement (their docstrings quote it).
A capability the CPU lacks (e.g. avx512 on an AVX2 machine) falls back silently in ATen, so
the script prints the capability each process really used.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"


def deviation(got: list[float], want: list[float]) -> dict:
    pairs = list(zip(got, want, strict=True))
    return {
        "abs": max(abs(a - b) for a, b in pairs),
        "rel": max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs),
    }


def inside() -> dict:
    """In the configured process: every golden and kvpress case against its stored values."""
    import torch

    from kvlens.engine.loop import RunOptions, run
    from kvlens.engine.models import load_model
    from kvlens.policies import make_policy
    from scripts.make_golden_runs import check_case, one, stored_rows

    model = load_model("default")
    golden = json.loads((DATA / "golden_runs.json").read_text(encoding="utf-8"))
    out = {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "golden": {},
        "kvpress": {},
        "kvpress_prompt": {},
    }
    for case, want in golden["cases"].items():
        got = one(model, golden["ids"], want["policy"], want["params"], measure=case.endswith(":measured"))
        entry = {
            "nll": deviation(got["nll"], want["nll"]),
            "weights": deviation(got["weights"], want["weights"]),
            "structural_equal": check_case(got, want, stored_rows(case)) is None,
        }
        if "perturbation" in want:
            entry["perturbation"] = {
                k: deviation([got["perturbation"][k]], [v]) for k, v in want["perturbation"].items()
            }
        out["golden"][case] = entry
    ref = json.loads((DATA / "kvpress_reference.json").read_text(encoding="utf-8"))
    for case, spec in ref["cases"].items():
        r = run(
            model,
            make_policy(spec["policy"], spec["params"]),
            ref["ids"],
            prefill=ref["prefill"],
            steps=ref["steps"],
            teacher=True,
            opts=RunOptions(budget=ref["budget"]),
        )
        out["kvpress"][case] = {"nll": deviation(r.tensors["steps/nll"].tolist(), spec["nll"])}
    from kvlens.experiments.api import encode
    from kvlens.texts import DIR
    from tests.cross_checks.test_kvpress_crosscheck import removed_by_step, same_tokens

    shape, prompt = model.shape(), ref["prompt"]
    for case, spec in ref["prompt_cases"].items():
        for i, want in enumerate(spec["runs"]):
            ids = encode(model, (DIR / want["text"]).read_text(encoding="utf-8"))[
                : prompt["prefill"] + prompt["steps"]
            ]
            r = run(
                model,
                make_policy(spec["policy"], spec["params"]),
                ids,
                prefill=prompt["prefill"],
                steps=prompt["steps"],
                teacher=True,
                opts=RunOptions(budget=want["budget"]),
            )
            got = removed_by_step(r.decisions[r.decisions.step == 0], 1, shape["layers"], shape["kv_heads"])[
                0
            ]
            same = got == want["removed"]
            tie = (
                not same
                and spec["policy"] == "knorm"
                and got[1:] == want["removed"][1:]
                and same_tokens(got[0], ids) == same_tokens(want["removed"][0], ids)
            )  # copies of a token in layer 0 (the test's rule)
            entry = {"structural_equal": same or tie, "tie_broken_otherwise": tie}
            if same:  # a tie broken the other way removes other positions: another NLL
                entry["nll"] = deviation(r.tensors["steps/nll"].tolist(), want["nll"])
            out["kvpress_prompt"][f"{case}/{i}"] = entry
    return out


def summary(results: dict) -> dict:
    """The largest deviation of each kind over every configuration and case."""
    worst: dict = {}
    for res in results.values():
        for group in ("golden", "kvpress", "kvpress_prompt"):
            for entry in res[group].values():
                for kind, dev in entry.items():
                    if kind == "tie_broken_otherwise":
                        continue
                    if kind == "structural_equal":
                        worst["all_structural_equal"] = worst.get("all_structural_equal", True) and dev
                        continue
                    devs = dev.values() if kind == "perturbation" else [dev]
                    for d in devs:
                        w = worst.setdefault(f"{group}.{kind}", {"abs": 0.0, "rel": 0.0})
                        w["abs"], w["rel"] = max(w["abs"], d["abs"]), max(w["rel"], d["rel"])
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="default:1,default:2,avx2:1,avx2:2,avx512:2")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        print(json.dumps(inside()))
        return 0
    results = {}
    for config in args.configs.split(","):
        capability, threads = config.split(":")
        env = {
            **os.environ,
            "ATEN_CPU_CAPABILITY": capability,
            "OMP_NUM_THREADS": threads,
            "PYTHONPATH": str(ROOT),
        }
        done = subprocess.run(
            [sys.executable, __file__, "--inside"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        results[config] = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            config,
            "ran as",
            results[config]["capability"],
            results[config]["threads"],
            "threads:",
            json.dumps(summary({config: results[config]})),
            flush=True,
        )
    report = {"configs": results, "worst": summary(results)}
    print(json.dumps(report["worst"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
