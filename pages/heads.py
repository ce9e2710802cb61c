"""Head grid: every recorded layer and head at one step, as attention strips or one number per head; a click
opens the head on the Attention page with the token inspector (bertviz's model view, CircuitsVis'
click-to-enlarge). Below it, the text at that step, each token coloured by how many heads keep it, or by one
head's state."""

import streamlit as st

from kvlens.figures.head_grid import METRICS, rows_figure, summary_figure
from kvlens.figures.kept_text import kept_text, kept_text_html
from kvlens.levels import RecordLevel
from kvlens.ui import session, url_state
from kvlens.ui.charts import chart
from kvlens.ui.page import browse_page, level_need, pick_head, pick_layer, pick_step
from kvlens.ui.state import run_head_grid

VIEWS = ["attention rows", "one number per head"]
COLOURS = ["how many heads keep it", "one head's state"]
run = browse_page(
    "Head grid",
    "Every recorded layer and head at one step. Click a head to open it on the Attention "
    "page with the token inspector.",
    need=level_need(RecordLevel.ATTENTION, "The head grid"),
)
grid = run_head_grid(run)
c1, c2, c3 = st.columns([3, 1.4, 1.6])
step = pick_step(
    "Step",
    grid.steps - 1,
    "heads_step",
    c1,
    help="Step 0 is the last prompt token's query; step s fed generated token s - 1 (its cache holds the "
    "decisions of the steps before).",
)
view = url_state.bound(
    lambda **kw: c2.radio("Show", VIEWS, **kw), "view", "heads_view", VIEWS, "view", VIEWS[0]
)
metrics = [m for m, (_, measured) in METRICS.items() if not measured or grid.measured]
if view == VIEWS[1]:
    metric = url_state.bound(
        lambda **kw: c3.selectbox(
            "Number", metrics, help="; ".join(f"{m}: {METRICS[m][0]}" for m in metrics), **kw
        ),
        "metric",
        "heads_metric",
        metrics,
        "number",
        metrics[0],
    )
    fig = summary_figure(grid, step, metric)
else:
    fig = rows_figure(grid, step)
clicked = chart(
    fig, "heads_grid", name=f"head-grid-step{step}", config={"run": str(run.path), "step": step}, clicked=True
)
if clicked:
    layer, head = clicked["customdata"]
    url_state.reread(session.RUN, "attn_layer", "attn_head", "attn_step")
    st.switch_page(
        "pages/attention.py",
        query_params={"run": run.path.name, "layer": layer, "head": head, "step": step, "inspect": "1"},
    )

st.subheader(f"The text at step {step}")
c1, c2, c3 = st.columns([2, 1, 1])
by = url_state.bound(
    lambda **kw: c1.radio("Colour each token by", COLOURS, horizontal=True, **kw),
    "colour",
    "heads_colour",
    COLOURS,
    "colouring",
    COLOURS[0],
)
if by == COLOURS[1]:
    layer = pick_layer(grid.layers, "heads_text_layer", c2, param="tlayer")
    head = pick_head(run, "heads_text_head", c3, param="thead")
    view = kept_text(run, step, layer, head)
else:
    view = kept_text(run, step)
st.markdown(kept_text_html(view), unsafe_allow_html=True)
