"""The Why page's computation: an `explain` result for the selected run or a generated task sample, cached per
setting (a 1024-token sample takes minutes on a CPU, a short run seconds)."""

from __future__ import annotations

import json

import streamlit as st

from kvlens.experiments.bench.ruler import IMPLIED, SUITE
from kvlens.runs.run import Run
from kvlens.ui.results import results_dir
from kvlens.ui.state import get_model, open_run

MINIMAL_BY = {True: "head", False: None}  # `explain`'s minimal_by for the "smallest set" box


def suite() -> tuple[tuple[str, object], ...]:
    """The conventions of the task suite whose samples the page explains: those in the `config` of
    `results/bench_tasks.json` (the leaderboard's), else `kvlens bench tasks`'s defaults; as items, a key of
    `explain_sample`'s cache."""
    try:
        config = json.loads((results_dir() / "bench_tasks.json").read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return tuple(SUITE.items())
    return tuple((k, config.get(k, IMPLIED.get(k, v))) for k, v in SUITE.items())


def patch_count(run: Run, by: list[str], span: int, minimal: bool) -> int:
    """About how many patched caches `explain` scores for `run` with these groups (a cache per group, the
    smallest set's head groups when asked; its search adds a few), before computing any: the Why page's
    estimate."""
    layers, heads, tokens = run.shape["layers"], run.shape["kv_heads"], len(run.meta.prompt_tokens)
    sizes = {"layer": layers, "head": layers * heads, "span": -(-tokens // span), "kind": 2, "sinks": 1}
    kinds = list(by) + (["head"] if minimal and "head" not in by else [])
    return sum(sizes.get(kind, 0) for kind in kinds)


@st.cache_data(max_entries=16, show_spinner=False)
def explain_run(path: str, by: tuple[str, ...], span: int, minimal: bool) -> dict:
    from kvlens.explain.case import run_case
    from kvlens.explain.explain import explain

    run = open_run(path)
    model = get_model(run.meta.model.spec, "auto")
    return explain(run_case(model, path), list(by), span, minimal_by=MINIMAL_BY[minimal])


@st.cache_data(max_entries=16, show_spinner=False)
def explain_sample(
    task: str,
    length: int,
    index: int,
    policy: str,
    ratio: float,
    by: tuple[str, ...],
    span: int,
    minimal: bool,
    conventions: tuple[tuple[str, object], ...],
) -> dict:
    from kvlens.experiments.bench import ruler
    from kvlens.explain.case import sample_case
    from kvlens.explain.explain import explain
    from kvlens.texts import bundled

    model = get_model("default", "auto")
    count = lambda s: len(model.tokenizer(s, add_special_tokens=False).input_ids)  # noqa: E731
    conv: dict = dict(conventions)
    sample = ruler.generate(
        task,
        length,
        index,
        count,
        " ".join(bundled().values()),
        seed=conv["seed"],
        depths=conv["depths"],
        count=conv["count"],
    )
    about = {"length": length, "index": index, **conv}
    return explain(
        sample_case(model, sample, policy, ratio, chat=conv["chat"], about=about, rounding=conv["rounding"]),
        list(by),
        span,
        minimal_by=MINIMAL_BY[minimal],
    )
