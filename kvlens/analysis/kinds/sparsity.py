"""Layer-wise and head-wise attention sparsity, CORM's definition (CORM Fig. 1).

Per layer and query head, the mean over query rows t of the share of the t visible keys with
prefill attention `>= 1/t` (CORM Definition 3.1), recomputed from the recorded q and k:
`Sparsity.important` `(L, Hq)`; `sparsity = 1 - important` is what CORM Fig. 1 plots.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from kvlens.analysis.registry import Analysis, register_analysis
from kvlens.analysis.states import attention_chunks, recorded_layers, states
from kvlens.errors import KvlensError
from kvlens.figures.plots import SCALE, finish, run_model
from kvlens.levels import RecordLevel
from kvlens.runs.run import Run


@dataclass
class Sparsity:
    """`important` `(L, Hq)`: mean over query rows t of the share of the t visible keys with
    attention >= 1/t (CORM Definition 3.1); `sparsity = 1 - important` is what CORM Fig. 1 plots."""

    layers: list[int]
    important: torch.Tensor

    @property
    def sparsity(self) -> torch.Tensor:
        return 1 - self.important


def corm_sparsity(run: Run, layers: list[int] | None = None, start: int = 0) -> Sparsity:
    """CORM Fig. 1: per layer and query head, the share of important keys, averaged over rows.

    Row i (0-based) sees t = i + 1 keys; key j is important if `A[i, j] >= 1/t`. Rows before
    `start` are skipped (the paper does not say which rows it averages; default: all of them).
    """
    layers = layers or recorded_layers(run, "q")  # callers give none or a parsed, non-empty list
    out = []
    for layer in layers:
        q, k = states(run, "q", layer), states(run, "k", layer)
        t = q.shape[1]
        if not 0 <= start < t:
            raise KvlensError(
                f"start must be between 0 and {t - 1} (the prompt has {t} tokens); got {start}."
            )
        total = torch.zeros(q.shape[0], dtype=torch.float64)
        for a, b, probs in attention_chunks(q, k, start):  # (Hq, rows, T)
            seen = torch.arange(a + 1, b + 1, dtype=torch.float32)  # keys visible per row
            share = (probs >= 1 / seen[None, :, None]).sum(-1) / seen  # (Hq, rows)
            total += share.double().sum(-1)
        out.append((total / (t - start)).float())
    return Sparsity(list(layers), torch.stack(out))


def sparsity_figure(run: Run, start: int = 0) -> go.Figure:
    """CORM Fig. 1: (a) layer-wise attention sparsity (mean over heads), (b) head-wise, as a map."""
    sp = corm_sparsity(run, start=start)
    values = sp.sparsity  # (L, Hq)
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.55, 0.45],
        horizontal_spacing=0.12,
        subplot_titles=["(a) layer-wise", "(b) head-wise"],
    )
    fig.add_trace(
        go.Bar(x=sp.layers, y=values.mean(1).tolist(), marker=dict(color="#555555"), name="mean over heads"),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Heatmap(
            z=values.tolist(),
            x=list(range(values.shape[1])),
            y=sp.layers,
            colorscale=SCALE,
            zmax=1,
            name="per head",
            colorbar=dict(title=dict(text="sparsity"), thickness=14),
            hovertemplate="layer %{y} head %{x}<br>sparsity %{z:.3f}<extra></extra>",
        ),
        row=1,
        col=2,
    )
    fig.update_xaxes(title_text="layer", row=1, col=1)
    fig.update_yaxes(title_text="sparsity (share of keys with A < 1/t)", range=[0, 1], row=1, col=1)
    fig.update_xaxes(title_text="query head", row=1, col=2)
    fig.update_yaxes(title_text="layer", autorange="reversed", row=1, col=2)
    fig = finish(
        fig, f"Attention sparsity, CORM's definition ({run_model(run)})", "sparsity", run, start=start
    )
    fig.update_layout(width=1000, showlegend=False)
    return fig


@register_analysis
class SparsityAnalysis(Analysis):
    name = "sparsity"
    paper = "CORM Fig. 1"
    level = RecordLevel.STATES

    def compute(self, run):
        return corm_sparsity(run)

    def to_json(self, sp) -> dict:
        return {
            "layers": sp.layers,
            "sparsity": sp.sparsity.mean(1).tolist(),
            "sparsity_per_head": sp.sparsity.tolist(),
        }

    def figure(self, run):
        return sparsity_figure(run)
