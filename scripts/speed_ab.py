"""Speed A/B: `kvlens bench speed` at another revision and at this checkout, alternated, ratios side by side.

    python scripts/speed_ab.py REV [--rounds 2] [-- BENCH SPEED ARGUMENTS]

A git worktree of REV is made in a temporary folder; each round runs `python -m kvlens bench speed --json` once in
REV's tree and once in this one (which goes first flips each round), each as its own process importing its own
tree's `kvlens`, on the same machine and the same venv. The table gives each ratio's median over rounds and its
range, REV beside this checkout, so a change to the engine, the cache or a policy's hot path can be checked for
regressions before it lands. Bench arguments default to `--quick`; anything after `--` replaces them (e.g.
`-- --quick --lockstep none`). Run it on a quiet machine: the ratios are measured in lockstep inside each run,
but two runs of the same revision still differ by their spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bench(tree: Path, args: list[str]) -> dict[str, float]:
    """One `kvlens bench speed --json` run importing `tree`'s kvlens: its ratios."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run(
            [sys.executable, "-m", "kvlens", "bench", "speed", *args, "--json", "--out-dir", out],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        sys.exit(f"speed_ab: the bench failed in {tree}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)["ratios"]


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, extra = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, ["--quick"])
    )
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the revision to compare against (a commit, branch or tag)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternated (default 2)")
    args = parser.parse_args(own)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
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
            sides: dict[str, list[dict[str, float]]] = {args.rev: [], "this checkout": []}
            trees = {args.rev: other, "this checkout": ROOT}
            for r in range(args.rounds):
                order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                for name in order:
                    print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                    sides[name].append(bench(trees[name], extra))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, check=False)
    keys = [k for k in sides["this checkout"][0] if all(k in run for runs in sides.values() for run in runs)]
    width = max(len(k) for k in keys)
    print(f"{'ratio':<{width}}  {args.rev:>26}  {'this checkout':>26}  (median [min, max] of {args.rounds})")
    for k in keys:
        print(
            f"{k:<{width}}  " + "  ".join(f"{cell([run[k] for run in runs]):>26}" for runs in sides.values())
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
