"""Per-step curves of one or more runs overlaid: each new token's NLL, kept slots, and the output
perturbation of the runs measured with --measure (the Runs page's overlay; no paper figure).

Reads each run's `steps/nll` `(N,)`, `steps/kv_slots` `(steps + 1, L, Hkv)` (mean per step) and,
when measured, `perturbation/used` `(decode steps, L, Hq)` (mean per step).
"""

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlens.analysis.registry import Analysis, Param, nan_to_none, register_analysis
from kvlens.figures.plots import finish, line_style, run_path
from kvlens.figures.wording import when


def _labels(runs: list, label: list) -> list[str]:
    """One legend label per run: the given ones, else the run's folder name (its policy when unsaved), made
    unique."""
    out = []
    for i, run in enumerate(runs):
        if i < len(label):
            base = label[i]
        elif run.path:
            base = run.path.name
        else:
            base = run.meta.policy.name
        out.append(base + when(base in out, f" ({i + 1})"))
    return out


@register_analysis
class StepsAnalysis(Analysis):
    name = "steps"
    paper = "per-step NLL, kept slots and perturbation of several runs, overlaid (every policy)"
    inputs = "runs"
    params = (
        Param(
            "label",
            (),
            kind="text",
            help="legend label of each run, in order (default: its folder name)",
            many=True,
        ),
    )

    def compute(self, runs, label):
        """Per run: its label, the NLL of each new token, mean kept slots per KV head after each step, and the
        mean output perturbation of each decode step (None when not measured)."""
        curves = []
        for run, lab in zip(runs, _labels(runs, label), strict=True):
            pert = run.tensors.get("perturbation/used")
            curves.append(
                {
                    "label": lab,
                    "run": run_path(run),
                    "nll": run.tensor("steps/nll").float(),
                    "kept_slots": run.tensor("steps/kv_slots").float().flatten(1).mean(1),
                    "perturbation": None if pert is None else pert.float().mean(dim=(1, 2)),
                }
            )
        return curves

    def to_json(self, curves, **params) -> dict:
        return {
            "runs": [
                {k: v if isinstance(v, str) or v is None else nan_to_none(v) for k, v in c.items()}
                for c in curves
            ]
        }

    def figure(self, runs, label):
        curves = self.compute(runs, label)
        panels = [
            ("nll", "NLL of each new token (nats)", 0),
            ("kept_slots", "kept slots per KV head (mean)", 0),
        ]
        if any(
            c["perturbation"] is not None for c in curves
        ):  # row k is the forward that produced token k + 1
            panels.append(("perturbation", "output perturbation (mean)", 1))
        fig = make_subplots(
            rows=1,
            cols=len(panels),
            horizontal_spacing=0.08,
            subplot_titles=[title for _, title, _ in panels],
        )
        for i, c in enumerate(curves):
            for col, (key, _, first) in enumerate(panels, start=1):
                if c[key] is None:
                    continue
                ys = c[key].tolist()
                fig.add_trace(
                    go.Scatter(
                        x=list(range(first, first + len(ys))),
                        y=ys,
                        mode="lines",
                        name=c["label"],
                        legendgroup=c["label"],
                        showlegend=col == 1,
                        line=line_style(i)["line"],
                    ),
                    row=1,
                    col=col,
                )
        for col in range(1, len(panels) + 1):
            fig.update_xaxes(title_text="step (new token)", row=1, col=col)
            fig.update_yaxes(rangemode="tozero", row=1, col=col)
        finish(
            fig,
            "Per-step curves",
            self.name,
            labels=[c["label"] for c in curves],
            runs=[c["run"] for c in curves],
        )
        fig.update_layout(
            width=1000,
            height=400,
            margin=dict(t=100),
            legend=dict(orientation="h", x=1, xanchor="right", y=1.14, yanchor="bottom"),
        )
        return fig
