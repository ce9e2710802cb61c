"""The Compare page's views of `kvlens.experiments.compare` results: the table, the texts, the aligned
charts."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from kvlens.experiments.compare import Result, ResultCache, table
from kvlens.figures.plots import line_style
from kvlens.figures.wording import when
from kvlens.runs.token_text import TokenText
from kvlens.ui.charts import chart
from kvlens.ui.inspector import inspect_pair
from kvlens.ui.page import report_button
from kvlens.ui.views import diverging_text, escaped

# `kvlens compare --json` row keys -> the page's column names and number formats
COLUMNS = {
    "policy": ("policy", None, "The policy and its budget"),
    "first_divergence": ("diverges at", None, "The first new token where its choice differs from full's"),
    "top1_agreement": ("top-1 agrees", "percent", "Share of steps where its choice is full's token"),
    "ppl": ("ppl", "%.3f", "Perplexity on the full cache's text"),
    "kl": ("KL", "%.4f", "Mean KL(p_full || p_policy) per step"),
    "perturbation": ("perturbation", "%.3f", "Mean output perturbation of the cache it used"),
    "attention_loss": ("attn. loss", "%.3f", "Mean attention mass on what it no longer holds"),
    "kv_slots_max": ("max slots", None, "Most slots one KV head held"),
    "kv_bytes_peak": ("peak KV bytes", "localized", "Allocated KV bytes at the peak"),
    "ms_per_token": ("ms/token", "%.0f", "Wall time per step of the measured pass, measuring included"),
    "generated_steps": ("own tokens", None, "Tokens its own text generated after leaving the measured pass"),
}


@st.cache_resource
def result_cache() -> ResultCache:
    """The results of earlier comparisons, shared by every session of this server (they depend only on the
    inputs)."""
    return ResultCache()


def show_table(results: list[Result]) -> None:
    """The rows of `kvlens.experiments.compare.table`, with the page's column names."""
    frame = pd.DataFrame(table(results))[list(COLUMNS)]
    for k in ("kl", "perturbation", "attention_loss"):  # non-negative: a float's -1e-9 is 0, not "-0.000"
        frame[k] = frame[k].clip(lower=0.0)
    frame = frame.rename(columns={k: v[0] for k, v in COLUMNS.items()})
    config = {
        name: st.column_config.NumberColumn(format=fmt, help=text)
        if fmt
        else st.column_config.Column(help=text)
        for name, fmt, text in COLUMNS.values()
    }
    st.dataframe(frame, hide_index=True, width="stretch", column_config=config, placeholder="–")


def show_text(
    label: str,
    text: TokenText,
    first_diff: int | None,
    reference: TokenText | None = None,
    agree: int | None = None,
) -> None:
    """The reference's own text (`reference` None), or a policy's greedy choice at each step of the
    reference's text (decoded jointly), everything from its first divergence highlighted; `agree`: steps where
    the two agree."""
    st.markdown(f"**{label}**")
    diverging_text(text, first_diff, reference=reference is None)
    if first_diff is not None and reference is not None and first_diff < len(reference.spans):
        st.caption(
            f"It writes {text.label(first_diff)!r} where the full cache writes "
            f"{reference.label(first_diff)!r}. Highlighted: its choice at each later step of the full "
            "cache's text, on which it is scored"
            + when(agree is not None, f"; it agrees at {agree} of {len(text.spans)} steps")
            + "."
        )


def show_own_text(r: Result, reference: Result) -> None:
    """A policy's own greedy text (`Result.own`), from where it leaves the full cache's own text highlighted,
    and the full cache's text from that token, highlighted too: the divergence marked in both."""
    st.markdown(f"**{r.entry.label}**")
    if r is reference:
        diverging_text(r.written, None, reference=True)
        return
    diverging_text(r.written, r.own_diff)
    if r.own_diff is not None:
        full = reference.written
        start = full.spans[r.own_diff][0] if r.own_diff < len(full.spans) else len(full.text)
        same = escaped(full.text[:start][-40:])
        rest = escaped(full.after(r.own_diff))
        st.markdown(
            f"<div style='white-space:pre-wrap;font-size:0.85em;color:#555'>full cache: …{same}<span "
            f"style='background:#cfe3f7' title='the full cache from the same token'>{rest}</span></div>",
            unsafe_allow_html=True,
        )


def show_results(results: list[Result]) -> None:
    """The texts side by side, the table and the aligned charts of a finished comparison."""
    reference = results[0].text
    report_button(
        [r.run for r in results], "cmp_report", st.columns([7, 1])[1]
    )  # the measured passes' report
    if all(r.own is not None for r in results):
        st.subheader("What each one writes")
        st.caption(
            "Each policy's own greedy text (`kvlens generate` with the same settings), orange from where it "
            "leaves the full cache's; below it, blue, the full cache's text from that token."
        )
        for col, r in zip(st.columns(len(results)), results):
            with col, st.container(border=True):
                show_own_text(r, results[0])
    st.subheader("Scored on the full cache's text")
    st.caption(
        "Each policy teacher-forced on the full cache's text: its choice at each step (the metrics below "
        "come from this pass)."
    )
    for col, r in zip(st.columns(len(results)), results):
        with col, st.container(border=True):
            show_text(
                r.entry.label,
                r.text,
                r.first_diff,
                None if r is results[0] else reference,
                round(r.agreement * len(r.picks)),
            )
    st.subheader("Metrics")
    show_table(results)
    chart(
        compare_figure(results),
        "cmp_fig",
        name="compare",
        config={
            "prompt": results[0].run.meta.prompt,
            "new_tokens": len(reference.spans),
            "policies": [
                {
                    "policy": r.entry.policy,
                    "params": r.entry.params,
                    "budget": r.entry.budget,
                    "storage": r.entry.storage.describe(),
                }
                for r in results
            ],
        },
    )
    show_pair(results)


def show_pair(results: list[Result]) -> None:
    """Two of the compared runs' attention rows for one token of the full cache's text, side by side."""
    st.subheader("Token inspector")
    labels = [r.entry.label for r in results]
    c1, c2, c3 = st.columns([1, 1, 2])
    # the first two after the reference when there are (else the reference)
    a = c1.selectbox("Left", labels, index=int(len(labels) > 1), key="cmp_pair_a")
    b = c2.selectbox("Right", labels, index=2 * (len(labels) > 2), key="cmp_pair_b")
    step = c3.select_slider(
        "Token of the full cache's text",
        list(range(len(results[0].text.spans))),
        format_func=lambda i: f"{i}: {results[0].text.label(i)!r}",
        key="cmp_pair_step",
    )
    runs = {r.entry.label: r.run for r in results}
    inspect_pair(runs[a], runs[b], step, key="cmp_pair")


def compare_figure(results: list[Result]) -> go.Figure:
    """Three aligned panels over new-token steps: NLL on the full cache's text, KL to full, kept slots."""
    fig = make_subplots(
        rows=1,
        cols=3,
        horizontal_spacing=0.07,
        subplot_titles=[
            "NLL of the full cache's tokens (nats)",
            "KL(p_full ‖ p_policy) per step",
            "kept slots per KV head (max over layers)",
        ],
    )
    for i, r in enumerate(results):
        style = line_style(i)
        nll = r.run.tensor("steps/nll").tolist()
        kl = r.run.tensor("perturbation/kl").tolist()
        slots = r.run.tensor("steps/kv_slots").flatten(1).amax(1).tolist()
        for col, ys in ((1, nll), (2, kl), (3, slots)):
            fig.add_trace(
                go.Scatter(
                    x=list(range(len(ys))),
                    y=ys,
                    mode="lines",
                    name=r.entry.label,
                    legendgroup=r.entry.label,
                    showlegend=col == 1,
                    line=style["line"],
                ),
                row=1,
                col=col,
            )
    for col in (1, 2, 3):
        fig.update_xaxes(title_text="new token", row=1, col=col)
    fig.update_yaxes(rangemode="tozero", row=1, col=3)
    fig.update_layout(
        height=410,
        margin=dict(b=110),
        legend=dict(orientation="h", yref="container", y=0.02, yanchor="bottom"),
        title=dict(text="Policies side by side"),
        meta={"analysis": "compare", "policies": [r.entry.label for r in results]},
    )
    return fig
