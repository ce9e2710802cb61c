"""The Runs page's Streamlit pieces (keys prefixed `runs_`): the cached table, the overlay of the
picked runs, opening one in the browse pages, the delete dialog, zip download and upload.

The table and the archive logic live in `kvlens.figures.run_table` and `kvlens.runs.archive`; the runs are
those of the sidebar's picker (`kvlens.ui.state.all_runs`), so both always agree on what a run is.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pandas as pd
import streamlit as st

from kvlens.analysis.registry import analysis_figure
from kvlens.errors import KvlensError
from kvlens.figures.run_table import run_table
from kvlens.runs.archive import delete_run, export_run, import_run
from kvlens.ui import session
from kvlens.ui.charts import chart
from kvlens.ui.state import RunEntry, list_runs, open_run, stamp, user_runs_dir

PENDING = "runs_pending_delete"  # the runs whose Delete was pressed, until the dialog is answered
VERSION = "runs_version"  # bumped after a delete: the table's selection starts afresh
IMPORTED = "runs_imported"  # uploaded file id -> the sentence its import gave (each upload is imported once)

KEY_COLUMNS = [
    "name",
    "text",
    "prompt",
    "policy",
    "budget",
    "ppl",
    "peak KV (MiB)",
    "KL",
    "perturbation",
]  # what tells runs apart first: in view without scrolling sideways (`KEY_WIDTH`)
ORDER = [
    *KEY_COLUMNS,
    "params",
    "storage",
    "source",
    "prompt tokens",
    "new tokens",
    "mode",
    "level",
    "model",
    "saved",
]
KEY_WIDTH = 820  # px: the app's content at a 1280-px-wide window (wide layout, sidebar open)
COLUMN_CONFIG = {
    "name": st.column_config.TextColumn("name", width=160, pinned=True),
    "text": st.column_config.TextColumn(
        "text",
        width=40,
        help="Runs with the same letter ran on the same prompt tokens; ppl, KL and perturbation compare only "
        "within one letter",
    ),
    "prompt": st.column_config.TextColumn("prompt", width=130, help="The prompt's first words"),
    "policy": st.column_config.TextColumn("policy", width=105),
    "source": st.column_config.TextColumn(
        "source", width="small", help="shipped: cached_runs/; yours: runs/"
    ),
    "params": st.column_config.TextColumn(
        "params", width=130, help="Parameters that differ from their defaults"
    ),
    "budget": st.column_config.TextColumn(
        "budget",
        width=70,
        help="Slots per KV head per layer (none: the policy keeps "
        "what it decides, e.g. full, KVMerger, CORM)",
    ),
    "storage": st.column_config.TextColumn(
        "KV storage",
        width=100,
        help="How keys and values were stored: the model's dtype, or quantized to this many bits (--kv-bits)",
    ),
    "ppl": st.column_config.NumberColumn("ppl", format="%.3f", width=60, help="Perplexity of the new tokens"),
    "KL": st.column_config.NumberColumn(
        "KL",
        format="%.4f",
        width=65,
        help="Mean KL(p_full ‖ p_policy) per step (runs made with --measure)",
    ),
    "perturbation": st.column_config.NumberColumn(
        "perturb.",
        format="%.4f",
        width=70,
        help="Mean output perturbation ‖O − O_full‖ / ‖O_full‖ (runs made with --measure)",
    ),
    "peak KV (MiB)": st.column_config.NumberColumn(
        "peak KV",
        format="%.2f MiB",
        width=85,
        help="Largest allocated K+V bytes after any compression, in MiB",
    ),
    "prompt tokens": st.column_config.NumberColumn(
        "prompt", width="small", help="Prompt (or prefill) tokens"
    ),
    "new tokens": st.column_config.NumberColumn("new", width="small", help="Generated (or scored) tokens"),
    "saved": st.column_config.DatetimeColumn(
        "saved (UTC)",
        format="YYYY-MM-DD HH:mm",
        help="When run.json was last written (a shipped run: when it was checked out)",
    ),
}


@st.cache_data(max_entries=4, show_spinner=False)
def _table(entries: tuple[tuple[str, str, float], ...]) -> tuple[pd.DataFrame, list[str]]:
    return run_table((path, source) for path, source, _ in entries)


def runs_frame(entries: list[RunEntry]) -> tuple[pd.DataFrame, list[str]]:
    """The table of the picker's runs (cached per run and modification time) and the sentences of those left
    out."""
    return _table(tuple((e.path, e.source, stamp(e.path)) for e in entries))


def table_key(version: int, text: str, policies: list[str]) -> str:
    """The table's widget key: a new one after a delete (`version`) or a filter change, so row numbers never
    point at runs they did not mean."""
    return f"runs_table_{version}_{zlib.crc32(repr((text, list(policies))).encode())}"


def overlay(paths: list[str], names: list[str]) -> None:
    """The `steps` analysis of the picked runs in one figure; a run that does not load is one sentence."""
    runs, labels = [], []
    for path, name in zip(paths, names, strict=True):
        try:
            runs.append(open_run(path))
            labels.append(name)
        except KvlensError as err:
            st.error(str(err))
    if runs:
        chart(
            analysis_figure("steps", runs, label=labels),
            "runs_overlay",
            name="steps-" + "-".join(labels)[:60],
            config={"runs": [str(r.path) for r in runs], "labels": labels},
            height=330,
        )


def open_in_browse(path: str) -> None:
    """Make `path` the sidebar's run (as a page that saved a run does) and go to Overview."""
    st.session_state[session.RUN_REQUEST] = path
    st.switch_page("pages/overview.py")


@st.cache_data(max_entries=2, show_spinner="Zipping the run…")
def _zip(path: str, mtime: float) -> bytes:
    return export_run(path)


def download_button(column, path: str, name: str) -> None:
    """A download button with the run as a zip (or the sentence saying why it cannot be zipped)."""
    try:
        data = _zip(path, stamp(path))
    except KvlensError as err:
        column.error(str(err))
        return
    column.download_button(
        "Download .zip",
        data=data,
        file_name=f"{name}.zip",
        mime="application/zip",
        key="runs_download",
        on_click="ignore",
        icon=":material/download:",
        width="stretch",
        help="run.json, tensors.safetensors and decisions.parquet in one zip",
    )


def delete_button(column, paths: list[str], yours: bool) -> None:
    """A Delete button for the ticked runs (only when all are yours) that asks first, in a dialog."""
    if column.button(
        "Delete",
        icon=":material/delete:",
        disabled=not yours,
        key="runs_delete",
        width="stretch",
        help="Delete the ticked runs from your runs folder (asks first)"
        if yours
        else "Shipped runs (cached_runs/) cannot be deleted here",
    ):
        st.session_state[PENDING] = paths
    if st.session_state.get(PENDING):
        _confirm_delete(st.session_state[PENDING])


def _forget_pending() -> None:
    st.session_state.pop(PENDING, None)


@st.dialog("Delete runs", on_dismiss=_forget_pending)
def _confirm_delete(paths: list[str]) -> None:
    names = ", ".join(f"`{Path(p).name}`" for p in paths)
    st.write(f"Delete {names} from {user_runs_dir()}? This cannot be undone.")
    left, right = st.columns(2)
    if left.button("Delete", type="primary", key="runs_delete_yes", width="stretch"):
        _forget_pending()
        try:
            for path in paths:
                delete_run(path, user_runs_dir())
        except KvlensError as err:
            st.error(str(err))
            return
        finally:
            list_runs.clear()
        st.session_state[VERSION] = st.session_state.get(VERSION, 0) + 1
        st.rerun()
    if right.button("Cancel", key="runs_delete_no", width="stretch"):
        _forget_pending()
        st.rerun()


def upload() -> tuple[bool, str] | None:
    """An uploader that imports a zip into the user's runs (once per upload); whether it worked and the
    sentence saying so, while the file is in the uploader (None when there is none)."""
    file = st.file_uploader(
        "A run as a .zip: one made by *Download .zip*, or a zip of a run folder",
        type=["zip"],
        key="runs_upload",
        help="It is checked like any run before it joins your runs, and never replaces one "
        "(a name already taken gets -2, -3, ...).",
    )
    if file is None:
        return None
    done = st.session_state.setdefault(IMPORTED, {})
    if file.file_id not in done:
        try:
            target = import_run(file, user_runs_dir(), file.name)
            done[file.file_id] = (True, f"Imported {file.name} as `{target.name}` in your runs.")
            list_runs.clear()
        except KvlensError as err:
            done[file.file_id] = (False, str(err))
    return done[file.file_id]
