"""The first finding of `kvlens explain`: how small is the smallest sufficient set, and where does it sit?

On the task suite's niah_single and niah_multikey samples at 1024 tokens whose full cache answers right, for
StreamingLLM, H2O, SnapKV, Expected Attention and KVzip at r = 0.5 and 0.75, wherever the policy answers
wrong: the greedy smallest set of (layer, KV head) groups whose restore makes the answer right again (`kvlens
explain --by head --find-minimal`). Writes results/explain.{json,csv,png}; each case's row is appended to
results/explain.rows.jsonl as it finishes, so a second run resumes where the first stopped.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/explain_finding.py [--limit-minutes M]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kvlens.engine.models import load_model
from kvlens.engine.shared_prefill import SharedPrefill
from kvlens.experiments.bench import ruler
from kvlens.experiments.bench.common import bootstrap, environment, save_results
from kvlens.explain.case import build, sample_case
from kvlens.explain.explain import explain_built
from kvlens.policies import make_policy

POLICIES = ["streaming_llm", "h2o", "snapkv", "expected_attention", "kvzip"]
RATIOS = [0.5, 0.75]
TASKS, LENGTH, COUNT, SEED = ["niah_single", "niah_multikey"], 1024, 8, 0
# the conventions the finding was made under (`kvlens bench tasks --depths random --rounding kvlens`)
DEPTHS, ROUNDING = "random", "kvlens"
ROOT = Path(__file__).resolve().parent.parent
SMALL = (1, 3, 5, 10)  # the share of cases whose minimal set has at most this many (layer, KV head) groups


def samples_file(model, out: Path) -> Path:
    """The suite's samples (`kvlens bench tasks --tasks niah_single,niah_multikey --lengths 1024 --depths
    random --dump-samples`), interleaved by index so that a partial run covers both tasks."""
    from kvlens.texts import bundled

    count = lambda s: len(model.tokenizer(s, add_special_tokens=False).input_ids)  # noqa: E731
    samples = [
        ruler.generate(t, LENGTH, i, count, " ".join(bundled().values()), seed=SEED, depths=DEPTHS)
        for i in range(COUNT)
        for t in TASKS
    ]
    path = out / "explain.samples.jsonl"
    ruler.write_samples(samples, path)
    return path


def run_cases(model, path: Path, rows_path: Path, deadline: float) -> None:
    done = {(r["task"], r["index"], r["policy"], r["ratio"]) for r in read_rows(rows_path)}
    for line, sample in enumerate(ruler.read_samples(path)):
        index = line // 2
        todo = [(p, r) for p in POLICIES for r in RATIOS if (sample.task, index, p, r) not in done]
        shared = None
        for policy, ratio in todo:
            if time.time() > deadline:
                return
            case = sample_case(model, sample, policy, ratio, about={"index": index}, rounding=ROUNDING)
            if shared is None:
                shared = SharedPrefill(model, case.context, [make_policy(p) for p in POLICIES])
            built = build(case, shared)
            row = {
                "task": sample.task,
                "index": index,
                "policy": policy,
                "ratio": ratio,
                "full_right": built.answers["full_right"],
                "compressed_right": built.answers["compressed_right"],
            }
            if row["full_right"] and not row["compressed_right"]:
                result = explain_built(built, ["head"], minimal_by="head")
                m = result["minimal"]
                row.update(
                    gap=result["lp_full"] - result["lp_compressed"],
                    slots_removed=result["slots_removed"],
                    found=m["found"],
                    right=m.get("right"),
                    minimal_groups=len(m["groups"]),
                    minimal_slots=m["slots"],
                    minimal_layers=m.get("layers", []),
                    minimal_heads=m["groups"],
                    seconds=result["cost"]["total_s"],
                    patched_caches=result["cost"]["patched_caches"],
                )
            with rows_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


def read_rows(path: Path) -> list[dict]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


def interval(values: list[float]) -> list[float]:
    return list(bootstrap([values])) if values else [None, None]


def summarise(rows: list[dict], layers: int) -> dict:
    """Minimal-set sizes (slots, groups) per policy and ratio and over all, with bootstrap 95 % intervals of
    the mean; and per layer, the share of minimal sets that restore something there."""
    fixed = [r for r in rows if r.get("found")]
    cells = {}
    for key, sub in [(("all", None), fixed)] + [
        ((p, q), [r for r in fixed if (r["policy"], r["ratio"]) == (p, q)]) for p in POLICIES for q in RATIOS
    ]:
        wrong = [
            r
            for r in rows
            if r["full_right"]
            and not r["compressed_right"]
            and (key[0] == "all" or (r["policy"], r["ratio"]) == key)
        ]
        slots = [r["minimal_slots"] for r in sub]
        shares = [r["minimal_slots"] / r["slots_removed"] for r in sub]
        cells[f"{key[0]}@{key[1]}" if key[1] else "all"] = {
            "wrong_cases": len(wrong),
            "fixed": len(sub),
            "slots_median": statistics.median(slots) if slots else None,
            "slots_mean": statistics.fmean(slots) if slots else None,
            "slots_mean_ci": interval(slots),
            "share_of_removed_mean": statistics.fmean(shares) if shares else None,
            "share_of_removed_mean_ci": interval(shares),
            "groups_median": statistics.median(r["minimal_groups"] for r in sub) if sub else None,
            "fixed_by_at_most": {
                k: {"share": statistics.fmean(at) if at else None, "ci": interval(at)}
                for k in SMALL
                for at in [[float(r["minimal_groups"] <= k) for r in sub]]
            },
        }
    by_layer = []
    for layer in range(layers):
        hit = [float(layer in r["minimal_layers"]) for r in fixed]
        by_layer.append(
            {"layer": layer, "share_of_sets": statistics.fmean(hit) if hit else None, "ci": interval(hit)}
        )
    return {"cells": cells, "layers": by_layer}


def figure(summary: dict, rows: list[dict]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    import kvlens.figures.plots  # noqa: F401  registers the "kvlens" paper template

    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=["smallest sufficient set (slots restored)", "layers the sets fall in"],
        column_widths=[0.55, 0.45],
    )
    fixed = [r for r in rows if r.get("found")]
    names = [f"{p}@{q}" for p in POLICIES for q in RATIOS]
    for name in names:
        ys = [r["minimal_slots"] for r in fixed if f"{r['policy']}@{r['ratio']}" == name]
        if ys:
            fig.add_trace(go.Box(y=ys, name=name, boxpoints="all", showlegend=False), 1, 1)
    layers = summary["layers"]
    fig.add_trace(
        go.Bar(
            x=[lay["layer"] for lay in layers],
            y=[lay["share_of_sets"] for lay in layers],
            error_y={
                "type": "data",
                "symmetric": False,
                "array": [(lay["ci"][1] or 0) - (lay["share_of_sets"] or 0) for lay in layers],
                "arrayminus": [(lay["share_of_sets"] or 0) - (lay["ci"][0] or 0) for lay in layers],
            },
            showlegend=False,
        ),
        1,
        2,
    )
    fig.update_yaxes(type="log", title_text="slots (log)", row=1, col=1)
    fig.update_yaxes(title_text="share of sets restoring there", range=[0, 1.02], row=1, col=2)
    fig.update_xaxes(title_text="layer", row=1, col=2)
    fig.update_layout(
        title=f"Why the compressed cache got the needle wrong ({len(fixed)} cases)",
        width=1300,
        height=560,
        margin={"b": 140},
        template="kvlens",
    )
    return fig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument(
        "--limit-minutes", type=float, default=600.0, help="stop starting cases after this long"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model("default")
    path = out / "explain.samples.jsonl"
    if not path.exists():
        path = samples_file(model, out)
    rows_path = out / "explain.rows.jsonl"
    run_cases(model, path, rows_path, time.time() + 60 * args.limit_minutes)
    rows = read_rows(rows_path)
    summary = summarise(rows, model.shape()["layers"])
    total = len(TASKS) * COUNT * len(POLICIES) * len(RATIOS)
    result = {
        "command": "OMP_NUM_THREADS=1 python scripts/explain_finding.py",  # resumes: the rows so far stay
        "config": {
            "tasks": TASKS,
            "length": LENGTH,
            "count": COUNT,
            "seed": SEED,
            "policies": POLICIES,
            "ratios": RATIOS,
            "by": "head",
            "criterion": "greedy answer right again",
            "rows": "results/explain.rows.jsonl, appended case by case by every invocation (resumable); "
            "each row's seconds were measured on its own invocation's machine state",
        },
        "environment": environment(model),
        "threads": torch.get_num_threads(),
        "cases_total": total,
        "cases_done": len(rows),
        "status": "complete" if len(rows) == total else "partial",
        "summary": summary,
        "rows": rows,
    }
    csv_rows = [
        {k: (" ".join(map(str, v)) if isinstance(v, list) else v) for k, v in r.items()} for r in rows
    ]
    keys = list(dict.fromkeys(k for r in csv_rows for k in r))
    save_results(
        result, [{k: r.get(k) for k in keys} for r in csv_rows], figure(summary, rows), out, "explain"
    )
    print(json.dumps(summary["cells"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
