"""`evaluate`: `lm_eval.simple_evaluate` on a `KvlensLM`, lm-eval's results JSON and kvlens's summary
written into one folder.

The folder holds `results.json` (lm-eval's own output: its `results` key per task and metric, `configs`,
`versions`, `n-shot`, `config`; the per-sample log left out), `kvlens.json` (the policy, its settings, each
request's kind, tokens fed, budget, kept slots and physical bytes, the share of the fed tokens kept and the
time) and
`tasks/`, the shipped tasks as lm-eval read them (`kvlens.eval.shipped`).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from kvlens.errors import KvlensError
from kvlens.eval import require_lm_eval, shipped

RESULTS, SUMMARY = "results.json", "kvlens.json"


def evaluate(
    model,
    tokenizer,
    tasks: list[str],
    policy: str,
    ratio: float | None,
    params: dict,
    out: str | Path,
    limit: int | None = None,
    include_path: str | Path | None = None,
) -> dict:
    """Run `tasks` on `model` (a transformers model object) under `policy`; write and return
    `{"results": lm-eval's output, "kvlens": the summary}`."""
    require_lm_eval()
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable

    from kvlens.eval.lm import KvlensLM

    folder = Path(out)
    paths = [shipped.write_tasks(folder / "tasks")]
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise KvlensError(f"--include-path {include_path} is not a folder of lm-eval task YAML files.")
        paths.append(Path(include_path).resolve())
    manager = TaskManager(include_path=[str(p) for p in paths])
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise KvlensError(
            f"lm-eval has no task {', '.join(unknown)}; the shipped ones are {', '.join(shipped.TASKS)}, "
            f"and --include-path adds a folder of your own."
        )
    lm = KvlensLM(model, policy=policy, ratio=ratio, params=params, tokenizer=tokenizer)
    started = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, limit=limit, task_manager=manager, log_samples=False, bootstrap_iters=0
    )
    summary = summarise(lm, policy, ratio, params, time.perf_counter() - started)
    (folder / RESULTS).write_text(
        json.dumps(results, indent=2, default=handle_non_serializable), encoding="utf-8"
    )
    (folder / SUMMARY).write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return {"results": results, "kvlens": summary}


def summarise(lm, policy: str, ratio: float | None, params: dict, seconds: float) -> dict:
    """kvlens's side of an evaluation: the settings, each request's cache and the share of tokens kept."""
    requests = [
        {
            "kind": r.kind,
            "prompt_tokens": r.prompt_tokens,
            "fed": r.fed,
            "budget": r.budget,
            "kv_bytes": r.kv_bytes,
            "kept_slots": r.kept_slots,
            "seconds": r.seconds,
        }
        for r in lm.requests
    ]
    kept, fed = sum(r["kept_slots"] for r in requests), sum(r["fed"] for r in requests)
    return {
        "policy": policy,
        "ratio": ratio,
        "params": params,
        "requests": len(requests),
        "kv_bytes_mean": statistics.fmean(r["kv_bytes"] for r in requests) if requests else None,
        "kept_share": kept / fed if fed else None,
        "seconds": seconds,
        "per_request": requests,
    }
