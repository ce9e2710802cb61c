"""Every chart in the app goes through `chart()`: the figure, then PNG / SVG / PDF / CSV / JSON downloads.

Files come from `kvlens.figures.export` (the CLI's exporter) and images are rendered only when their
button is clicked (Streamlit calls the data callable then), so a page never pays kaleido's
seconds for exports nobody asked for. Exports are always in the paper style (`kvlens.figures.plots`'
template); the sidebar's paper-style toggle (`session.PAPER`) shows that style on screen too,
otherwise charts follow the app's theme.
"""

from __future__ import annotations

import json
import re

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

import kvlens.figures.plots  # noqa: F401  (registers the "kvlens" plotly template used below)
from kvlens.errors import KvlensError
from kvlens.figures import export
from kvlens.figures.plots import integer_ticks
from kvlens.ui import session

MIME = {
    "png": "image/png",
    "svg": "image/svg+xml",
    "pdf": "application/pdf",
    "csv": "text/csv",
    "json": "application/json",
}


def paper_mode() -> bool:
    return bool(st.session_state.get(session.PAPER, False))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")[:80] or "figure"


def chart(
    fig: go.Figure,
    key: str,
    *,
    name: str,
    config: dict,
    data: pd.DataFrame | None = None,
    height: int | None = None,
    clicked: bool = False,
) -> dict | None:
    """Show `fig` with its export row. `config` is what reproduces it (run, layer, head, ...);
    `data` the figure's numbers as a table (default: the traces' x/y/z). With `clicked`, returns the first
    clicked point (plotly's point dict: `customdata`, `x`, `y`, ...) or None."""
    if not fig.layout.template or not fig.layout.template.layout.font.family:  # the app's own figures
        fig.update_layout(template="kvlens")
    if height:
        fig.update_layout(height=height)
    integer_ticks(fig)
    event = st.plotly_chart(
        fig,
        key=f"{key}_chart",
        theme=None if paper_mode() else "streamlit",
        config={"displaylogo": False, "toImageButtonOptions": {"filename": _slug(name)}},
        **({"on_select": "rerun", "selection_mode": "points"} if clicked else {}),
    )
    stem = _slug(name)
    full_config = {**export.figure_config(fig), **config}
    with st.popover(
        "Export", icon=":material/download:", help="PNG, SVG, PDF (paper style), CSV data, JSON config"
    ):
        for fmt in ("png", "svg", "pdf"):
            st.download_button(
                f"{fmt.upper()} image",
                data=lambda f=fig, x=fmt: _image(f, x),
                file_name=f"{stem}.{fmt}",
                mime=MIME[fmt],
                key=f"{key}_{fmt}",
                on_click="ignore",
                width="stretch",
                help="Rendered in the paper style when clicked (a few seconds)",
            )
        st.download_button(
            "CSV data",
            data=lambda: _csv(fig, data),
            file_name=f"{stem}.csv",
            mime=MIME["csv"],
            key=f"{key}_csv",
            on_click="ignore",
            width="stretch",
            help="The plotted numbers",
        )
        st.download_button(
            "JSON config",
            data=lambda: json.dumps(full_config, indent=1, default=str),
            file_name=f"{stem}.json",
            mime=MIME["json"],
            key=f"{key}_json",
            on_click="ignore",
            width="stretch",
            help="The settings that reproduce this figure",
        )
    if not (clicked and event):
        return None
    return next(iter(event.selection.points), None)


def _image(fig: go.Figure, fmt: str) -> bytes:
    """Image bytes; without Chromium the download holds the sentence saying how to get it."""
    try:
        return export.image_bytes(fig, fmt)
    except KvlensError as err:
        return str(err).encode()


def _csv(fig: go.Figure, data: pd.DataFrame | None) -> str:
    frame = data if data is not None else pd.DataFrame(export.figure_rows(fig), columns=export.COLUMNS)
    return frame.to_csv(index=False)
