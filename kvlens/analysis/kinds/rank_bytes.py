"""What a spectrum's decay buys: low-rank storage's reconstruction error against its bytes, rank by rank.

For each layer and KV head, the prompt's keys or values `(T, D)` stored at rank r (`kvlens.kvcache.lowrank`:
coefficients over the top-r right singular vectors) have the relative squared error
`sum_{i > r} s_i^2 / sum_i s_i^2` (Eckart-Young: the discarded singular values' energy) and cost
`(r T + D r) / (D T)` of the model-dtype bytes (coefficients plus the head's basis). `RankBytes.error`
`(L, H, D)` holds the error at ranks 1..D; `rank_for(error)` the smallest rank per layer and head that stays
under it (1 % by default: the model's per-layer "rank for 1 % error"). The spectrum is the Spectra page's
(`kvlens.analysis.kinds.spectrum`, WeightedKV Fig. 1); this is its price in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from kvlens.analysis.kinds.spectrum import layer_colours
from kvlens.analysis.registry import Analysis, Param, register_analysis
from kvlens.analysis.states import kind_code, kind_name, recorded_layers, states
from kvlens.figures.plots import finish, run_model
from kvlens.levels import RecordLevel
from kvlens.runs.run import Run


@dataclass
class RankBytes:
    """`error` `(L, H, D)`: relative squared reconstruction error at ranks 1..D; `tokens` T, `dim` D."""

    kind: str
    layers: list[int]
    error: torch.Tensor
    tokens: int
    dim: int

    def bytes_share(self) -> torch.Tensor:
        """`(D,)` the bytes of ranks 1..D over the model-dtype cache's: coefficients plus a basis per head."""
        r = torch.arange(1, self.dim + 1, dtype=torch.float64)
        return (r * self.tokens + self.dim * r) / (self.dim * self.tokens)

    def rank_for(self, error: float) -> torch.Tensor:
        """`(L, H)` the smallest rank whose error is at most `error`."""
        return (self.error > error).sum(-1) + 1


def rank_error(run: Run, kind: str = "key") -> RankBytes:
    """Low-rank reconstruction error of `kind` states per recorded layer, head and rank (module docstring)."""
    code = kind_code(kind)
    layers = recorded_layers(run, code)
    errors = []
    for layer in layers:
        x = states(run, code, layer).double()  # (H, T, D)
        energy = torch.linalg.svdvals(x) ** 2  # (H, min(T, D))
        energy = torch.nn.functional.pad(energy, (0, x.shape[2] - energy.shape[1]))
        kept = energy.cumsum(-1) / energy.sum(-1, keepdim=True).clamp(min=1e-300)
        errors.append((1 - kept).clamp(min=0).float())
    x = states(run, code, layers[0])
    return RankBytes(kind_name(code), layers, torch.stack(errors), x.shape[1], x.shape[2])


def rank_bytes_figure(run: Run, error: float = 0.01) -> go.Figure:
    """Reconstruction error against bytes for keys and values, a line per layer (mean over heads) over the
    ranks that cost less than the model-dtype cache, and each layer's rank for `error` marked where it
    pays."""
    found = [rank_error(run, k) for k in ("key", "value")]
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=["keys", "values"], shared_yaxes=True, horizontal_spacing=0.06
    )
    layers = found[0].layers
    colors, few = layer_colours(fig, layers)
    for col, res in enumerate(found, start=1):
        share = res.bytes_share()
        paying = int((share < 1).sum())  # ranks that store fewer bytes than the model's dtype
        for i, layer in enumerate(layers):
            y = res.error[i].mean(0)[:paying]
            shown = y > 0
            fig.add_trace(
                go.Scatter(
                    x=share[:paying][shown].tolist(),
                    y=y[shown].tolist(),
                    mode="lines",
                    name=f"layer {layer}",
                    legendgroup=f"{layer}",
                    showlegend=few and col == 1,
                    customdata=torch.arange(1, paying + 1)[shown].tolist(),
                    line=dict(color=colors[i], width=1.5),
                    hovertemplate=f"layer {layer}, rank %{{customdata}}<br>bytes %{{x:.3f}} of the "
                    "cache<br>error %{y:.2e}<extra></extra>",
                ),
                row=1,
                col=col,
            )
        need = res.rank_for(error).float().mean(1).round().long()  # (L,) mean over heads
        marks = [(i, int(r)) for i, r in enumerate(need.tolist()) if r <= paying]
        fig.add_trace(
            go.Scatter(
                x=[float(share[r - 1]) for _, r in marks],
                y=[error] * len(marks),
                mode="markers",
                showlegend=col == 1,
                name=f"a layer's rank for {error:g} error (where it pays)",
                marker=dict(
                    color=[colors[i] for i, _ in marks], size=12, symbol="line-ns-open", line=dict(width=2)
                ),
                customdata=[(layers[i], r) for i, r in marks],
                hovertemplate="layer %{customdata[0]}: rank %{customdata[1]}<extra></extra>",
            ),
            row=1,
            col=col,
        )
        fig.add_hline(y=error, line_dash="dot", line_color="#555", row=1, col=col)
        fig.update_xaxes(
            title_text="KV bytes at that rank, share of the model-dtype cache", range=[0, 1], row=1, col=col
        )
    fig.update_yaxes(
        type="log",
        exponentformat="power",
        row=1,
        col=1,
        title_text="relative squared error (mean over KV heads)",
    )
    fig.update_yaxes(type="log", exponentformat="power", row=1, col=2)
    title = (
        f"Low-rank storage: reconstruction error against bytes ({run_model(run)}, {found[0].tokens} tokens)"
    )
    fig = finish(fig, title, "rank_bytes", run, error=error)
    fig.update_layout(width=1000, legend=dict(orientation="h", y=-0.22, x=0))
    return fig


@register_analysis
class RankBytesAnalysis(Analysis):
    name = "rank_bytes"
    paper = "xKV / Palu: rank against error and bytes"
    level = RecordLevel.STATES
    params = (
        Param(
            "error",
            0.01,
            kind="float",
            help="reconstruction error each layer's rank must reach",
            minimum=1e-6,
            maximum=0.5,
        ),
    )

    def compute(self, run, error):
        return {kind: rank_error(run, kind) for kind in ("key", "value")}

    def to_json(self, found, error, **params) -> dict:
        out = {"error": error}
        for kind, res in found.items():
            out[kind] = {
                "layers": res.layers,
                "bytes_share": res.bytes_share().tolist(),
                "error": res.error.mean(1).tolist(),
                "rank_for_error": res.rank_for(error).float().mean(1).tolist(),
            }
        return out

    def figure(self, run, error):
        return rank_bytes_figure(run, error)
