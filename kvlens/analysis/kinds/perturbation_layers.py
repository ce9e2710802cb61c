"""Output perturbation per layer, merging vs evicting the same slots, and its step x layer map (CaM Fig. 1d).

Reads a `--measure` run's `perturbation/used|evict` `(decode steps, L, Hq)`: the mean per layer over steps
and heads, and the step x layer map of the cache used (mean over heads, at most 512 x 512 cells).
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlens.analysis.registry import Analysis, register_analysis
from kvlens.figures.plots import run_path


@register_analysis
class PerturbationLayersAnalysis(Analysis):
    name = "perturbation-layers"
    paper = "CaM Fig. 1 (d), across layers"
    measured = True

    def compute(self, run):
        return {k: run.tensor(f"perturbation/{k}").float().mean(dim=(0, 2)) for k in ("used", "evict")}

    def to_json(self, per_layer) -> dict:
        return {k: v.tolist() for k, v in per_layer.items()}

    def figure(self, run):
        """Mean output perturbation per layer (over steps and heads), merging vs evicting, and its step x
        layer map."""
        used = run.tensor("perturbation/used").float()  # (steps, L, Hq)
        per_layer = self.compute(run)
        layers = list(range(used.shape[1]))
        fig = make_subplots(
            rows=1,
            cols=2,
            horizontal_spacing=0.12,
            column_widths=[0.45, 0.55],
            subplot_titles=["per layer (mean over steps and heads)", "step x layer (mean over heads)"],
        )
        fig.add_trace(
            go.Scatter(
                x=layers,
                y=per_layer["used"].tolist(),
                mode="lines+markers",
                name="cache used",
                line=dict(color="#D55E00"),
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=layers,
                y=per_layer["evict"].tolist(),
                mode="lines+markers",
                name="evict only",
                line=dict(color="#0072B2", dash="dash"),
            ),
            row=1,
            col=1,
        )
        grid = used.mean(2)[:512, :512]  # (steps, L)
        fig.add_trace(
            go.Heatmap(
                z=grid.T.tolist(),
                x=list(range(1, grid.shape[0] + 1)),
                y=layers,
                colorscale="Viridis",
                colorbar=dict(title=dict(text="perturbation"), thickness=14),
                name="map",
                hovertemplate="step %{x}, layer %{y}<br>%{z:.3f}<extra></extra>",
            ),
            row=1,
            col=2,
        )
        fig.update_xaxes(title_text="layer", row=1, col=1)
        fig.update_xaxes(title_text="step", row=1, col=2)
        fig.update_yaxes(title_text="layer", row=1, col=2)
        fig.update_layout(
            title=dict(text="Perturbation across layers"),
            height=420,
            margin=dict(b=110),
            legend=dict(orientation="h", yref="container", y=0.02, yanchor="bottom"),
            meta={"analysis": "perturbation-layers", "run": run_path(run)},
        )
        return fig
