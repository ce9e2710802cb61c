"""The task grid's two protocols side by side: question-agnostic (`kvlens bench tasks`: the context compressed
alone, then asked) against query-aware (`--query-aware`: context and question compressed together, SnapKV's
setting), paired sample for sample on what both grids ran."""

from __future__ import annotations

import statistics

from kvlens.experiments.bench.tasks import bootstrap, flatten

QUERY_AWARE_BY_DESIGN = ("snapkv", "pyramidkv", "adakv")  # methods whose paper scores with the question


def verdict(low: float, high: float) -> str:
    """The protocol an interval of (query-aware minus question-agnostic) favours, or "tie" across 0."""
    if low > 0:
        return "query-aware"
    if high < 0:
        return "question-agnostic"
    return "tie"


def paired(agnostic: list[dict], aware: list[dict], policy: str, ratio: float) -> dict | None:
    """`policy` at `ratio` under both protocols on the samples both grids hold (rows of `bench_tasks.json`
    and `bench_tasks_query_aware.json`): each protocol's mean score, and the query-aware minus
    question-agnostic difference with its bootstrap 95 % interval (samples resampled within each task and
    length, paired). `verdict`: "query-aware" or "question-agnostic" when the interval excludes 0, else
    "tie". None when no sample is in both."""

    def scores(rows: list[dict]) -> dict[tuple, float]:
        return {
            (r["task"], r["length"], r["index"]): r["score"]
            for r in flatten(rows)
            if r["policy"] == policy and r["ratio"] == ratio
        }

    first, second = scores(agnostic), scores(aware)
    both = sorted(first.keys() & second.keys())
    if not both:
        return None
    groups: dict[tuple, list[tuple[float, float]]] = {}  # (task, length) -> (agnostic, aware) per sample
    for key in both:
        groups.setdefault(key[:2], []).append((first[key], second[key]))
    low, high = bootstrap([[b - a for a, b in pairs] for pairs in groups.values()])
    # each protocol's mean of the task-and-length means, as the leaderboard averages
    agnostic_mean = statistics.fmean(statistics.fmean(a for a, _ in pairs) for pairs in groups.values())
    aware_mean = statistics.fmean(statistics.fmean(b for _, b in pairs) for pairs in groups.values())
    return {
        "policy": policy,
        "ratio": ratio,
        "samples": len(both),
        "lengths": sorted({key[1] for key in both}),
        "agnostic": agnostic_mean,
        "aware": aware_mean,
        "diff": aware_mean - agnostic_mean,
        "ci_low": low,
        "ci_high": high,
        "verdict": verdict(low, high),
    }
