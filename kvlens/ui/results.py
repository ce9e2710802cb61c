"""Saved sweep and benchmark results (`results/sweep_*.json`, `results/bench_*.json`) for the app.

A results file is one JSON object with a `rows` list (sweeps, `bench_ppl`, `bench_speed`) or a
`cells` list (`bench_needle`) of flat records; anything else in the object is its settings.
Files that do not parse are listed with the reason.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from kvlens.figures.plots import line_style
from kvlens.figures.wording import when
from kvlens.policies import changed_params
from kvlens.ui import url_state
from kvlens.ui.charts import chart
from kvlens.ui.state import ROOT

MAX_BYTES = 32 << 20
# The results that results/ ships and the docs cite, in the order the page offers them (before any other file)
PUBLISHED = (
    "bench_tasks",
    "bench_tasks_query_aware",
    "bench_frontier",
    "bench_speed",
    "bench_needle",
    "bench_ppl",
    "sweep_cam_perturbation",
)
# What to say when there is no results file of a kind (`pick_results`' `make` says it instead when given)
MAKE = {
    "sweep": "Make one with `kvlens sweep ... --out results/sweep_NAME.json`.",
    "bench": "Make one with the benchmark commands (`kvlens bench --help`), which write "
    "`results/bench_*.json`.",
}
# A frontier summary row's measure by its metric: (name, its interval's low and high columns, what it is over)
FRONTIER_MEASURES = {
    "ppl": ("perplexity", "ppl_min", "ppl_max", "texts"),
    "score": ("task score", "ci_low", "ci_high", "samples"),
}


def results_dir() -> Path:
    """$KVLENS_RESULTS or `results/` beside app.py."""
    return Path(os.environ.get("KVLENS_RESULTS") or ROOT / "results")


@st.cache_data(ttl=10, max_entries=32, show_spinner=False)
def read_results(path: str, mtime: float) -> tuple[dict, pd.DataFrame, dict] | str:
    """(settings, rows, the whole object) of one results file, or the sentence saying why it cannot be
    read."""
    p = Path(path)
    if p.stat().st_size > MAX_BYTES:
        return f"{p.name} is larger than {MAX_BYTES >> 20} MB; not shown."
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{p.name} is not valid JSON ({type(err).__name__})."
    key = "rows" if isinstance(obj, dict) and isinstance(obj.get("rows"), list) else "cells"
    if not isinstance(obj, dict) or not isinstance(obj.get(key), list):
        return f"{p.name} has no 'rows' (or 'cells') list of results."
    rows = [r for r in obj[key] if isinstance(r, dict)]
    frame = pd.DataFrame(rows)
    for col in frame.columns:  # nested values (params, per-layer lists) as text, so tables render
        if frame[col].map(lambda v: isinstance(v, (dict, list))).any():
            frame[col] = frame[col].map(lambda v: json.dumps(v) if isinstance(v, (dict, list)) else v)
    return {k: v for k, v in obj.items() if k != key}, frame, obj


def result_files(kind: str) -> list[Path]:
    """`results/{kind}_*.json`: the published files first (`PUBLISHED`'s order), then the others by name."""
    folder = results_dir()
    if not folder.is_dir():
        return []
    rank = {name: i for i, name in enumerate(PUBLISHED)}
    return sorted(folder.glob(f"{kind}_*.json"), key=lambda p: (rank.get(p.stem, len(rank)), p.name))


def of_benchmark(path: Path, names: tuple[str, ...]) -> bool:
    """Whether a results file is one of these benchmarks' (`bench_tasks.json`, `bench_tasks_quick.json`,
    ...)."""
    return any(path.stem == n or path.stem.startswith(n + "_") for n in names)


def _usable(path: Path, want: tuple[str, ...]) -> bool:
    got = read_results(str(path), path.stat().st_mtime)
    if isinstance(got, str):
        return False
    frame = got[1]
    return all(c in frame.columns and frame[c].notna().any() for c in want)


def pick_results(
    prefix: str,
    kind: str,
    label: str,
    want: tuple[str, ...] = (),
    only: tuple[str, ...] = (),
    without: tuple[str, ...] = (),
    param: str | None = None,
    make: str = "",
):
    """A select box over `results/{kind}_*.json` (`result_files`' order, files holding the `want` columns
    before the others; `only`/`without`: the files of these benchmarks only, or all but theirs; the file's
    name kept in the URL as `?{param or kind}=`); returns (path, settings, frame, whole object) or None (after
    saying why, with `make`, the command that writes such a file, if given)."""
    files = [
        p for p in result_files(kind) if (not only or of_benchmark(p, only)) and not of_benchmark(p, without)
    ]
    files.sort(key=lambda p: not _usable(p, want))  # stable: keeps the published first within each group
    if not files:
        pattern = " or ".join(f"`{n}*.json`" for n in only or [f"{kind}_"])
        st.info(f"No saved {label} yet: {results_dir()} holds no {pattern}. " + (make or MAKE[kind]))
        return None
    param = param or kind
    path = url_state.bound(
        lambda **kw: st.selectbox(f"Saved {label}", files, format_func=_file_name, **kw),
        param,
        f"{prefix}_{kind}_file",
        files,
        f"saved {label}",
        files[0],
        show=lambda p: p.name,
    )
    got = read_results(str(path), path.stat().st_mtime)
    if isinstance(got, str):
        st.error(got)
        return None
    cells_status(path, got[0])
    return path, *got


def _file_name(path: Path) -> str:
    return path.name + when(path.stem in PUBLISHED, " (published)")


def cells_status(path: Path, settings: dict) -> None:
    """How many cells of a grid's results file are done: a progress bar while it is not finished."""
    total, done, failed = (settings.get(k) for k in ("cells_total", "cells_done", "cells_failed"))
    if not isinstance(total, int) or not isinstance(done, int) or total < 1:
        return
    text = f"{done} of {total} cells done" + when(
        failed, f", {failed} failed (re-run the command to retry them)"
    )
    if settings.get("status") == "done":
        st.caption(text + ".")
        return
    ago = max(0, time.time() - path.stat().st_mtime)
    st.progress(
        min(1.0, done / total),
        text=f"Not finished: {text}, the last {ago:.0f} s ago "
        "(the rows so far are shown and refreshed while it runs).",
    )


def metric_figure(frame: pd.DataFrame, x: str, ys: list[str], title: str) -> go.Figure:
    """One line per policy (and per y column) of `ys` against `x`."""
    fig = go.Figure()
    i = 0
    keys = [c for c in ("policy", "params") if c in frame.columns]  # the caller checks there is a policy
    for key, rows in frame.groupby(keys, sort=False):
        policy = key[0]
        params = (
            json.loads(key[1]) if len(key) > 1 and isinstance(key[1], str) and key[1].startswith("{") else {}
        )
        extra = ", ".join(f"{k}={v}" for k, v in changed_params(policy, params).items())
        series = policy + when(extra, f" ({extra})")
        rows = rows.sort_values(x)
        for y in ys:
            name = series + when(len(ys) > 1, f": {y}")
            fig.add_trace(
                go.Scatter(
                    x=rows[x].tolist(), y=rows[y].tolist(), mode="lines+markers", name=name, **line_style(i)
                )
            )
            i += 1
    fig.update_xaxes(title_text=x.replace("_", " "))
    fig.update_yaxes(title_text=" / ".join(y.replace("_", " ") for y in ys))
    fig.update_layout(title=dict(text=title), height=400)
    return fig


def measured(frame: pd.DataFrame, settings: dict) -> pd.Series:
    """Which rows of a sweep ran with the perturbation meter (`--measure`): their own flag, the file's, or the
    perturbation they report."""
    flag = frame.get("measure", pd.Series(bool(settings.get("measure")), index=frame.index))
    flag = flag.fillna(False).astype(bool)
    if "perturbation_used" in frame.columns:
        flag = flag | frame["perturbation_used"].notna()
    return flag


def sweep_section(prefix: str, charts: list[tuple[str, list[str]]]) -> None:
    """Pick a saved sweep, then for each `(title, y columns)` its metrics against the budget, one line
    per policy (CaM Fig. 1d for perturbation, WeightedKV Table I for perplexity)."""
    picked = pick_results(prefix, "sweep", "sweeps", ("budget_slots", *charts[0][1]))
    if picked is None:
        return
    path, settings, frame, _ = picked
    x = "budget_slots" if "budget_slots" in frame.columns else "budget"
    rows = frame[frame[x].notna()] if x in frame.columns else frame.iloc[:0]
    if not len(rows) or "policy" not in rows.columns:
        st.info(f"{path.name} has no budgeted runs to plot against the budget.")
        return
    for title, ys in charts:
        shown = rows
        if (
            "ms_per_token" in ys
        ):  # a measured run's time includes its measuring passes: speed from the others only
            shown = rows[~measured(rows, settings)]
            if not len(shown):
                st.info(
                    f"{path.name} was run with `--measure`: its time per token includes the "
                    "measuring passes, "
                    "so no speed is shown (the speed benchmark, `kvlens bench speed`, measures speed)."
                )
                continue
            if len(shown) < len(rows):
                st.caption(
                    f"{title}: the unmeasured rows only (a measured run's time includes its "
                    "measuring passes)."
                )
        missing = [y for y in ys if y not in shown.columns or shown[y].isna().all()]
        if missing:
            hint = when(missing[0].startswith(("perturbation", "kl")), " (run the sweep with `--measure`)")
            st.info(f"{path.name} has no `{missing[0]}` column{hint}.")
            continue
        chart(
            metric_figure(shown, x, ys, f"{title} ({path.name})"),
            f"{prefix}_{'_'.join(ys)}",
            name=f"{path.stem}-{'-'.join(ys)}",
            config={"results": str(path), **settings},
            data=shown,
        )


def bench_figure(name: str):
    """The figure builder of a `results/bench_*.json` file (its benchmark's own), or None (table only)."""
    from kvlens.experiments.bench import frontier, needle, ppl

    if name.startswith("bench_frontier"):
        return frontier.figure
    if name.startswith("bench_needle"):
        return needle.figure
    if name.startswith("bench_ppl"):
        return ppl.figure
    return None


def frontier_table(summary: list[dict]) -> pd.DataFrame:
    """The bytes-quality frontier's summary as the Benchmarks page shows it: a row per configuration and
    measure."""
    rows = []
    for s in summary:
        measure, low, high, over = FRONTIER_MEASURES[s["metric"]]
        rows.append(
            {
                "family": s["family"],
                "configuration": s["config"],
                "measure": measure,
                "bytes share": s["bytes_share"],
                "value": s[s["metric"]],
                "low": s[low],
                "high": s[high],
                "over": f"{s[over]} {over}",
            }
        )
    return pd.DataFrame(rows)
