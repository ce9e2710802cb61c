"""The token inspector: pick a generated token by its text, see its attention row over the cache in a layer
and head, with each position's status (kept, sink, holds merged values, merged away, evicted) and what the
merged slots hold. `token_inspector(run, key)` is the widget of one run (token, layer and head kept in the
URL); `inspect_pair(run_a, run_b, step)` shows two runs' rows for the same token side by side.
"""

from __future__ import annotations

import html
import math
import re

import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from kvlens.figures.attention import (
    HOLDS_MERGE,
    KEPT,
    SINK,
    STATUS,
    STATUS_META,
    recorded_attention_layers,
    status_scale,
)
from kvlens.figures.inspect_token import TokenRow, has_rows, inspect_token, token_strings
from kvlens.figures.plots import run_path
from kvlens.figures.wording import when
from kvlens.levels import RecordLevel
from kvlens.runs.run import Run
from kvlens.ui import url_state
from kvlens.ui.charts import chart
from kvlens.ui.page import level_need, pick_head, pick_layer

MAX_PILLS = 256  # longer runs pick their token on a slider
BAR_COLORS = {
    STATUS[KEPT][0]: "#1f77b4",
    STATUS[HOLDS_MERGE][0]: STATUS[HOLDS_MERGE][1],
    STATUS[SINK][0]: "#111111",
}
CODES = {name: code for code, (name, _) in STATUS.items()}
COUNTED = {
    STATUS[HOLDS_MERGE][0]: "holding merged values",
    STATUS[SINK][0]: "sinks",
}  # "4 holding merged values"
NEED = level_need(RecordLevel.ATTENTION, "The token inspector")


def shown(text: str) -> str:
    """A token's text with its whitespace visible (a pill or a label would hide it)."""
    text = text.replace("\n", "↵").replace("\t", "⇥")
    return text if text.strip() else (text.replace(" ", "␣") or "∅")


def pill_names(texts: list[str]) -> list[str]:
    """`texts` made distinct by invisible zero-width spaces (a repeated token gets one more each time): pills
    report the clicked option by its text, so two pills reading "of" must still differ."""
    seen: dict[str, int] = {}
    out = []
    for text in texts:
        seen[text] = seen.get(text, -1) + 1
        out.append(text + "\u200b" * seen[text])
    return out


def label(text: str) -> str:
    """A token's text for a sentence or a title: trimmed, unless it is only whitespace."""
    return text.strip() or shown(text)


def lacks_rows(run: Run) -> bool:
    """Say (one sentence) that `run` kept no attention rows and which level keeps them; True if so."""
    if has_rows(run):
        return False
    level = run.meta.record.level
    st.info(NEED.why.replace("{have}", str(level)))
    return True


def token_inspector(run: Run, key: str) -> None:
    """Pick a generated token (its text), a layer and a head of `run`: its attention row, status marks and the
    provenance of merged slots. Token, layer and head live in the URL (`?step=`, `?layer=`, `?head=`)."""
    if lacks_rows(run):
        return
    strings = token_strings(run)
    steps = list(range(run.tensor(f"attn/{recorded_attention_layers(run)[0]}").shape[0]))
    label = "Generated token" if run.meta.mode == "generate" else "Scored token"
    if len(steps) <= MAX_PILLS:
        names = pill_names([shown(t) for t in strings[: len(steps)]])

        def widget(**kw):
            return st.pills(label, steps, format_func=names.__getitem__, **kw)
    else:

        def widget(**kw):
            return st.select_slider(label, steps, format_func=lambda s: f"{s}: {shown(strings[s])}", **kw)

    step = url_state.bound(widget, "step", f"{key}_step", steps, "token step", steps[-1])
    if step is None:  # the pill was clicked off
        st.caption("Click a token above to see its attention row.")
        return
    c1, c2, _ = st.columns([1, 1, 3])
    layer = pick_layer(recorded_attention_layers(run), f"{key}_layer", c1)
    head = pick_head(run, f"{key}_head", c2)
    token_view(run, key, step, layer, head)


def token_view(run: Run, key: str, step: int, layer: int, head: int) -> None:
    """Token `step`'s context, a sentence on its query, its attention row in `layer` and `head`, and what the
    merged slots hold (the inspector without its pickers: the Attention page passes its own)."""
    row = inspect_token(run, step, layer, head)
    st.markdown(_context(row), unsafe_allow_html=True)
    st.markdown(summary(row))
    left, right = st.columns([5, 2]) if row.provenance else (st.container(), None)
    with left:
        chart(
            token_row_figure(row, run.meta.policy.name),
            f"{key}_row",
            name=f"token-{step}-L{layer}-H{head}",
            config={"run": str(run.path), "step": step, "layer": layer, "head": head},
        )
    if right is not None:
        with right:
            provenance_table(row)


def inspect_pair(run_a: Run, run_b: Run, step: int, key: str = "pair") -> None:
    """The attention rows of token `step` under two runs (two policies on one prompt) side by side, for one
    layer and head picked here among the layers both recorded."""
    if any(lacks_rows(r) for r in (run_a, run_b)):
        return
    layers = sorted(set(recorded_attention_layers(run_a)) & set(recorded_attention_layers(run_b)))
    if not layers:
        st.info("The two runs recorded attention rows of different layers, so there is no layer to compare.")
        return
    n_rows = min(r.tensor(f"attn/{layers[0]}").shape[0] for r in (run_a, run_b))
    if not 0 <= step < n_rows:
        st.info(
            f"Token {step} is past the end of one of the runs; both have rows for tokens 0 to {n_rows - 1}."
        )
        return
    c1, c2, _ = st.columns([1, 1, 3])
    layer = c1.selectbox("Layer", layers, index=len(layers) // 2, key=f"{key}_layer")
    heads = list(range(min(run_a.shape["heads"], run_b.shape["heads"])))
    head = c2.selectbox("Query head", heads, key=f"{key}_head")
    rows = [inspect_token(r, step, layer, head) for r in (run_a, run_b)]
    if rows[0].token != rows[1].token or rows[0].query != rows[1].query:
        st.caption(
            "The two runs had generated different text by this token; each row below is its own run's."
        )
    for i, (col, run, row) in enumerate(zip(st.columns(2), (run_a, run_b), rows, strict=True)):
        with col:
            st.markdown(summary(row))
            chart(
                token_row_figure(row, run.meta.policy.name, height=380),
                f"{key}_row{i}",
                name=f"token-{step}-L{layer}-H{head}-{run.meta.policy.name}",
                config={
                    "run": run_path(run),
                    "step": step,
                    "layer": layer,
                    "head": head,
                },
            )


def summary(row: TokenRow) -> str:
    """One sentence: which query produced the token and how much of what it had seen it attended to."""
    counts = {name: row.status.count(name) for name in dict.fromkeys(row.status)}
    parts = ", ".join(f"{n} {COUNTED.get(name, name)}" for name, n in counts.items())
    return (
        f"Token {row.step} «{_md(label(row.token))}» came from the query of «{_md(label(row.query))}» "
        f"(position {row.query_position}), which attended to "
        f"{row.in_cache} cache slots of the {len(row.positions)} positions seen so far in layer {row.layer}, "
        f"KV head {row.kv_head} ({parts})."
    )


def _md(text: str) -> str:
    """`text` with Markdown's special characters escaped."""
    return re.sub(r"([\\`*_\[\]<>#|~$])", r"\\\1", text)


def _context(row: TokenRow, before: int = 24) -> str:
    """The text leading up to the token, the token highlighted."""
    lead = "".join(row.texts[max(0, row.query_position + 1 - before) : row.query_position + 1])
    cut = row.query_position + 1 - before > 0
    word = row.token.lstrip() or row.token
    space = row.token[: len(row.token) - len(word)]  # a leading space stays outside the highlight
    return (
        f"<div style='white-space:pre-wrap;line-height:1.6'><span style='color:#888'>{when(cut, '…')}"
        f"{html.escape(lead + space)}</span><span style='background:#ffe08a;font-weight:600' "
        f"title='token {row.step}'>{html.escape(word)}</span></div>"
    )


def _hover(row: TokenRow, i: int) -> str:
    p = row.positions[i]
    text = f"position {p} «{html.escape(shown(row.texts[i]))}»<br>{row.status[i]}"
    if not math.isnan(row.weights[i]):
        text += f"<br>attention {row.weights[i]:.4g}"
    if p in row.provenance:
        held = ", ".join(f"{s} ({w:.3g})" for s, w in row.provenance[p].items())
        text += f"<br>holds {held}"
    if p in row.merged_into:
        text += f"<br>merged into {', '.join(map(str, row.merged_into[p]))}"
    return text


def token_row_figure(row: TokenRow, policy: str, height: int = 460) -> go.Figure:
    """The token's attention row as bars over positions (log scale, coloured by status), above a strip of
    every seen position's status; the query's position is marked."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.84, 0.16], vertical_spacing=0.04)
    hover = [_hover(row, i) for i in range(len(row.positions))]
    for name, color in BAR_COLORS.items():
        idx = [i for i, s in enumerate(row.status) if s == name and not math.isnan(row.weights[i])]
        if idx:
            fig.add_trace(
                go.Bar(
                    x=[row.positions[i] for i in idx],
                    y=[max(row.weights[i], 1e-6) for i in idx],
                    name=name,
                    marker=dict(color=color),
                    hovertext=[hover[i] for i in idx],
                    hoverinfo="text",
                ),
                row=1,
                col=1,
            )
    codes = sorted(STATUS)
    scale = status_scale({CODES[name]: color for name, color in BAR_COLORS.items()})  # the bars' colours
    fig.add_trace(
        go.Heatmap(
            z=[[CODES[s] for s in row.status]],
            x=row.positions,
            y=["status"],
            zmin=-0.5,
            zmax=len(codes) - 0.5,
            colorscale=scale,
            showscale=False,
            meta=STATUS_META,
            hovertext=[hover],
            hoverinfo="text",
            name="status",
        ),
        row=2,
        col=1,
    )
    for name in (STATUS[c][0] for c in codes if c not in (KEPT, HOLDS_MERGE, SINK)):
        if name in row.status:  # legend entries for the statuses that only the strip shows
            fig.add_trace(
                go.Scatter(
                    x=[None],
                    y=[None],
                    mode="markers",
                    name=name,
                    marker=dict(
                        symbol="square",
                        size=12,
                        color=STATUS[CODES[name]][1],
                        line=dict(color="#555", width=1),
                    ),
                ),
                row=1,
                col=1,
            )
    fig.add_vline(x=row.query_position, line=dict(color="#d62728", width=1, dash="dot"))
    fig.update_yaxes(title_text="attention", type="log", dtick=1, exponentformat="power", row=1, col=1)
    fig.update_yaxes(showticklabels=False, row=2, col=1)
    fig.update_xaxes(title_text="token position (red dotted: the query)", row=2, col=1)
    fig.update_layout(
        title=dict(
            text=f"Token {row.step} «{html.escape(label(row.token))}» under {policy}: layer "
            f"{row.layer}, head {row.head} (KV head {row.kv_head})"
        ),
        height=height,
        bargap=0,
        barmode="overlay",
        margin=dict(t=90),
        legend=dict(orientation="h", y=1.02, yanchor="bottom"),
        meta={"analysis": "token", "params": {"step": row.step, "layer": row.layer, "head": row.head}},
    )
    return fig


def provenance_table(row: TokenRow) -> None:
    """What each slot holding merged values held when the token was produced (from the decision log)."""
    text = dict(zip(row.positions, row.texts, strict=True))
    st.markdown(
        f"**Merged slots of layer {row.layer}, KV head {row.kv_head}** at this token: the original "
        "positions each holds, with their weights (replayed from the decision log)"
    )
    pairs = [(slot, p, w) for slot, src in row.provenance.items() for p, w in src.items()]
    st.dataframe(
        {
            "slot": [s for s, _, _ in pairs],
            "holds position": [p for _, p, _ in pairs],
            "token": [label(text.get(p, "")) for _, p, _ in pairs],
            "weight": [w for _, _, w in pairs],
        },
        hide_index=True,
        width="stretch",
        height=min(36 * (len(pairs) + 1) + 3, 420),
        column_config={"weight": st.column_config.NumberColumn(format="%.4f")},
    )
