"""Kept slots per KV head after each step's compression, against the tokens seen and the budget (every
policy).

Reads `steps/kv_slots` `(steps + 1, L, Hkv)` (row 0: right after the prompt's compression); the
figure shows the mean, min and max over layers and KV heads per step.
"""

from __future__ import annotations

import plotly.graph_objects as go

from kvlens.analysis.registry import Analysis, register_analysis
from kvlens.figures.plots import run_path


@register_analysis
class OccupancyAnalysis(Analysis):
    name = "occupancy"
    paper = "cache occupancy over steps (every policy)"

    def compute(self, run):
        return run.tensor("steps/kv_slots").flatten(1)  # (steps + 1, L * Hkv)

    def to_json(self, kept) -> dict:
        return {
            "mean": kept.float().mean(1).tolist(),
            "min": kept.amin(1).tolist(),
            "max": kept.amax(1).tolist(),
        }

    def figure(self, run):
        """Kept slots per KV head after each step's compression (mean, min and max over layers and heads)."""
        flat = self.compute(run).float()  # (steps + 1, L * Hkv)
        steps = list(range(flat.shape[0]))
        prompt_len = len(run.meta.prompt_tokens)
        fig = go.Figure()
        fig.add_trace(
            go.Scatter(
                x=steps,
                y=[prompt_len + s for s in steps],
                mode="lines",
                name="tokens seen",
                line=dict(color="#888", dash="dot"),
            )
        )
        fig.add_trace(
            go.Scatter(
                x=steps + steps[::-1],
                y=flat.amax(1).tolist() + flat.amin(1).tolist()[::-1],
                fill="toself",
                mode="none",
                fillcolor="rgba(0,114,178,0.15)",
                name="min-max over heads",
            )
        )
        fig.add_trace(
            go.Scatter(
                x=steps,
                y=flat.mean(1).tolist(),
                mode="lines",
                name="kept slots (mean)",
                line=dict(color="#0072B2", width=2),
            )
        )
        budget = run.meta.budget.slots
        if budget:
            fig.add_hline(
                y=budget,
                line=dict(color="#D55E00", dash="dash", width=1),
                annotation_text=f"budget {budget}",
                annotation_position="top left",
            )
        fig.update_xaxes(title_text="step (0 = right after the prompt)")
        fig.update_yaxes(title_text="slots per KV head", rangemode="tozero")
        fig.update_layout(
            title=dict(text="Cache occupancy"),
            height=340,
            legend=dict(orientation="h", y=1.12),
            meta={"analysis": "occupancy", "run": run_path(run)},
        )
        return fig
