"""Future attention with and without one merge, per layer (WeightedKV Fig. 2).

At query row `step`, each KV head's least-attended token has its value merged into its right
neighbour and its key dropped; `MergeSimilarity.cosine` `(L, Hq, N)` is the cosine similarity of
the attention rows `step+1 .. step+N` with and without that key, recomputed from the recorded q and k.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go
import torch

from kvlens.analysis.registry import Analysis, Param, register_analysis
from kvlens.analysis.states import attention_chunks, recorded_layers, states
from kvlens.errors import KvlensError
from kvlens.figures.plots import finish, line_style, run_model
from kvlens.levels import RecordLevel
from kvlens.runs.run import Run


@dataclass
class MergeSimilarity:
    """WeightedKV Fig. 2: `cosine` `(L, Hq, N)` float64 similarity of attention rows at steps
    `step+1 .. step+N` with and without the merge at `step`; `merged` `(L, Hkv)` the merged token."""

    layers: list[int]
    step: int
    cosine: torch.Tensor
    merged: torch.Tensor


def merge_future_similarity(
    run: Run, step: int = 100, horizon: int = 800, sink: int = 4, layers: list[int] | None = None
) -> MergeSimilarity:
    """WeightedKV Fig. 2 from prefill states: one merge at `step`, its effect on later attention rows.

    At query row `step`, each KV head's token j with the smallest average attention
    `Abar[j] / n[j]` over rows 0..step (sinks `0..sink-1` and token `step` itself excluded) has its
    value merged into token j+1 and its key dropped. Later rows then attend over the other keys:
    `A'_t = A_t` without column j, renormalised, and `cos(A_t, A'_t)` is reported for each query
    head of the group. Choice: queries come from the unmerged run (the merged value changes no
    attention weight of this layer; its knock-on effect on later layers' queries is not modelled),
    which makes the measure exact for the layer itself and cheap.
    """
    layers = layers or recorded_layers(run, "q")  # callers give none or a non-empty list
    out, merged = [], []
    for layer in layers:
        q, k = states(run, "q", layer), states(run, "k", layer)
        hq, t, _ = q.shape
        hkv = k.shape[0]
        if not sink < step < t - 1:
            raise KvlensError(
                f"The merge step must lie between {sink + 1} and {t - 2} for this {t}-token prompt; "
                f"got {step}."
            )
        stop = min(t, step + 1 + horizon)
        abar = torch.zeros(hkv, t, dtype=torch.float64)
        for _, _, probs in attention_chunks(q, k, 0, step + 1):
            abar += probs.view(hkv, -1, *probs.shape[1:]).mean(1).sum(1).double()
        seen = (step + 1 - torch.arange(t)).clamp(min=1)  # rows 0..step that saw each token
        score = (abar / seen)[:, :step].clone()
        score[:, :sink] = float("inf")
        j = score.argmin(-1)  # (Hkv,)
        jq = j.repeat_interleave(hq // hkv)  # (Hq,)
        cos = []
        for _, _, probs in attention_chunks(q, k, step + 1, stop):  # (Hq, r, T)
            a = probs.double()
            aj = a.gather(-1, jq[:, None, None].expand(-1, a.shape[1], 1)).squeeze(-1)  # (Hq, r)
            norm2 = (a**2).sum(-1)
            cos.append((norm2 - aj**2).clamp(min=0).sqrt() / norm2.sqrt())  # float64: values sit near 1
        out.append(torch.cat(cos, dim=1))
        merged.append(j)
    return MergeSimilarity(list(layers), step, torch.stack(out), torch.stack(merged))


def merge_similarity_figure(run: Run, step: int = 100, horizon: int = 800, sink: int = 4) -> go.Figure:
    """WeightedKV Fig. 2: per layer, 1 − cosine similarity of future attention rows with and without
    one merge (mean, and the worst row of any head), on a log axis: the paper's cosine is so close to
    1 that error bars around it would cross 1."""
    res = merge_future_similarity(run, step, horizon, sink)
    flat = res.cosine.flatten(1).double()  # (L, Hq * N)
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=res.layers, y=(1 - flat.mean(1)).tolist(), mode="lines+markers", name="mean", **line_style(0)
        )
    )
    fig.add_trace(
        go.Scatter(
            x=res.layers,
            y=(1 - flat.min(1).values).tolist(),
            mode="lines+markers",
            name="worst row",
            **line_style(1),
        )
    )
    fig.update_xaxes(title_text="layer")
    fig.update_yaxes(
        type="log",
        dtick=1,
        exponentformat="power",
        title_text=f"1 − cosine similarity, steps {step + 1}–{step + res.cosine.shape[-1]}",
    )
    return finish(
        fig,
        f"Future attention with vs without one merge at step {step} ({run_model(run)})",
        "merge-similarity",
        run,
        step=step,
        horizon=horizon,
        sink=sink,
    )


@register_analysis
class MergeSimilarityAnalysis(Analysis):
    name = "merge-similarity"
    paper = "WeightedKV Fig. 2"
    level = RecordLevel.STATES
    params = (
        Param("step", 100, kind="int", help="the query row at which one token is merged"),
        Param("horizon", 800, kind="int", help="how many later rows are compared", minimum=1),
    )

    def compute(self, run, step, horizon):
        return merge_future_similarity(run, step, horizon)

    def to_json(self, ms, **params) -> dict:
        flat = ms.cosine.flatten(1)
        return {
            "layers": ms.layers,
            "step": ms.step,
            "mean": flat.mean(1).tolist(),
            "std": flat.std(1, unbiased=False).tolist(),
            "merged_token": ms.merged.tolist(),
        }

    def figure(self, run, step, horizon):
        return merge_similarity_figure(run, step, horizon)
