"""Attention: the step x position attention map of a layer and head, kept/evicted/merged/sink marked (CaM
Fig. 1a-c), and the token inspector of the chosen row (open when the Head grid sent the user here:
`?inspect=1`)."""

import streamlit as st

from kvlens.figures.attention import (
    attention_grid,
    attention_map_figure,
    attention_row_figure,
    recorded_attention_layers,
)
from kvlens.levels import RecordLevel
from kvlens.ui.charts import chart
from kvlens.ui.inspector import token_view
from kvlens.ui.page import browse_page, level_need, pick_head, pick_layer, pick_step
from kvlens.ui.state import run_figure
from kvlens.ui.views import decision_counts

run = browse_page("Attention", need=level_need(RecordLevel.ATTENTION, "The attention map"))
c1, c2, c3 = st.columns([1, 1, 3])
layer = pick_layer(recorded_attention_layers(run), "attn_layer", c1)  # layer, head and row live in the URL
head = pick_head(run, "attn_head", c2)
grid = attention_grid(run, layer, head)
last = grid.rows[-1]
step = (
    pick_step(
        "Query row",
        last,
        "attn_step",
        c3,
        help="Row 0 is the last prompt token's query; row r fed generated token r - 1.",
    )
    if last
    else 0
)
cfg = {"run": str(run.path), "layer": layer, "head": head}
st.caption(decision_counts(run) + " The map below is one layer and query head.")
chart(attention_map_figure(run, grid, step), "attn_map", name=f"attention-L{layer}-H{head}", config=cfg)
left, right = st.columns(2)
with left:
    chart(
        attention_row_figure(grid, step),
        "attn_row",
        name=f"attention-row-{step}-L{layer}-H{head}",
        config={**cfg, "row": step},
    )
with right:
    chart(run_figure(run, "occupancy"), "attn_occ", name="occupancy", config={"run": str(run.path)})
with st.expander(
    f"Token inspector: row {step}, layer {layer}, head {head}",
    icon=":material/search:",
    expanded=st.query_params.get("inspect") == "1",
):
    token_view(run, "attn_insp", step, layer, head)
