"""The Why page's figures, from an `explain` result (`kvlens.explain.explain`): the recovered share per
layer and KV head, the span strip over the text with the needle marked, and the minimal set on the Head
grid's strips. Each carries `layout.meta` (`analysis`, `params`) like the other figures, so it exports the
same way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import plotly.graph_objects as go

from kvlens.errors import KvlensError
from kvlens.figures.wording import when


def _title(result: dict) -> str:
    case = result["case"]
    where = (
        f"{case['task']} sample {case['index']}, r = {case['ratio']}"
        if case["source"] == "sample"
        else f"run {Path(case['run']).name}, budget {result['budget']}"
    )
    return f"{case['policy']} on {where}"


def _meta(result: dict, view: str) -> dict:
    return {"analysis": "why", "params": {"view": view, **result["case"]}}


def share_heatmap(result: dict) -> go.Figure:
    """Recovered share of restoring each (layer, KV head) group alone: layers down, KV heads across (one
    column for all heads when only layers were grouped)."""
    layers, heads = result["shape"]["layers"], result["shape"]["kv_heads"]
    by_head = [g for g in result["groups"] if g["kind"] == "head"]
    by_layer = [g for g in result["groups"] if g["kind"] == "layer"]
    if not by_head and not by_layer:
        raise KvlensError("This result has no layer or head groups; explain it with --by layer or head.")
    x = [f"KV head {h}" for h in range(heads)] if by_head else ["all KV heads"]
    cols = len(x)
    z = np.full((layers, cols), np.nan)
    slots = np.zeros((layers, cols), dtype=int)
    for g in by_head or by_layer:
        z[g["layer"], g.get("head", 0)] = g["recovered_share"]
        slots[g["layer"], g.get("head", 0)] = g["slots"]
    y = [f"L{i}" for i in range(layers)]
    fig = go.Figure(
        go.Heatmap(
            z=z.tolist(),
            x=x,
            y=y,
            colorscale="RdBu",
            zmid=0,
            customdata=slots.tolist(),
            text=[[f"{v:.2f}" for v in row] for row in z.tolist()],
            texttemplate="%{text}",
            textfont={"size": 9},
            colorbar={"title": {"text": "recovered share"}, "thickness": 12},
            hovertemplate="%{y} %{x}: %{z:.3f} of the gap, %{customdata} slots<extra></extra>",
        )
    )
    fig.update_xaxes(side="top")
    fig.update_yaxes(autorange="reversed", title_text="layer")
    fig.update_layout(
        title={"text": f"Recovered share by layer and KV head: {_title(result)}"},
        height=max(360, 110 + 20 * layers),
        width=520 + 60 * cols,
        margin={"t": 110},
        meta=_meta(result, "heads"),
    )
    return fig


def span_strip(result: dict) -> go.Figure:
    """Recovered share of restoring each position span alone, along the context (hover: the span's text); the
    needle's span shaded."""
    spans = [g for g in result["groups"] if g["kind"] == "span"]
    if not spans:
        raise KvlensError("This result has no position spans; explain it with --by span.")
    shares = [g["recovered_share"] for g in spans]
    top = max(1.0, max(abs(s) for s in shares))
    fig = go.Figure(
        go.Bar(
            x=[(g["start"] + g["end"]) / 2 for g in spans],
            y=shares,
            width=[g["end"] - g["start"] for g in spans],
            marker={
                "color": shares,
                "colorscale": "RdBu",
                "cmid": 0,
                "cmin": -top,
                "cmax": top,
                "line": {"width": 0},
            },
            customdata=[[g["name"], g["slots"], g.get("text", "").replace("\n", " ")[:200]] for g in spans],
            name="span",
            hovertemplate="positions %{customdata[0]}: %{y:.3f} of the gap, %{customdata[1]} slots"
            "<br>%{customdata[2]}<extra></extra>",
        )
    )
    for start, end in result.get("needles", []):
        fig.add_vrect(
            x0=start - 0.5,
            x1=end - 0.5,
            fillcolor="#f2b134",
            opacity=0.35,
            line_width=0,
            annotation_text="needle",
            annotation_position="top left",
        )
    fig.update_xaxes(title_text="context position", range=[-0.5, result["context_tokens"] - 0.5])
    fig.update_yaxes(title_text="recovered share")
    fig.update_layout(
        title={"text": f"Recovered share by position span ({result['span']} tokens): {_title(result)}"},
        height=360,
        width=1100,
        showlegend=False,
        meta=_meta(result, "spans"),
    )
    return fig


def minimal_strips(result: dict, gap: int = 3) -> go.Figure:
    """The minimal set on the Head grid's strips: layers down, KV heads across, each strip the context's
    positions (pooled in blocks): grey where the policy removed entries, red where the minimal set restores
    them."""
    if "strips" not in result or not result.get("minimal", {}).get("found"):
        raise KvlensError("This result has no minimal set; explain it with --find-minimal.")
    removed, restored = np.array(result["strips"]["removed"]), np.array(result["strips"]["restored"])
    layers, heads, width = removed.shape
    code = np.where(restored > 0, 2.0, np.where(removed > 0, 1.0, 0.0))

    def image(t: np.ndarray) -> np.ndarray:  # (L, Hkv, W) -> (L, Hkv * (W + gap) - gap), NaN between strips
        t = np.pad(t, ((0, 0), (0, 0), (0, gap)), constant_values=np.nan)
        return t.reshape(layers, -1)[:, :-gap]

    y = [f"L{i}" for i in range(layers)]
    scale = [
        [0, "#ffffff"],
        [0.33, "#ffffff"],
        [0.34, "#c9c9c9"],
        [0.66, "#c9c9c9"],
        [0.67, "#d62728"],
        [1, "#d62728"],
    ]
    fig = go.Figure(
        go.Heatmap(
            z=image(code).tolist(),
            y=y,
            zmin=0,
            zmax=2,
            colorscale=scale,
            showscale=False,
            customdata=image(restored).tolist(),
            name="minimal set",
            meta={
                "value": "the block's code",
                "codes": {
                    0: "kept by the policy",
                    1: "removed by the policy",
                    2: "restored by the minimal set",
                },
            },
            hovertemplate="%{y}: %{customdata:.0%} of the block restored<extra></extra>",
        )
    )
    for label, color in (("removed by the policy", "#c9c9c9"), ("restored by the minimal set", "#d62728")):
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=label,
                marker={"symbol": "square", "size": 12, "color": color},
            )
        )
    centers = [h * (width + gap) + (width - 1) / 2 for h in range(heads)]
    fig.update_xaxes(
        tickvals=centers,
        ticktext=[f"KV head {h}" for h in range(heads)],
        side="top",
        showgrid=False,
        zeroline=False,
    )
    fig.update_yaxes(autorange="reversed", showgrid=False, title_text="layer")
    m = result["minimal"]
    block = result["strips"]["block"]
    fig.update_layout(
        title={
            "text": f"Minimal sufficient set: {len(m['groups'])} {m['by']} groups, {m['slots']} "
            f"slots ({_title(result)}; a strip = positions 0-{result['context_tokens'] - 1}"
            + when(block > 1, f" in blocks of {block}")
            + ")"
        },
        height=max(360, 90 + 22 * layers),
        width=1100,
        margin={"t": 110},
        legend={"orientation": "h", "y": -0.02, "yanchor": "top"},
        meta=_meta(result, "minimal"),
    )
    return fig


FIGURES = {"heads": share_heatmap, "spans": span_strip, "minimal": minimal_strips}  # view -> builder


def figures(result: dict) -> dict[str, go.Figure | str]:
    """Every Why figure the result can draw, or the sentence saying why not."""
    out = {}
    for view, make in FIGURES.items():
        try:
            out[view] = make(result)
        except KvlensError as err:
            out[view] = str(err)
    return out
