"""Attention variance of single tokens against that of group means over later steps (CaM Fig. 2).

For one layer (one query head, or the mean over its heads), the variance over the last query rows
of the attention each earlier token receives, `token_var` `(G, m)`, and of the mean attention of
each group of m consecutive tokens, `group_var` `(G,)`, recomputed from the recorded q and k.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go
import torch

from kvlens.analysis.registry import LAYER, Analysis, Param, register_analysis
from kvlens.analysis.states import attention_chunks, layer_or_middle, states
from kvlens.errors import KvlensError
from kvlens.figures.plots import COLORS, finish, line_style, run_model
from kvlens.figures.wording import if_none
from kvlens.levels import RecordLevel
from kvlens.runs.run import Run


@dataclass
class AttentionVariance:
    """CaM Fig. 2 for one layer: `group_var` `(G,)` variance over query rows of the mean attention
    of group g's m consecutive tokens; `token_var` `(G, m)` the same for each single token.
    `starts` `(G,)` first token of each group; `rows` the query rows the variance is over."""

    layer: int
    head: int | None
    group: int
    starts: torch.Tensor
    group_var: torch.Tensor
    token_var: torch.Tensor
    rows: tuple[int, int]


def attention_variance(
    run: Run, layer: int, head: int | None = None, group: int = 64, rows: int | None = None
) -> AttentionVariance:
    """CaM Fig. 2: how much single tokens' attention varies over later steps vs their group means.

    Over the last `rows` query rows (default: the second half of the prompt; teacher-forced steps
    of a full-cache run stand in for the paper's generation steps), take the attention to each
    earlier token (positions before the first of those rows, cut into consecutive groups of
    `group`); `head=None` averages the attention over the layer's query heads first.
    """
    q, k = states(run, "q", layer), states(run, "k", layer)
    hq, t, _ = q.shape
    if head is not None and not 0 <= head < hq:
        raise KvlensError(f"Head {head} is out of range: layer {layer} has query heads 0 to {hq - 1}.")
    rows = if_none(rows, t // 2)
    first = t - rows
    if rows < 2 or first < group or group < 1:
        raise KvlensError(
            f"Attention variance needs at least 2 rows and one group of {group} tokens before them; "
            f"the prompt has {t} tokens (rows={rows})."
        )
    n_groups = first // group
    cols = n_groups * group
    picked = []
    for _, _, probs in attention_chunks(q, k, first):  # (Hq, r, T)
        p = probs.mean(0) if head is None else probs[head]  # (r, T)
        picked.append(p[:, :cols])
    a = torch.cat(picked).double()  # (rows, G * m)
    token_var = a.var(0, unbiased=False).view(n_groups, group)
    group_var = a.view(rows, n_groups, group).mean(-1).var(0, unbiased=False)
    return AttentionVariance(
        layer, head, group, torch.arange(n_groups) * group, group_var.float(), token_var.float(), (first, t)
    )


def variance_figure(
    run: Run, layer: int, head: int | None = None, group: int = 64, rows: int | None = None
) -> go.Figure:
    """CaM Fig. 2: attention variance of single tokens (small) vs of group means (large), log scale."""
    res = attention_variance(run, layer, head, group, rows)
    g, m = res.token_var.shape
    xs = res.starts.tolist()
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=[x for x in xs for _ in range(m)],
            y=res.token_var.flatten().tolist(),
            mode="markers",
            name="single tokens",
            marker=dict(color=COLORS[3], size=4, symbol="circle-open"),
        )
    )
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=res.group_var.tolist(),
            mode="lines+markers",
            name=f"mean of {group} tokens",
            **line_style(1),
        )
    )
    fig.update_xaxes(title_text=f"first token of the group of {group}")
    fig.update_yaxes(
        type="log",
        dtick=1,
        exponentformat="power",
        title_text=f"variance of attention over steps {res.rows[0]}–{res.rows[1] - 1}",
    )
    who = "mean of heads" if head is None else f"head {head}"
    fig = finish(
        fig,
        f"Attention variance, layer {layer}, {who} ({run_model(run)})",
        "variance",
        run,
        layer=layer,
        head=head,
        group=group,
        rows=rows,
    )
    fig.update_layout(legend=dict(x=0.98, xanchor="right", y=0.02, yanchor="bottom"))
    return fig


@register_analysis
class VarianceAnalysis(Analysis):
    name = "variance"
    paper = "CaM Fig. 2"
    level = RecordLevel.STATES
    params = (
        LAYER,
        Param(
            "head",
            None,
            kind="int",
            optional=True,
            help="query head (default: the mean over the layer's heads)",
        ),
        Param("group", 64, kind="int", help="tokens per group (CaM's m)", minimum=1),
    )

    def compute(self, run, layer, head, group):
        return attention_variance(run, layer_or_middle(run, layer), head, group)

    def to_json(self, res, **params) -> dict:
        return {
            "layer": res.layer,
            "head": res.head,
            "group": res.group,
            "rows": list(res.rows),
            "starts": res.starts.tolist(),
            "group_var": res.group_var.tolist(),
            "token_var_mean": res.token_var.mean(1).tolist(),
        }

    def figure(self, run, layer, head, group):
        return variance_figure(run, layer_or_middle(run, layer), head, group)
