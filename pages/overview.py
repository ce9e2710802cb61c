"""Overview: what the selected run is (policy, prompt, generated text, metrics, command) and its cache
occupancy."""

import streamlit as st

from kvlens.ui.charts import chart
from kvlens.ui.inspector import token_inspector
from kvlens.ui.page import browse_page
from kvlens.ui.state import run_figure
from kvlens.ui.views import decision_counts, metric_row, token_text

run = browse_page(
    "kvlens",
    "See what KV-cache compression does to a language model: pick a run in the sidebar, "
    "browse its pages, or run and compare policies on your own prompt.",
)
metric_row(run)
left, right = st.columns([3, 2])
with left:
    st.subheader("Text")
    token_text(run)
    st.caption(decision_counts(run))
with right:
    chart(
        run_figure(run, "occupancy"),
        "ov_occ",
        name=f"occupancy-{run.path.name}",
        config={"run": str(run.path), "figure": "occupancy"},
    )
st.subheader(
    "Token inspector",
    help="Click a token: the attention its step paid to every position of the cache, "
    "as the run recorded it, with what the policy had kept, evicted or merged by then.",
)
token_inspector(run, "ov_insp")
with st.expander("How this run was made, and what it recorded"):
    st.code(run.meta.command or "(made in the app)", language="bash", wrap_lines=True)
    st.dataframe(
        {"tensor": list(run.tensors), "shape": [str(list(t.shape)) for t in run.tensors.values()]},
        hide_index=True,
        width="stretch",
    )
