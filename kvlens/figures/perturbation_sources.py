"""Where a quantized run's output error comes from: the choice of positions, quantized storage, merging.

A `--measure` run with quantized storage (`--kv-bits`) holds `perturbation/used|stored|evict|full_norm`
`(decode steps, L, Hq)` and the metric `perturbation_sources` (`kvlens.engine.perturbation.summary`): the
pooled relative output error `sum ||O - O_full|| / sum ||O_full||` of the cache used, split into `selection`
(the same positions in full precision), `storage` (what quantizing them adds) and `merging` (what merging
adds; negative when merging brings the output closer to the full cache's). `sources_figure` draws that split
as a waterfall that ends at the cache used, and per layer the same three pooled errors, so the gaps between
the curves are the split per layer. `has_sources(run)` says whether a run has what it needs (older and
unquantized runs do not).
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlens.figures.plots import finish, storage_label
from kvlens.runs.run import Run

PARTS = [
    ("selection", "choice of positions", "choice of<br>positions"),
    ("storage", "quantized storage", "quantized<br>storage"),
    ("merging", "merging", "merging"),
]  # metric key, label, the bar's label
COLORS = ["#0072B2", "#009E73", "#D55E00"]  # as the per-layer curves whose gaps they are
CURVES = [
    ("evict", "same positions, full precision", "#0072B2", "dash", "square"),
    ("stored", "same positions, quantized", "#009E73", "dot", "diamond"),
    ("used", "cache used", "#D55E00", "solid", "circle"),
]


def has_sources(run: Run) -> bool:
    """Whether the run is measured with quantized storage (it has the split and the per-layer tensors)."""
    return bool(run.metrics.get("perturbation_sources")) and all(
        run.has(f"perturbation/{k}") for k in ("used", "stored", "evict", "full_norm")
    )


def pooled_per_layer(run: Run) -> dict[str, list[float]]:
    """Per layer, `sum ||O - O_full|| / sum ||O_full||` over steps and heads of `evict`, `stored` and
    `used`."""
    norm = run.tensor("perturbation/full_norm").float()
    total = norm.sum(dim=(0, 2)).clamp(min=1e-30)
    return {
        k: ((run.tensor(f"perturbation/{k}").float() * norm).sum(dim=(0, 2)) / total).tolist()
        for k, *_ in CURVES
    }


def shares(sources: dict) -> dict[str, float]:
    """Each part's share of the cache used's pooled error (they add up to 1; merging's is negative when it
    helps)."""
    total = sum(sources[k] for k, *_ in PARTS)
    return {k: sources[k] / total if total else 0.0 for k, *_ in PARTS}


def _add_waterfall(fig: go.Figure, values: list[float]) -> None:
    """The first panel: a bar per part (`PARTS`' order, each from the last one's end), then the cache used,
    their sum."""
    start = 0.0
    for (key, label, tick), value, color in zip(PARTS, values, COLORS, strict=True):
        fig.add_trace(
            go.Bar(
                x=[tick],
                y=[value],
                base=[start],
                name=label,
                showlegend=False,
                marker_color=color,
                text=[f"{value:+.3f}"],
                textposition="outside",
                cliponaxis=False,
                hovertemplate=f"{key}: {value:+.4f}<extra></extra>",
            ),
            row=1,
            col=1,
        )
        start += value
    used = sum(values)
    fig.add_trace(
        go.Bar(
            x=["cache used"],
            y=[used],
            name="cache used",
            showlegend=False,
            marker_color="#555555",
            text=[f"{used:.3f}"],
            textposition="outside",
            cliponaxis=False,
            hovertemplate=f"cache used: {used:.4f}<extra></extra>",
        ),
        row=1,
        col=1,
    )


def _waterfall_range(values: list[float]) -> list[float]:
    """The first panel's y range: every running total and 0, with room for the numbers above the bars."""
    running = [sum(values[: i + 1]) for i in range(len(values))]
    low, high = min(0.0, *running), max(0.0, *running)
    pad = 0.15 * (high - low or 1.0)
    return [low - pad if low < 0 else 0, high + pad]


def sources_figure(run: Run) -> go.Figure:
    """The waterfall of the pooled error (choice of positions + quantized storage + merging = cache used) and
    the three pooled errors per layer."""
    src = run.metrics["perturbation_sources"]
    per_layer = pooled_per_layer(run)
    layers = list(range(len(per_layer["used"])))
    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.1,
        column_widths=[0.36, 0.64],
        subplot_titles=["pooled output error, by source", "per layer (pooled over steps and heads)"],
    )
    values = [src[k] for k, *_ in PARTS]
    _add_waterfall(fig, values)
    for key, label, color, dash, symbol in CURVES:
        fig.add_trace(
            go.Scatter(
                x=layers,
                y=per_layer[key],
                mode="lines+markers",
                name=label,
                line=dict(color=color, dash=dash, width=2),
                marker=dict(color=color, symbol=symbol, size=6),
            ),
            row=1,
            col=2,
        )
    fig.update_yaxes(title_text="‖O − O_full‖ / ‖O_full‖", range=_waterfall_range(values), row=1, col=1)
    fig.update_yaxes(rangemode="tozero", row=1, col=2)
    fig.update_xaxes(tickangle=0, row=1, col=1)
    fig.update_xaxes(title_text="layer", row=1, col=2)
    fig = finish(
        fig, f"Output error by source ({storage_label(run.meta.storage)})", "perturbation-sources", run
    )
    fig.update_layout(
        width=None,
        height=420,
        barmode="overlay",
        bargap=0.35,
        legend=dict(orientation="h", x=0.4, y=-0.24, yanchor="top"),
        margin=dict(t=90, b=100),
    )
    return fig
