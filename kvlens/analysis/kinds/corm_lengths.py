"""Compression rate CORM reaches against sequence length, over the bundled texts (CORM Fig. 4).

For each text and length n, the model prefills the text's first n tokens under the `corm` policy;
`CormLengths.ratio` `(texts, lengths)` is `1 - kept entries / n` after the prefill compression,
averaged over layers and KV heads (`steps/kv_slots` `(steps + 1, L, Hkv)`, row 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import plotly.graph_objects as go
import torch

from kvlens.analysis.registry import TEXTS, Analysis, Param, register_analysis
from kvlens.figures.plots import finish, line_style, model_label
from kvlens.lists import parse_list
from kvlens.texts import bundled, prefix_ids

if TYPE_CHECKING:
    from kvlens.engine.models import LoadedModel


@dataclass
class CormLengths:
    """`ratio` `(texts, lengths)`: share of the prompt's KV entries CORM removed after prefill."""

    lengths: list[int]
    labels: list[str]
    ratio: torch.Tensor
    params: dict

    def mean(self) -> list[float]:
        return self.ratio.mean(0).tolist()


def corm_over_lengths(
    model: LoadedModel, texts: dict[str, str], lengths: list[int], params: dict | None = None
) -> CormLengths:
    """CORM Fig. 4: for each text and length n, prefill its first n tokens under `corm` and report
    `1 - kept entries / n`, averaged over layers and KV heads (the policy's step-0 compression
    uses the last `window` prefill rows as its recent messages)."""
    from kvlens.engine.loop import RunOptions, run
    from kvlens.policies import make_policy

    resolved = make_policy("corm", params).params()  # validates before any run
    rows = []
    for label, text in texts.items():
        ids = prefix_ids(model, text, max(lengths), label)
        row = []
        for n in lengths:
            r = run(
                model,
                make_policy("corm", params),
                ids[:n],
                prefill=n,
                steps=1,
                teacher=False,
                opts=RunOptions(max_new_tokens=1, log_decisions=False),
            )
            kept = r.tensor("steps/kv_slots")[0].float()  # (L, Hkv) after the prefill compression
            row.append(1 - float(kept.mean()) / n)
        rows.append(row)
    return CormLengths(list(lengths), list(texts), torch.tensor(rows), resolved)


def corm_lengths_figure(
    lengths: list[int], ratios: list[float], budget: int | None = None, note: str = ""
) -> go.Figure:
    """CORM Fig. 4: compression rate reached by CORM against sequence length."""
    fig = go.Figure(go.Scatter(x=lengths, y=ratios, mode="lines+markers", name="CORM", **line_style(0)))
    if budget:
        fig.add_trace(
            go.Scatter(
                x=lengths,
                y=[max(0.0, 1 - budget / n) for n in lengths],
                mode="lines",
                name=f"budget {budget}",
                **line_style(1),
            )
        )
    fig.update_xaxes(title_text="sequence length (tokens)")
    fig.update_yaxes(title_text="compression rate (share of KV removed)", range=[0, 1])
    return finish(
        fig,
        f"CORM compression rate against sequence length{note}",
        "corm-lengths",
        lengths=list(lengths),
        budget=budget,
    )


@register_analysis
class CormLengthsAnalysis(Analysis):
    name = "corm-lengths"
    paper = "CORM Fig. 4"
    inputs = "model"
    params = (
        TEXTS,
        Param("lengths", "256,512,1024,2048", kind="text", help="comma-separated sequence lengths"),
        Param(
            "settings",
            (),
            kind="text",
            help="a corm parameter, KEY=VALUE (e.g. window=64); repeat for several",
            many=True,
            cli="--set",
        ),
    )

    def compute(self, model, texts, lengths, settings):
        from kvlens.policies import parse_settings

        lengths = sorted(parse_list(lengths, "--lengths", int, minimum=2))
        return corm_over_lengths(model, bundled(texts), lengths, parse_settings("corm", settings))

    def to_json(self, res, **params) -> dict:
        return {
            "lengths": res.lengths,
            "params": res.params,
            "compression": res.mean(),
            "texts": dict(zip(res.labels, res.ratio.tolist(), strict=True)),
        }

    def figure(self, model, **params):
        res = self.compute(model, **params)
        used = ", ".join(f"{k}={v}" for k, v in res.params.items())
        note = f"<br><sup>{model_label(model.spec)}, corm {used}, mean of {len(res.labels)} texts</sup>"
        return corm_lengths_figure(res.lengths, res.mean(), note=note)
