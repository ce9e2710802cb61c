"""Layer-wise compression ratio of KVMerger's merging sets over the bundled texts (KVMerger Fig. 3b).

For one text, Algorithm 1 (the policy's own `merging_sets`) over every prefill key of each layer
and KV head: `MergingRatio.ratio` `(L, Hkv)` = `1 - sets / T`. The analysis runs the model over the
first `tokens` tokens of each bundled text (one curve per text: the paper's claim is that the
curves coincide).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import plotly.graph_objects as go
import torch

from kvlens.analysis.registry import TEXTS, THRESHOLD, Analysis, Param, check_threshold, register_analysis
from kvlens.analysis.states import recorded_layers, states
from kvlens.figures.plots import finish, line_style, model_label
from kvlens.policies.kvmerger import merging_sets
from kvlens.runs.run import Run
from kvlens.texts import bundled, prefix_ids

if TYPE_CHECKING:
    from kvlens.engine.models import LoadedModel


@dataclass
class MergingRatio:
    """`ratio` `(L, Hkv)`: share of a prompt's keys that merging removes, `1 - sets / T`."""

    layers: list[int]
    threshold: float
    ratio: torch.Tensor

    def per_layer(self) -> torch.Tensor:
        return self.ratio.mean(1)  # (L,)


def merging_ratio(run: Run, threshold: float = 0.75) -> MergingRatio:
    """KVMerger Fig. 3b for one text: layer-wise compression ratio of Algorithm 1 on all prefill keys.

    Every key is a candidate (the figure studies the set identification alone, before the
    policy's recent window and top-k are set aside). Ratio = share of keys that disappear when
    each merging set becomes one state: `1 - number of sets / T`, per KV head.
    """
    check_threshold(threshold)
    layers = recorded_layers(run, "k")
    rows = []
    for layer in layers:
        k = states(run, "k", layer)  # (Hkv, T, D)
        rows.append(torch.tensor([1 - len(merging_sets(head, threshold)) / k.shape[1] for head in k]))
    return MergingRatio(layers, threshold, torch.stack(rows))


def record_states(model: LoadedModel, ids: list[int], layers: list[int] | None = None) -> Run:
    """A full-cache run over `ids` with prefill states recorded (one generated token)."""
    from kvlens.engine.loop import RunOptions, run
    from kvlens.policies import make_policy

    opts = RunOptions(max_new_tokens=1, record="states", record_layers=layers, log_decisions=False)
    return run(model, make_policy("full"), ids, prefill=len(ids), steps=1, teacher=False, opts=opts)


def merging_ratio_over_texts(
    model: LoadedModel, texts: dict[str, str], tokens: int = 1024, threshold: float = 0.75
) -> dict[str, MergingRatio]:
    """KVMerger Fig. 3b: `merging_ratio` of the first `tokens` tokens of each text, by label (runs the
    model)."""
    out = {}
    for label, text in texts.items():
        out[label] = merging_ratio(record_states(model, prefix_ids(model, text, tokens, label)), threshold)
    return out


def merging_ratio_figure(ratios: list[MergingRatio], labels: list[str], note: str = "") -> go.Figure:
    """KVMerger Fig. 3b: layer-wise merging-set compression ratio, one line per text (`note` ends the
    title)."""
    fig = go.Figure()
    for i, (r, label) in enumerate(zip(ratios, labels, strict=False)):
        fig.add_trace(
            go.Scatter(
                x=r.layers, y=r.per_layer().tolist(), mode="lines+markers", name=label, **line_style(i)
            )
        )
    fig.update_xaxes(title_text="layer")
    fig.update_yaxes(title_text="compression ratio (1 − sets / tokens)", range=[0, 1])
    threshold = next((r.threshold for r in ratios), None)
    return finish(
        fig,
        f"Merging-set compression ratio per layer, threshold {threshold}{note}",
        "merging-ratio",
        threshold=threshold,
        labels=list(labels),
    )


@register_analysis
class MergingRatioAnalysis(Analysis):
    name = "merging-ratio"
    paper = "KVMerger Fig. 3b"
    inputs = "model"
    params = (TEXTS, Param("tokens", 1024, kind="int", help="tokens of each text", minimum=2), THRESHOLD)

    def compute(self, model, texts, tokens, threshold):
        return merging_ratio_over_texts(model, bundled(texts), tokens, threshold)

    def to_json(self, res, threshold, tokens, **params) -> dict:
        return {
            "threshold": threshold,
            "tokens": tokens,
            "layers": next(iter(res.values())).layers,
            "texts": {label: r.per_layer().tolist() for label, r in res.items()},
        }

    def figure(self, model, **params):
        res = self.compute(model, **params)
        note = f" ({model_label(model.spec)}, first {params['tokens']} tokens of {len(res)} texts)"
        return merging_ratio_figure(list(res.values()), list(res), note)
