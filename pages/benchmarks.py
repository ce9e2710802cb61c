"""Benchmarks: saved sweeps (perplexity, memory, speed against the budget) and benchmark results, as tables and charts."""
import streamlit as st

from kvlens.ui.charts import chart
from kvlens.ui.results import bench_figure, pick_results, sweep_section
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
        path, settings, frame, raw = picked
        builder = bench_figure(path.name)
        if builder is not None:
            try:
                chart(builder(raw), "bench_fig", name=path.stem, config={"results": str(path), **settings}, data=frame)
            except (KeyError, TypeError, ValueError) as err:
                st.error(f"{path.name} does not have the layout its benchmark writes ({type(err).__name__}: {err}).")
        st.dataframe(frame, hide_index=True, width="stretch")
        for key in ("ratios", "targets", "growth"):
            if isinstance(raw.get(key), dict):
                st.markdown(f"**{key}**")
                st.json(raw[key], expanded=True)
        with st.expander("Settings of this benchmark"):
            st.json(settings.get("config", settings), expanded=False)
