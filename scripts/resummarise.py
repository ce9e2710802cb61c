"""Recompute the summary of stored results files from their rows, without running a model: after a change to
how a summary is computed (its bootstrap intervals, say), with the same `summarise` the command that wrote
the file uses.

    python scripts/resummarise.py results/bench_tasks.json results/explain.json [...]

Rewrites each file's "summary" in place and leaves the rest as it was; the CSV beside a file holds its rows
only, so it stays as it is. The figure beside a file (`<stem>.png`, where there is one) is drawn again from
the new summary as its command draws it. Files: `kvlens bench tasks` grids (bench_tasks*.json), `kvlens bench
frontier` grids (bench_frontier*.json) and scripts/explain_finding.py's explain.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def summarise(path: Path, obj: dict):
    """The summary of the results file `path` (its content `obj`) recomputed from its rows."""
    from kvlens.experiments.bench import frontier, tasks

    if path.name.startswith("bench_tasks"):
        return tasks.summarise(obj["rows"])
    if path.name.startswith("bench_frontier"):
        return frontier.summarise(obj["rows"])
    if path.name.startswith("explain"):
        import explain_finding

        return explain_finding.summarise(obj["rows"], len(obj["summary"]["layers"]))
    raise SystemExit(f"{path}: not a file this script knows how to summarise")


def figure(path: Path, obj: dict):
    """The figure its command draws of the results file `path` (its content `obj`)."""
    from kvlens.experiments.bench import frontier, tasks

    if path.name.startswith("bench_tasks"):
        return tasks.figure(obj)
    if path.name.startswith("bench_frontier"):
        return frontier.figure(obj)
    import explain_finding

    return explain_finding.figure(obj["summary"], obj["rows"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for path in args.files:
        obj = json.loads(path.read_text(encoding="utf-8"))
        obj["summary"] = summarise(path, obj)
        path.write_text(json.dumps(obj, indent=1, default=str), encoding="utf-8")  # as the commands write it
        print(f"rewrote the summary of {path}")
        if path.with_suffix(".png").exists():
            from kvlens.figures.export import image_bytes

            path.with_suffix(".png").write_bytes(image_bytes(figure(path, obj), "png"))
            print(f"drew {path.with_suffix('.png')} again")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
