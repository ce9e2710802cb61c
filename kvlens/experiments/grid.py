"""Grids of cells: one planner for `kvlens sweep` and `kvlens bench`, and the results file that grows cell by
cell.

A cell is a flat dict of JSON values that fully describes one run: its task (`ppl`, `needle`),
the model spec, the policy and its resolved parameters, the budget, the text id and a digest of
the text, the lengths, the seed and whether to measure. Running a cell is deterministic, so
the same cell gives the same row wherever it runs (`kvlens.experiments.executors`).

`Results` is the results file of a grid: `{**settings, "cells_total", "cells_done",
"cells_failed", "status", "rows", "failed"}`. Every finished cell rewrites it atomically
(temporary file, fsync, rename), so a killed sweep leaves only whole cells; re-running the same
grid skips the cells that already have a row and retries the failed ones. Finished cells of another grid found
in the file (other policies, lengths or settings) stay in it as `other_rows`, untouched, and count as done for
a later grid that plans them again: two grids can share an out-dir without either losing a row.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from kvlens.errors import KvlensError
from kvlens.policies import make_policy
from kvlens.version import __version__

# Per-layer lists and nested parameters stay in the JSON only.
CSV_SKIP = ("params", "perturbation_used_per_layer", "perturbation_evict_per_layer")
# Fields that measure time: they differ between two runs of the same cell.
TIMINGS = ("ms_per_token",)


def digest(text: str) -> str:
    """A short content digest, so a cell names exactly the text it ran on."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def plan(
    task: str,
    policies: list[tuple[str, dict]],
    budgets: list,
    axes: dict[str, list],
    fixed: dict,
    seeds: list[int] | None = None,
) -> list[dict]:
    """Every `(policy, params)` x budget x the product of `axes` (x seed), as cells, checked before any model
    work.

    Budget-free policies (`full`, CORM) get one `None` budget. `fixed` goes into every cell.
    `seeds` (if given) is an axis that sets both the run's seed and the `seed` parameter of
    the policies that have one (CaM's random draws).
    """
    if not policies:
        raise KvlensError("A grid needs at least one policy.")
    cells = []
    for name, given in policies:
        policy = make_policy(name, given)
        if not policy.budget_free and not budgets:
            raise KvlensError(f"Policy {name} needs a budget; give --budgets.")
        if seeds is not None and "seed" in given:
            raise KvlensError(f"Give {name}'s seed either with --seeds or as its parameter, not both.")
        for budget, values, seed in itertools.product(
            [None] if policy.budget_free else budgets, itertools.product(*axes.values()), seeds or [0]
        ):
            params = {**given, "seed": seed} if seeds is not None and "seed" in policy.params() else given
            cells.append(
                {
                    "task": task,
                    **fixed,
                    "policy": name,
                    "params": make_policy(name, params).params(),
                    "budget": budget,
                    **dict(zip(axes, values, strict=True)),
                    "seed": seed,
                }
            )
    return json.loads(json.dumps(cells))  # tuples as lists, as they read back from the results file


def present(**items) -> dict:
    """The items whose value is set (not None, 0 or empty): a field written only when it says something."""
    return {k: v for k, v in items.items() if v}


def key(cell: dict) -> str:
    """The identity of a cell: its parameters as canonical JSON."""
    return json.dumps(cell, sort_keys=True)


def _write_atomic(path: Path, write: Callable) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Results:
    """The results file of a grid (JSON, with a CSV of the rows beside it), rewritten atomically after each
    cell."""

    def __init__(
        self,
        path: str | Path,
        cells: list[dict],
        settings: dict,
        fresh: bool = False,
        implied: dict | None = None,
    ):
        """`implied`: the value a row written before a cell field existed had for it (matched as such)."""
        self.path = Path(path)
        self.cells, self.settings, self.implied = cells, settings, implied or {}
        self.order = {key(c): i for i, c in enumerate(cells)}
        if len(self.order) < len(cells):
            raise KvlensError("The grid names the same cell twice; give each value once.")
        self.rows: dict[str, dict] = {}
        self.failed: dict[str, dict] = {}
        self.other: list[dict] = []  # finished cells of another grid found in the file: kept as they were
        if self.path.is_file() and not fresh:
            self._read()
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _read(self) -> None:
        try:
            old = json.loads(self.path.read_text(encoding="utf-8"))
            rows, failed = old.get("rows", []), old.get("failed", [])
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            raise KvlensError(
                f"{self.path} exists but is not a results file; use --fresh to replace it."
            ) from None
        fields = list(next(iter(self.cells), {}))
        for entry, into in [(r, self.rows) for r in rows + old.get("other_rows", [])] + [
            (f, self.failed) for f in failed
        ]:
            k = key({f: entry.get(f, self.implied.get(f)) for f in fields})
            if k in self.order:
                into[k] = entry
            elif into is self.rows:
                self.other.append(entry)

    def todo(self) -> list[dict]:
        """The planned cells without a row yet (failed ones included), in plan order."""
        return [c for c in self.cells if key(c) not in self.rows]

    def add(self, cell: dict, outcome: dict) -> None:
        """Record one finished cell (`{"row": metrics}` or `{"error": sentence}`) and rewrite the file."""
        k = key(cell)
        if "row" in outcome:
            self.rows[k] = {**cell, **outcome["row"], "kvlens_version": __version__}
            self.failed.pop(k, None)
        else:
            self.failed[k] = {**cell, "error": outcome["error"], "kvlens_version": __version__}
        self.write()

    def ordered(self) -> list[dict]:
        """The rows in plan order."""
        return [self.rows[k] for k in sorted(self.rows, key=self.order.__getitem__)]

    def write(self, extra: dict | None = None) -> None:
        """Write the JSON (settings, counts, rows, failures) and the CSV of the rows, each atomically."""
        rows = self.ordered()
        done = len(rows) == len(self.cells)
        obj = {
            **self.settings,
            **(extra or {}),
            "cells_total": len(self.cells),
            "cells_done": len(rows),
            "cells_failed": len(self.failed),
            "status": "done" if done else "running",
            "rows": rows,
            "failed": [self.failed[k] for k in sorted(self.failed, key=self.order.__getitem__)],
            **present(other_rows=self.other),
        }
        _write_atomic(self.path, lambda f: f.write(json.dumps(obj, indent=1, default=str)))
        columns = list(dict.fromkeys(c for r in rows for c in r if c not in CSV_SKIP))

        def write_csv(f):
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)

        _write_atomic(self.path.with_suffix(".csv"), write_csv)


def run_grid(
    results: Results, outcomes: Callable[[list[dict]], Iterable[tuple[dict, dict]]], desc: str
) -> Results:
    """Run the cells `results` still lacks through an executor's `outcomes(cells)`, recording each as it
    finishes, with a progress bar (ETA) over the whole grid: redrawn on a terminal, a line per finished cell
    otherwise (a log of a grid left running for hours)."""
    from kvlens.progress import Progress

    todo = results.todo()
    results.write()
    total = len(results.cells)
    with Progress(desc, total, "cell", initial=total - len(todo), log=True) as bar:
        for cell, outcome in outcomes(todo):
            results.add(cell, outcome)
            bar.advance(note=f"{len(results.failed)} failed" if results.failed else _label(cell))
    return results


def _label(cell: dict) -> str:
    """What a finished cell was, for the progress line: its policy, or its task, length and sample."""
    if "policy" in cell:
        return cell["policy"]
    return " ".join(str(cell[k]) for k in ("suite_task", "length", "index") if k in cell)


def report(results: Results) -> Iterator[str]:
    """Lines for the terminal: how many cells ran, and each failure's reason."""
    path = results.path
    yield f"{len(results.rows)} of {len(results.cells)} cells done -> {path} and {path.with_suffix('.csv')}"
    if results.other:
        yield f"kept {len(results.other)} finished cells of another grid in {path.name} (other_rows)"
    for f in list(results.failed.values())[:10]:
        where = (
            f"{f['policy']} budget {f['budget']}"
            if "policy" in f
            else f"{f.get('suite_task')} sample {f.get('index')}"
        )
        yield f"failed: {where}: {f['error']} (re-run the same command to retry)"
