"""Similarity: query/key/value cosine maps of a layer and head (KVMerger Fig. 2, CORM Fig. 3) and
adjacent-token similarity across layers and heads (KVMerger Fig. 3a)."""

import streamlit as st

from kvlens.analysis.states import recorded_layers
from kvlens.ui import url_state
from kvlens.ui.charts import chart
from kvlens.ui.page import analysis_need, browse_page, pick_head, pick_layer, pick_step
from kvlens.ui.state import run_figure

run = browse_page(
    "Similarity",
    "Cosine similarity of the prompt's query, key and value states after RoPE. Keys of "
    "neighbouring tokens are alike (KVMerger's premise); values much less so.",
    analysis_need("similarity"),
)
c1, c2, c3 = st.columns([1, 1, 2])
layer = pick_layer(recorded_layers(run), "sim_layer", c1)  # layer, head, states and token live in the URL
head = pick_head(
    run, "sim_head", c2, kv=True, help="Queries are shown for the first query head of this KV head's group."
)
kv_heads = run.shape["kv_heads"]
states = ["query", "key", "value"]
kinds = url_state.bound_many(
    lambda **kw: c3.multiselect("States", states, **kw),
    "states",
    "sim_kinds",
    states,
    "choice of states",
    states,
)
if not kinds:
    st.info("Pick at least one of query, key, value.")
group = run.shape["heads"] // kv_heads
heads = {kind: head * group if kind == "query" else head for kind in kinds}
figures = {kind: run_figure(run, "similarity", layer=layer, head=h, state=kind) for kind, h in heads.items()}
lo = min((min(t.zmin for t in fig.data if t.type == "heatmap") for fig in figures.values()), default=0.0)
for col, kind in zip(st.columns(max(1, len(kinds))), kinds, strict=False):
    h, fig = heads[kind], figures[kind]
    with col:
        fig.update_traces(zmin=lo, zmax=1, selector=dict(type="heatmap"))  # one colour range for every panel
        fig.update_layout(title=dict(text=f"layer {layer}, {'query' if kind == 'query' else 'KV'} head {h}"))
        chart(
            fig,
            f"sim_{kind}",
            name=f"similarity-{kind}-L{layer}-H{h}",
            config={"run": str(run.path), "layer": layer, "head": h, "kind": kind},
        )
st.subheader("Across layers and heads")
left, right = st.columns(2)
with left:
    chart(run_figure(run, "adjacency"), "sim_adj", name="adjacency", config={"run": str(run.path)})
with right:
    n = len(run.meta.prompt_tokens)
    token = pick_step(
        "Token t",
        n - 1,
        "sim_token",
        first=1,
        param="token",
        help="Similarity of this token's key to the 32 keys before it, per KV head.",
    )
    chart(
        run_figure(run, "preceding", layer=layer, token=token, window=32, state="key"),
        "sim_prec",
        name=f"preceding-L{layer}-t{token}",
        config={"run": str(run.path), "layer": layer, "token": token},
    )
