"""The paper style every kvlens figure shares (the analyses' figures, `kvlens figure`, the app's exports).

Style: one font, white background, axis lines without grids, ticks outside, units in axis titles,
greyscale-safe colour scales (Viridis for maps) and line styles that differ by dash and marker
as well as colour. Importing this module registers the "kvlens" plotly template; `finish` applies
it with a title and `layout.meta` (the analysis, its parameters and the run), which
`kvlens.figures.export` writes as the figure's JSON config. Each analysis' own figure is built in
its file in `kvlens/analysis/kinds/`.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
import plotly.io as pio

from kvlens.figures.wording import if_none, when
from kvlens.runs.run import Run

FONT = dict(family="Helvetica, Arial, sans-serif", size=14, color="#111111")
SCALE = "Viridis"
COLORS = ["#000000", "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00"]  # Okabe-Ito, dark first
DASHES = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"]
SYMBOLS = ["circle", "square", "diamond", "triangle-up", "x", "cross"]
WIDTH, HEIGHT = 720, 460
PLURAL = {"query": "queries", "key": "keys", "value": "values"}

_axis = dict(
    showline=True,
    linecolor="#111111",
    linewidth=1,
    ticks="outside",
    showgrid=False,
    zeroline=False,
    mirror=False,
    title=dict(font=dict(size=14)),
)
pio.templates["kvlens"] = go.layout.Template(
    layout=dict(
        font=FONT,
        paper_bgcolor="white",
        plot_bgcolor="white",
        xaxis=_axis,
        yaxis=_axis,
        margin=dict(l=90, r=30, t=70, b=60),
        legend=dict(bgcolor="rgba(0,0,0,0)", borderwidth=0),
        title=dict(font=dict(size=16), x=0.02, xanchor="left"),
        colorway=COLORS,
        width=WIDTH,
        height=HEIGHT,
    )
)


def line_style(i: int) -> dict:
    """Colour, dash and marker of the i-th series: distinct in greyscale too."""
    return dict(
        line=dict(color=COLORS[i % 6], dash=DASHES[i % 6], width=2),
        marker=dict(color=COLORS[i % 6], symbol=SYMBOLS[i % 6], size=6),
    )


def finish(fig: go.Figure, title: str, analysis: str, run: Run | None = None, **params) -> go.Figure:
    """The paper style, the title, and `layout.meta` (the analysis, its parameters and the run) that
    `kvlens.figures.export` writes as the figure's JSON config."""
    meta: dict[str, Any] = {"analysis": analysis, "params": params}
    if run is not None:
        meta["run"] = run_path(run)
        meta["run_command"] = run.meta.command
        meta["model"] = run.meta.model.spec
    fig.update_layout(template="kvlens", title=dict(text=title), meta=meta)
    return integer_ticks(fig)


def run_path(run: Run) -> str | None:
    """The run's folder as a figure's metadata records it; None for an unsaved run."""
    return run.path and str(run.path)


def integer_ticks(fig: go.Figure, span: int = 12) -> go.Figure:
    """Ticks at whole numbers on every axis whose points are all whole numbers spanning at most `span` (plotly
    would otherwise tick steps or positions at 0.5); an axis drawn from zero (`rangemode="tozero"`) spans
    from zero (48 kept slots on an axis from 0 would get 49 labels)."""
    values: dict[str, list] = {}
    for trace in fig.data:
        if trace.type not in ("scatter", "bar"):
            continue
        for letter in ("x", "y"):
            axis = (getattr(trace, f"{letter}axis", None) or letter).replace(letter, f"{letter}axis", 1)
            points = getattr(trace, letter)
            values.setdefault(axis, []).extend(if_none(points, ()))
    for axis, points in values.items():
        numbers = [v for v in points if v is not None]
        if numbers and fig.layout[axis].rangemode == "tozero":
            numbers.append(0)
        if (
            numbers
            and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer()
                for v in numbers
            )
            and max(numbers) - min(numbers) <= span
            and fig.layout[axis].type in (None, "-", "linear")
            and fig.layout[axis].dtick is None
        ):
            fig.layout[axis].dtick = 1
    return fig


def model_label(spec: str) -> str:
    """A model spec as a figure shows it: the embedded default by name, else the last path part."""
    return {"default": "SmolLM2-135M-Instruct"}.get(spec, spec.rstrip("/").split("/")[-1])


def storage_label(storage: dict | None, short: bool = False) -> str:
    """A run's KV storage (run.json's `storage`, `Storage.describe()`) in words: "model dtype" for none (older
    runs too), else e.g. "4-bit kivi, group 64" (+ ", last 32 in full precision"); `short`: "4-bit" with only
    the settings that differ from the defaults (kivi, group 64, no window)."""
    if storage and (storage.get("rank") or storage.get("rank_share")):
        return rank_label(storage, short)
    if not storage or storage.get("bits") is None:
        return "model dtype"
    bits, scheme, group, residual = (storage.get(k) for k in ("bits", "scheme", "group", "residual"))
    if short:
        extra = [
            text
            for text, differs in [
                (scheme, scheme not in (None, "kivi")),
                (f"group {group}", group not in (None, 64)),
                (f"window {residual}", residual),
            ]
            if differs
        ]
        return f"{bits}-bit" + when(extra, f" ({', '.join(extra)})")
    return f"{bits}-bit {scheme}, group {group}" + when(residual, f", last {residual} in full precision")


def rank_label(storage: dict, short: bool = False) -> str:
    """Low-rank storage in words, e.g. "low-rank, rank at 0.25 of the bytes per head (later tokens
    projected)"; records made before `rank_append` existed gave `rank_share` as a share of the head size."""
    unit = "of the bytes" if "rank_append" in storage else "of the head size"
    rank = f"rank {storage['rank']}" if storage.get("rank") else f"rank at {storage['rank_share']:g} {unit}"
    rank += when(storage.get("bits"), f", {storage.get('bits')}-bit coefficients")
    if short:
        return rank
    where = f"xKV over {storage['rank_layers']} layers" if storage.get("rank_layers") else "per head"
    later = {"full": "full width"}.get(storage.get("rank_append"), "projected")
    return f"low-rank, {rank}, {where} (later tokens {later})"


def run_model(run: Run) -> str:
    """The model a run was recorded with, as a figure title shows it (`model_label` of its spec)."""
    return model_label(str(run.meta.model.spec))
