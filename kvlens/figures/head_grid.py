"""Every recorded layer and head of a run at one step (the app's Head grid; bertviz's model view as small
multiples).

`head_grid(run)` stacks `kvlens.figures.attention.layer_cache` of every recorded layer once, as numpy arrays
step first (a step is one contiguous block; torch's thread pool costs more than these small per-step sums):
`weights` `(R, L, Hq, P)` and `status` `(R, L, Hkv, P)`. At a step (row r: the cache row r attended to, see
`attention_grid`) `rows_figure` draws each head's attention row as one strip, layers down and heads across,
on the status colours (evicted grey, merged away orange, ...), and `summary_figure` one number per head
(`METRICS`: the share of seen positions it keeps, the attention its merged slots receive, the entropy of its
row, and on a measured run the attention mass lost and the output perturbation). Both carry one invisible
marker per head whose `customdata` is `[layer, head]`: the app opens the clicked head on the Attention page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
import torch

from kvlens.errors import KvlensError
from kvlens.figures.attention import (
    EVICTED,
    FUTURE,
    HOLDS_MERGE,
    MERGED_AWAY,
    SINK,
    attention_heatmap,
    layer_cache,
    pool_blocks,
    recorded_attention_layers,
    status_heatmap,
    status_legend,
)
from kvlens.figures.wording import when
from kvlens.runs.run import Run

METRICS = {  # name: (description, measured run only)
    "kept share": ("share of the positions seen so far that the head's cache holds", False),
    "attention on merged slots": (
        "share of the head's attention that went to slots holding merged values",
        False,
    ),
    "attention entropy": ("entropy of the head's attention row over its cache, / log(cached slots)", False),
    "attention mass lost": ("1 - the full cache's attention on the positions kept (--measure)", True),
    "output perturbation": ("||O_used - O_full|| / ||O_full|| of the head's output (--measure)", True),
}
MAX_STRIP = 160  # positions per strip before pooling


@dataclass(frozen=True)
class HeadGrid:
    """`weights` `(R, L, Hq, P)` (NaN where not cached), `status` `(R, L, Hkv, P)` of the recorded `layers`;
    `measured` `{metric: (R - 1, L, Hq)}` for the measured metrics (row k = attention row k + 1)."""

    layers: list[int]
    weights: np.ndarray
    status: np.ndarray
    prompt_len: int
    policy: str
    measured: dict[str, np.ndarray]

    @property
    def steps(self) -> int:
        return self.weights.shape[0]

    @property
    def heads(self) -> int:
        return self.weights.shape[2]

    def head_status(self, step: int) -> np.ndarray:
        """`(L, Hq, P)` status codes of every query head (its KV head's) at `step`."""
        return np.repeat(self.status[step], self.heads // self.status.shape[2], axis=1)

    def metrics(self, step: int) -> dict[str, np.ndarray]:
        """`{metric: (L, Hq)}` at `step`; the measured ones NaN at step 0 (no decode step measured yet)."""
        self.check(step)
        w, st = self.weights[step], self.head_status(step)
        seen = (st != FUTURE).sum(-1)
        cached = ~np.isnan(w)
        p = np.nan_to_num(w, nan=0.0)
        entropy = -(p * np.log(np.maximum(p, 1e-30))).sum(-1) / np.log(np.maximum(cached.sum(-1), 2))
        out = {
            "kept share": cached.sum(-1) / seen,
            "attention on merged slots": (p * (st == HOLDS_MERGE)).sum(-1),
            "attention entropy": entropy,
        }
        for name, rows in self.measured.items():
            out[name] = rows[step - 1] if step >= 1 else np.full_like(entropy, np.nan)
        return out

    def check(self, step: int) -> None:
        if not 0 <= step < self.steps:
            raise KvlensError(f"Step {step} is out of range: this run recorded steps 0 to {self.steps - 1}.")


def head_grid(run: Run) -> HeadGrid:
    """Every recorded layer's `layer_cache`, stacked (see module docstring)."""
    layers = recorded_attention_layers(run)
    caches = [layer_cache(run, layer) for layer in layers]
    measured = {}
    for name, tensor in (
        ("attention mass lost", "perturbation/attention_loss"),
        ("output perturbation", "perturbation/used"),
    ):
        if run.has(tensor):
            measured[name] = run.tensor(tensor).float()[:, layers].numpy()
    return HeadGrid(
        layers,
        torch.stack([w for w, _ in caches], dim=1).numpy(),
        torch.stack([s for _, s in caches], dim=1).numpy(),
        len(run.meta.prompt_tokens),
        run.meta.policy.name,
        measured,
    )


def _targets(
    fig: go.Figure, x: list[float], y: list[float], layers: list[int], heads: list[int], text: list[str]
) -> None:
    """The invisible click targets: one marker per head, `customdata` `[layer, head]`, hover `text`."""
    fig.add_trace(
        go.Scatter(
            x=x,
            y=y,
            mode="markers",
            name="heads",
            showlegend=False,
            text=text,
            customdata=[[la, h] for la, h in zip(layers, heads, strict=True)],
            hovertemplate="%{text}<extra></extra>",
            marker=dict(size=14, color="rgba(0,0,0,0)"),  # transparent, yet hovered and clicked
            selected=dict(marker=dict(color="rgba(0,0,0,0)")),
            unselected=dict(marker=dict(color="rgba(0,0,0,0)")),
        )
    )
    fig.update_layout(hovermode="closest", hoverdistance=-1)


def _hover(grid: HeadGrid, values: dict[str, np.ndarray], li: int, h: int) -> str:
    parts = [f"<b>layer {grid.layers[li]}, head {h}</b>"]
    parts += [f"{name}: {v[li, h]:.3f}" for name, v in values.items() if not math.isnan(float(v[li, h]))]
    return "<br>".join(parts + ["click to open it on the Attention page"])


def _strip_image(t: np.ndarray, layers: int, heads: int, gap: int) -> np.ndarray:
    """`t` `(L * Hq, width)` laid out as one image `(L, Hq * (width + gap) - gap)`, each layer's heads side by
    side, NaN in the `gap` between strips."""
    width = t.shape[1]
    t = np.pad(
        t.astype(np.float32).reshape(layers, heads, width), ((0, 0), (0, 0), (0, gap)), constant_values=np.nan
    )
    return t.reshape(layers, -1)[:, :-gap]


def _strip_axes(fig: go.Figure, grid: HeadGrid, centers: list[float], width: int, gap: int) -> None:
    """Heads across the top at the strips' `centers`, layers down."""
    fig.update_xaxes(
        tickvals=centers,
        ticktext=[f"head {h}" for h in range(grid.heads)],
        side="top",
        showgrid=False,
        zeroline=False,
        range=[-0.5, grid.heads * (width + gap) - gap - 0.5],
    )
    fig.update_yaxes(autorange="reversed", showgrid=False, title_text="layer")


def rows_figure(grid: HeadGrid, step: int, gap: int = 3) -> go.Figure:
    """Each head's attention row at `step` as a strip (log10 attention on its status colours), layers down,
    heads across; positions pooled to at most `MAX_STRIP` per strip."""
    grid.check(step)
    n_pos = grid.prompt_len + step  # the positions seen by row `step`'s query
    block = math.ceil(n_pos / MAX_STRIP)
    w = grid.weights[step, :, :, :n_pos].reshape(-1, n_pos)  # (L * Hq, P)
    st = grid.head_status(step)[..., :n_pos].reshape(-1, n_pos)
    w, st = pool_blocks(w, st, 1, block)
    n_layers, width = len(grid.layers), w.shape[1]
    w_img, st_img = (_strip_image(t, n_layers, grid.heads, gap) for t in (w, st))
    y = [f"L{la}" for la in grid.layers]
    fig = go.Figure()
    fig.add_trace(status_heatmap(st_img, y=y, hoverinfo="skip"))
    fig.add_trace(attention_heatmap(np.log10(np.maximum(w_img, 1e-6)), 12, y=y, hoverinfo="skip"))
    for trace in status_legend((EVICTED, MERGED_AWAY, SINK), st):
        fig.add_trace(trace)
    values = grid.metrics(step)
    centers = [h * (width + gap) + (width - 1) / 2 for h in range(grid.heads)]
    cells = [(li, h) for li in range(n_layers) for h in range(grid.heads)]
    _targets(
        fig,
        [centers[h] for _, h in cells],
        [y[li] for li, _ in cells],
        [grid.layers[li] for li, _ in cells],
        [h for _, h in cells],
        [_hover(grid, values, li, h) for li, h in cells],
    )
    _strip_axes(fig, grid, centers, width, gap)
    pooled = when(block > 1, f", positions in blocks of {block}")
    fig.update_layout(
        title=dict(
            text=f"Attention of every head at step {step} under {grid.policy} "
            f"(a strip = one head's row over positions 0-{n_pos - 1}{pooled})"
        ),
        height=max(320, 90 + 24 * n_layers),
        legend=dict(orientation="h", y=-0.02, yanchor="top"),
        margin=dict(t=110),
        meta={"analysis": "head-grid", "params": {"step": step, "view": "rows"}},
    )
    return fig


def summary_figure(grid: HeadGrid, step: int, metric: str = "kept share") -> go.Figure:
    """One `metric` (`METRICS`) per layer (rows) and head (columns) at `step`, as a heatmap."""
    if metric not in METRICS:
        raise KvlensError(f"Unknown head metric '{metric}'; choose from: {', '.join(METRICS)}.")
    values = grid.metrics(step)
    if metric not in values:
        raise KvlensError(f"'{metric}' needs a measured run (record it with --measure).")
    z = values[metric]
    y = [f"L{la}" for la in grid.layers]
    fig = go.Figure(
        go.Heatmap(
            z=z.tolist(),
            x=list(range(grid.heads)),
            y=y,
            colorscale="Viridis",
            zmin=0,
            zmax={"output perturbation": None}.get(metric, 1),  # shares up to 1; the perturbation unbounded
            meta={"value": f"{metric} of each layer (row) and query head (column)"},
            hoverinfo="skip",
            text=[[f"{v:.2f}" for v in row] for row in z.tolist()],
            texttemplate="%{text}" if z.size <= 400 else None,
            textfont=dict(size=10),
            colorbar=dict(title=dict(text=metric), thickness=12),
        )
    )
    cells = [(li, h) for li in range(len(grid.layers)) for h in range(grid.heads)]
    _targets(
        fig,
        [h for _, h in cells],
        [y[li] for li, _ in cells],
        [grid.layers[li] for li, _ in cells],
        [h for _, h in cells],
        [_hover(grid, values, li, h) for li, h in cells],
    )
    fig.update_xaxes(
        side="top",
        tickvals=list(range(grid.heads)),
        ticktext=[f"head {h}" for h in range(grid.heads)],
        showgrid=False,
    )
    fig.update_yaxes(autorange="reversed", showgrid=False, title_text="layer")
    fig.update_layout(
        title=dict(text=f"{metric.capitalize()} of every head at step {step} under {grid.policy}"),
        height=max(320, 110 + 24 * len(grid.layers)),
        margin=dict(t=110),
        meta={"analysis": "head-grid", "params": {"step": step, "view": "summary", "metric": metric}},
    )
    return fig
