"""Perturbation: merge vs evict output perturbation over steps and layers, attention loss, KL (CaM Fig. 1d)."""
import streamlit as st

from kvlens.plots_attention import perturbation_layers_figure, perturbation_steps_figure
from kvlens.ui.charts import chart
from kvlens.ui.results import sweep_section
from kvlens.ui.sidebar import app_shell
from kvlens.ui.state import offer_runs, run_figure, selected_run
from kvlens.ui.views import run_header

app_shell()

st.title("Perturbation")
st.caption("How far attention outputs drift from the full cache: the cache actually used, the same evictions "
           "without merging, the attention mass lost, and the KL of the next-token distribution.")
run = selected_run()
if run is not None:
    run_header(run)
    if not run.has("perturbation/used"):
        st.warning("This run was not measured. Record one with `kvlens generate ... --measure` (or tick *Measure* "
                   "on the Run page), or open a measured run:")
        offer_runs(lambda e: e.measured, "pert_offer")
    elif run.tensor("perturbation/used").shape[0] == 0:
        st.info("This run produced a single token, so no decode step was measured.")
    else:
        m = run.metrics
        cols = st.columns(4)
        cols[0].metric("Perturbation (cache used)", f"{m['perturbation_used']:.4f}")
        cols[1].metric("Perturbation (evict only)", f"{m['perturbation_evict']:.4f}")
        cols[2].metric("Attention loss", f"{m['attention_loss']:.4f}")
        cols[3].metric("KL to full", f"{m['kl']:.4f}")
        chart(run_figure(perturbation_steps_figure, run), "pert_steps", name="perturbation-steps",
              config={"run": str(run.path)})
        chart(run_figure(perturbation_layers_figure, run), "pert_layers", name="perturbation-layers",
              config={"run": str(run.path)})
st.subheader("Against the budget (from a sweep)")
sweep_section("pert", [("Output perturbation against the budget, merging vs evicting (CaM Fig. 1d)",
                        ["perturbation_used", "perturbation_evict"])])
