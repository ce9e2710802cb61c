"""Policies x budgets (x prompt lengths) on one text: one row of metrics per run.

The paper-style comparisons are one sweep each: perplexity of every policy at a few budgets
(WeightedKV Table I, CORM Table 3), perturbation of merging vs eviction against the budget (CaM
Fig. 1(d), with `measure=True`: a `cam` row carries both its own `perturbation_used` and the
perturbation of its base's evictions `perturbation_evict`), and a budget-free policy's reached
compression against the sequence length (CORM Fig. 4, several `prefills`). Budget-free
policies run once per prompt length, whatever the budgets.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Callable

from kvlens.api import perplexity
from kvlens.engine import RunOptions
from kvlens.errors import KvlensError
from kvlens.models import LoadedModel
from kvlens.perturbation import summary
from kvlens.policies import make_policy

CSV_SKIP = ("params", "perturbation_used_per_layer", "perturbation_evict_per_layer")


def plan(policies: list[str], budgets: list, prefills: list[int], settings: dict[str, dict]) -> list[dict]:
    """The runs of a sweep, validated before any model work: `{policy, params, budget, prefill}`."""
    if not policies or not prefills:
        raise KvlensError("A sweep needs at least one policy and one prompt length.")
    unknown = sorted(set(settings) - set(policies))
    if unknown:
        raise KvlensError(f"--set names policy '{unknown[0]}', which is not in --policies.")
    runs = []
    for prefill in prefills:
        for name in policies:
            params = settings.get(name, {})
            policy = make_policy(name, params)
            if not policy.budget_free and not budgets:
                raise KvlensError(f"Policy {name} needs --budgets.")
            for budget in ([None] if policy.budget_free or name == "full" else budgets):
                runs.append({"policy": name, "params": params, "budget": budget, "prefill": prefill})
    return runs


def row(spec: dict, run, tokens: int) -> dict:
    """One table row from a finished run."""
    m = run.metrics
    cached = spec["prefill"] + tokens - 1  # tokens in a full cache at the last step
    full_bytes = m["kv_bytes_prefill"] * cached / spec["prefill"]
    out = {"policy": spec["policy"], "params": run.meta["policy"]["params"], "budget": spec["budget"],
           "budget_slots": run.meta["budget"]["slots"], "prefill": spec["prefill"], "tokens": tokens,
           "nll": m["nll"], "ppl": m["ppl"], "kept_final_mean": m["kv_slots_final_mean"],
           "kept_share": m["kv_slots_final_mean"] / cached, "kv_bytes_final": m["kv_bytes_final"],
           "bytes_share": m["kv_bytes_final"] / full_bytes, "ms_per_token": m["ms_per_token"]}
    if "perturbation/kl" in run.tensors:
        out.update(summary(run.tensors))
    return out


def sweep(model: LoadedModel, text: str, runs: list[dict], *, tokens: int, measure: bool = False,
          on_run: Callable[[dict], None] | None = None) -> list[dict]:
    """Run each planned run (teacher-forced perplexity over `tokens` after its prefill); rows in order."""
    rows = []
    for spec in runs:
        run = perplexity(model, text, spec["policy"], spec["params"], prefill=spec["prefill"], tokens=tokens,
                         opts=RunOptions(budget=spec["budget"]), measure=measure)
        rows.append(row(spec, run, tokens))
        if on_run is not None:
            on_run(rows[-1])
    return rows


def write(rows: list[dict], path: str | Path, meta: dict) -> tuple[Path, Path]:
    """Write `{meta..., rows}` as JSON at `path` and the rows (without per-layer lists) as CSV beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))
    csv_path = path.with_suffix(".csv")
    columns = [k for k in rows[0] if k not in CSV_SKIP] if rows else []
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path, csv_path
