"""The Why page's computation: an `explain` result for the selected run or a generated task sample, cached per
setting (a 1024-token sample takes minutes on a CPU, a short run seconds)."""

from __future__ import annotations

import streamlit as st

from kvlens.ui.state import get_model, open_run

SUITE_SEED = 0  # the task suite's samples (`kvlens bench tasks`): generated from this seed
SUITE = {"depths": "random", "rounding": "kvlens"}  # the conventions of the shipped results/bench_tasks.json


@st.cache_data(max_entries=16, show_spinner=False)
def explain_run(path: str, by: tuple[str, ...], span: int, minimal: bool) -> dict:
    from kvlens.explain.case import run_case
    from kvlens.explain.explain import explain

    run = open_run(path)
    model = get_model(run.meta["model"]["spec"], "auto")
    return explain(run_case(model, path), list(by), span, minimal_by="head" if minimal else None)


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
) -> dict:
    from kvlens.experiments.bench import ruler
    from kvlens.explain.case import sample_case
    from kvlens.explain.explain import explain
    from kvlens.texts import bundled

    model = get_model("default", "auto")
    count = lambda s: len(model.tokenizer(s, add_special_tokens=False).input_ids)  # noqa: E731
    sample = ruler.generate(
        task, length, index, count, " ".join(bundled().values()), seed=SUITE_SEED, depths=SUITE["depths"]
    )
    about = {"length": length, "index": index, "seed": SUITE_SEED, **SUITE}
    return explain(
        sample_case(model, sample, policy, ratio, about=about, rounding=SUITE["rounding"]),
        list(by),
        span,
        minimal_by="head" if minimal else None,
    )
