"""Spectra: normalised singular values of keys vs values per layer (WeightedKV Fig. 1), and what that decay buys in
low-rank storage: reconstruction error against bytes, rank by rank."""
import streamlit as st

from kvlens.ui import url_state
from kvlens.ui.charts import chart
from kvlens.ui.page import analysis_need, browse_page
from kvlens.ui.state import run_figure

run = browse_page("Spectra", "Keys are low-rank (their singular values fall fast), values are not: WeightedKV's "
                             "reason to drop keys but merge values.", analysis_need("spectrum"))
components = url_state.bound(lambda **kw: st.slider("Singular values shown", 8, 64, step=8, **kw), "components",
                             "spec_components", list(range(8, 65, 8)), "number of singular values", 64)
chart(run_figure(run, "spectrum", components=components), "spec_fig", name="spectrum",
      config={"run": str(run.path), "components": components})
st.subheader("What the decay buys: low-rank storage")
st.caption("Each layer's keys and values stored at rank r (`--kv-rank`): the reconstruction error (the discarded "
           "singular values' energy) against the bytes that rank costs, coefficients plus each head's basis. "
           "Marks: the rank each layer needs for the error below.")
TARGETS = [0.001, 0.003, 0.01, 0.03, 0.1]
error = url_state.bound(lambda **kw: st.select_slider("Error target", options=TARGETS, **kw), "error", "spec_error",
                        TARGETS, "reconstruction error target", 0.01, parse=float)
chart(run_figure(run, "rank_bytes", error=error), "spec_rank_fig", name="rank_bytes",
      config={"run": str(run.path), "error": error})
