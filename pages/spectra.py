"""Spectra: normalised singular values of keys vs values per layer (WeightedKV Fig. 1)."""
import streamlit as st

from kvlens.plots import spectrum_figure
from kvlens.ui.charts import chart
from kvlens.ui.sidebar import app_shell
from kvlens.ui.state import require, run_figure, selected_run
from kvlens.ui.views import run_header

app_shell()

st.title("Spectra")
st.caption("Keys are low-rank (their singular values fall fast), values are not: WeightedKV's reason to drop "
           "keys but merge values.")
run = selected_run()
if run is not None:
    run_header(run)
    if require(run, "states", "The spectra"):
        components = st.slider("Singular values shown", 8, 64, 64, step=8, key="spec_components")
        chart(run_figure(spectrum_figure, run, components), "spec_fig", name="spectrum",
              config={"run": str(run.path), "components": components})
