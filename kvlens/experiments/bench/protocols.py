"""Two sets of task scores compared sample for sample: the task grid's two protocols (question-agnostic,
`kvlens bench tasks`: the context compressed alone, then asked; query-aware, `--query-aware`: context and
question compressed together, SnapKV's setting), or two policies on the samples of one grid (`kvzap` against
the `kvzip` scores it learns)."""

from __future__ import annotations

import statistics

from kvlens.experiments.bench.common import bootstrap, mean
from kvlens.experiments.bench.tasks import flatten

QUERY_AWARE_BY_DESIGN = ("snapkv", "pyramidkv", "adakv")  # methods whose paper scores with the question
PROTOCOL_SIDES = {"first": "question-agnostic", "second": "query-aware", "tie": "tie"}


def favoured(low: float, high: float) -> str:
    """The side an interval of (second minus first) favours: "second" above 0, "first" below, else "tie"."""
    if low > 0:
        return "second"
    if high < 0:
        return "first"
    return "tie"


def scores(rows: list[dict], policy: str, ratio: float | None) -> dict[tuple, float]:
    """`(task, length, index)` -> the score of `policy` at `ratio` (None: a budget-free policy's own size) in
    a grid's rows."""
    return {
        (r["task"], r["length"], r["index"]): r["score"]
        for r in flatten(rows)
        if r["policy"] == policy and r["ratio"] == ratio
    }


def difference(first: dict[tuple, float], second: dict[tuple, float]) -> dict | None:
    """Two `scores` on the samples both hold: each one's mean of the task-and-length means (as the
    leaderboard averages), and second minus first with its bootstrap 95 % interval (samples resampled within
    each task and length, paired). None when no sample is in both."""
    both = sorted(first.keys() & second.keys())
    if not both:
        return None
    groups: dict[tuple, list[tuple[float, float]]] = {}  # (task, length) -> (first, second) per sample
    for key in both:
        groups.setdefault(key[:2], []).append((first[key], second[key]))
    low, high = bootstrap([[b - a for a, b in pairs] for pairs in groups.values()])
    first_mean = statistics.fmean(statistics.fmean(a for a, _ in pairs) for pairs in groups.values())
    second_mean = statistics.fmean(statistics.fmean(b for _, b in pairs) for pairs in groups.values())
    return {
        "samples": len(both),
        "lengths": sorted({key[1] for key in both}),
        "first": first_mean,
        "second": second_mean,
        "diff": second_mean - first_mean,
        "ci_low": low,
        "ci_high": high,
    }


def paired(agnostic: list[dict], aware: list[dict], policy: str, ratio: float) -> dict | None:
    """`policy` at `ratio` under both protocols on the samples both grids hold (rows of `bench_tasks.json`
    and `bench_tasks_query_aware.json`): each protocol's mean score, and the query-aware minus
    question-agnostic difference with its bootstrap 95 % interval (`difference`). `verdict`: "query-aware" or
    "question-agnostic" when the interval excludes 0, else "tie". None when no sample is in both."""
    d = difference(scores(agnostic, policy, ratio), scores(aware, policy, ratio))
    if d is None:
        return None
    return {
        "policy": policy,
        "ratio": ratio,
        **{k: d[k] for k in ("samples", "lengths", "diff", "ci_low", "ci_high")},
        "agnostic": d["first"],
        "aware": d["second"],
        "verdict": PROTOCOL_SIDES[favoured(d["ci_low"], d["ci_high"])],
    }


def against(
    rows: list[dict], reference: tuple[str, float | None], other: tuple[str, float | None]
) -> dict | None:
    """Policy `other` against policy `reference` (each `(policy, ratio)`) on the samples of one grid's `rows`
    where both ran: `difference` (other minus reference), the mean share of the context `other` kept, and
    `verdict`: "tie" when the interval straddles 0, else the policy it favours."""
    d = difference(scores(rows, *reference), scores(rows, *other))
    if d is None:
        return None
    kept = [
        r["kept_share"] for r in flatten(rows) if (r["policy"], r["ratio"]) == other and "kept_share" in r
    ]
    wins = {"tie": "tie", "first": reference[0], "second": other[0]}
    return {**d, "kept_share": mean(kept), "verdict": wins[favoured(d["ci_low"], d["ci_high"])]}
