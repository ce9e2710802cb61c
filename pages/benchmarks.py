"""Benchmarks: saved sweeps (perplexity, memory, speed against the budget) and benchmark results, as tables and charts.

A sweep or benchmark still running writes its results file after every cell: while any is
unfinished, both tabs re-read their file every few seconds and show the rows so far.
"""
import streamlit as st

from kvlens.ui.charts import chart
from kvlens.ui.leaderboard import leaderboard
from kvlens.ui.page import page_top
from kvlens.ui.results import bench_figure, frontier_table, pick_results, read_results, result_files, sweep_section

REFRESH_S = 5

page_top("Benchmarks", "Read from saved results (`results/`); nothing is run here.")


def unfinished(path) -> bool:
    got = read_results(str(path), path.stat().st_mtime)
    return not isinstance(got, str) and got[0].get("status") == "running"


live = any(unfinished(p) for p in result_files("sweep") + result_files("bench"))


@st.fragment(run_every=REFRESH_S if live else None)
def sweeps():
    sweep_section("bench_sweep", [("Perplexity against the budget", ["ppl"]),
                                  ("Share of the full cache's bytes kept", ["bytes_share"]),
                                  ("Speed", ["ms_per_token"])])


@st.fragment(run_every=REFRESH_S if live else None)
def benchmarks():
    picked = pick_results("bench", "bench", "benchmark results")
    if picked is None:
        return
    path, settings, frame, raw = picked
    if path.name.startswith("bench_tasks"):
        leaderboard(path, settings, raw)
        with st.expander("Settings of this benchmark"):
            st.json(settings.get("config", settings), expanded=False)
        return
    builder = bench_figure(path.name)
    if builder is not None and len(frame):
        try:
            chart(builder(raw), "bench_fig", name=path.stem, config={"results": str(path), **settings}, data=frame)
        except (KeyError, TypeError, ValueError) as err:
            st.error(f"{path.name} does not have the layout its benchmark writes ({type(err).__name__}: {err}).")
    if path.name.startswith("bench_frontier") and isinstance(raw.get("summary"), list):
        st.dataframe(frontier_table(raw["summary"]), hide_index=True, width="stretch")
        with st.expander(f"Every cell ({len(frame)})"):
            st.dataframe(frame, hide_index=True, width="stretch")
    else:
        st.dataframe(frame, hide_index=True, width="stretch")
    for key in ("ratios", "targets", "growth"):
        if isinstance(raw.get(key), dict):
            st.markdown(f"**{key}**")
            st.json(raw[key], expanded=True)
    with st.expander("Settings of this benchmark"):
        st.json(settings.get("config", settings), expanded=False)


tab_sweep, tab_bench = st.tabs(["Sweeps", "Benchmarks"])
with tab_sweep:
    sweeps()
with tab_bench:
    benchmarks()
