"""Speed A/B: `kvlens bench speed` at another revision and at this checkout, alternated, ratios side by side.

    scripts/speed_ab.sh REV [--rounds 3] [BENCH SPEED ARGUMENTS]    (or: make speed-ab REV=... ARGS=...)

A git worktree of REV is made in a temporary folder (removed after); each round runs `python -m kvlens bench
speed --json --no-figure --out-dir TMP` once in REV's tree and once in this one (which goes first flips each
round: A B, B A, ...), each as its own process importing its own tree's `kvlens` under the same interpreter,
so both sides run the same libraries. Nothing is written into `results/`. The bench's arguments default to
`--quick`.

The table gives each ratio (wall clock, and `(cpu)`: process CPU time, which other processes disturb less) as
its median [min, max] over the rounds, REV beside HEAD (this checkout). Every ratio is lower-is-better (the
targets are upper bounds), so `worse` marks a ratio whose every HEAD round is above every REV round: a
slowdown beyond the spread of either side. With one round it marks any increase; run it on a quiet machine.
A ratio taken over every policy (`every_policy_*`) names its worst policy at HEAD (the one most rounds name),
and each policy's own ratio follows as `RATIO: POLICY`, flagged the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Row:
    """One ratio's values over the rounds, at REV and at HEAD."""

    ratio: str
    rev: list[float]
    head: list[float]

    @property
    def worse(self) -> bool:
        """HEAD above REV beyond both spreads: its lowest round over REV's highest."""
        return min(self.head) > max(self.rev)


def ratios_of(result: dict) -> dict[str, float]:
    """A `bench speed --json` result's ratios: wall clock under their names, CPU time as `NAME (cpu)`, each
    policy's share of an every-policy ratio as `NAME: POLICY`."""
    cpu = {f"{k} (cpu)": v for k, v in result.get("ratios_cpu", {}).items()}
    per_policy = {
        f"{k}: {policy}": v
        for k, details in result.get("ratio_details", {}).items()
        for policy, v in details.get("per_policy", {}).items()
    }
    return {**result["ratios"], **cpu, **per_policy}


def worst_of(results: list[dict]) -> dict[str, str]:
    """Each every-policy ratio's worst policy, the one most of `results` (one side's rounds) name."""
    named: dict[str, list[str]] = {}
    for result in results:
        for k, details in result.get("ratio_details", {}).items():
            if "worst" in details:
                named.setdefault(k, []).append(details["worst"])
    return {k: statistics.mode(names) for k, names in named.items()}


def summarize(rev: list[dict], head: list[dict]) -> list[Row]:
    """One row per ratio in every run of both sides (`bench speed --json` results), in HEAD's order."""
    runs = [ratios_of(r) for r in rev], [ratios_of(r) for r in head]
    keys = [k for k in runs[1][0] if all(k in run for side in runs for run in side)]
    return [Row(k, [run[k] for run in runs[0]], [run[k] for run in runs[1]]) for k in keys]


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def table(rows: list[Row], rev_name: str, worst: dict[str, str] | None = None) -> str:
    """The rows as a text table: median [min, max] at REV and at HEAD, the `worse` flag and, for an
    every-policy ratio, its worst policy at HEAD (`worst`, from `worst_of`)."""
    worst = worst or {}
    width = max(len(r.ratio) for r in rows)
    lines = [f"{'ratio':<{width}}  {rev_name[:26]:>26}  {'HEAD':>26}  worse  worst at HEAD"]
    for r in rows:
        flag = "WORSE" if r.worse else ""
        line = (
            f"{r.ratio:<{width}}  {cell(r.rev):>26}  {cell(r.head):>26}  {flag:<5}  {worst.get(r.ratio, '')}"
        )
        lines.append(line.rstrip())
    rounds = len(rows[0].head) if rows else 0
    lines.append(f"(median [min, max] over {rounds} rounds; WORSE: every HEAD round above every REV round)")
    return "\n".join(lines)


def bench(tree: Path, args: list[str]) -> dict:
    """One `kvlens bench speed --json` run importing `tree`'s kvlens, its outputs in a temporary folder."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as out:
        command = ["-m", "kvlens", "bench", "speed", *args, "--json", "--no-figure", f"--out-dir={out}"]
        done = subprocess.run(
            [sys.executable, *command],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        sys.exit(f"speed_ab: the bench failed in {tree}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """REV and --rounds; every other argument goes to `bench speed` (`--quick` when there is none)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("rev", help="the revision to compare against (a commit, branch or tag)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side, alternated (default 3)")
    args, extra = parser.parse_known_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args, extra or ["--quick"]


def main(argv: list[str] | None = None) -> int:
    args, extra = parse(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "rev"
        made = subprocess.run(
            ["git", "worktree", "add", "--detach", str(other), args.rev],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        if made.returncode != 0:
            sys.exit(f"speed_ab: no worktree of {args.rev}: {made.stderr.strip()}")
        try:
            sides: dict[str, list[dict]] = {"rev": [], "head": []}
            trees = {"rev": other, "head": ROOT}
            for r in range(args.rounds):
                for name in ("rev", "head") if r % 2 == 0 else ("head", "rev"):
                    print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                    sides[name].append(bench(trees[name], extra))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, check=False)
    print(table(summarize(sides["rev"], sides["head"]), args.rev, worst_of(sides["head"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
