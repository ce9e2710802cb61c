"""The token inspector (`kvlens.figures.inspect_token`, `kvlens.ui.inspector`) and views kept in the URL
(`kvlens.ui.url_state`), on the shipped runs: rows checked against the recorded tensors and the decision log.
"""

from __future__ import annotations

import json
import math

import pytest
from streamlit.testing.v1 import AppTest

from kvlens import load_run
from kvlens.errors import KvlensError
from kvlens.figures.inspect_token import inspect_token, token_strings
from tests.conftest import CACHED_RUNS, ROOT


def test_a_row_is_the_recorded_attention_of_the_slots_then_cached(cam):
    step, layer, head = 10, 15, 4
    row = inspect_token(cam, step, layer, head)
    kv = head // (cam.shape["heads"] // cam.shape["kv_heads"])
    pos = cam.tensor(f"attn_pos/{layer}")[step, kv].tolist()
    attn = cam.tensor(f"attn/{layer}")[step, head].float().tolist()
    recorded = {p: a for p, a in zip(pos, attn, strict=False) if p >= 0}
    prompt = len(cam.meta.prompt_tokens)
    assert row.query_position == prompt - 1 + step and row.positions == list(range(prompt + step))
    assert row.token == token_strings(cam)[step]
    assert row.query == token_strings(cam)[step - 1]
    cached = {p: w for p, w in zip(row.positions, row.weights, strict=True) if not math.isnan(w)}
    assert cached.keys() == recorded.keys() and row.in_cache == len(recorded)
    assert all(abs(cached[p] - recorded[p]) < 1e-6 for p in cached)
    assert abs(sum(cached.values()) - 1) < 0.01  # a softmax row
    for p, status in zip(row.positions, row.status, strict=True):
        assert (status in ("kept", "holds merged values", "sink")) == (p in recorded), (p, status)
    assert "holds merged values" in row.status and "evicted" in row.status


def test_merged_slots_hold_what_the_decision_log_merged_into_them_before_the_step(cam):
    step, layer, kv = 30, 0, 1
    row = inspect_token(cam, step, layer, 3)  # query head 3 reads KV head 1
    assert row.kv_head == kv
    d = cam.decisions
    merges = d[
        (d["action"] == "merge")
        & (d["layer"] == layer)
        & (d["kv_head"] == kv)
        & (d["step"] < step)
        & (d["draw"] == 1)
    ]
    cached = {p for p, w in zip(row.positions, row.weights, strict=True) if not math.isnan(w)}
    expected: dict[int, set[int]] = {}
    for position, targets in zip(merges["position"], merges["targets"], strict=True):
        for t in targets:
            expected.setdefault(int(t), set()).add(int(position))
    assert row.provenance, "CaM merged into layer 0 before step 30"
    for slot, sources in row.provenance.items():
        assert slot in cached and sources[slot] == 1.0  # CaM adds to the target's own value
        assert set(sources) - {slot} <= _closure(expected, slot)
        assert all(w > 0 for w in sources.values())
    for position, slots in row.merged_into.items():
        assert all(position in row.provenance[s] for s in slots)
    statuses = dict(zip(row.positions, row.status, strict=True))
    assert {p for p, s in statuses.items() if s == "holds merged values"} >= set(row.provenance)


def _closure(merged: dict[int, set[int]], slot: int) -> set[int]:
    """Positions merged into `slot`, directly or through slots merged into it."""
    out, todo = set(), [slot]
    while todo:
        for p in merged.get(todo.pop(), ()):
            if p not in out:
                out.add(p)
                todo.append(p)
    return out


def test_step_zero_attends_to_the_whole_prompt_before_any_decision(cam):
    row = inspect_token(cam, 0, 29, 0)
    assert row.in_cache == len(row.positions) == len(cam.meta.prompt_tokens)
    assert set(row.status) <= {"kept", "sink"} and row.provenance == {} and row.merged_into == {}


def test_runs_without_rows_and_bad_steps_are_one_sentence(cam):
    with pytest.raises(KvlensError, match="recorded at 'summary'.*--record attention"):
        inspect_token(load_run(CACHED_RUNS / "tova-summary"), 0, 0, 0)
    with pytest.raises(KvlensError, match="Step 40 is out of range.*0 to 39"):
        inspect_token(cam, 40, 15, 0)
    with pytest.raises(KvlensError, match="Layer 3 has no recorded attention rows"):
        inspect_token(cam, 1, 3, 0)


def _app(monkeypatch, tmp_path, **params) -> AppTest:
    monkeypatch.setenv("KVLENS_RUNS", str(tmp_path / "runs"))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    for name, value in params.items():
        at.query_params[name] = value
    return at.run()


def test_a_link_opens_the_overview_on_its_run_token_layer_and_head(monkeypatch, tmp_path):
    at = _app(monkeypatch, tmp_path, run="h2o-attention", step="12", layer="0", head="5")
    assert not at.exception and not at.warning
    assert at.session_state["app_run"] == str(CACHED_RUNS / "h2o-attention")
    assert (
        at.session_state["ov_insp_step"],
        at.session_state["ov_insp_layer"],
        at.session_state["ov_insp_head"],
    ) == (12, 0, 5)
    title = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert any(t.startswith("Token 12 ") and "h2o: layer 0, head 5 (KV head 1)" in t for t in title), title
    at.selectbox(key="ov_insp_layer").set_value(29).run()  # a change is written back into the URL
    assert at.query_params["layer"] == "29"


def test_bad_values_in_a_link_are_ignored_with_one_sentence(monkeypatch, tmp_path):
    at = _app(monkeypatch, tmp_path, run="cam-attention", step="999", layer="7", head="x")
    assert not at.exception
    warnings = [w.value for w in at.warning]
    assert len(warnings) == 3 and all(
        w.startswith("The link's ") and w.endswith("it was ignored.") for w in warnings
    )
    assert at.session_state["ov_insp_step"] == 39 and at.session_state["ov_insp_layer"] == 15  # the defaults
    assert at.query_params["step"] == "39"  # the bad value was replaced by what is shown


def test_a_summary_run_says_which_level_keeps_attention_rows(monkeypatch, tmp_path):
    at = _app(monkeypatch, tmp_path, run="tova-summary")
    assert not at.exception
    assert any(
        "token inspector needs a run recorded with `--record attention`" in i.value and "`summary`" in i.value
        for i in at.info
    )


def test_the_run_page_takes_its_policy_choices_from_the_link(monkeypatch, tmp_path):
    at = _app(monkeypatch, tmp_path)
    at.query_params.update(policy="cam", preset="official-ppl", budget="0.3")
    at.switch_page("pages/run.py").run()
    assert not at.exception and not at.warning
    assert at.selectbox(key="run_policy").value == "cam"
    assert at.selectbox(key="run_cam_preset").value == "official-ppl"
    assert at.text_input(key="run_cam_budget").value == "0.3"
    at.text_input(key="run_cam_budget").set_value("64").run()
    assert at.query_params["budget"] == "64" and at.query_params["policy"] == "cam"


def test_the_run_page_inspects_the_run_it_saved_last(monkeypatch, tmp_path):
    at = _app(monkeypatch, tmp_path)
    at.session_state["run_last"] = str(
        CACHED_RUNS / "kvmerger-attention"
    )  # what the page sets after saving a run
    at.switch_page("pages/run.py").run()
    assert not at.exception
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert any(t.startswith("Token 23 ") and "under kvmerger" in t for t in titles), titles
    assert any("Merged slots of layer 15" in m.value for m in at.markdown)  # KVMerger's sets, from the log


def test_repeated_tokens_get_distinct_pills_that_read_the_same():
    from kvlens.ui.inspector import pill_names

    names = pill_names([" of", "the", " of", " of"])
    assert len(set(names)) == 4 and [n.replace("\u200b", "") for n in names] == [" of", "the", " of", " of"]


def test_inspect_pair_shows_two_policies_rows_for_one_token():
    def page(folder):
        from kvlens import load_run
        from kvlens.ui.inspector import inspect_pair

        runs = [load_run(f"{folder}/{name}") for name in ("cam-attention", "streaming_llm-attention")]
        inspect_pair(*runs, 10)

    at = AppTest.from_function(page, default_timeout=120, args=(str(CACHED_RUNS),)).run()
    assert not at.exception
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert [t.split(" under ")[1].split(":")[0] for t in titles] == ["cam", "streaming_llm"]
    texts = [
        load_run(CACHED_RUNS / n).meta.token_strings[:11]
        for n in ("cam-attention", "streaming_llm-attention")
    ]
    assert [t.split(" under ")[0] for t in titles] == [
        f"Token 10 «{token_strings(load_run(CACHED_RUNS / n))[10].strip()}»"
        for n in ("cam-attention", "streaming_llm-attention")
    ]
    diverged = any("generated different text" in c.value for c in at.caption)
    assert diverged == (texts[0] != texts[1]) and diverged  # these two runs part before token 10
    sink = [json.loads(c.proto.spec) for c in at.get("plotly_chart")][1]
    assert any(
        t.get("name") == "sink" and t["x"] == [0, 1, 2, 3] for t in sink["data"]
    )  # StreamingLLM's sinks
    at.selectbox(key="pair_layer").set_value(0).run()
    assert all(
        ": layer 0, head 0" in json.loads(c.proto.spec)["layout"]["title"]["text"]
        for c in at.get("plotly_chart")
    )


def test_the_attention_axes_tick_at_powers_of_ten_only(cam):
    """The inspector's and the attention row's log axes label 10^-3, 10^-2, ... and not the 2s and 5s between
    them, which piled up on the Compare page's two inspectors."""
    from kvlens.figures.attention import attention_grid, attention_row_figure
    from kvlens.ui.inspector import token_row_figure

    fig = token_row_figure(inspect_token(cam, 10, 15, 4), "cam")
    assert (fig.layout.yaxis.type, fig.layout.yaxis.dtick, fig.layout.yaxis.exponentformat) == (
        "log",
        1,
        "power",
    )
    row = attention_row_figure(attention_grid(cam, 15, 4), 3)
    assert (row.layout.yaxis.type, row.layout.yaxis.dtick) == ("log", 1)
