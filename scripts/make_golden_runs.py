"""Record every policy's decisions, NLLs and kept positions as the reference the cache must keep.

    python scripts/make_golden_runs.py        # writes tests/data/golden_runs.json

`tests/test_golden_runs.py` re-runs each case and compares: per-step NLL (rel <= 1e-5), a digest
of each step's decision rows (sorted; everything but the float weights and probabilities, whose
per-step sums are compared with a tolerance: summing in another slot order moves them by ~1e-7),
the kept counts per step and, for the measured case, the perturbation summary. Made once,
before the slot-reusing cache replaced the append-and-gather one, so any change of layout that
moves a decision fails the test. Regenerate only for an intended change of a policy's behaviour.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvlens.engine import RunOptions, run
from kvlens.models import load_model
from kvlens.perturbation import measured
from kvlens.policies import make_policy, policy_names

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "golden_runs.json"
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


def cases() -> dict[str, tuple[str, dict]]:
    out = {name: (name, {}) for name in policy_names()}
    out.update(EXTRA)
    return out


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def step_digests(decisions) -> list[str]:
    """One digest per step over its decision rows, sorted (layer, head, action, position, targets, draw)."""
    out = []
    for step in range(STEPS + 1):
        rows = decisions[decisions.step == step]
        out.append(digest(sorted((int(r.layer), int(r.kv_head), str(r.action), int(r.position),
                                  [int(t) for t in r.targets], int(r.draw)) for r in rows.itertuples())))
    return out


def step_weights(decisions) -> list[float]:
    """Per step, the sum of every merge weight and Bernoulli probability (floats: compared with a tolerance)."""
    return [float(sum(sum(w) for w in rows.weights) + rows.prob.fillna(0).sum())
            for rows in (decisions[decisions.step == step] for step in range(STEPS + 1))]


def one(model, ids, policy: str, params: dict, measure: bool) -> dict:
    pol = make_policy(policy, params)
    budget = None if pol.budget_free else BUDGET

    def go(observers, on_step):
        return run(model, pol, ids, prefill=PREFILL, steps=STEPS, teacher=True,
                   opts=RunOptions(budget=budget), observers=observers, on_step=on_step)
    r = measured(model, go, [], None) if measure else go([], None)
    out = {"policy": policy, "params": params, "nll": r.tensors["steps/nll"].tolist(),
           "kv_slots": digest(r.tensors["steps/kv_slots"].tolist()), "decisions": step_digests(r.decisions),
           "weights": step_weights(r.decisions),
           "n_decisions": len(r.decisions)}
    if measure:
        out["perturbation"] = {k: r.metrics[k] for k in ("perturbation_used_pooled", "perturbation_evict_pooled",
                                                          "kl", "merge_better_share")}
    return out


def main() -> None:
    model = load_model("default")
    ids = list(model.tokenizer(Path(TEXT).read_text(encoding="utf-8")).input_ids)[:PREFILL + STEPS]
    result = {"command": "python scripts/make_golden_runs.py", "text": TEXT, "ids": ids, "prefill": PREFILL,
              "steps": STEPS, "budget": BUDGET, "cases": {}}
    for name, (policy, params) in cases().items():
        result["cases"][name] = one(model, ids, policy, params, measure=False)
        if name in MEASURED:
            result["cases"][f"{name}:measured"] = one(model, ids, policy, params, measure=True)
        print(name, result["cases"][name]["n_decisions"])
    OUT.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
