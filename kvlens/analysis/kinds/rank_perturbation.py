"""What a rank costs the model's outputs: the run replayed with its keys and values stored at each rank of a
ladder.

`rank_bytes` prices a rank in reconstruction error and bytes; this replays it (xKV, Chang et al. 2025, and
Palu, Chang et al. 2024, report the same trade in accuracy). The run's own tokens (prompt, then what it
produced) are fed again teacher-forced through its model, under its policy and budget, with low-rank storage
at rank r (`Storage(rank=r)`, `kvlens.kvcache.lowrank`) and the perturbation meter on
(`kvlens.engine.perturbation.measured`), against an uncompressed forward over the same tokens:
- end to end, over decode steps 1.. (step 0's logits come from the prompt's uncompressed forward, the same at
  every rank): KL(p_full || p_r) (`measured`'s), the NLL change `NLL_r - NLL_full` of the fed tokens, and the
  top-1 agreement (share of steps whose most likely token is the full cache's);
- the pooled output error `sum ||O - O_full|| / sum ||O_full||` split as for quantized storage
  (`kvlens.engine.perturbation.sources`): the choice of positions (the kept positions, original keys and
  values), what storage at rank r adds, and what the policy's merges add. A full-cache run has no positions or
  merging part: storage is all of it; an evicting run's positions part is its eviction's. The same replay in
  the model's dtype (`reference`) gives the policy's own cost end to end, so what rank r adds end to end is
  its row minus the reference. Bytes are the replay's peak KV bytes (the stored tensors: coefficients and each
  head's basis) over the reference's. The reconstruction errors are `rank_bytes`' (Eckart-Young on the
  recorded states of the whole prompt, mean over layers and KV heads), and each layer's rank for `error` is
  marked. The ladder defaults to D/16, D/8, D/4, D/2 and D (D the head size). At D storage adds nothing but
  float rounding when each head keeps at least D of the prompt's slots; a budget below D leaves the basis, fit
  on the kept slots, fewer than D dimensions, so the tokens that come later lose what lies outside it even at
  rank D (and the prompt's error above understates it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from kvlens.analysis.kinds.rank_bytes import RankBytes, rank_error
from kvlens.analysis.kinds.spectrum import _sample
from kvlens.analysis.registry import Analysis, Param, register_analysis
from kvlens.engine.loop import RunOptions
from kvlens.engine.loop import run as run_policy
from kvlens.engine.models import LoadedModel
from kvlens.engine.perturbation import full_logprobs, measured, sources
from kvlens.errors import KvlensError
from kvlens.figures.perturbation_sources import COLORS
from kvlens.figures.plots import COLORS as LINE_COLORS
from kvlens.figures.plots import SCALE, finish, run_model
from kvlens.figures.wording import if_none, when
from kvlens.kvcache.quantize import Storage
from kvlens.levels import RecordLevel
from kvlens.policies import make_policy
from kvlens.runs.run import Run

PARTS = [("selection", "choice of positions"), ("storage", "low-rank storage"), ("merging", "merging")]
DTYPE = "model dtype"  # the reference row's label


@dataclass
class Replay:
    """One replay of a run: `rank` (None: the model's dtype), its peak KV bytes, KL, NLL change and top-1
    agreement over decode steps 1.., and its pooled output error by source (`sources`' keys)."""

    rank: int | None
    kv_bytes: int
    kl: float
    nll_change: float
    top1: float
    sources: dict


@dataclass
class RankPerturbation:
    """The replays at each rank of the ladder and in the model's dtype, and `rank_bytes`' errors of the
    run."""

    ranks: list[Replay]
    reference: Replay
    errors: dict[str, RankBytes]  # "key", "value"
    head_dim: int
    steps: int  # decode steps measured

    def rows(self) -> list[dict]:
        """One row per replay, the reference last: rank, bytes and their share, errors, end to end,
        sources."""
        out = []
        for rep in [*self.ranks, self.reference]:
            errors = {
                f"{kind}_error": 0.0 if rep.rank is None else float(res.error[..., rep.rank - 1].mean())
                for kind, res in self.errors.items()
            }
            out.append(
                {
                    "rank": rep.rank,
                    "kv_bytes": rep.kv_bytes,
                    "bytes_share": rep.kv_bytes / self.reference.kv_bytes,
                    **errors,
                    "kl": rep.kl,
                    "nll_change": rep.nll_change,
                    "top1_agreement": rep.top1,
                    "sources": rep.sources,
                }
            )
        return out


def default_ranks(head_dim: int) -> list[int]:
    """D/16, D/8, D/4, D/2 and D (at least 1, without repeats)."""
    return sorted({max(1, head_dim // k) for k in (16, 8, 4, 2, 1)})


def replay(model: LoadedModel, run: Run, rank: int | None, full: torch.Tensor) -> Replay:
    """`run`'s tokens teacher-forced under its policy and budget with storage at `rank` (None: the model's
    dtype), measured; `full` `(tokens, V)`: the uncompressed forward's log-probabilities of each produced
    token."""
    meta = run.meta
    prompt, tokens = list(meta.prompt_tokens), list(meta.tokens)
    policy = make_policy(meta.policy.name, meta.policy.params)
    opts = RunOptions(budget=meta.budget.requested, storage=Storage(rank=rank), log_decisions=False)
    logits: list[torch.Tensor] = []

    def go(observers, on_step):
        return run_policy(
            model,
            policy,
            prompt + tokens,
            prefill=len(prompt),
            steps=len(tokens),
            teacher=True,
            opts=opts,
            observers=observers,
            on_step=on_step,
        )

    out = measured(model, go, on_step=lambda event: logits.append(event.logits.float().cpu()))
    nll = out.tensors["steps/nll"][1:].double()
    nll_full = -full[1:].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].double()
    agree = torch.stack(logits[1:]).argmax(-1) == full[1:].argmax(-1)
    return Replay(
        rank,
        out.metrics["kv_bytes_peak"],
        out.metrics["kl"],
        float((nll - nll_full).mean()),
        float(agree.float().mean()),
        sources(out.tensors),
    )


def rank_perturbation(run: Run, model: LoadedModel, ranks: list[int] | None = None) -> RankPerturbation:
    """The run replayed at each of `ranks` (default `default_ranks`) and in the model's dtype (module
    docstring)."""
    head_dim = model.shape()["head_dim"]
    ranks = sorted(set(ranks or default_ranks(head_dim)))
    if ranks[-1] > head_dim:
        raise KvlensError(
            f"--ranks: {ranks[-1]} is above the model's head size ({head_dim}); a rank of "
            f"{head_dim} stores every channel."
        )
    prompt, tokens = run.meta.prompt_tokens, run.meta.tokens
    if len(tokens) < 2:
        raise KvlensError("The run has fewer than 2 tokens after its prompt: no decode step to measure.")
    full = full_logprobs(model, (prompt + tokens)[:-1])[len(prompt) - 1 :]  # (tokens, V): predicts each token
    replays = [replay(model, run, r, full) for r in [*ranks, None]]
    errors = {kind: rank_error(run, kind) for kind in ("key", "value")}
    return RankPerturbation(replays[:-1], replays[-1], errors, head_dim, len(tokens) - 1)


def _tick(row: dict) -> str:
    """A rank's tick: the rank (or the model dtype) over its share of the model dtype's KV bytes."""
    return f"{if_none(row['rank'], 'dtype')}<br>{row['bytes_share']:.0%}"


def _add_sources(fig: go.Figure, rows: list[dict], ticks: list[str]) -> None:
    """The first panel: each replay's pooled output error by source, one bar trace per source."""
    for (key, label), color in zip(PARTS, COLORS, strict=True):
        y = [r["sources"][key] for r in rows]
        fig.add_trace(
            go.Bar(
                x=ticks,
                y=y,
                name=label,
                marker_color=color,
                legendgroup="sources",
                hovertemplate=f"{label}: %{{y:+.4f}}<extra></extra>",
            ),
            row=1,
            col=1,
        )


def _add_end_to_end(fig: go.Figure, rows: list[dict], ticks: list[str]) -> None:
    """The second panel: KL (labelled with the top-1 agreement) and the NLL change of each replay."""
    agree = [f"{r['top1_agreement']:.0%}" for r in rows]
    for key, short, label, color, dash, text in (
        ("kl", "KL", "KL(p_full ‖ p) (labels: top-1 agreement)", "#000000", "solid", agree),
        ("nll_change", "NLL change", "NLL change", "#CC79A7", "dash", None),
    ):
        hover = [
            f"{short} %{{y:.4f}} nats<br>top-1 agreement {r['top1_agreement']:.0%}<br>KV bytes "
            f"{r['kv_bytes']:,}<extra></extra>"
            for r in rows
        ]
        fig.add_trace(
            go.Scatter(
                x=ticks,
                y=[r[key] for r in rows],
                mode="lines+markers" + when(text, "+text"),
                name=label,
                text=text,
                textposition="bottom left",
                textfont=dict(size=10),
                line=dict(color=color, dash=dash, width=2),
                marker=dict(size=7),
                cliponaxis=False,
                hovertemplate=hover,
            ),
            row=1,
            col=2,
        )


def _add_layer_ranks(fig: go.Figure, found: RankPerturbation, ranks: list[int], error: float) -> None:
    """The third panel: the rank each layer's keys and values need for `error` (mean over KV heads), the
    ladder's `ranks` as dotted lines."""
    layers = found.errors["key"].layers
    few = len(layers) <= len(LINE_COLORS)  # a handful of layers: Spectra's discrete colours
    colours = LINE_COLORS[: len(layers)] if few else _sample(SCALE, len(layers))
    for (kind, res), symbol in zip(found.errors.items(), ("circle", "diamond-open"), strict=True):
        need = res.rank_for(error).float().mean(1)  # (L,) mean over KV heads
        fig.add_trace(
            go.Scatter(
                x=need.tolist(),
                y=layers,
                mode="markers",
                name=f"{kind}s' rank",
                marker=dict(symbol=symbol, size=8, color=colours),
                hovertemplate=f"layer %{{y}}: {kind}s need rank %{{x:.1f}}<extra></extra>",
            ),
            row=1,
            col=3,
        )
    for rank in ranks:
        fig.add_vline(x=rank, line_dash="dot", line_color="#999", row=1, col=3)


def _axes(fig: go.Figure, replays: int, ranks: list[int], head_dim: int) -> None:
    """The three panels' axes: `replays` ticks on the first two, the log rank up to `head_dim` on the
    third."""
    fig.update_yaxes(title_text="‖O − O_full‖ / ‖O_full‖", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="nats per token", row=1, col=2)
    fig.update_yaxes(title_text="layer", row=1, col=3)
    for col in (1, 2):
        fig.update_xaxes(
            title_text="rank<br>KV bytes, share of the model dtype's",
            tickangle=0,
            range=[-0.7, replays - 0.5],
            row=1,
            col=col,
        )  # room for the labels left of the points
    fig.update_xaxes(
        type="log",
        title_text="rank (mean over KV heads)",
        range=[0, 1.08 * math.log10(head_dim)],
        tickvals=ranks,
        row=1,
        col=3,
    )


def rank_perturbation_figure(run: Run, found: RankPerturbation, error: float = 0.01) -> go.Figure:
    """Per rank (and the model's dtype), its bytes share under it: the pooled output error by source,
    stacked; KL (labelled with the top-1 agreement) and the NLL change end to end; and each layer's rank
    for `error`."""
    rows = found.rows()
    ticks = [_tick(r) for r in rows]
    ranks = [r["rank"] for r in rows[:-1]]
    fig = make_subplots(
        rows=1,
        cols=3,
        horizontal_spacing=0.08,
        column_widths=[0.36, 0.36, 0.28],
        subplot_titles=[
            "output error by source (pooled)",
            "end to end, against the full cache",
            f"each layer's rank for {error:g} error",
        ],
    )
    _add_sources(fig, rows, ticks)
    _add_end_to_end(fig, rows, ticks)
    _add_layer_ranks(fig, found, ranks, error)
    _axes(fig, len(rows), ranks, found.head_dim)
    meta = run.meta
    budget = meta.budget.requested
    policy = meta.policy.name + ("" if budget is None else f" @{budget:g}")
    title = (
        f"What each rank costs: the run replayed with low-rank KV storage ({run_model(run)}, {policy}, "
        f"{found.steps} decode steps)"
    )
    fig = finish(fig, title, "rank_perturbation", run, error=error, ranks=ranks)
    fig.update_layout(
        width=1200,
        height=460,
        barmode="relative",
        bargap=0.3,
        legend=dict(orientation="h", y=-0.4, x=0, yanchor="top"),
        margin=dict(b=150),
    )
    return fig


@register_analysis
class RankPerturbationAnalysis(Analysis):
    name = "rank_perturbation"
    paper = "xKV / Palu: rank against output perturbation (the run replayed at each rank)"
    level = RecordLevel.STATES
    replays = True
    params = (
        Param(
            "ranks",
            (),
            "a rank to replay; repeat the flag (default: D/16, D/8, D/4, D/2 and D, D the head size)",
            kind="int",
            many=True,
            minimum=1,
        ),
        Param(
            "error",
            0.01,
            kind="float",
            help="reconstruction error each layer's marked rank must reach",
            minimum=1e-6,
            maximum=0.5,
        ),
    )

    def compute(self, run, model, ranks, error):
        return rank_perturbation(run, model, ranks)

    def to_json(self, found, ranks, error) -> dict:
        return {
            "head_dim": found.head_dim,
            "steps": found.steps,
            "error": error,
            "rows": found.rows(),
            "layers": found.errors["key"].layers,
            "rank_for_error": {
                kind: res.rank_for(error).float().mean(1).tolist() for kind, res in found.errors.items()
            },
        }

    def text(self, found: dict) -> str:
        head = (
            f"{'rank':>11} {'bytes':>6} {'key err':>8} {'value err':>9} {'KL':>8} {'dNLL':>8} {'top-1':>6}  "
            f"{'positions':>9} {'storage':>8} {'merging':>8}"
        )
        lines = [
            f"Replayed over {found['steps']} decode steps; bytes: KV bytes over the model "
            "dtype's; errors: the "
            "prompt's reconstruction error; KL, NLL change (nats per token) and top-1 agreement "
            "against the full "
            "cache; the pooled output error by source.",
            head,
        ]
        for row in found["rows"]:
            src = row["sources"]
            lines.append(
                f"{if_none(row['rank'], DTYPE):>11} {row['bytes_share']:>6.1%} "
                f"{row['key_error']:>8.2e} {row['value_error']:>9.2e} {row['kl']:>8.4f} "
                f"{row['nll_change']:>+8.4f} {row['top1_agreement']:>6.1%}  "
                + " ".join(f"{src[k]:>{w}.4f}" for k, w in (("selection", 9), ("storage", 8), ("merging", 8)))
            )
        for kind, need in found["rank_for_error"].items():
            lines.append(
                f"{kind}s' rank for {found['error']:g} error per layer (mean over KV heads): "
                + ", ".join(f"{n:g}" for n in need)
            )
        return "\n".join(lines)

    def figure(self, run, model, ranks, error):
        return rank_perturbation_figure(run, rank_perturbation(run, model, ranks), error)
