"""Log-perplexity of the tokens so far against position, one curve per run (WeightedKV Fig. 4: merging vs
evicting).

For each run, the running mean of `steps/nll` `(N,)` over its scored (or generated) tokens:
`PerplexityCurve.log_ppl` `(N,)` at `positions` `(N,)`, the log of the perplexity so far.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go
import torch

from kvlens.analysis.registry import Analysis, Param, register_analysis
from kvlens.figures.plots import finish, line_style, run_model, run_path
from kvlens.levels import RecordLevel
from kvlens.runs.run import Run


@dataclass
class PerplexityCurve:
    """`positions` `(N,)` of the scored tokens and `log_ppl` `(N,)`: the mean NLL of tokens up to
    each position (the log of the perplexity so far, as the paper's y axis)."""

    label: str
    positions: torch.Tensor
    log_ppl: torch.Tensor


def log_perplexity_curve(run: Run, label: str | None = None) -> PerplexityCurve:
    """Running mean of `steps/nll` `(N,)` over the run's scored (or generated) tokens."""
    nll = run.tensor("steps/nll").double()  # (N,)
    start = len(run.meta.prompt_tokens)
    running = nll.cumsum(0) / torch.arange(1, nll.shape[0] + 1)
    label = label or run.meta.policy.name
    return PerplexityCurve(label, torch.arange(start, start + nll.shape[0]), running.float())


def perplexity_figure(runs: list[Run], labels: list[str] | None = None) -> go.Figure:
    """WeightedKV Fig. 4: log-perplexity of the tokens so far against position, one line per run."""
    labels = labels or [None] * len(runs)
    fig = go.Figure()
    for i, (r, label) in enumerate(zip(runs, labels, strict=False)):
        c = log_perplexity_curve(r, label)
        fig.add_trace(
            go.Scatter(
                x=c.positions.tolist(),
                y=c.log_ppl.tolist(),
                mode="lines",
                name=c.label,
                line=line_style(i)["line"],
            )
        )
    fig.update_xaxes(title_text="position (tokens)")
    fig.update_yaxes(title_text="log perplexity (mean NLL so far, nats)")
    model = "".join(f" ({run_model(run)})" for run in runs[:1])
    return finish(
        fig,
        f"Log-perplexity over position{model}",
        "perplexity",
        labels=[str(x) for x in labels],
        runs=[run_path(r) for r in runs],
    )


def _labels(runs: list, label: list) -> list:
    """One label per run (None: its policy)."""
    return (label + [None] * len(runs))[: len(runs)]


@register_analysis
class PerplexityAnalysis(Analysis):
    name = "perplexity"
    paper = "WeightedKV Fig. 4"
    inputs = "runs"
    level = RecordLevel.SUMMARY
    params = (
        Param(
            "label",
            (),
            kind="text",
            help="legend label of each run, in order (default: its policy)",
            many=True,
        ),
    )

    def compute(self, runs, label):
        return [log_perplexity_curve(r, lab) for r, lab in zip(runs, _labels(runs, label), strict=True)]

    def to_json(self, curves, **params) -> dict:
        return {
            "runs": [
                {"label": c.label, "positions": c.positions.tolist(), "log_ppl": c.log_ppl.tolist()}
                for c in curves
            ]
        }

    def figure(self, runs, label):
        return perplexity_figure(runs, _labels(runs, label))
