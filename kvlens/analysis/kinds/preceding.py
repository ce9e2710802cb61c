"""Similarity of token t's state to each of the tokens before it, per head (KVMerger Fig. 3a).

`cos(x_t, x_{t-j})` for j = 1..window and every head of one layer: `(H, window)`, NaN before token 0.
KVMerger Fig. 3a plots this for tokens 2000, 3000 and 4000 of a long prompt.
"""

from __future__ import annotations

import plotly.graph_objects as go
import torch

from kvlens.analysis.registry import LAYER, Analysis, Param, nan_to_none, register_analysis
from kvlens.analysis.states import HEADS, kind_code, layer_or_middle, parse_states, states, unit
from kvlens.errors import KvlensError
from kvlens.figures.plots import finish, line_style, run_model
from kvlens.figures.wording import if_none
from kvlens.levels import RecordLevel
from kvlens.runs.run import Run


def preceding_similarity(
    run: Run, layer: int, token: int, window: int = 32, kind: str = "key"
) -> torch.Tensor:
    """`cos(x_token, x_{token-j})` for j = 1..window and every head: `(H, window)`, NaN before token 0."""
    x = unit(states(run, kind, layer))  # (H, T, D)
    if not 0 <= token < x.shape[1]:
        raise KvlensError(f"Token {token} is out of range: the prompt has tokens 0 to {x.shape[1] - 1}.")
    if window < 1:
        raise KvlensError(f"The window must be at least 1 token; got {window}.")
    out = torch.full((x.shape[0], window), float("nan"))
    n = min(window, token)
    before = x[:, token - n : token].flip(1)  # (H, n, D), nearest first
    out[:, :n] = (before * x[:, token : token + 1]).sum(-1)
    return out


def preceding_figure(run: Run, layer: int, token: int, window: int = 32, kind: str = "key") -> go.Figure:
    """Similarity of token t to each of the `window` tokens before it, one line per head."""
    sims = preceding_similarity(run, layer, token, window, kind)  # (H, window)
    fig = go.Figure()
    for h, row in enumerate(sims):
        fig.add_trace(
            go.Scatter(
                x=list(range(1, window + 1)),
                y=row.tolist(),
                mode="lines+markers",
                name=f"{HEADS[kind_code(kind)]} head {h}",
                **line_style(h),
            )
        )
    fig.update_xaxes(title_text="distance j (tokens before t)")
    fig.update_yaxes(title_text=f"cos({kind}<sub>t</sub>, {kind}<sub>t-j</sub>)")
    title = f"Similarity of {kind} {token} to the {window} before it, layer {layer} ({run_model(run)})"
    return finish(fig, title, "preceding", run, layer=layer, token=token, window=window, kind=kind)


@register_analysis
class PrecedingAnalysis(Analysis):
    name = "preceding"
    paper = "KVMerger Fig. 3a"
    level = RecordLevel.STATES
    params = (
        LAYER,
        Param("token", None, kind="int", optional=True, help="token t (default: the last prompt token)"),
        Param("window", 32, kind="int", help="how many tokens before t", minimum=1),
        Param("state", "key", kind="text", help="query, key or value"),
    )

    def _args(self, run, layer, token, window, state):
        token = if_none(token, len(run.meta.prompt_tokens) - 1)
        return layer_or_middle(run, layer), token, window, parse_states(state, many=False)[0]

    def compute(self, run, **params):
        layer, token, window, state = self._args(run, **params)
        return {
            "layer": layer,
            "token": token,
            "state": state,
            "similarity": preceding_similarity(run, layer, token, window, state),
        }

    def to_json(self, result, **params) -> dict:
        return {**result, "similarity": nan_to_none(result["similarity"])}

    def figure(self, run, **params):
        return preceding_figure(run, *self._args(run, **params))
