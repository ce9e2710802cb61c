"""Benchmarks: saved sweeps (perplexity, memory, speed against the budget) and benchmark results, as tables and charts."""
import streamlit as st

from kvlens.ui.charts import chart
from kvlens.ui.results import metric_figure, pick_results, sweep_section

st.title("Benchmarks")
st.caption("Read from saved results (`results/`); nothing is run here.")

tab_sweep, tab_bench = st.tabs(["Sweeps", "Benchmarks"])
with tab_sweep:
    st.markdown("**Perplexity against the budget** (WeightedKV Table I, CORM Table 3)")
    sweep_section("bench_ppl", y=["ppl"], require_column="ppl")
    st.markdown("**Memory and speed against the budget** (KVMerger Table 2, CaM Table 4)")
    sweep_section("bench_mem", y=["bytes_share"], require_column="bytes_share")
    sweep_section("bench_ms", y=["ms_per_token"], require_column="ms_per_token")
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
