"""The kept-text view (`kvlens.figures.kept_text`) on the shipped runs, against what their tensors and
decision log say directly: counts from `attn_pos/{layer}`, attention from `attn/{layer}`, statuses from the
decisions."""

from __future__ import annotations

import copy
import html
import math
import re
from collections import Counter

import pytest

from kvlens import load_run
from kvlens.errors import KvlensError
from kvlens.figures.attention import EVICTED, FUTURE, HOLDS_MERGE, MERGED_AWAY, SINK, STATUS
from kvlens.figures.kept_text import CACHED, kept_text, kept_text_html
from tests.conftest import CACHED_RUNS

TOKEN = re.compile(r'<span style="([^"]*)" title="([^"]*)">([^<]*)</span>')


@pytest.fixture(scope="module")
def shipped_runs():
    return {
        name: load_run(CACHED_RUNS / name)
        for name in (
            "h2o-attention",
            "cam-attention",
            "kvmerger-attention",
            "streaming_llm-attention",
            "tova-summary",
        )
    }


def layers(run) -> list[int]:
    return run.meta.record.layers


def token_spans(fragment: str) -> list[tuple[str, str, str]]:
    """(style, tooltip, text) of every token span, unescaped (the legend's spans have no tooltip)."""
    return [
        (style, html.unescape(title), html.unescape(text)) for style, title, text in TOKEN.findall(fragment)
    ]


@pytest.mark.parametrize(
    "name,step",
    [("h2o-attention", 0), ("h2o-attention", 17), ("h2o-attention", 39), ("kvmerger-attention", 23)],
)  # kvmerger's slots hold merged values
def test_counts_and_mean_attention_are_what_the_recorded_rows_hold(shipped_runs, name, step):
    run = shipped_runs[name]
    view = kept_text(run, step)
    kept, mass, heads = Counter(), Counter(), 0
    for layer in layers(run):
        pos = run.tensor(f"attn_pos/{layer}")[step]  # (Hkv, Smax)
        attn = run.tensor(f"attn/{layer}")[step].float()  # (Hq, Smax)
        group = attn.shape[0] // pos.shape[0]
        for kv, row in enumerate(pos.tolist()):
            kept.update({p for p in row if p >= 0})
            for h in range(kv * group, (kv + 1) * group):
                for slot, p in enumerate(row):
                    if p >= 0:
                        mass[p] += float(attn[h, slot])
        heads += attn.shape[0]
    assert view.pairs == 9 and len(view.texts) == len(run.meta.prompt_tokens) + len(run.meta.tokens)
    assert view.kept == [kept[p] for p in range(len(view.texts))]
    for p, weight in enumerate(view.attention):
        assert math.isnan(weight) if not kept[p] else weight == pytest.approx(mass[p] / heads, abs=1e-6)
    assert view.query_position == len(run.meta.prompt_tokens) - 1 + step and kept[view.query_position] == 9
    assert not any(view.kept[view.query_position + 1 :])  # nothing after the query is in any cache


def test_the_text_is_the_runs_prompt_and_generated_text(shipped_runs):
    run = shipped_runs["cam-attention"]
    assert "".join(kept_text(run, 5).texts) == run.meta.prompt + run.meta.text


def test_streaming_llm_keeps_its_sinks_in_every_head_at_every_step(shipped_runs):
    run = shipped_runs["streaming_llm-attention"]
    sink = run.meta.policy.params["sink"]
    for step in (0, 20, 39):
        assert kept_text(run, step).kept[:sink] == [9] * sink
        for layer in layers(run):
            for head in range(run.shape["heads"]):
                view = kept_text(run, step, layer, head)
                assert view.status[:sink] == [SINK] * sink
                assert SINK not in view.status[sink:]


@pytest.mark.parametrize("step", [1, 39])
def test_a_chosen_heads_statuses_follow_its_cache_and_the_decision_log(shipped_runs, step):
    """Every position seen by a step of cam's layer 15: in the head's cache -> kept (or holding merged
    values), gone after a merge that drew 1 -> merged away, gone otherwise -> evicted; later ones not yet
    seen. A merged-away position names the slots holding its values, or says they were evicted since."""
    run = shipped_runs["cam-attention"]
    d = run.decisions
    merges = d[(d["action"] == "merge") & (d["draw"] != 0) & (d["layer"] == 15) & (d["step"] < step)]
    assert len(merges)  # the shipped run merges in this layer
    merged_away = []
    for kv in range(run.shape["kv_heads"]):
        cached = {p for p in run.tensor("attn_pos/15")[step, kv].tolist() if p >= 0}
        merged = set(merges[merges["kv_head"] == kv]["position"].tolist())
        view = kept_text(run, step, 15, 3 * kv + 2)
        assert view.kv_head == kv
        for p, code in enumerate(view.status):
            if p > view.query_position:
                allowed = {FUTURE}
            elif p in cached:
                allowed = set(CACHED)
            else:
                allowed = {MERGED_AWAY if p in merged else EVICTED}
            assert code in allowed, (kv, p, STATUS[code][0])
        for p in merged - cached:
            if p in view.merged_into:
                assert all(s in cached and view.status[s] == HOLDS_MERGE for s in view.merged_into[p])
                assert "merged into slots " + ", ".join(map(str, view.merged_into[p])) in _tooltip(view, p)
            else:
                assert "the slots it was merged into have been evicted since" in _tooltip(view, p)
            merged_away.append(p)
        for slot, sources in view.holds.items():
            assert "holds positions " + ", ".join(f"{q} ({w:.3g})" for q, w in sources.items()) in _tooltip(
                view, slot
            )
    assert merged_away


def _tooltip(view, p: int) -> str:
    return token_spans(kept_text_html(view))[p][1]


def test_the_html_outlines_the_query_underlines_generated_tokens_and_colours_by_status(shipped_runs):
    run = shipped_runs["cam-attention"]
    view = kept_text(run, 12, 15, 4)
    spans = token_spans(kept_text_html(view))
    assert [text for _, _, text in spans] == view.texts
    assert [i for i, (style, _, _) in enumerate(spans) if "outline:" in style] == [view.query_position]
    assert [i for i, (style, _, _) in enumerate(spans) if "underline" in style] == list(
        range(view.prompt_len, len(view.texts))
    )
    for p, (style, tooltip, _) in enumerate(spans):
        if p <= view.query_position:
            assert f"background:{STATUS[view.status[p]][1]}" in style and STATUS[view.status[p]][0] in tooltip
        else:
            assert "background" not in style and tooltip.endswith("not yet seen at step 12")
    assert f"position {view.query_position} " in spans[view.query_position][1]
    assert "the query of step 12" in spans[view.query_position][1]


def test_tokens_are_escaped_and_whitespace_kept(shipped_runs):
    run = copy.deepcopy(shipped_runs["h2o-attention"])
    run.meta.prompt_token_strings[3] = '<script>alert("x")</script>'
    run.meta.token_strings[0] = "Ċ&amp;"  # byte-level "\n" followed by text that looks like an entity
    fragment = kept_text_html(kept_text(run, 39))
    assert "<script>" not in fragment and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in fragment
    spans = token_spans(fragment)
    assert spans[3][2] == '<script>alert("x")</script>' and '«<script>alert("x")</script>»' in spans[3][1]
    assert spans[len(run.meta.prompt_tokens)][2] == "\n&amp;"
    assert "white-space:pre-wrap" in fragment


def test_a_count_view_has_a_legend_of_counts_and_no_head(shipped_runs):
    fragment = kept_text_html(kept_text(shipped_runs["h2o-attention"], 39))
    assert "kept by how many of the 9 recorded (layer, KV head) pairs" in fragment
    assert "mean over the recorded query heads" in fragment and "merged into" not in fragment


@pytest.mark.parametrize(
    "args,message",
    [
        ((40,), "Step 40 is out of range: this run recorded steps 0 to 39."),
        ((-1,), "Step -1 is out of range: this run recorded steps 0 to 39."),
        ((3, 15), "Give both a layer and a query head"),
        ((3, None, 2), "Give both a layer and a query head"),
        ((3, 7, 0), "Layer 7 has no recorded attention rows; recorded layers: 0, 15, 29."),
        ((3, 15, 9), "Head 9 is out of range: the model has query heads 0 to 8."),
    ],
)
def test_bad_input_is_one_sentence(shipped_runs, args, message):
    with pytest.raises(KvlensError) as err:
        kept_text(shipped_runs["h2o-attention"], *args)
    assert str(err.value).startswith(message) and str(err.value).count(". ") == 0


def test_a_run_without_attention_rows_says_how_to_record_them(shipped_runs):
    with pytest.raises(
        KvlensError,
        match=r"^This run has no per-step attention rows; record it with "
        r"--record attention\.$",
    ):
        kept_text(shipped_runs["tova-summary"], 0)
