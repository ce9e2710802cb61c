"""Analyses: any registered analysis (`kvlens analyze --list`) of the open run, with widgets generated from its
parameters."""
import streamlit as st

from kvlens.analysis.registry import analyses
from kvlens.ui.analysis_widgets import analysis_widgets
from kvlens.ui.charts import chart
from kvlens.ui.page import analysis_need, browse_page, meets
from kvlens.ui.state import run_figure

run = browse_page("Analyses", "Every registered analysis of one run, with its parameters: the figure `kvlens figure` "
                              "exports and `kvlens.load_run(...).figure(...)` returns.")
known = {name: cls for name, cls in analyses().items() if cls.inputs != "model"}  # those that read runs
kind = st.selectbox("Analysis", list(known), key="an_kind", format_func=lambda n: f"{n} ({known[n].paper})")
if meets(analysis_need(kind), "an_offer"):
    params = analysis_widgets(kind, "an")
    if params is not None:
        chart(run_figure(run, kind, **params), f"an_{kind}", name=kind,
              config={"run": str(run.path), **params})
