"""Spectra: normalised singular values of keys vs values per layer (WeightedKV Fig. 1), and what that decay
buys in low-rank storage: reconstruction error against bytes, rank by rank, and, replaying the run at a ladder
of ranks, what each rank does to the model's outputs."""

import streamlit as st

from kvlens.ui import url_state
from kvlens.ui.charts import chart
from kvlens.ui.page import analysis_need, browse_page
from kvlens.ui.state import run_figure

run = browse_page(
    "Spectra",
    "Keys are low-rank (their singular values fall fast), values are not: WeightedKV's "
    "reason to drop keys but merge values.",
    analysis_need("spectrum"),
)
components = url_state.bound(
    lambda **kw: st.slider("Singular values shown", 8, 64, step=8, **kw),
    "components",
    "spec_components",
    list(range(8, 65, 8)),
    "number of singular values",
    64,
)
chart(
    run_figure(run, "spectrum", components=components),
    "spec_fig",
    name="spectrum",
    config={"run": str(run.path), "components": components},
)
st.subheader("What the decay buys: low-rank storage")
st.caption(
    "Each layer's keys and values stored at rank r (`--kv-rank`): the reconstruction error (the discarded "
    "singular values' energy) against the bytes that rank costs, coefficients plus each head's basis. "
    "Marks: the rank each layer needs for the error below."
)
TARGETS = [0.001, 0.003, 0.01, 0.03, 0.1]
error = url_state.bound(
    lambda **kw: st.select_slider("Error target", options=TARGETS, **kw),
    "error",
    "spec_error",
    TARGETS,
    "reconstruction error target",
    0.01,
    parse=float,
)
chart(
    run_figure(run, "rank_bytes", error=error),
    "spec_rank_fig",
    name="rank_bytes",
    config={"run": str(run.path), "error": error},
)
st.subheader("What each rank does to the outputs")
st.caption(
    "The run's own tokens fed again through its model under its policy and budget, with keys and "
    "values stored "
    "at each rank (D/16 to D, D the head size) and in the model's dtype: the output error pooled over steps, "
    "layers and heads, split into the choice of positions, what low-rank storage adds and what merging adds; "
    "KL (labelled with the top-1 agreement) and NLL change against the full cache; each rank's "
    "KV bytes under "
    "it; and each layer's rank for the error target above. `kvlens analyze rank_perturbation` "
    "prints the same "
    "as a table."
)
asked = f"spec_replayed_{run.path}"
if not st.session_state.get(asked):
    if st.button(
        "Replay the run at each rank",
        key="spec_replay",
        help="Six measured passes of the run's model: about a minute on a CPU for a shipped run; then kept",
    ):
        st.session_state[asked] = True
        st.rerun()  # drawn without the button
    st.stop()
chart(
    run_figure(run, "rank_perturbation", error=error),
    "spec_replay_fig",
    name="rank_perturbation",
    config={"run": str(run.path), "error": error},
)
