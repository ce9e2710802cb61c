"""Compare 2-4 policies on one prompt: texts, first divergence from the full cache, metrics, aligned charts.

For each policy: one measured generation (`kvlens.api.generate(measure=True)`: its text, output
perturbation and KL to a full-cache pass over its own tokens, memory), and one unmeasured
teacher-forced pass over the full cache's continuation, so every policy's perplexity (and speed,
free of the measuring overhead) is on the same tokens. The full cache itself is always run first
as the reference. No Streamlit here.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlens.api import encode, generate
from kvlens.engine import RunOptions, run
from kvlens.errors import KvlensError
from kvlens.plots import line_style
from kvlens.policies import make_policy
from kvlens.runs import Run
from kvlens.ui.labels import changed_params

MAX_POLICIES = 4


@dataclass
class Entry:
    policy: str
    params: dict
    budget: int | float | None

    @property
    def label(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in changed_params(self.policy, self.params).items())
        budget = "" if self.budget is None else f" @{self.budget:g}"
        return f"{self.policy}{budget}" + (f" ({extra})" if extra else "")


@dataclass
class Outcome:
    entry: Entry
    generated: Run  # free generation, measured
    scored: Run  # teacher-forced on the full cache's continuation
    first_diff: int | None  # first new token that differs from the full cache's (None: identical)
    pieces: list[str]  # each new token decoded on its own, for highlighting

    def row(self) -> dict:
        g, s = self.generated.metrics, self.scored.metrics
        return {"policy": self.entry.label, "diverges at token": self.first_diff,
                "ppl on full's text": s["ppl"], "KL to full (mean)": g.get("kl"),
                "perturbation (mean)": g.get("perturbation_used"), "attention loss": g.get("attention_loss"),
                "peak KV (MiB)": g["kv_bytes_peak"] / 2**20, "max slots": g["kv_slots_max"],
                "ms / token": s["ms_per_token"]}  # from the unmeasured pass: no shadow-cache overhead


def first_difference(reference: list[int], tokens: list[int]) -> int | None:
    """Index of the first token where the two sequences differ (None if equal)."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def compare(model, prompt: str, entries: list[Entry], new_tokens: int,
            on_step: Callable[[str, object], None] | None = None,
            cancel: threading.Event | None = None) -> list[Outcome]:
    """Run the full cache and each entry on `prompt` (see module docstring); the full cache comes first."""
    if not 1 <= len(entries) <= MAX_POLICIES:
        raise KvlensError(f"Compare takes 1 to {MAX_POLICIES} policies besides the full cache; got {len(entries)}.")
    for e in entries:
        make_policy(e.policy, e.params)
    ids = encode(model, prompt)
    entries = [Entry("full", {}, None)] + [e for e in entries if e.policy != "full"]
    outcomes, reference = [], None
    for e in entries:
        label = e.label

        def step(event, label=label):
            if on_step is not None:
                on_step(label, event)
        opts = RunOptions(budget=e.budget, max_new_tokens=new_tokens, stop_at_eos=False)
        gen = generate(model, prompt, e.policy, e.params, opts=opts, on_step=step, cancel=cancel, measure=True,
                       meta={"compare": True})
        if reference is None:
            reference = gen.meta["tokens"]
        scored = run(model, make_policy(e.policy, e.params), ids + reference, prefill=len(ids),
                     steps=len(reference), teacher=True, opts=opts, cancel=cancel)
        pieces = [model.tokenizer.decode([t]) for t in gen.meta["tokens"]]
        outcomes.append(Outcome(e, gen, scored, first_difference(reference, gen.meta["tokens"]), pieces))
    return outcomes


def table(outcomes: list[Outcome]) -> pd.DataFrame:
    return pd.DataFrame([o.row() for o in outcomes])


def compare_figure(outcomes: list[Outcome]) -> go.Figure:
    """Three aligned panels over new-token steps: NLL on the full cache's text, KL to full, kept slots."""
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.07,
                        subplot_titles=["NLL of the full cache's tokens (nats)", "KL(p_full ‖ p_policy) per step",
                                        "kept slots per KV head (max over layers)"])
    for i, o in enumerate(outcomes):
        style = line_style(i)
        nll = o.scored.tensor("steps/nll").tolist()
        kl = o.generated.tensor("perturbation/kl").tolist()
        slots = o.generated.tensor("steps/kv_slots").flatten(1).amax(1).tolist()
        for col, ys in ((1, nll), (2, kl), (3, slots)):
            fig.add_trace(go.Scatter(x=list(range(len(ys))), y=ys, mode="lines", name=o.entry.label,
                                     legendgroup=o.entry.label, showlegend=col == 1, line=style["line"]),
                          row=1, col=col)
    for col in (1, 2, 3):
        fig.update_xaxes(title_text="new token", row=1, col=col)
    fig.update_yaxes(rangemode="tozero", row=1, col=3)
    fig.update_layout(height=380, legend=dict(orientation="h", y=-0.25), title=dict(text="Policies side by side"),
                      meta={"analysis": "compare", "policies": [o.entry.label for o in outcomes]})
    return fig
