"""Perturbation: merge vs evict output perturbation over steps and layers, attention loss, KL (CaM Fig. 1d)."""
import streamlit as st

from kvlens.ui.charts import chart
from kvlens.ui.page import analysis_need, browse_page, meets
from kvlens.ui.results import sweep_section
from kvlens.ui.state import run_figure

run = browse_page("Perturbation", "How far attention outputs drift from the full cache: the cache actually used, the "
                                  "same evictions without merging, the attention mass lost, and the KL of the "
                                  "next-token distribution.")
if meets(analysis_need("perturbation"), "pert_offer"):
    if run.tensor("perturbation/used").shape[0] == 0:
        st.info("This run produced a single token, so no decode step was measured.")
    else:
        m = run.metrics
        for col, (label, key) in zip(st.columns(4), [("Perturbation (cache used)", "perturbation_used"),
                                                     ("Perturbation (evict only)", "perturbation_evict"),
                                                     ("Attention loss", "attention_loss"), ("KL to full", "kl")],
                                     strict=True):
            col.metric(label, f"{m[key]:.4f}")
        for kind in ("perturbation", "perturbation-layers"):
            chart(run_figure(run, kind), f"pert_{kind}", name=kind, config={"run": str(run.path)})
st.subheader("Against the budget (from a sweep)")
sweep_section("pert", [("Output perturbation against the budget, merging vs evicting (CaM Fig. 1d)",
                        ["perturbation_used", "perturbation_evict"])])
