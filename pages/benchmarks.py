"""Benchmarks: saved sweeps (perplexity, memory, speed against the budget) and benchmark results, as tables and charts."""
import streamlit as st

from kvlens.ui.charts import chart
from kvlens.ui.results import metric_figure, pick_results, sweep_section
from kvlens.ui.sidebar import app_shell

app_shell()

st.title("Benchmarks")
st.caption("Read from saved results (`results/`); nothing is run here.")

tab_sweep, tab_bench = st.tabs(["Sweeps", "Benchmarks"])
with tab_sweep:
    sweep_section("bench_sweep", [("Perplexity against the budget", ["ppl"]),
                                  ("Share of the full cache's bytes kept", ["bytes_share"]),
                                  ("Speed", ["ms_per_token"])])
with tab_bench:
    picked = pick_results("bench", "bench", "benchmark results")
    if picked is not None:
        path, settings, frame = picked
        if settings:
            with st.expander("Settings of this benchmark"):
                st.json(settings, expanded=False)
        st.dataframe(frame, hide_index=True, width="stretch")
        numeric = [c for c in frame.select_dtypes("number").columns]
        if "policy" in frame.columns and numeric:
            c1, c2 = st.columns(2)
            x = c1.selectbox("x", numeric, key="bench_x")
            y = c2.selectbox("y", [c for c in numeric if c != x] or numeric, key="bench_y")
            chart(metric_figure(frame, x, [y], f"{y} against {x} ({path.name})"), "bench_fig",
                  name=f"{path.stem}-{y}", config={"results": str(path), **settings}, data=frame)
