"""Benchmarks: the task leaderboard, then quality at equal bytes, then speed and memory, then the other saved
benchmarks and the sweeps (perplexity, memory, speed against the budget), as tables and charts.

A sweep or benchmark still running writes its results file after every cell: while any is
unfinished, the sections re-read their file every few seconds and show the rows so far.
"""

import streamlit as st

from kvlens.ui.charts import chart
from kvlens.ui.eval_results import eval_section
from kvlens.ui.leaderboard import leaderboard
from kvlens.ui.page import page_top
from kvlens.ui.results import (
    bench_figure,
    frontier_table,
    pick_results,
    read_results,
    result_files,
    sweep_section,
)
from kvlens.ui.speed import speed_section

REFRESH_S = 5
# The benchmarks the page opens on, in this order: (results file name, title, URL key, the command that makes
# it)
LEAD = [
    ("bench_tasks", "Task leaderboard", "tasks", "kvlens bench tasks"),
    ("bench_frontier", "Quality at equal bytes", "frontier", "kvlens bench frontier"),
    ("bench_speed", "Speed and memory", "speed", "kvlens bench speed"),
]

page_top("Benchmarks", "Read from saved results (`results/`); nothing is run here.")


def unfinished(path) -> bool:
    got = read_results(str(path), path.stat().st_mtime)
    return not isinstance(got, str) and got[0].get("status") == "running"


live = any(unfinished(p) for p in result_files("sweep") + result_files("bench"))


def show(picked) -> None:
    """One benchmark results file: its own figure and table, or the leaderboard of a task benchmark."""
    path, settings, frame, raw = picked
    if path.name.startswith("bench_tasks"):
        leaderboard(path, settings, raw)
    elif path.name.startswith("bench_speed"):
        speed_section(path, settings, frame, raw)
    else:
        builder = bench_figure(path.name)
        if builder is not None and len(frame):
            try:
                chart(
                    builder(raw),
                    f"bench_fig_{path.stem}",
                    name=path.stem,
                    config={"results": str(path), **settings},
                    data=frame,
                )
            except (KeyError, TypeError, ValueError) as err:
                st.error(
                    f"{path.name} does not have the layout its benchmark writes "
                    f"({type(err).__name__}: {err})."
                )
        if path.name.startswith("bench_frontier") and isinstance(raw.get("summary"), list):
            st.dataframe(frontier_table(raw["summary"]), hide_index=True, width="stretch")
            with st.expander(f"Every cell ({len(frame)})"):
                st.dataframe(frame, hide_index=True, width="stretch")
        else:
            st.dataframe(frame, hide_index=True, width="stretch")
    if settings.get("command"):
        st.caption(f"Made by `{settings['command']}`.")
    with st.expander("Settings of this benchmark"):
        st.json(settings.get("config", settings), expanded=False)


@st.fragment(run_every=REFRESH_S if live else None)
def lead_section(name: str, title: str, param: str, command: str) -> None:
    st.subheader(title)
    picked = pick_results(
        f"bench_{param}",
        "bench",
        title.lower(),
        only=(name,),
        param=param,
        make=f"Make one with `{command}`.",
    )
    if picked is not None:
        show(picked)


@st.fragment(run_every=REFRESH_S if live else None)
def others():
    picked = pick_results("bench", "bench", "benchmark results", without=tuple(n for n, *_ in LEAD))
    if picked is not None:
        show(picked)


@st.fragment(run_every=REFRESH_S if live else None)
def sweeps():
    sweep_section(
        "bench_sweep",
        [
            ("Perplexity against the budget", ["ppl"]),
            ("Share of the full cache's bytes kept", ["bytes_share"]),
            ("Speed", ["ms_per_token"]),
        ],
    )


tab_lead, tab_eval, tab_other, tab_sweep = st.tabs(
    ["Leaderboard, frontier, speed", "lm-eval tasks", "Other benchmarks", "Sweeps"]
)
with tab_lead:
    for spec in LEAD:
        lead_section(*spec)
with tab_eval:
    eval_section()
with tab_other:
    others()
with tab_sweep:
    sweeps()
