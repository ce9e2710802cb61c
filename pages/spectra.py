"""Spectra: normalised singular values of keys vs values per layer (WeightedKV Fig. 1)."""
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
