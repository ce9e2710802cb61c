"""Runs: every run in cached_runs/ and runs/ in one sortable, filterable table (read from run.json only);
tick rows to overlay their per-step curves, open one in the browse pages, download, delete or import a run."""

import streamlit as st

from kvlens.figures.run_table import filter_table
from kvlens.ui import runs_table as rt
from kvlens.ui import url_state
from kvlens.ui.page import page_top
from kvlens.ui.state import all_runs, cached_runs_dir, user_runs_dir

page_top(
    "Runs",
    f"Shipped runs ({cached_runs_dir().name}/) and yours ({user_runs_dir().name}/), read from each "
    "run.json. Click a column to sort; tick rows to compare their curves.",
)
c1, c2, c3 = st.columns([3, 2, 1], vertical_alignment="bottom")
with c3.popover("Import .zip", icon=":material/upload:", width="stretch"):
    imported = rt.upload()
frame, skipped = rt.runs_frame(all_runs())
text = url_state.bound(
    lambda **kw: c1.text_input(
        "Filter",
        placeholder="words from the name, policy, parameters, model …",
        help="Keeps the runs whose name, source, policy, parameters, budget, model, mode or "
        "level hold every word typed here.",
        **kw,
    ),
    "filter",
    "runs_filter",
    None,
    "filter",
    "",
)  # the filter and the policies live in the URL
names = sorted(frame["policy"].unique())
policies = url_state.bound_many(
    lambda **kw: c2.multiselect("Policies", names, placeholder="all policies", **kw),
    "policies",
    "runs_policies",
    names,
    "choice of policies",
    [],
)
shown = filter_table(frame, text, policies)
key = rt.table_key(st.session_state.get(rt.VERSION, 0), text, policies)
event = st.dataframe(
    shown,
    column_config=rt.COLUMN_CONFIG,
    column_order=rt.ORDER,
    hide_index=True,
    placeholder="–",
    on_select="rerun",
    selection_mode="multi-row",
    key=key,
)
texts = shown["text"].nunique()
st.caption(
    f"{len(shown)} of {len(frame)} runs"
    + (
        f" on {texts} different texts: ppl, KL and perturbation compare only runs of one letter in `text`"
        if texts > 1
        else ""
    )
    + (f" · {len(skipped)} folders could not be read: " + " ".join(skipped) if skipped else "")
)
if imported:
    (st.success if imported[0] else st.error)(imported[1])
picked = shown.iloc[[i for i in event.selection.rows if i < len(shown)]]
if picked.empty:
    st.info(
        "Tick one or more rows to overlay their per-step curves; tick one to open, download or delete it."
    )
else:
    one = len(picked) == 1
    b1, b2, b3, _ = st.columns([1, 1, 1, 2])
    if b1.button(
        "Open in Overview",
        icon=":material/open_in_new:",
        disabled=not one,
        key="runs_open",
        width="stretch",
        help="Select this run in the sidebar and browse it",
    ):
        rt.open_in_browse(picked["path"].iloc[0])
    if one:
        rt.download_button(b2, picked["path"].iloc[0], picked["name"].iloc[0])
    else:
        b2.button(
            "Download .zip",
            icon=":material/download:",
            disabled=True,
            key="runs_download_off",
            width="stretch",
            help="Tick one run to download it",
        )
    rt.delete_button(b3, list(picked["path"]), bool((picked["source"] == "yours").all()))
    rt.overlay(list(picked["path"]), list(picked["name"]))
