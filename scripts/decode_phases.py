"""Where a decode step's time goes, per policy: the model, attention, the cache's writes, the policy's
per-step statistic (`observe`), the attention bookkeeping (`accumulate`) and the compression (`compress`).

    python scripts/decode_phases.py [--policies full,streaming_llm,adakv | all] [--tokens 1024,4096]
        [--steps 24] [--rounds 3] [--budget 0.5] [--json results/decode_phases.json]

Each policy generates `--steps` greedy tokens after a `--tokens` prompt of the bundled texts at budget
`--budget` (`kvlens bench speed`'s decode lockstep, `engine_steps`), the policies alternating over `--rounds`
rounds. Wall-clock timers wrap the engine's phases for the decode steps only (the prompt's prefill and
compression are not counted): `attention` is the decode attention (`decode_rows`, `decode_segments`,
`decode_channels` or SDPA), `cache` the cache's `update` (the new token's writes and the keys and values
handed to attention), `observe` the policy's per-step statistic, `accumulate` the slots' accumulated
attention, `compress` the step's compression (`compress_step`: the policy's scores and selection, the eviction
or merge); `model` is the rest of the step (projections, MLP, norms, rotary embedding, Python). Each cell is
the median over rounds of the mean ms per token; `vs full` the median [lowest, highest] over rounds of the
step's ratio to the full cache's in the same round; `beyond full` the policy's step minus the full cache's
(what it costs per token beyond attending to the full cache) and `beyond eviction` minus StreamingLLM's
(beyond the cheapest eviction: what the method itself costs). Timers cost a few microseconds per call; compare
rows of one run, on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PHASES = ("model", "attention", "cache", "observe", "accumulate", "compress")


class Timers:
    """Milliseconds and calls per phase, counted only while `on`."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False

    def wrap(self, owner: object, name: str, phase: str) -> Callable[[], None]:
        """Time every call of `owner.name` as `phase` (nested timed calls count in both); returns its undo."""
        inner, own = getattr(owner, name), name in vars(owner)
        timers = self

        def timed(*args, **kwargs):
            if not timers.on:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                timers.ms[phase] += (time.perf_counter() - start) * 1000
                timers.calls[phase] += 1

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, inner) if own else delattr(owner, name)


def decode_phases(
    model, name: str, ids: list[int], steps: int, budget: float
) -> tuple[dict[str, float], dict[str, int]]:
    """One run of policy `name`: mean ms per decode token for each phase and `total`, and each phase's calls
    over the decode steps (`steps`: how many were timed)."""
    from kvlens.engine import context, loop
    from kvlens.experiments.bench.common import PolicySpec
    from kvlens.experiments.bench.speed import engine_steps
    from kvlens.kvcache.cache import KVCache
    from kvlens.policies import REGISTRY

    timers = Timers()
    undo = [
        timers.wrap(context, "decode_rows", "attention"),
        timers.wrap(context, "sdpa", "attention"),
        timers.wrap(context, "decode_segments", "attention"),
        timers.wrap(context, "decode_channels", "attention"),
        timers.wrap(KVCache, "update", "cache"),
        timers.wrap(REGISTRY[name], "observe", "observe"),
        timers.wrap(context.RunContext, "accumulate", "accumulate"),
        timers.wrap(loop._Loop, "compress_step", "compress"),
    ]
    try:
        run = engine_steps(model, PolicySpec(name), ids, steps, budget)
        next(run)  # the prompt: prefill, replay passes and its compression are not counted
        total, count = 0.0, 0
        timers.on = True
        for ms in run:
            total, count = total + ms, count + 1
    finally:
        for restore in reversed(undo):
            restore()
    out = {phase: timers.ms[phase] / count for phase in PHASES[1:]}
    out["model"] = total / count - sum(out.values())
    out["total"] = total / count
    return out, {**timers.calls, "steps": count}


EVICTION = "streaming_llm"  # the cheapest eviction: what a method costs beyond evicting (`beyond eviction`)


def summarise(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict]:
    """Per policy: each phase's median over rounds, the per-round ratio of its total to the full cache's
    (median, lowest, highest: the policies of one round ran side by side) and its ms per token beyond the full
    cache and beyond `EVICTION` (medians of the per-round differences)."""
    out = {}
    for name, rounds in runs.items():
        row: dict = {key: statistics.median(r[key] for r in rounds) for key in (*PHASES, "total")}
        paired = list(zip(rounds, runs["full"], strict=True))
        ratios = [r["total"] / f["total"] for r, f in paired]
        row["vs_full"] = [statistics.median(ratios), min(ratios), max(ratios)]
        row["beyond_full"] = statistics.median(r["total"] - f["total"] for r, f in paired)
        if EVICTION in runs:
            row["beyond_eviction"] = statistics.median(
                r["total"] - e["total"] for r, e in zip(rounds, runs[EVICTION], strict=True)
            )
        out[name] = row
    return out


def print_table(tokens: int, table: dict[str, dict], args: argparse.Namespace, threads: int) -> None:
    print(
        f"ms per decode token, {tokens}-token prompt, budget {args.budget}, {args.steps} steps, "
        f"median of {args.rounds} rounds, {threads} threads"
    )
    cols = (*PHASES, "total")
    print(
        f"{'policy':<20}" + "".join(f"{p:>11}" for p in cols) + f"{'vs full':>20}{'beyond full':>13}"
        f"{'beyond evict':>13}"
    )
    for name, row in sorted(table.items(), key=lambda item: item[1]["total"]):
        mid, low, high = row["vs_full"]
        ratio = f"{mid:.2f} [{low:.2f}-{high:.2f}]"
        evict = f"{row['beyond_eviction']:>13.2f}" if "beyond_eviction" in row else f"{'':>13}"
        cells = "".join(f"{row[p]:>11.2f}" for p in cols)
        print(f"{name:<20}{cells}{ratio:>20}{row['beyond_full']:>13.2f}{evict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--policies",
        default="full,streaming_llm,snapkv,adakv,kvzip,pyramidkv,corm,d2o,keydiff,scissorhands,"
        "expected_attention,think,cam",
        help="comma-separated policies, or `all` (every registered policy); full is always added",
    )
    parser.add_argument("--tokens", default="1024", help="prompt tokens, comma-separated (default 1024)")
    parser.add_argument("--steps", type=int, default=24, help="decode steps per run (default 24)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each policy, alternated (default 3)")
    parser.add_argument("--budget", type=float, default=0.5, help="budget as a prompt share (default 0.5)")
    parser.add_argument("--json", help="also write the tables there (e.g. results/decode_phases.json)")
    args = parser.parse_args(argv)

    import torch

    from kvlens.engine.models import load_model
    from kvlens.experiments.bench.common import environment
    from kvlens.policies import REGISTRY
    from kvlens.texts import bundled, prefix_ids

    names = list(REGISTRY) if args.policies == "all" else args.policies.split(",")
    if "full" not in names:
        names.insert(0, "full")
    model = load_model("default")
    text = "\n\n".join(bundled().values())
    tables = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        ids = prefix_ids(model, text, tokens, "decode_phases")
        runs: dict[str, list[dict[str, float]]] = defaultdict(list)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                print(f"{tokens} tokens, round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                runs[name].append(decode_phases(model, name, ids, args.steps, args.budget)[0])
        tables[tokens] = summarise(runs)
        print_table(tokens, tables[tokens], args, torch.get_num_threads())
    if args.json:
        config = {k: getattr(args, k) for k in ("steps", "rounds", "budget")}
        command = "python scripts/decode_phases.py " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": command.strip(),
                    "config": {**config, "tokens": list(tables), "eviction": EVICTION},
                    "environment": environment(model),
                    "ms_per_token": {str(t): table for t, table in tables.items()},
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
