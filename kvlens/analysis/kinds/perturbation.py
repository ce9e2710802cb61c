"""Output perturbation over steps, merging vs evicting the same slots, attention loss and KL (CaM Fig. 1d).

Reads a `--measure` run's `perturbation/used|evict|attention_loss` `(decode steps, L, Hq)` (relative output
error of the cache used, and of evicting the same slots without merging) and `perturbation/kl`
`(new tokens,)`; per decode step, the means over layers and query heads.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlens.analysis.registry import Analysis, register_analysis
from kvlens.figures.plots import run_path


@register_analysis
class PerturbationAnalysis(Analysis):
    name = "perturbation"
    paper = "CaM Fig. 1 (d), over steps"
    measured = True

    def compute(self, run):
        means = {
            k: run.tensor(f"perturbation/{k}").float().mean(dim=(1, 2))
            for k in ("used", "evict", "attention_loss")
        }
        return {**means, "kl": run.tensor("perturbation/kl").float()}

    def to_json(self, per_step) -> dict:
        return {k: v.tolist() for k, v in per_step.items()}

    def figure(self, run):
        """Relative output error of the cache used vs evicting the same slots, attention loss, and KL per
        step."""
        used, evict, loss = (
            run.tensor(f"perturbation/{k}").float() for k in ("used", "evict", "attention_loss")
        )
        kl = run.tensor("perturbation/kl").float()
        steps = list(range(1, used.shape[0] + 1))
        fig = make_subplots(
            rows=1,
            cols=2,
            horizontal_spacing=0.1,
            subplot_titles=["output perturbation ‖O − O_full‖ / ‖O_full‖", "KL(p_full ‖ p_policy)"],
        )
        merging = bool((used - evict).abs().max() > 0) if used.numel() else False
        series = [("this policy's cache", used, "#D55E00", "solid")]
        if merging:
            series.append(("same evictions, no merging", evict, "#0072B2", "dash"))
        series.append(("attention loss", loss, "#777777", "dot"))
        for name, t, color, dash in series:
            fig.add_trace(
                go.Scatter(
                    x=steps,
                    y=t.mean(dim=(1, 2)).tolist(),
                    mode="lines",
                    name=name,
                    line=dict(color=color, dash=dash, width=2),
                ),
                row=1,
                col=1,
            )
        fig.add_trace(
            go.Scatter(
                x=list(range(len(kl))),
                y=kl.tolist(),
                mode="lines",
                name="KL",
                line=dict(color="#000000", width=2),
            ),
            row=1,
            col=2,
        )
        fig.update_xaxes(title_text="step", row=1, col=1)
        fig.update_xaxes(title_text="new token", row=1, col=2)
        fig.update_yaxes(rangemode="tozero", row=1, col=1)
        fig.update_yaxes(rangemode="tozero", row=1, col=2)
        fig.update_layout(
            title=dict(text="Perturbation over steps (means over layers and heads)"),
            height=400,
            margin=dict(b=110),
            legend=dict(orientation="h", yref="container", y=0.02, yanchor="bottom"),
            meta={"analysis": "perturbation", "run": run_path(run)},
        )
        return fig
