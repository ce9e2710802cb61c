"""Similarity: query/key/value cosine maps of a layer and head (KVMerger Fig. 2, CORM Fig. 3) and
adjacent-token similarity across layers and heads (KVMerger Fig. 3a)."""
import streamlit as st

from kvlens.analysis import recorded_layers
from kvlens.plots import adjacency_figure, preceding_figure, similarity_figure
from kvlens.ui.charts import chart
from kvlens.ui.sidebar import app_shell
from kvlens.ui.state import require, run_figure, selected_run
from kvlens.ui.views import run_header

app_shell()

st.title("Similarity")
st.caption("Cosine similarity of the prompt's query, key and value states after RoPE. Keys of neighbouring tokens "
           "are alike (KVMerger's premise); values much less so.")
run = selected_run()
if run is not None:
    run_header(run)
    if require(run, "states", "The similarity maps"):
        layers = recorded_layers(run)
        c1, c2, c3 = st.columns([1, 1, 2])
        layer = c1.selectbox("Layer", layers, index=len(layers) // 2, key="sim_layer")
        kv_heads = run.shape["kv_heads"]
        head = c2.selectbox("KV head", list(range(kv_heads)), key="sim_head",
                            help="Queries are shown for the first query head of this KV head's group.")
        kinds = c3.multiselect("States", ["query", "key", "value"], default=["query", "key", "value"], key="sim_kinds")
        if not kinds:
            st.info("Pick at least one of query, key, value.")
        else:
            cfg = {"run": str(run.path), "layer": layer, "head": head, "kinds": kinds}
            group = run.shape["heads"] // kv_heads
            cols = st.columns(len(kinds))
            for col, kind in zip(cols, kinds):
                h = head * group if kind == "query" else head
                with col:
                    fig = run_figure(similarity_figure, run, layer, h, kind)
                    fig.update_layout(title=dict(text=f"layer {layer}, {'query' if kind == 'query' else 'KV'} head {h}"))
                    chart(fig, f"sim_{kind}",
                          name=f"similarity-{kind}-L{layer}-H{h}", config={**cfg, "kind": kind, "head": h})
        st.subheader("Across layers and heads")
        left, right = st.columns(2)
        with left:
            chart(run_figure(adjacency_figure, run), "sim_adj", name="adjacency", config={"run": str(run.path)})
        with right:
            n = len(run.meta["prompt_tokens"])
            token = st.slider("Token t", 1, n - 1, n - 1, key="sim_token",
                              help="Similarity of this token's key to the 32 keys before it, per KV head.")
            chart(run_figure(preceding_figure, run, layer, token, 32, "key"), "sim_prec",
                  name=f"preceding-L{layer}-t{token}", config={"run": str(run.path), "layer": layer, "token": token})
