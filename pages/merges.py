"""Merges: the decision timeline, each merged slot's provenance, and the Gaussian weights of a KVMerger
set."""

import streamlit as st

from kvlens.analysis.states import recorded_layers
from kvlens.figures import provenance
from kvlens.figures.attention import provenance_figure
from kvlens.ui import url_state
from kvlens.ui.charts import chart
from kvlens.ui.page import analysis_need, browse_page, fits, offer_runs, pick_head, pick_layer
from kvlens.ui.state import run_figure
from kvlens.ui.views import decision_counts

run = browse_page(
    "Merges",
    "Which slot went where: evictions and merges per step, what each merged slot now holds, "
    "and how KVMerger weighs a merging set.",
)
d = run.decisions
if d is None or not len(d):
    st.info("This run made no decisions (nothing was evicted or merged). Pick a run of a compressing policy.")
    offer_runs(lambda e: e.merging, "merge_offer")
else:
    c1, c2, _ = st.columns([1, 1, 2])
    layers = sorted(d["layer"].unique().tolist())
    layer = pick_layer(layers, "merge_layer", c1, default=layers[0])  # in the URL, as the Gaussian's below
    head = pick_head(run, "merge_head", c2, kv=True)
    merges = d[d["action"] == "merge"]
    st.markdown(decision_counts(run))
    cfg = {"run": str(run.path), "layer": layer, "kv_head": head}
    chart(
        run_figure(run, "decisions", layer=layer, kv_head=head),
        "merge_timeline",
        name=f"decisions-L{layer}-H{head}",
        config=cfg,
    )
    if not len(merges):
        st.info(
            f"{run.meta.policy.name} only evicts, so no slot holds merged values. "
            "Open a merging run to see provenance."
        )
        offer_runs(lambda e: e.merging, "merge_offer")
    else:
        table = provenance.table(run)
        table = table[table["weight"] > 0]  # a Bernoulli draw of 0 added nothing
        sub = table[(table["layer"] == layer) & (table["kv_head"] == head)]
        left, right = st.columns([3, 2])
        with left:
            if len(sub):
                chart(
                    provenance_figure(table, layer, head),
                    "merge_prov",
                    name=f"provenance-L{layer}-H{head}",
                    config=cfg,
                    data=sub,
                )
            else:
                st.info("No slot of this layer and head holds merged values at the end of the run.")
        with right:
            st.markdown("**Provenance table** (slot, original position it holds, weight)")
            st.dataframe(sub[["slot", "source", "weight"]], hide_index=True, height=380, width="stretch")
if fits(analysis_need("gaussian")):
    st.subheader("Gaussian weights of a KVMerger merging set")
    c1, c2, c3 = st.columns(3)
    g_layers = recorded_layers(run)
    g_layer = pick_layer(g_layers, "merge_glayer", c1, default=g_layers[0], param="glayer")
    g_head = pick_head(run, "merge_ghead", c2, kv=True, param="ghead")
    thresholds = [round(0.3 + 0.05 * i, 2) for i in range(14)]  # the slider's stops, 0.3 to 0.95
    threshold = url_state.bound(
        lambda **kw: c3.slider("Similarity threshold", 0.3, 0.95, step=0.05, **kw),
        "threshold",
        "merge_thr",
        thresholds,
        "similarity threshold",
        0.75,
        show=lambda t: f"{t:g}",
    )
    chart(
        run_figure(run, "gaussian", layer=g_layer, head=g_head, threshold=threshold),
        "merge_gauss",
        name=f"gaussian-L{g_layer}-H{g_head}",
        config={"run": str(run.path), "layer": g_layer, "head": g_head, "threshold": threshold},
    )
