"""Normalised singular values of the key and value caches per layer (WeightedKV Fig. 1).

For each layer and KV head, the singular values of the head's prefill state matrix `(T, D)`
(no centring, as the paper), divided by the largest: `Spectrum.values` `(L, H, r)`. Keys are
low-rank (fast decay), values are not: WeightedKV's argument for dropping keys but merging values.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from kvlens.analysis.registry import Analysis, Param, register_analysis
from kvlens.analysis.states import kind_code, kind_name, recorded_layers, states
from kvlens.figures.plots import COLORS, SCALE, finish, run_model
from kvlens.levels import RecordLevel
from kvlens.runs.run import Run

EXACT_MAX = 512  # full SVD when min(T, D) is at most this; randomized_svd above


@dataclass
class Spectrum:
    """`values` `(L, H, r)` normalised singular values (largest = 1), `energy_top` `(L, H)` the
    share of squared singular values in the top `top` (of all, not only the r returned)."""

    kind: str
    layers: list[int]
    values: torch.Tensor
    energy_top: torch.Tensor
    top: int


def singular_values(x: torch.Tensor, components: int, seed: int = 0) -> tuple[torch.Tensor, float]:
    """Largest `components` singular values of `x` `(T, D)`, and the total energy `sum s^2`.

    Exact (`torch.linalg.svdvals`) when `min(T, D) <= 512`, else scikit-learn's
    `randomized_svd` (seeded); the total energy is the squared Frobenius norm either way.
    """
    x = x.double()
    total = float((x**2).sum())
    r = min(components, *x.shape)
    if min(x.shape) <= EXACT_MAX:
        return torch.linalg.svdvals(x)[:r].float(), total
    from sklearn.utils.extmath import randomized_svd

    _, s, _ = randomized_svd(x.numpy(), n_components=r, random_state=seed)
    return torch.from_numpy(s).float(), total


def spectrum(run: Run, kind: str = "key", components: int = 64, top: int = 8) -> Spectrum:
    """Normalised singular values of `kind` states per recorded layer and head (WeightedKV Fig. 1)."""
    code = kind_code(kind)
    layers = recorded_layers(run, code)
    values, energy = [], []
    for layer in layers:
        x = states(run, code, layer)  # (H, T, D)
        vs, es = [], []
        for head in x:
            s, total = singular_values(head, components)
            vs.append(s / (float(s[0]) or 1.0))  # all zero: as they are
            es.append(float((s[:top].double() ** 2).sum()) / (total or 1.0))
        values.append(torch.stack(vs))
        energy.append(torch.tensor(es))
    return Spectrum(kind_name(code), layers, torch.stack(values), torch.stack(energy), top)


def _sample(scale: str, n: int) -> list[str]:
    from plotly.colors import sample_colorscale

    return sample_colorscale(scale, [i / max(1, n - 1) for i in range(n)])


def layer_colours(fig: go.Figure, layers: list[int]) -> tuple[list[str], bool]:
    """A colour per layer, and whether the lines name their layers in the legend: a handful of layers get
    discrete colours; more, a colour scale whose colour bar is added to `fig`."""
    if len(layers) <= len(COLORS):
        return COLORS[: len(layers)], True
    _colour_bar(fig, layers)
    return _sample(SCALE, len(layers)), False


def _colour_bar(fig: go.Figure, layers: list[int]) -> None:
    """A colour bar of the layers (an invisible marker trace carries it)."""
    fig.add_trace(
        go.Scatter(
            x=[None],
            y=[None],
            mode="markers",
            showlegend=False,
            hoverinfo="skip",
            marker=dict(
                colorscale=SCALE,
                cmin=layers[0],
                cmax=layers[-1],
                color=[layers[0]],
                showscale=True,
                colorbar=dict(title=dict(text="layer"), thickness=14),
            ),
        )
    )


def spectrum_figure(run: Run, components: int = 64) -> go.Figure:
    """Normalised singular values of keys and values, one line per layer (mean over heads), log scale."""
    specs = [spectrum(run, k, components) for k in ("key", "value")]
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=["keys", "values"], shared_yaxes=True, horizontal_spacing=0.06
    )
    n = len(specs[0].layers)
    colors, few = layer_colours(fig, specs[0].layers)
    for col, spec in enumerate(specs, start=1):
        for i, layer in enumerate(spec.layers):
            y = spec.values[i].mean(0).tolist()
            fig.add_trace(
                go.Scatter(
                    x=list(range(1, len(y) + 1)),
                    y=y,
                    mode="lines",
                    name=f"layer {layer}",
                    legendgroup=f"{layer}",
                    showlegend=few and col == 1,
                    line=dict(color=colors[i], width=1.5),
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="singular value index", row=1, col=col)
    fig.update_yaxes(
        type="log",
        dtick=1,
        exponentformat="power",
        row=1,
        col=1,
        title_text="σ<sub>i</sub> / σ<sub>1</sub> (mean over KV heads)",
    )
    fig.update_yaxes(type="log", dtick=1, exponentformat="power", row=1, col=2)
    title = f"Normalised singular values of the KV cache ({run_model(run)}, {n} layers)"
    fig = finish(fig, title, "spectrum", run, components=components)
    fig.update_layout(width=1000)
    return fig


@register_analysis
class SpectrumAnalysis(Analysis):
    name = "spectrum"
    paper = "WeightedKV Fig. 1"
    level = RecordLevel.STATES
    see_also = (
        "What each rank of the spectrum costs: `kvlens analyze rank_bytes` (reconstruction error against "
        "bytes, each layer's rank for 1 % error) and `kvlens analyze rank_perturbation` (the run replayed "
        "at each rank: KL, NLL change, top-1 agreement, output error by source)."
    )
    params = (Param("components", 64, kind="int", help="singular values kept per head", minimum=1),)

    def compute(self, run, components):
        return {kind: spectrum(run, kind, components) for kind in ("key", "value")}

    def to_json(self, specs, **params) -> dict:
        return {
            "layers": len(specs["key"].layers),
            **{
                k: {
                    "singular_values": s.values.mean(1).tolist(),
                    "energy_top8": s.energy_top.mean(1).tolist(),
                }
                for k, s in specs.items()
            },
        }

    def figure(self, run, components):
        return spectrum_figure(run, components)
