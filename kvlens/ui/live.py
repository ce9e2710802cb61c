"""A run launched from the app: its settings, the worker that runs it, and the live figure.

`RunSettings.work` is what `kvlens.ui.jobs.Job` executes on its thread (the CLI's `generate` /
`perplexity` API, so the app and the CLI run the same code); `Live` accumulates the step events
the page draws while the run goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlens.engine.loop import RunOptions, StepEvent
from kvlens.errors import KvlensError
from kvlens.experiments.api import generate, perplexity
from kvlens.kvcache.quantize import Storage
from kvlens.lists import parse_list
from kvlens.runs.token_text import decode

COMMANDS = {True: "ppl", False: "generate"}  # the CLI command, by `teacher`


@dataclass
class RunSettings:
    policy: str
    params: dict
    budget: int | float | None
    text: str
    teacher: bool
    new_tokens: int
    prefill: int = 0  # teacher forcing only
    record: str = "full"
    record_layers: list[int] | None = None
    measure: bool = False
    seed: int = 0
    storage: Storage = Storage()  # the model's dtype, or quantized (`kvlens.ui.widgets.storage_picker`)
    prefill_chunk: int | None = None  # feed the prompt in chunks (`--prefill-chunk`)

    def options(self) -> RunOptions:
        return RunOptions(
            budget=self.budget,
            max_new_tokens=self.new_tokens,
            seed=self.seed,
            record=self.record,
            record_layers=self.record_layers,
            storage=self.storage,
            prefill_chunk=self.prefill_chunk,
        )

    def command(self) -> str:
        """The equivalent CLI command (the prompt itself is not repeated)."""
        parts = ["kvlens", COMMANDS[self.teacher], "--policy", self.policy]
        if self.budget is not None:
            parts += ["--budget", str(self.budget)]
        for k, v in self.params.items():
            parts += ["--set", f"{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}"]
        if self.teacher:
            parts += ["--text-file", "TEXT", "--prefill", str(self.prefill), "--tokens", str(self.new_tokens)]
        else:
            parts += ["--prompt", "PROMPT", "--max-new-tokens", str(self.new_tokens)]
        s = self.storage
        if s.quantized:
            parts += [
                "--kv-bits",
                str(s.bits),
                "--kv-scheme",
                s.scheme,
                "--kv-group",
                str(s.group),
                "--kv-residual",
                str(s.residual),
            ]
        if s.low_rank:
            parts += (
                ["--kv-rank", str(s.rank)] if s.rank is not None else ["--kv-rank-share", str(s.rank_share)]
            )
            if s.rank_layers:
                parts += ["--kv-rank-layers", str(s.rank_layers)]
            if s.rank_append != "project":
                parts += ["--kv-rank-append", s.rank_append]
        if self.prefill_chunk:
            parts += ["--prefill-chunk", str(self.prefill_chunk)]
        parts += ["--record", self.record]
        if self.record_layers:
            parts += ["--record-layers", ",".join(map(str, self.record_layers))]
        if self.measure:
            parts.append("--measure")
        return " ".join(parts) + "   # made in the app"

    def work(self, model):
        """`(on_step, cancel) -> Run` for a `Job`."""
        check_storage(self.storage, model)
        meta = {"command": self.command(), "made_in": "app"}

        def go(on_step, cancel):
            if self.teacher:
                return perplexity(
                    model,
                    self.text,
                    self.policy,
                    self.params,
                    prefill=self.prefill,
                    tokens=self.new_tokens,
                    opts=self.options(),
                    on_step=on_step,
                    cancel=cancel,
                    meta=meta,
                    measure=self.measure,
                )
            return generate(
                model,
                self.text,
                self.policy,
                self.params,
                opts=self.options(),
                on_step=on_step,
                cancel=cancel,
                meta=meta,
                measure=self.measure,
            )

        return go


def check_storage(storage: Storage, model) -> None:
    """Refuse a quantization group that does not tile the model's head size, before anything runs."""
    storage.check(model.shape()["head_dim"], model.shape()["kv_heads"])


def parse_layers(text: str, n_layers: int) -> list[int] | None:
    """'all' or '' -> None; '0,15,29' -> [0, 15, 29] checked against the model."""
    text = text.strip().lower()
    if text in ("", "all"):
        return None
    layers = sorted(set(parse_list(text, "Layers to record ('all' or a list like 0,15,29)")))
    bad = [x for x in layers if not 0 <= x < n_layers]
    if bad:
        raise KvlensError(f"Layer {bad[0]} does not exist: the model has layers 0 to {n_layers - 1}.")
    return layers


@dataclass
class Live:
    """Step events received so far."""

    t0: float = field(default_factory=time.perf_counter)
    steps: list[int] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    slots: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    attention: dict | None = None
    perturbation: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # measured runs only
    quantized: bool = False  # quantized storage: the meter's `perturbation_stored` is drawn too
    names: Callable[[list[int]], list[str]] | None = (
        None  # the tokenizer's `convert_ids_to_tokens`, once loaded
    )

    def add(self, events: list[StepEvent]) -> None:
        for e in events:
            self.steps.append(e.step)
            self.nll.append(e.nll)
            self.slots.append(max(e.kv_slots))
            self.tokens.append(e.token)
            self.attention = e.attention or self.attention
            for name in ("perturbation_used", "perturbation_evict") + (
                "perturbation_stored",
            ) * self.quantized:
                if name in e.extra:
                    self.perturbation.setdefault(name, []).append((e.step, e.extra[name]))

    @property
    def text(self) -> str:
        """The text so far, its tokens decoded jointly (empty until `names` is set)."""
        return "" if self.names is None else decode(self.names(self.tokens)).text

    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def figure(self) -> go.Figure:
        """Aligned panels: NLL per step, kept slots, output perturbation (measured runs), and the last
        layer's current attention row."""
        titles = ["NLL of each token (nats)", "kept slots per KV head (max)"]
        if self.perturbation:
            titles.append("output perturbation (mean)")
        titles.append("current attention row, last layer")
        fig = make_subplots(rows=1, cols=len(titles), horizontal_spacing=0.07, subplot_titles=titles)
        last = len(titles)
        fig.add_trace(
            go.Scatter(
                x=self.steps,
                y=self.nll,
                mode="lines+markers",
                name="NLL",
                showlegend=False,
                line=dict(color="#0072B2"),
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=self.steps,
                y=self.slots,
                mode="lines",
                name="kept slots",
                showlegend=False,
                line=dict(color="#009E73"),
            ),
            row=1,
            col=2,
        )
        styles = {
            "perturbation_used": ("cache used (merged)", "#D55E00", "solid"),
            "perturbation_evict": (
                "same evictions, no merge" + ", full precision" * self.quantized,
                "#0072B2",
                "dash",
            ),
            "perturbation_stored": ("same evictions, no merge, quantized", "#009E73", "dot"),
        }
        for name, points in self.perturbation.items():
            label, color, dash = styles[name]
            fig.add_trace(
                go.Scatter(
                    x=[s for s, _ in points],
                    y=[v for _, v in points],
                    mode="lines",
                    name=label,
                    line=dict(color=color, dash=dash),
                    showlegend=True,
                ),
                row=1,
                col=3,
            )
        if self.attention:
            fig.add_trace(
                go.Bar(
                    x=self.attention["positions"],
                    y=self.attention["weights"],
                    name="attention",
                    marker=dict(color="#444"),
                    showlegend=False,
                ),
                row=1,
                col=last,
            )
        for col in range(1, last):
            fig.update_xaxes(title_text="step", row=1, col=col)
        fig.update_xaxes(title_text="position", row=1, col=last)
        fig.update_yaxes(rangemode="tozero", row=1, col=2)
        fig.update_layout(
            height=300,
            showlegend=bool(self.perturbation),
            margin=dict(t=40, b=40, l=40, r=10),
            bargap=0,
            legend=dict(orientation="h", y=-0.25),
        )
        return fig
