"""A task benchmark's leaderboard (`results/bench_tasks*.json`): the score-vs-ratio figure and a sortable
table, filtered by task, length and policy, summarised from the rows so far (a grid still running shows its
samples finished until now), then the needles found by depth and length."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from kvlens.ui.charts import chart

COLUMNS = [
    "policy",
    "ratio",
    "score",
    "ci_low",
    "ci_high",
    "samples",
    "full_score",
    "kept_share",
    "cost_vs_answer",
    "own_vs_answer",
    "cell_ms",
    "turns",
]

# the two protocols a task grid runs under (`kvlens bench tasks [--query-aware]`), one file each
PROTOCOLS = {
    False: "Protocol: question-agnostic (the context is compressed alone, then the question is asked; "
    "kvpress's "
    "default). The query-aware grid (`--query-aware`, `bench_tasks_query_aware.json`) is in the "
    "file list above.",
    True: "Protocol: query-aware (context and question compressed together, SnapKV's setting). The "
    "question-agnostic grid (`bench_tasks.json`) is in the file list above.",
}


def _turns(turns: list[dict] | None) -> str:
    """Each question's score in turn, e.g. "100% · 88% · 75%" (a task that asks several of one context)."""
    return " · ".join(f"{t['score']:.0%}" for t in turns or ())


def leaderboard(path: Path, settings: dict, raw: dict) -> None:
    from kvlens.experiments.bench import tasks

    rows = [r for r in raw.get("rows", []) if isinstance(r, dict) and isinstance(r.get("results"), list)]
    if not rows:
        st.info(f"{path.name} has no finished sample yet.")
        return
    summary = tasks.summarise(rows)
    st.caption(PROTOCOLS[bool(settings.get("config", {}).get("query_aware"))])
    left, middle, right = st.columns([1, 1, 2])
    task = left.selectbox(
        "Task",
        ["all", *sorted({s["task"] for s in summary} - {"all"})],
        key="tasks_task",
        format_func=lambda t: {"all": "average over tasks"}.get(t, t),
    )
    lengths = sorted({s["length"] for s in summary if s["task"] == task}, key=str)
    if any(n not in (None, "all") for n in lengths):
        length = middle.selectbox(
            "Context length",
            lengths,
            key="tasks_length",
            format_func=lambda n: {"all": "all lengths"}.get(n, f"{n} tokens"),
        )
    else:  # a file that records no context lengths: nothing to pick
        length = "all" if "all" in lengths else lengths[0]
    names = list(dict.fromkeys(s["policy"] for s in summary))
    chosen = right.multiselect("Policies", names, default=names, key="tasks_policies")
    shown = [s for s in summary if s["policy"] in chosen]
    chart(
        tasks.figure({**raw, "summary": shown}),
        "tasks_fig",
        name=path.stem,
        config={"results": str(path), **settings.get("config", {})},
        data=pd.DataFrame(shown),
    )
    table = pd.DataFrame([s for s in shown if s["task"] == task and s["length"] == length], columns=COLUMNS)
    table["turns"] = table["turns"].map(_turns)
    st.caption(
        "Score: share of the expected strings found in the answers; [ci_low, ci_high]: bootstrap 95 % "
        "interval over samples; cost_vs_answer: (compression + answers) / answers, median over samples; "
        "own_vs_answer: the method's own passes (KVzip's replay of the prompt) / answers; "
        "cell_ms: a sample's cost for this policy and ratio (its share of the shared prefill, "
        "its compression, "
        "its share of the batched answers), median over samples; turns: each question's score in turn, for "
        "a task that asks several questions of one compressed context."
    )
    st.dataframe(
        table.sort_values("score", ascending=False, kind="stable"),
        hide_index=True,
        width="stretch",
        column_config={c: st.column_config.NumberColumn(format="%.3f") for c in COLUMNS[2:5] + COLUMNS[6:-1]},
    )
    needles(path, settings, rows, chosen)


def needles(path: Path, settings: dict, rows: list[dict], chosen: list[str]) -> None:
    """The needle figure (`task_needles`): each niah needle found or not, by depth and length, per policy."""
    from kvlens.experiments.bench import task_needles, tasks

    st.markdown("**Needles by depth and context length**")
    cells = [c for c in task_needles.grid(rows) if c["policy"] in chosen]
    if not cells:
        st.caption(
            "These rows record no needle depths: `kvlens bench tasks` with the command that made them adds "
            "them (it regenerates each sample)."
        )
        return
    ratios = sorted({c["ratio"] for c in cells if c["ratio"] not in (None, 0.0)})
    ratio = (
        st.select_slider(
            "Compression ratio", ratios, value=task_needles.default_ratio(cells), key="tasks_needle_ratio"
        )
        if len(ratios) > 1
        else task_needles.default_ratio(cells)
    )
    chart(
        task_needles.figure(cells, ratio, tasks.protocol(settings.get("config", {}))),
        "tasks_needles_fig",
        name=f"{path.stem}_needles",
        config={"results": str(path), "ratio": ratio, **settings.get("config", {})},
        data=pd.DataFrame(cells),
    )
    st.caption(
        "Each expected number of a niah sample is a needle at its depth (its sentence boundary's share of "
        "the haystack, binned in tenths); colour: the share of the needles of that depth and length found "
        "in the answer."
    )
