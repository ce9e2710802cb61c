"""Gaussian-kernel merge weights over one KVMerger merging set, pivot marked (KVMerger Fig. 3d).

The merging set (Algorithm 1 over one head's prefill keys `(T, D)`) holding a token, its pivot
(the member with the largest aggregated attention) and the weights `(n,)` per sigma, from the
policy's own `merging_sets` and `gaussian_weights` (Eq. 7-8), so the figure shows what the policy
does. Drawn under both of the paper's sigma rules (the policy's default, §6.3's mean distance to
the pivot, first; Eq. 7 of §5.2 beside it), plus any fixed sigma values.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import plotly.graph_objects as go
import torch

from kvlens.analysis.registry import LAYER, THRESHOLD, Analysis, Param, check_threshold, register_analysis
from kvlens.analysis.states import aggregated_attention, head_states, layer_or_middle
from kvlens.errors import KvlensError
from kvlens.figures.plots import finish, line_style, run_model
from kvlens.figures.wording import if_none, when
from kvlens.levels import RecordLevel
from kvlens.policies.kvmerger import SIGMA_RULES, KVMerger, gaussian_weights, merging_sets
from kvlens.runs.run import Run

# KVMerger (arXiv 2407.08454) defines the Gaussian kernel's sigma in two usable ways (its §5.2 sentence, "the
# mean value of g_pi", is circular): where each rule comes from, and the policy's default drawn first
SIGMA_SOURCES = {"mean_distance": ("σ = mean ‖k_p − k_i‖", "§6.3"), "eq7": ("σ from Eq. 7", "§5.2")}
POLICY_RULE = next(f.default for f in fields(KVMerger) if f.name == "sigma_rule")
RULES = (POLICY_RULE, *(r for r in SIGMA_RULES if r != POLICY_RULE))


@dataclass
class GaussianSet:
    """KVMerger Fig. 3d: one merging set's token `positions` `(n,)`, its `pivot` position, and the
    Gaussian weights `(n,)` per sigma: a rule name (`eq7`, `mean_distance`) or a fixed value."""

    layer: int
    head: int
    threshold: float
    positions: list[int]
    pivot: int
    weights: dict[str | float, torch.Tensor]

    @staticmethod
    def label(sigma: str | float) -> str:
        """How a sigma is named in figures: the rule and the paper section defining it, or the value."""
        if isinstance(sigma, str):
            name, section = SIGMA_SOURCES[sigma]
            return f"{name} ({section}{when(sigma == POLICY_RULE, ', default')})"
        return f"σ = {sigma:g}"


def gaussian_set(
    run: Run,
    layer: int,
    head: int,
    threshold: float = 0.75,
    position: int | None = None,
    sigmas: tuple[str | float | None, ...] = RULES,
) -> GaussianSet:
    """Gaussian-kernel weights of the merging set holding `position` (default: the largest set).

    Sets come from Algorithm 1 over the head's prefill keys; the pivot is the member with the
    largest aggregated attention (the recorded prefill statistic, else recomputed from q and k).
    `sigmas`: rule names or positive values (None is Eq. 7, as in `gaussian_weights`); by default
    both rules, the policy's default first.
    """
    check_threshold(threshold)
    if not sigmas:
        raise KvlensError("Name at least one sigma: a rule (mean_distance, eq7) or a positive value.")
    keys = head_states(run, "key", layer, head)  # (T, D)
    sets = merging_sets(keys, threshold)
    if position is None:
        chosen = max(sets, key=len)
    else:
        if not 0 <= position < keys.shape[0]:
            raise KvlensError(
                f"Token {position} is out of range: the prompt has tokens 0 to {keys.shape[0] - 1}."
            )
        chosen = next(s for s in sets if position in s)
    abar = aggregated_attention(run, layer)[head]  # (T,)
    idx = torch.tensor(chosen)
    p = int(abar[idx].argmax())
    weights = {if_none(s, "eq7"): gaussian_weights(keys[idx], p, s) for s in sigmas}
    return GaussianSet(layer, head, threshold, chosen, chosen[p], weights)


def gaussian_figure(
    run: Run,
    layer: int,
    head: int,
    threshold: float = 0.75,
    position: int | None = None,
    sigmas: tuple[str | float | None, ...] = RULES,
) -> go.Figure:
    """KVMerger Fig. 3d: Gaussian-kernel weights over one merging set under each sigma rule or value, pivot
    marked."""
    gs = gaussian_set(run, layer, head, threshold, position, sigmas)
    fig = go.Figure()
    for i, (sigma, w) in enumerate(gs.weights.items()):
        name = gs.label(sigma)
        fig.add_trace(
            go.Scatter(x=gs.positions, y=w.tolist(), mode="lines+markers", name=name, **line_style(i))
        )
    fig.add_vline(
        x=gs.pivot,
        line=dict(color="#777777", dash="dot", width=1),
        annotation_text=f"pivot {gs.pivot}",
        annotation_position="top",
    )
    fig.update_xaxes(title_text="token position in the merging set")
    fig.update_yaxes(title_text="merge weight w<sub>i</sub>")
    title = f"Gaussian merge weights, layer {layer}, KV head {head}, threshold {threshold} ({run_model(run)})"
    return finish(
        fig,
        title,
        "gaussian",
        run,
        layer=layer,
        head=head,
        threshold=threshold,
        position=position,
        sigmas=list(sigmas),
    )


@register_analysis
class GaussianAnalysis(Analysis):
    name = "gaussian"
    paper = "KVMerger Fig. 3d"
    level = RecordLevel.STATES
    params = (
        LAYER,
        Param("head", 0, kind="int", help="KV head"),
        THRESHOLD,
        Param(
            "token",
            None,
            kind="int",
            optional=True,
            help="show the merging set holding this token (default: the largest set)",
        ),
        Param(
            "rule",
            RULES,
            kind="text",
            help="sigma rules drawn: mean_distance (§6.3, the kvmerger policy's default) "
            "and eq7 (Eq. 7, §5.2); repeat the flag",
            many=True,
        ),
        Param(
            "sigma",
            (),
            kind="float",
            help="fixed sigma values drawn besides the rules (repeat the flag)",
            many=True,
        ),
    )

    def _args(self, run, layer, head, threshold, token, rule, sigma):
        unknown = [r for r in rule if r not in RULES]
        if unknown:
            raise KvlensError(f"rule takes {' or '.join(RULES)}; got {unknown[0]!r}.")
        return layer_or_middle(run, layer), head, threshold, token, (*rule, *sigma)

    def compute(self, run, **params):
        return gaussian_set(run, *self._args(run, **params))

    def to_json(self, gs, **params) -> dict:
        cited = {r: " in KVMerger ".join(SIGMA_SOURCES[r]) for r in gs.weights if isinstance(r, str)}
        return {
            "layer": gs.layer,
            "head": gs.head,
            "threshold": gs.threshold,
            "positions": gs.positions,
            "pivot": gs.pivot,
            "sigma_rules": cited,
            "weights": {str(s): w.tolist() for s, w in gs.weights.items()},
        }

    def figure(self, run, **params):
        return gaussian_figure(run, *self._args(run, **params))
