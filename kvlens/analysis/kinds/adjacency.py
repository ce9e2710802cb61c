"""Mean cosine similarity of adjacent tokens' states per layer (KVMerger Fig. 3a's locality, summarised).

For queries, keys and values: the mean over t >= 1 of `cos(x_t, x_{t-1})` for each recorded layer
and head (`Adjacency.values[kind]` `(L, H)`); the figure plots the mean over heads per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go
import torch

from kvlens.analysis.registry import Analysis, register_analysis
from kvlens.analysis.states import NAMES, recorded_layers, states, unit
from kvlens.errors import KvlensError
from kvlens.figures.plots import PLURAL, finish, line_style, run_model
from kvlens.levels import RecordLevel
from kvlens.runs.run import Run


@dataclass
class Adjacency:
    """`values[kind]` `(L, H)`: mean over t >= 1 of `cos(x_t, x_{t-1})` for each recorded layer and head."""

    layers: list[int]
    values: dict[str, torch.Tensor]

    def per_layer(self, kind: str) -> list[float]:
        """Mean over the layer's heads, per layer (the CLI's JSON contract)."""
        return self.values[kind].mean(1).tolist()


def adjacency(run: Run) -> Adjacency:
    """Adjacent-token cosine similarity of queries, keys and values per layer and head (KVMerger Fig. 3a)."""
    layers = recorded_layers(run)
    values = {}
    for code, name in NAMES.items():
        rows = []
        for layer in layers:
            x = unit(states(run, code, layer))  # (H, T, D)
            if x.shape[1] < 2:
                raise KvlensError("Adjacent-token similarity needs a prompt of at least 2 tokens.")
            rows.append((x[:, 1:] * x[:, :-1]).sum(-1).mean(-1))  # (H,)
        values[name] = torch.stack(rows)  # (L, H)
    return Adjacency(layers, values)


def adjacency_figure(run: Run) -> go.Figure:
    """Mean cosine similarity of adjacent tokens per layer (mean over heads; each head as a faint dot)."""
    adj = adjacency(run)
    fig = go.Figure()
    for i, (kind, values) in enumerate(adj.values.items()):
        style = line_style(i)
        heads = values.shape[1]
        fig.add_trace(
            go.Scatter(
                x=[layer for layer in adj.layers for _ in range(heads)],
                y=values.flatten().tolist(),
                mode="markers",
                name=f"{kind} (each head)",
                showlegend=False,
                hoverinfo="skip",
                marker=dict(color=style["marker"]["color"], size=4, opacity=0.3),
            )
        )
        fig.add_trace(
            go.Scatter(x=adj.layers, y=adj.per_layer(kind), mode="lines+markers", name=PLURAL[kind], **style)
        )
    fig.update_xaxes(title_text="layer")
    fig.update_yaxes(title_text="cos(x<sub>t</sub>, x<sub>t-1</sub>), mean over tokens")
    return finish(fig, f"Adjacent-token similarity of prefill states ({run_model(run)})", "adjacency", run)


@register_analysis
class AdjacencyAnalysis(Analysis):
    name = "adjacency"
    paper = "KVMerger Fig. 3a (summary over tokens)"
    level = RecordLevel.STATES

    def compute(self, run):
        return adjacency(run)

    def to_json(self, adj) -> dict:
        return {"layers": len(adj.layers), **{k: adj.per_layer(k) for k in ("query", "key", "value")}}

    def figure(self, run):
        return adjacency_figure(run)
