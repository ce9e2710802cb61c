"""Record every policy's decisions, kept counts and NLLs as the reference the engine must keep.

    python scripts/make_golden_runs.py [--cases a,b]   # writes tests/data/golden_runs.json +
    golden_decisions.parquet

Structural facts are stored explicitly and compared exactly by `tests/cross_checks/test_golden_runs.py`:
every decision row (step, layer, KV head, action, position, merge targets, Bernoulli draw) in
`golden_decisions.parquet`, and the kept count of every step, layer and KV head in the JSON; the
kept positions follow from them. Floats (per-step NLL, per-step sums of merge weights and
probabilities, the perturbation summary) are compared within the envelope measured by
`scripts/float_envelope.py` across kernel sets and thread counts. The cases were recorded
before the slot-reusing cache replaced the append-and-gather one, so a layout that moves a
decision fails. Regenerate only for an intended change of a policy's behaviour (`--cases`
rewrites only those cases).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from kvlens.engine.loop import RunOptions, run
from kvlens.engine.models import load_model
from kvlens.engine.perturbation import measured
from kvlens.policies import make_policy, policy_names

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
OUT, ROWS = DATA / "golden_runs.json", DATA / "golden_decisions.parquet"
TEXT = "kvlens/data/state_union/1946-Truman.txt"
PREFILL, STEPS, BUDGET = 64, 24, 0.5
EXTRA = {  # variants whose code paths the defaults do not reach
    "cam:preset=paper": ("cam", {"preset": "paper"}),
    "cam:preset=kvpress": ("cam", {"preset": "kvpress"}),
    "cam:base=h2o": ("cam", {"base": "h2o"}),
    "cam:base=tova": ("cam", {"base": "tova"}),
    "scissorhands:drop=4": ("scissorhands", {"drop": 4}),
    "weightedkv:merge=false": ("weightedkv", {"merge": False}),
}
MEASURED = ("cam", "h2o")  # also compare the perturbation summary
STRUCTURE = ["step", "layer", "kv_head", "action", "position", "targets", "draw"]  # compared exactly


def cases() -> dict[str, tuple[str, dict]]:
    out = {name: (name, {}) for name in policy_names()}
    out.update(EXTRA)
    return out


def structure(decisions: pd.DataFrame) -> pd.DataFrame:
    """The decision rows' structural columns, sorted, with plain Python-comparable types."""
    rows = pd.DataFrame(
        {
            "step": decisions.step.astype("int64"),
            "layer": decisions.layer.astype("int64"),
            "kv_head": decisions.kv_head.astype("int64"),
            "action": decisions.action.astype(str),
            "position": decisions.position.astype("int64"),
            "targets": [tuple(int(t) for t in ts) for ts in decisions.targets],
            "draw": decisions.draw.astype("int64"),
        }
    )
    return rows.sort_values(STRUCTURE).reset_index(drop=True)


def step_weights(decisions) -> list[float]:
    """Per step, the sum of every merge weight and Bernoulli probability (floats: compared with a
    tolerance)."""
    return [
        float(sum(sum(w) for w in rows.weights) + rows.prob.fillna(0).sum())
        for rows in (decisions[decisions.step == step] for step in range(STEPS + 1))
    ]


def one(model, ids, policy: str, params: dict, measure: bool) -> dict:
    """One case: NLLs, kept counts `(steps + 1, L, Hkv)`, decision rows (`structure`), weight sums."""
    pol = make_policy(policy, params)
    budget = None if pol.budget_free else BUDGET

    def go(observers, on_step):
        return run(
            model,
            pol,
            ids,
            prefill=PREFILL,
            steps=STEPS,
            teacher=True,
            opts=RunOptions(budget=budget),
            observers=observers,
            on_step=on_step,
        )

    r = measured(model, go, [], None) if measure else go([], None)
    out = {
        "policy": policy,
        "params": params,
        "nll": r.tensors["steps/nll"].tolist(),
        "kv_slots": r.tensors["steps/kv_slots"].tolist(),
        "weights": step_weights(r.decisions),
        "rows": structure(r.decisions),
    }
    if measure:
        out["perturbation"] = {
            k: r.metrics[k]
            for k in ("perturbation_used_pooled", "perturbation_evict_pooled", "kl", "merge_better_share")
        }
    return out


def stored_rows(case: str) -> pd.DataFrame:
    table = pd.read_parquet(ROWS)
    rows = table[table.case == case].drop(columns="case")
    return structure(rows.assign(targets=[tuple(t) for t in rows.targets]))


def check_case(got: dict, want: dict, want_rows: pd.DataFrame) -> str | None:
    """The first structural difference between a re-run and the stored case, in one sentence; None if
    equal."""
    for step, (a, b) in enumerate(zip(got["kv_slots"], want["kv_slots"], strict=True)):
        if a != b:
            layer = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            return f"kept counts differ at step {step}, layer {layer}: {a[layer]} against {b[layer]} stored"
    mine, theirs = got["rows"], want_rows
    for i in range(max(len(mine), len(theirs))):
        a = tuple(mine.iloc[i]) if i < len(mine) else None
        b = tuple(theirs.iloc[i]) if i < len(theirs) else None
        if a != b:
            return f"decision row {i} (sorted by {', '.join(STRUCTURE)}) is {a} but {b} is stored"
    return None


def write_rows(results: dict[str, dict]) -> None:
    frames = [r["rows"].assign(case=case) for case, r in results.items()]
    table = pd.concat(frames, ignore_index=True)[["case", *STRUCTURE]]
    table["targets"] = [list(t) for t in table.targets]
    table.to_parquet(ROWS, compression="zstd", index=False)


def write_json(result: dict) -> None:
    """One case per line, so a diff shows which cases changed."""
    head = {k: v for k, v in result.items() if k != "cases"}
    lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    cases_ = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in result["cases"].items()]
    OUT.write_text(
        "{\n" + "\n".join(lines) + '\n "cases": {\n' + ",\n".join(cases_) + "\n }\n}\n", encoding="utf-8"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated case names to rewrite (default: all)")
    args = parser.parse_args()
    model = load_model("default")
    ids = list(model.tokenizer(Path(TEXT).read_text(encoding="utf-8")).input_ids)[: PREFILL + STEPS]
    names = [
        f"{n}:measured" if m else n for n in cases() for m in ((False, True) if n in MEASURED else (False,))
    ]
    chosen = args.cases.split(",") if args.cases else names
    old = json.loads(OUT.read_text(encoding="utf-8")) if args.cases else {"cases": {}}
    results = {}
    for name in names:
        if name not in chosen:
            results[name] = {**old["cases"][name], "rows": stored_rows(name)}
            continue
        policy, params = cases()[name.removesuffix(":measured")]
        results[name] = one(model, ids, policy, params, measure=name.endswith(":measured"))
        print(name, len(results[name]["rows"]), "decisions")
    write_rows(results)
    write_json(
        {
            "command": "python scripts/make_golden_runs.py",
            "text": TEXT,
            "ids": ids,
            "prefill": PREFILL,
            "steps": STEPS,
            "budget": BUDGET,
            "cases": {n: {k: v for k, v in r.items() if k != "rows"} for n, r in results.items()},
        }
    )


if __name__ == "__main__":
    main()
