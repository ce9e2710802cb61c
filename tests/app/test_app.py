"""The app under `streamlit.testing.v1.AppTest`: every page on the shipped `cached_runs/`.

Each test checks that the page runs without an exception, that its widgets exist, and that the
charts' plotly JSON holds the expected trace types and sizes (from the run's own shapes).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from kvlens import load_run
from kvlens.levels import RecordLevel
from tests.conftest import CACHED_RUNS, ROOT, doc_example

TIMEOUT = 120


@pytest.fixture
def app(tmp_path, monkeypatch):
    """An AppTest of app.py with the user's runs and results in empty temporary folders."""
    monkeypatch.setenv("KVLENS_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("KVLENS_RESULTS", str(tmp_path / "results"))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=TIMEOUT)
    at.run()
    return at


def open_page(at: AppTest, page: str, run: str | None = None) -> AppTest:
    """Switch to `pages/{page}.py` as a page link does (leaving the last page's query parameters behind, which
    AppTest's `switch_page` keeps), then pick `run` in the sidebar (which the page draws itself under
    AppTest)."""
    at.query_params.clear()
    at.switch_page(f"pages/{page}.py")
    at.run()
    if run is not None:
        at.sidebar.selectbox(key="app_run").set_value(str(CACHED_RUNS / run) if "/" not in run else run)
        at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def charts(at: AppTest) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def traces(spec: dict, kind: str) -> list[dict]:
    return [t for t in spec["data"] if t["type"] == kind]


def test_overview_lists_shipped_runs_and_defaults_to_a_measured_merging_run(app):
    assert not app.exception
    options = app.sidebar.selectbox(key="app_run").options
    shipped = sorted(d.name for d in CACHED_RUNS.iterdir() if (d / "run.json").is_file())
    assert len(options) == len(shipped) >= 5
    run = load_run(app.sidebar.selectbox(key="app_run").value)
    assert run.meta.policy.name in ("cam", "kvmerger") and run.has("perturbation/used")
    occupancy = charts(app)[0]
    kept = traces(occupancy, "scatter")[-1]
    assert len(kept["y"]) == run.tensor("steps/kv_slots").shape[0]
    assert max(kept["y"]) <= run.meta.budget.slots


@pytest.mark.parametrize("name", sorted(p.parent.name for p in CACHED_RUNS.glob("*/run.json")))
def test_overview_merges_and_attention_state_the_same_eviction_and_merge_counts(app, name):
    """One truth per run: the sentence of `kvlens.ui.views.decision_counts` on every page, counting a merge
    whose Bernoulli draw was 0 (it moved nothing) as an eviction."""
    d = load_run(CACHED_RUNS / name).decisions
    evicted = 0 if d is None else int(((d["action"] == "evict") | (d["draw"] == 0)).sum())
    merged = 0 if d is None else int(((d["action"] == "merge") & (d["draw"] != 0)).sum())
    want = f"{evicted:,} positions evicted"
    said = {}
    for page in ("overview", "merges", "attention"):
        at = open_page(app, page, name)
        assert not at.exception
        said[page] = [
            t.value for t in [*at.caption, *at.markdown] if "In all layers, KV heads and steps" in t.value
        ]
    assert (
        len(said["overview"]) == 1
        and want in said["overview"][0]
        and f"{merged:,} merged" in said["overview"][0]
    )
    assert said["merges"] in ([], said["overview"])  # a run without decisions: Merges offers other runs
    assert all(s.startswith(said["overview"][0]) for s in said["attention"])


def test_attention_map_marks_evictions_and_stays_small(app):
    at = open_page(app, "attention", "streaming_llm-attention")
    run = load_run(CACHED_RUNS / "streaming_llm-attention")
    assert at.selectbox(key="attn_layer").options == ["0", "15", "29"]
    assert len(at.selectbox(key="attn_head").options) == run.shape["heads"]
    heat = traces(charts(at)[0], "heatmap")
    assert len(heat) == 2  # status background + attention
    rows = run.tensor("attn/15").shape[0]
    prompt = len(run.meta.prompt_tokens)
    assert len(heat[1]["z"]) == rows and len(heat[1]["z"][0]) == prompt + rows - 1
    statuses = {c for row in heat[0]["customdata"] for c in row}
    assert {"evicted", "sink", "kept"} <= statuses
    sink = next(t for t in charts(at)[0]["data"] if t.get("name") == "sink")
    assert sink["x"] == [0, 1, 2, 3]
    at.slider(key="attn_step").set_value(5).run()
    assert not at.exception
    assert charts(at)[1]["layout"]["title"]["text"].endswith("query row 5")


def test_attention_asks_for_attention_recording_on_a_summary_run(app):
    at = open_page(app, "attention", "tova-summary")
    assert any(f"--record {RecordLevel.ATTENTION}" in w.value for w in at.warning)
    assert not at.get("plotly_chart")
    at.button(key="req_h2o-attention").click().run()  # the offered run opens
    assert not at.exception and at.get("plotly_chart")


def test_similarity_shows_three_lower_triangular_maps(app):
    at = open_page(app, "similarity", "full-states")
    n = len(load_run(CACHED_RUNS / "full-states").meta.prompt_tokens)
    assert at.multiselect(key="sim_kinds").value == ["query", "key", "value"]
    maps = [traces(c, "heatmap")[0] for c in charts(at)[:3]]
    for m in maps:
        assert len(m["z"]) == n and len(m["z"][0]) == n
        assert m["z"][0][1] is None and abs(m["z"][5][5] - 1) < 1e-3  # upper triangle blank, diagonal 1
    lowest = min(v for m in maps for row in m["z"] for v in row if v is not None)
    assert all(m["zmin"] == pytest.approx(lowest) and m["zmax"] == 1 for m in maps)  # one colour range
    adjacency = charts(at)[3]
    assert any(t.get("name") == "keys" and len(t["x"]) == 6 for t in adjacency["data"])


def test_spectra_has_one_line_per_recorded_layer_for_keys_and_values(app):
    at = open_page(app, "spectra", "full-states")
    at.slider(key="spec_components").set_value(32).run()
    lines = [t for t in traces(charts(at)[0], "scatter") if t.get("name", "").startswith("layer")]
    assert len(lines) == 2 * 6 and all(len(t["y"]) == 32 for t in lines)
    assert all(abs(t["y"][0] - 1) < 1e-6 for t in lines)  # normalised by the largest
    colours = {t["name"]: t["line"]["color"] for t in lines}
    assert len(set(colours.values())) == 6  # six layers: a discrete colour each, named in the legend
    assert [t["name"] for t in lines if t.get("showlegend") is not False] == list(colours)
    assert not any(t.get("marker", {}).get("showscale") for t in traces(charts(at)[0], "scatter"))


def test_spectra_draws_what_low_rank_storage_buys_at_the_chosen_error(app):
    at = open_page(app, "spectra", "full-states")
    at.select_slider(key="spec_error").set_value(0.03).run()
    rank = charts(at)[1]
    meta = rank["layout"]["meta"]
    assert meta["analysis"] == "rank_bytes" and meta["params"] == {"error": 0.03}
    lines = [t for t in traces(rank, "scatter") if t.get("name", "").startswith("layer")]
    assert len(lines) == 2 * 6 and all(
        max(t["x"]) < 1 for t in lines
    )  # only ranks cheaper than the full cache
    marks = next(t for t in rank["data"] if t.get("name", "").startswith("a layer's rank"))
    assert set(marks["y"]) == {0.03}


@pytest.mark.slow
def test_spectra_replays_a_shipped_run_at_each_rank_when_asked(app):
    at = open_page(app, "spectra", "full-states")
    assert len(charts(at)) == 2 and at.button(key="spec_replay")  # the replay waits for the button
    at.button(key="spec_replay").click().run()
    assert not at.exception, [e.value for e in at.exception]
    drawn = charts(at)[2]
    meta = drawn["layout"]["meta"]
    assert meta["analysis"] == "rank_perturbation" and meta["params"] == {
        "error": 0.01,
        "ranks": [4, 8, 16, 32, 64],
    }
    bars = traces(drawn, "bar")
    assert [b["name"] for b in bars] == ["choice of positions", "low-rank storage", "merging"]
    assert all(len(b["x"]) == 6 for b in bars) and bars[0]["x"][-1] == "dtype<br>100%"  # rank, bytes share
    assert not [b for b in at.button if b.key == "spec_replay"]  # asked once: drawn without the button
    storage = bars[1]["y"]  # a full-cache run: storage is all of the error, none at the head size
    assert storage[0] > 0.1 and abs(storage[4]) < 1e-4
    kl = next(t for t in traces(drawn, "scatter") if t["name"].startswith("KL"))
    assert kl["y"][0] > 0.01 and abs(kl["y"][4]) < 1e-5
    marks = [t for t in traces(drawn, "scatter") if t["name"] in ("keys' rank", "values' rank")]
    assert len(marks) == 2 and all(len(t["y"]) == 6 for t in marks)  # keys and values, each recorded layer


def test_merges_timeline_and_provenance_of_a_cam_run(app):
    at = open_page(app, "merges", "cam-attention")
    run = load_run(CACHED_RUNS / "cam-attention")
    timeline = charts(at)[0]
    names = {t["name"] for t in timeline["data"]}
    d = run.decisions
    layer0 = d[(d["layer"] == 0) & (d["kv_head"] == 0)]
    assert "merge" in names and names == set(layer0["action"])  # one trace per kind of decision the run made
    assert sum(len(t["x"]) for t in timeline["data"]) == len(layer0)
    assert at.dataframe  # provenance table
    assert any(t["type"] == "scatter" and t.get("name") == "weight" for t in charts(at)[1]["data"])


def test_merges_says_an_eviction_run_has_no_provenance(app):
    at = open_page(app, "merges", "h2o-attention")
    assert any("only evicts" in i.value for i in at.info)


def test_perturbation_of_a_measured_run(app):
    at = open_page(app, "perturbation", "cam-attention")
    run = load_run(CACHED_RUNS / "cam-attention")
    steps = run.tensor("perturbation/used").shape[0]
    spec = charts(at)[0]
    names = [t["name"] for t in spec["data"]]
    assert "this policy's cache" in names and "KL" in names
    used = next(t for t in spec["data"] if t["name"] == "this policy's cache")
    assert len(used["y"]) == steps
    assert any("No saved sweeps" in i.value for i in at.info)


def test_perturbation_asks_for_measure(app):
    at = open_page(app, "perturbation", "h2o-attention")
    assert any("--measure" in w.value for w in at.warning)


def test_benchmarks_reads_a_saved_sweep(app, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    rows = [
        {
            "policy": p,
            "budget": b,
            "budget_slots": b,
            "ppl": 10 + 100 / b,
            "bytes_share": b / 256,
            "ms_per_token": 60.0,
        }
        for p in ("h2o", "tova")
        for b in (32, 64, 128)
    ]
    (results / "sweep_broken.json").write_text("{not json")
    os.utime(results / "sweep_broken.json", (1, 1))  # newer or not, a file that reads is offered first
    (results / "sweep_demo.json").write_text(json.dumps({"text": "demo", "rows": rows}))
    at = open_page(app, "benchmarks")
    ppl = charts(at)[0]
    assert [t["name"] for t in ppl["data"]] == ["h2o", "tova"]
    assert ppl["data"][0]["x"] == [32, 64, 128]
    at.selectbox(key="bench_sweep_sweep_file").set_value(results / "sweep_broken.json").run()
    assert not at.exception and any("not valid JSON" in e.value for e in at.error)


def test_benchmarks_shows_an_unfinished_sweep_and_how_many_cells_are_done(app, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    rows = [
        {
            "policy": "h2o",
            "params": {},
            "budget": b,
            "budget_slots": b,
            "ppl": 10 + 100 / b,
            "bytes_share": 0.5,
            "ms_per_token": 60.0,
        }
        for b in (32, 64, 128)
    ]
    failed = [{"policy": "tova", "params": {}, "budget": 32, "error": "It broke."}]
    (results / "sweep_live.json").write_text(
        json.dumps(
            {
                "cells_total": 6,
                "cells_done": 3,
                "cells_failed": 1,
                "status": "running",
                "rows": rows,
                "failed": failed,
            }
        )
    )
    at = open_page(app, "benchmarks")
    progress = at.get("progress")[0].proto
    assert "3 of 6 cells done, 1 failed" in progress.text and progress.value == 50
    assert charts(at)[0]["data"][0]["x"] == [32, 64, 128]  # the rows so far


def test_no_runs_at_all_is_a_friendly_empty_state(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_CACHED_RUNS", str(tmp_path / "none"))
    monkeypatch.setenv("KVLENS_RUNS", str(tmp_path / "none2"))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=TIMEOUT).run()
    assert not at.exception
    assert any("No runs yet" in i.value for i in at.sidebar.info)
    for page in ("attention", "similarity", "merges"):
        at.switch_page(f"pages/{page}.py").run()
        assert not at.exception and any("No run is selected" in i.value for i in at.info)


def test_a_corrupt_run_is_one_sentence(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    shutil.copytree(CACHED_RUNS / "tova-summary", runs / "broken")
    (runs / "broken" / "tensors.safetensors").write_bytes(b"garbage")
    monkeypatch.setenv("KVLENS_RUNS", str(runs))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=TIMEOUT).run()
    at = open_page(at, "overview", str(runs / "broken"))
    assert any("truncated or corrupt" in e.value or "contradicts" in e.value for e in at.error)


def test_a_preset_sets_the_policy_widgets_to_its_settings(app):
    from kvlens.policies import make_policy, presets

    at = open_page(app, "run")
    at.selectbox(key="run_policy").set_value("cam").run()
    assert at.selectbox(key="run_cam_preset").options == ["(defaults)", *presets("cam")]
    at.selectbox(key="run_cam_preset").set_value("official-summarization").run()
    assert not at.exception, [e.value for e in at.exception]
    want = make_policy("cam", {"preset": "official-summarization"})
    assert at.selectbox(key="run_official-summarization_cam_score").value == want.score == "current"
    assert at.number_input(key="run_official-summarization_cam_span").value == want.span == 32
    assert at.selectbox(key="run_official-summarization_cam_denominator").value == want.denominator


def test_policy_widgets_are_generated_and_bad_budgets_explained(app):
    at = open_page(app, "run")
    from kvlens.policies import parameters

    at.selectbox(key="run_policy").set_value("cam").run()
    specs = {p.name: p.describe() for p in parameters("cam")}
    assert (
        at.selectbox(key="run_cam_base").options == specs["base"]["choices"]
        and "h2o" in specs["base"]["choices"]
    )
    assert at.number_input(key="run_cam_span").value == specs["span"]["default"]
    assert at.text_input(key="run_cam_clamp").value == ",".join(map(str, specs["clamp"]["default"]))
    at.text_input(key="run_cam_budget").set_value("1.5").run()
    assert any("(0, 1]" in e.value for e in at.error)
    assert at.button(key="run_go").disabled
    at.text_input(key="run_cam_budget").set_value("32").run()
    at.text_input(key="run_cam_clamp").set_value("a,b").run()
    assert any("comma-separated numbers" in e.value for e in at.error)


def test_compare_page_widgets(app):
    at = open_page(app, "compare")
    assert at.selectbox(key="cmp0_policy").value == "streaming_llm"
    assert at.selectbox(key="cmp1_policy").value == "h2o"
    at.number_input(key="cmp_count").set_value(4).run()
    assert not at.exception and at.selectbox(key="cmp3_policy").value == "cam"
    assert any("press **Compare**" in i.value for i in at.info)


@pytest.mark.slow
def test_run_page_generates_and_saves_a_run(app, tmp_path):
    at = open_page(app, "run")
    at.text_area(key="run_prompt").set_value("The Senate and the House of Representatives met in")
    at.selectbox(key="run_policy").set_value("streaming_llm").run()
    at.text_input(key="run_streaming_llm_budget").set_value("8")
    at.number_input(key="run_new").set_value(4)
    at.selectbox(key="run_record").set_value(RecordLevel.ATTENTION)
    at.text_input(key="run_layers").set_value("0,29")
    at.checkbox(key="run_measure").uncheck().run()
    at.button(key="run_go").click().run()
    assert not at.exception, [e.value for e in at.exception]
    saved = list((tmp_path / "runs").iterdir())
    assert len(saved) == 1
    run = load_run(saved[0])
    assert run.meta.policy.name == "streaming_llm" and len(run.meta.tokens) == 4
    assert sorted(int(n.split("/")[1]) for n in run.tensors if n.startswith("attn/")) == [0, 29]
    assert at.sidebar.selectbox(key="app_run").value == str(saved[0])  # the new run is selected
    at.switch_page("pages/attention.py").run()
    assert not at.exception and at.get("plotly_chart")


def test_benchmarks_draws_a_saved_needle_result_with_its_own_figure(app, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    cells = [
        {"policy": p, "length": n, "depth": d, "score": float(p == "full" or d < 0.5), "output": "x"}
        for p in ("full", "h2o")
        for n in (256, 512)
        for d in (0.0, 0.5, 1.0)
    ]
    config = {"policies": ["full", "h2o"], "lengths": [256, 512], "depths": [0.0, 0.5, 1.0], "budget": 64}
    (results / "bench_needle.json").write_text(json.dumps({"config": config, "cells": cells}))
    at = open_page(app, "benchmarks")
    needle = next(c for c in charts(at) if traces(c, "heatmap"))
    maps = traces(needle, "heatmap")
    assert [m["name"] for m in maps] == ["full", "h2o"]
    assert len(maps[1]["z"]) == 3 and len(maps[1]["z"][0]) == 2  # depths x lengths
    assert maps[1]["z"][2] == [0.0, 0.0]


def test_benchmarks_shows_a_task_leaderboard_filtered_by_task_and_policy(app, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    rows = [
        {
            "suite_task": t,
            "length": 1024,
            "index": i,
            "shared_prefill_ms": 1.0,
            "results": [
                {
                    "policy": p,
                    "ratio": r,
                    "score": float(p == "full" or (i + (t == "vt")) % 2),
                    "kept_share": 1 - r,
                    "prepare_ms": 1.0,
                    "answer_ms": 2.0,
                }
                for p, r in [("full", 0.0), ("h2o", 0.5), ("h2o", 0.875), ("tova", 0.5)]
            ],
        }
        for t in ("niah_single", "vt")
        for i in range(4)
    ]
    (results / "bench_tasks.json").write_text(
        json.dumps({"config": {}, "rows": rows, "cells_total": 10, "cells_done": 8, "status": "running"})
    )
    at = open_page(app, "benchmarks")
    assert not at.exception
    fig = next(c for c in charts(at) if c["layout"]["title"]["text"].startswith("Task accuracy"))
    assert {t["name"] for t in fig["data"]} == {"full", "h2o", "tova"}
    table = at.dataframe[-1].value
    assert list(table["policy"]) == ["full", "h2o", "tova", "h2o"]  # sorted by score: 1, 0.5, 0.5, 0.5
    at.selectbox(key="tasks_task").set_value("vt").run()
    at.multiselect(key="tasks_policies").set_value(["h2o"]).run()
    table = at.dataframe[-1].value
    assert list(table["policy"]) == ["h2o", "h2o"] and list(table["samples"]) == [4, 4]
    assert "8 of 10 cells done" in " ".join(p.proto.text for p in at.get("progress"))
    assert any(c.value.startswith("Protocol: question-agnostic") for c in at.caption)
    (results / "bench_tasks_query_aware.json").write_text(
        json.dumps({"config": {"query_aware": True}, "rows": rows, "cells_total": 8, "cells_done": 8})
    )
    at = open_page(app, "benchmarks")
    at.selectbox(key="bench_tasks_bench_file").set_value(results / "bench_tasks_query_aware.json").run()
    assert not at.exception
    assert any(c.value.startswith("Protocol: query-aware") for c in at.caption)


def test_benchmarks_draws_the_bytes_quality_frontier_with_perplexity_and_task_score(app, tmp_path):
    from kvlens.experiments.bench import frontier
    from kvlens.kvcache.quantize import Storage

    results = tmp_path / "results"
    results.mkdir()
    families = dict(
        evictors=[("h2o", {})],
        mergers=[("cam", {})],
        bits=[4],
        mix=("h2o", {}),
        mix_bits=[8],
        storage=Storage(bits=4),
    )
    rows = [
        {
            **c,
            "budget_slots": c["budget"],
            "ppl": 10.0 + (c["family"] != "reference"),
            "kv_bytes_peak": 1000 if c["family"] == "reference" else 250,
        }
        for c in frontier.plan_frontier(
            [0.25], {"a": "x"}, prefill=100, tokens=29, model="default", **families
        )
    ]
    for c in frontier.plan_frontier_tasks(
        [0.25], tasks=["niah_single"], lengths=[512], count=1, seed=0, source="s", model="default", **families
    ):
        share = 0.25 if c["storage"] else 1.0
        rows.append(
            {
                **c,
                "results": [
                    {
                        "policy": p,
                        "ratio": 0.0 if p == "full" else r,
                        "score": float(p == "full"),
                        "kv_bytes": 1000 * (share if p != "full" or c["storage"] else 1),
                    }
                    for p in c["policies"]
                    for r in (c["ratios"] if p != "full" else [0.0])
                ],
            }
        )
    config = {"prefill": 100, "tokens": 29, "texts": ["a"], "tasks": ["niah_single"]}
    (results / "bench_frontier.json").write_text(
        json.dumps({"config": config, "rows": rows, "summary": frontier.summarise(rows)})
    )
    at = open_page(app, "benchmarks")
    assert not at.exception
    fig = next(c for c in charts(at) if c["layout"]["title"]["text"].startswith("Quality against KV bytes"))
    assert {t["name"] for t in fig["data"]} == {  # one line per planned configuration, named with its family
        "h2o (eviction)",
        "cam (merging)",
        "all slots (quantization)",
        "h2o @ 8 bits (mix)",
        "all slots, low rank per head (low_rank)",
        "all slots, low rank per head, full-width new tokens (low_rank)",
        "all slots, xKV low rank, 4 layers (low_rank)",
        "all slots, low rank per head @ 4 bits (mix)",
        "h2o, low rank per head (mix)",
    }
    assert {t["xaxis"] for t in fig["data"]} == {"x", "x2"}  # perplexity and task score side by side
    table = at.dataframe[0].value
    assert set(table["measure"]) == {"perplexity", "task score"}
    assert set(table[table["measure"] == "task score"]["family"]) == {"reference", *frontier.FAMILIES}


def test_benchmarks_opens_on_the_leaderboard_then_the_frontier_then_speed(app, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name in (
        "bench_speed",
        "bench_frontier",
        "bench_needle",
        "bench_tasks",
    ):  # the last written is the newest, which changes nothing
        (results / f"{name}.json").write_text(
            json.dumps({"config": {}, "rows": [], "command": f"kvlens {name}"})
        )
    at = open_page(app, "benchmarks")
    assert not at.exception
    assert [h.value for h in at.subheader] == [
        "Task leaderboard",
        "Quality at equal bytes",
        "Speed and memory",
    ]
    assert at.selectbox(key="bench_tasks_bench_file").value == results / "bench_tasks.json"
    assert at.selectbox(key="bench_speed_bench_file").value == results / "bench_speed.json"
    assert at.selectbox(key="bench_bench_file").options == [
        "bench_needle.json (published)"
    ]  # the others, in their own tab
    assert "Made by `kvlens bench_speed`." in [c.value for c in at.caption]


def test_benchmarks_opens_on_the_published_files_whatever_is_newer(app, tmp_path):
    """Newer quick files beside the shipped ones are listed after them, by name; the speed file is drawn,
    the worst policy of each measure named; a task file without context lengths has no length picker."""
    results = tmp_path / "results"
    results.mkdir()
    for name in ("bench_tasks", "bench_tasks_query_aware", "bench_frontier", "bench_speed"):
        (results / f"{name}.json").symlink_to(ROOT / "results" / f"{name}.json")
    shipped = json.loads((ROOT / "results" / "bench_tasks.json").read_text(encoding="utf-8"))
    quick = [{**r, "length": None} for r in shipped["rows"][:2]]  # a held-out run: no context lengths
    (results / "bench_tasks_quick.json").write_text(json.dumps({"config": {}, "rows": quick}))
    (results / "bench_speed_quick.json").write_text(json.dumps({"config": {}, "rows": []}))
    (results / "bench_frontier_heldout.json").write_text(json.dumps({"config": {}, "rows": []}))
    at = open_page(app, "benchmarks")
    assert not at.exception
    assert at.selectbox(key="bench_tasks_bench_file").options == [
        "bench_tasks.json (published)",
        "bench_tasks_query_aware.json (published)",
        "bench_tasks_quick.json",
    ]
    for key, name in (("tasks", "bench_tasks"), ("frontier", "bench_frontier"), ("speed", "bench_speed")):
        assert at.selectbox(key=f"bench_{key}_bench_file").value == results / f"{name}.json"
    speed = next(c for c in charts(at) if c["layout"].get("meta", {}).get("benchmark") == "speed")
    published = json.loads((ROOT / "results" / "bench_speed.json").read_text(encoding="utf-8"))
    lengths = [
        k.rsplit("_", 1)[1] for k in published["ratio_details"] if k.startswith("every_policy_vs_floor")
    ]
    assert len(lengths) == 3 and {t["name"] for t in speed["data"]} == {f"{n} tokens" for n in lengths}
    worst = next(t.value for t in at.table if "worst policy" in t.value.columns)  # static: sentences wrap
    decode = worst[worst.index.str.startswith("decode")]  # the measure names each row
    # decode over the full cache and over its floor, at each length
    assert len(decode) == 2 * len(lengths) and set(decode["worst policy"]) <= set(
        published["config"]["policies"]
    )
    assert len(at.json) == sum(len(e.json) for e in at.expander)  # raw JSON only behind expanders
    at.selectbox(key="bench_tasks_bench_file").set_value(results / "bench_tasks_quick.json").run()
    assert not at.exception and not [s for s in at.selectbox if s.label == "Context length"]


def test_a_measured_sweep_shows_no_speed_and_says_why(app, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    rows = [
        {
            "policy": "cam",
            "budget": b,
            "budget_slots": b,
            "ppl": 10 + 100 / b,
            "bytes_share": b / 256,
            "ms_per_token": 7000.0,
            "perturbation_used": 0.1,
        }
        for b in (32, 64)
    ]
    (results / "sweep_measured.json").write_text(json.dumps({"measure": True, "rows": rows}))
    at = open_page(app, "benchmarks")
    titles = [c["layout"]["title"]["text"] for c in charts(at)]
    assert titles == [
        "Perplexity against the budget (sweep_measured.json)",
        "Share of the full cache's bytes kept (sweep_measured.json)",
    ]
    assert any("includes the measuring passes" in i.value for i in at.info)
    rows.append(
        {**rows[0], "budget": 128, "budget_slots": 128, "perturbation_used": None, "ms_per_token": 60.0}
    )
    (results / "sweep_measured.json").write_text(
        json.dumps({"rows": rows})
    )  # one unmeasured row: its speed only
    at = open_page(app, "benchmarks")
    speed = charts(at)[-1]
    assert speed["layout"]["title"]["text"].startswith("Speed") and speed["data"][0]["y"] == [60.0]


def test_paper_style_toggle_shows_the_export_style(app):
    app = open_page(app, "overview")
    assert app.get("plotly_chart")[0].proto.theme == "streamlit"
    app.sidebar.toggle(key="app_paper").set_value(True).run()
    assert not app.exception
    chart = app.get("plotly_chart")[0]
    assert chart.proto.theme == ""  # the figure's own (paper) template, as exported
    assert json.loads(chart.proto.spec)["layout"]["template"]["layout"]["font"]["family"].startswith(
        "Helvetica"
    )


def test_the_app_reads_no_model_path_typed_into_it(monkeypatch, tmp_path):
    from kvlens.errors import KvlensError
    from kvlens.ui.state import check_app_model

    monkeypatch.delenv("KVLENS_APP_MODEL", raising=False)
    assert check_app_model(" default ") == "default"
    assert check_app_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for typed in ("/etc", "../../secret", "~/.ssh", "x.gguf", str(tmp_path)):
        with pytest.raises(KvlensError, match="KVLENS_APP_MODEL"):
            check_app_model(typed)
    monkeypatch.setenv("KVLENS_APP_MODEL", str(tmp_path))
    assert check_app_model(str(tmp_path)) == str(tmp_path)


def test_the_app_draws_the_figure_a_notebook_gets_from_the_registry(app):
    at = open_page(app, "spectra", "full-states")
    at.slider(key="spec_components").set_value(16).run()
    drawn = charts(at)[0]
    notebook = json.loads(load_run(CACHED_RUNS / "full-states").figure("spectrum", components=16).to_json())
    assert drawn["data"] == notebook["data"] and drawn["layout"]["meta"] == notebook["layout"]["meta"]


def test_merges_offers_the_runs_of_merging_policies(app):
    at = open_page(app, "merges", "full-states")  # the full cache decides nothing
    assert any("made no decisions" in i.value for i in at.info)
    offered = {
        b.key.removeprefix("merge_offer_") for b in at.button if b.key and b.key.startswith("merge_offer_")
    }
    assert offered == {"cam-attention", "kvmerger-attention"}  # h2o and streaming_llm only evict


def test_page_job_protocol_errors_results_and_stop(monkeypatch):
    """Run and Compare share `PageJob`: a bad setting is one sentence, a result comes back, Stop is
    reported."""
    import kvlens.ui.jobs

    monkeypatch.setattr(kvlens.ui.jobs, "get_model", lambda spec, device: "model")

    def page():
        import streamlit as st

        from kvlens.errors import KvlensError
        from kvlens.ui.jobs import PageJob

        def make_work(model):
            if st.session_state.get("fail"):
                raise KvlensError("That setting is bad.")
            return lambda on_step, cancel: [on_step(i) for i in range(3)] and f"done with {model}"

        job = PageJob("t", "Stopped; nothing was saved.")
        job.begin()
        job.stop_button()
        if st.button("Go", key="t_go"):
            st.session_state.result = job.run(
                make_work, st.session_state.setdefault("events", []).extend, st.empty()
            )

    at = AppTest.from_function(page, default_timeout=TIMEOUT).run()
    at.button(key="t_go").click().run()
    assert at.session_state.result == "done with model" and at.session_state.events == [0, 1, 2]
    assert not at.session_state.t_running
    at.session_state.fail = True
    at.button(key="t_go").click().run()
    assert [e.value for e in at.error] == ["That setting is bad."] and at.session_state.result is None
    at.session_state.t_running = True  # as while a job runs: Stop's callback records it, the next run says so
    at.button(key="t_stop").click().run()
    assert [w.value for w in at.warning] == ["Stopped; nothing was saved."] and not at.session_state.t_running
    at.button(key="t_stop").click().run()  # Stop with nothing running says nothing
    assert not at.warning


def test_readme_page_example_joins_the_navigation_and_draws_its_analysis(tmp_path, monkeypatch):
    """The "Adding a page" file of docs/extending.md, saved beside a copy of app.py and its pages, is all it
    takes."""

    path, code = doc_example("Adding a page")
    assert path.startswith("pages/") and not (ROOT / path).exists()
    shutil.copytree(ROOT / "pages", tmp_path / "pages")
    shutil.copy(ROOT / "app.py", tmp_path / "app.py")
    (tmp_path / path).write_text(code)
    monkeypatch.setenv("KVLENS_RUNS", str(tmp_path / "runs"))
    at = AppTest.from_file(str(tmp_path / "app.py"), default_timeout=TIMEOUT).run()
    browse = [p["page_name"] for p in at._registered_pages.values()]  # AppTest's view of st.navigation
    assert browse.index("Variance") == browse.index("Run") - 1  # the end of Browse
    at = open_page(at, Path(path).stem, "full-states")
    drawn = charts(at)[0]
    want = json.loads(load_run(CACHED_RUNS / "full-states").figure("variance", layer=0, group=16).to_json())
    assert drawn["data"] == want["data"] and drawn["layout"]["meta"]["analysis"] == "variance"
    at = open_page(at, Path(path).stem, "tova-summary")
    assert any(f"--record {RecordLevel.STATES}" in w.value for w in at.warning) and not at.get("plotly_chart")


def test_analyses_page_offers_every_run_analysis_with_generated_widgets(app):
    at = open_page(app, "analyses", "full-states")
    from kvlens.analysis.registry import analyses

    shown = [o.split(" (")[0] for o in at.selectbox(key="an_kind").options]  # "name (paper figure)"
    assert shown == [n for n, c in analyses().items() if c.inputs != "model"] and "merging-ratio" not in shown
    at.selectbox(key="an_kind").set_value("gaussian").run()
    threshold = at.number_input(key="an_gaussian_threshold")
    assert threshold.value == 0.75 and "merging sets" in threshold.help
    assert at.number_input(key="an_gaussian_layer").value is None  # empty: the analysis' own default
    threshold.set_value(0.5).run()
    at.text_input(key="an_gaussian_sigma").set_value("2,4").run()
    want = load_run(CACHED_RUNS / "full-states").figure("gaussian", threshold=0.5, sigma=[2.0, 4.0])
    assert charts(at)[0]["data"] == json.loads(want.to_json())["data"]
    at.text_input(key="an_gaussian_sigma").set_value("2,x").run()
    assert any("comma-separated numbers" in e.value for e in at.error)
    at.selectbox(key="an_kind").set_value("perplexity").run()  # an analysis of several runs, on this one
    assert charts(at)[0]["data"][0]["name"] == "full" and not at.exception
    at.selectbox(key="an_kind").set_value("attention").run()  # full-states recorded no attention rows
    assert any(f"--record {RecordLevel.ATTENTION}" in w.value for w in at.warning)


def test_a_bad_budget_or_parameter_says_why_under_its_field_and_disables_compare(app):
    at = open_page(app, "compare")
    assert not at.button(key="cmp_go").disabled
    at.text_input(key="cmp1_h2o_budget").set_value("0").run()
    assert [e.value for e in at.error] == ["The budget must be a positive number of slots; got 0."]
    assert at.button(key="cmp_go").disabled
    at.text_input(key="cmp1_h2o_budget").set_value("0.5").run()
    assert not at.error and not at.button(key="cmp_go").disabled
    at.number_input(key="cmp0_streaming_llm_sink").set_value(-1).run()  # below the registry's bound
    assert [e.value for e in at.error] == ["sink of streaming_llm must be at least 0; got -1."]
    assert at.button(key="cmp_go").disabled
    at.number_input(key="cmp0_streaming_llm_sink").set_value(4).run()
    at.text_input(key="cmp0_streaming_llm_budget").set_value("3").run()  # fewer slots than the sinks it keeps
    assert [e.value for e in at.error] == ["Budget 3 is below the 5 slots that streaming_llm always keeps."]
    assert at.button(key="cmp_go").disabled


def test_every_policy_parameter_widget_has_the_registrys_help(app):
    from kvlens.policies import parameters, policy_names

    at = open_page(app, "run")
    for name in policy_names():
        at.selectbox(key="run_policy").set_value(name).run()
        for spec in parameters(name):
            if spec.kind == "policy":
                continue
            widget = next(
                w
                for kind in ("number_input", "text_input", "selectbox", "checkbox")
                for w in at.get(kind)
                if w.key == f"run_{name}_{spec.name}"
            )
            assert spec.help and widget.help == spec.help, (name, spec.name)


@pytest.mark.slow
def test_compare_page_shows_the_table_kvlens_compare_computes(app, smol):
    from kvlens.experiments.compare import Entry, compare, table

    prompt = (
        "The Senate and the House of Representatives met in the Capitol on Monday to debate the budget, and"
    )
    at = open_page(app, "compare")
    at.text_area(key="cmp_prompt").set_value(prompt)
    at.slider(key="cmp_tokens").set_value(4)
    at.button(key="cmp_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.exception] + [e.value for e in at.error]
    shown = at.dataframe[0].value
    want = table(compare(smol, prompt, [Entry("streaming_llm", {}, 0.5), Entry("h2o", {}, 0.5)], 4))
    assert list(shown["policy"]) == [r["policy"] for r in want] == ["full", "streaming_llm @0.5", "h2o @0.5"]
    for column, key in (
        ("ppl", "ppl"),
        ("KL", "kl"),
        ("peak KV bytes", "kv_bytes_peak"),
        ("perturbation", "perturbation"),
    ):
        assert list(shown[column]) == pytest.approx([r[key] for r in want], rel=1e-4, abs=1e-7), column
    assert [None if d != d else d for d in shown["diverges at"]] == [r["first_divergence"] for r in want]
    generated = list(shown["own tokens"])
    assert generated == [r["generated_steps"] for r in want] and all(1 <= g <= 4 for g in generated)
    drawn = charts(at)
    assert sum(len(c["data"]) == 3 * 3 for c in drawn) == 1  # three aligned panels, one line per run
    # the token inspector: the two policies' rows for token 0 of the full cache's text, side by side
    assert "Token inspector" in [h.value for h in at.subheader]
    assert (
        at.selectbox(key="cmp_pair_a").value == "streaming_llm @0.5"
        and at.selectbox(key="cmp_pair_b").value == "h2o @0.5"
    )
    assert len(drawn) >= 3, "the inspector draws one row per policy"
    report = next(b for b in at.get("download_button") if b.label == "Report")  # the measured passes' report
    assert report.proto.url or report.proto.deferred_file_id is not None


def test_kv_storage_picker_says_why_a_setting_is_bad_on_run_and_compare(app):
    from kvlens.errors import KvlensError
    from kvlens.kvcache.quantize import Storage

    with pytest.raises(KvlensError) as err:
        Storage(4, "kivi", 64, 32)
    at = open_page(app, "run")
    bits = at.selectbox(key="run_kv_bits")
    assert (
        bits.options
        == ["model dtype (no quantization)", "8 bits (quantized)", "4 bits (quantized)", "2 bits (quantized)"]
        and bits.value == 0
    )
    assert not [w for w in at.number_input if w.key == "run_kv_group"]  # the settings only once quantized
    bits.set_value(4).run()
    assert at.selectbox(key="run_kv_scheme").options == ["kivi", "token"]
    at.number_input(key="run_kv_residual").set_value(32).run()
    assert not at.exception and [e.value for e in at.error] == [str(err.value)]  # the engine's sentence
    assert at.button(key="run_go").disabled
    at.number_input(key="run_kv_residual").set_value(64).run()
    assert not at.error and not at.button(key="run_go").disabled
    at = open_page(at, "compare")  # the same widget under each policy
    at.selectbox(key="cmp1_kv_bits").set_value(2).run()
    at.number_input(key="cmp1_kv_residual").set_value(32).run()
    assert [e.value for e in at.error] == [str(err.value)] and at.button(key="cmp_go").disabled


def run_from_page(
    at: AppTest, policy: str, bits: int, measure: bool = False, chunk: int = 0, **storage
) -> AppTest:
    """Run `policy` @0.5 on the start of a bundled text from the Run page, 4 new tokens, with `bits` (and the
    `run_kv_*` settings in `storage`; 0: the model's dtype) and a prefill `chunk` (0: none); the saved run is
    then the sidebar's."""
    at = open_page(at, "run")
    at.radio(key="run_source").set_value("Bundled text").run()
    at.selectbox(key="run_policy").set_value(policy).run()
    at.number_input(key="run_new").set_value(4)
    at.selectbox(key="run_record").set_value(RecordLevel.SUMMARY)
    at.checkbox(key="run_measure").check() if measure else at.checkbox(key="run_measure").uncheck()
    at.selectbox(key="run_kv_bits").set_value(bits).run()
    for name, value in storage.items():
        (at.selectbox if name == "scheme" else at.number_input)(key=f"run_kv_{name}").set_value(value)
    at.number_input(key="run_chunk").set_value(chunk).run()
    at.button(key="run_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.exception] + [e.value for e in at.error]
    return at


@pytest.mark.slow
def test_run_page_stores_the_kv_cache_as_chosen(app, tmp_path):
    at = run_from_page(app, "h2o", 0)
    plain = load_run(at.sidebar.selectbox(key="app_run").value)
    at = run_from_page(at, "h2o", 4, scheme="token", group=32)
    packed = load_run(at.sidebar.selectbox(key="app_run").value)
    assert plain.meta.storage == {"bits": None}
    assert packed.meta.storage == {
        "bits": 4,
        "scheme": "token",
        "group": 32,
        "residual": 0,
        "scale_dtype": "float16",
    }
    assert "--kv-bits 4 --kv-scheme token --kv-group 32" in packed.meta.command
    assert packed.meta.prompt_tokens == plain.meta.prompt_tokens
    # float32 -> 4-bit codes + a float16 zero point and scale per 32 channels: 40 of 256 bytes a row
    assert packed.metrics["kv_bytes_peak"] < 0.2 * plain.metrics["kv_bytes_peak"]
    at = open_page(at, "overview", str(packed.path))
    assert any("KV 4-bit token, group 32" in md.value for md in at.markdown)  # the run's header line


@pytest.mark.slow
def test_run_page_prefills_in_chunks_with_the_summary_only(app):
    at = run_from_page(app, "h2o", 0, measure=True, chunk=64)
    assert at.selectbox(key="run_record").disabled and at.checkbox(key="run_measure").disabled
    run = load_run(at.sidebar.selectbox(key="app_run").value)
    assert run.meta.prefill_chunk == 64 and "--prefill-chunk 64" in run.meta.command
    assert run.meta.record.level == "summary" and "perturbation/kl" not in run.tensors
    budget = run.meta.budget.slots
    assert len(run.meta.prompt_tokens) > budget + 64  # the prompt never sat in the cache whole
    assert run.metrics["kv_bytes_prefill"] <= run.metrics["kv_bytes_prompt"] * (budget + 64) / len(
        run.meta.prompt_tokens
    )


@pytest.mark.slow
def test_perturbation_page_splits_the_error_of_a_quantized_measured_run(app):
    at = run_from_page(app, "cam", 2, measure=True)
    run = load_run(at.sidebar.selectbox(key="app_run").value)
    sources = run.metrics["perturbation_sources"]
    at = open_page(at, "perturbation", str(run.path))
    assert "Where the output error comes from" in [h.value for h in at.subheader]
    shown = {m.label: m.value for m in at.metric}
    for label, key in (
        ("Choice of positions", "selection"),
        ("Quantized storage", "storage"),
        ("Merging", "merging"),
    ):
        assert shown[label] == f"{sources[key]:+.4f}"
    assert float(shown["Cache used (pooled)"]) == pytest.approx(
        run.metrics["perturbation_used_pooled"], abs=1e-4
    )
    split = charts(at)[0]
    bars = traces(split, "bar")
    assert [b["y"][0] for b in bars] == pytest.approx([*sources.values(), sum(sources.values())])
    assert [b["base"][0] for b in bars[1:3]] == pytest.approx(
        [sources["selection"], sources["selection"] + sources["storage"]]
    )
    curves = {t["name"]: t["y"] for t in traces(split, "scatter")}
    assert set(curves) == {"same positions, full precision", "same positions, quantized", "cache used"}
    assert all(len(y) == run.shape["layers"] for y in curves.values())
    assert sources["storage"] > 0.1 * sources["selection"]  # 2 bits: quantization is a visible part
    at = open_page(at, "perturbation", "cam-attention")  # unquantized: the page as before
    assert "Where the output error comes from" not in [h.value for h in at.subheader]
    assert not traces(charts(at)[0], "bar")


@pytest.mark.slow
def test_compare_page_passes_each_policys_kv_storage(app):
    at = open_page(app, "compare")
    at.slider(key="cmp_tokens").set_value(4)
    at.selectbox(key="cmp0_policy").set_value("full").run()
    at.selectbox(key="cmp0_kv_bits").set_value(2).run()
    at.selectbox(key="cmp1_kv_bits").set_value(4).run()
    at.button(key="cmp_go").click().run()
    assert not at.exception and not at.error, [e.value for e in at.exception] + [e.value for e in at.error]
    results = at.session_state.cmp_result
    assert [r.entry.label for r in results] == ["full", "full · 2-bit", "h2o @0.5 · 4-bit"]
    assert [r.run.meta.storage["bits"] for r in results] == [
        None,
        2,
        4,
    ]  # the reference: the model's dtype
    shown = at.dataframe[0].value
    assert list(shown["policy"]) == ["full", "full · 2-bit", "h2o @0.5 · 4-bit"]
    peak = list(shown["peak KV bytes"])
    assert peak[1] < 0.3 * peak[0] and peak[2] < peak[1]
    assert results[0].run.metrics["perturbation_used"] < 1e-5 < results[1].run.metrics["perturbation_used"]


@pytest.fixture
def link(tmp_path, monkeypatch):
    """`link(page, **params)`: a new session opening `pages/{page}.py` by a link with the query parameters
    `params` (`?run=h2o-attention&layer=15`), the user's runs and results in empty temporary folders."""
    monkeypatch.setenv("KVLENS_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("KVLENS_RESULTS", str(tmp_path / "results"))

    def open_link(page: str, **params) -> AppTest:
        at = AppTest.from_file(str(ROOT / "pages" / f"{page}.py"), default_timeout=TIMEOUT)
        at.query_params.update(params)
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        return at

    return open_link


def test_a_link_sets_the_attention_pages_layer_head_and_row_and_a_change_goes_back_into_it(link):
    at = link("attention", run="cam-attention", layer="29", head="4", step="3")
    assert not at.warning, [w.value for w in at.warning]
    assert (
        at.selectbox(key="attn_layer").value,
        at.selectbox(key="attn_head").value,
        at.slider(key="attn_step").value,
    ) == (29, 4, 3)
    assert charts(at)[0]["layout"]["title"]["text"].startswith("Attention of layer 29, head 4 ")
    assert charts(at)[1]["layout"]["title"]["text"].endswith("query row 3")
    at.selectbox(key="attn_head").set_value(2).run()
    at.slider(key="attn_step").set_value(7).run()
    assert (at.query_params["layer"], at.query_params["head"], at.query_params["step"]) == ("29", "2", "7")


def test_similarity_keeps_its_layer_kv_head_and_token_in_the_link(link):
    at = link("similarity", run="cam-attention", layer="29", head="2", token="40")
    assert not at.warning, [w.value for w in at.warning]
    assert (
        at.selectbox(key="sim_layer").value,
        at.selectbox(key="sim_head").value,
        at.slider(key="sim_token").value,
    ) == (29, 2, 40)
    assert (
        charts(at)[0]["layout"]["title"]["text"] == "layer 29, query head 6"
    )  # KV head 2's first query head
    at.selectbox(key="sim_layer").set_value(0).run()
    assert (at.query_params["layer"], at.query_params["head"], at.query_params["token"]) == ("0", "2", "40")


def test_merges_keeps_its_layer_and_kv_head_in_the_link(link):
    at = link("merges", run="cam-attention", layer="29", head="1")
    assert not at.warning, [w.value for w in at.warning]
    assert (at.selectbox(key="merge_layer").value, at.selectbox(key="merge_head").value) == (29, 1)
    at.selectbox(key="merge_head").set_value(2).run()
    assert (at.query_params["layer"], at.query_params["head"]) == ("29", "2")


def test_a_link_opens_the_analyses_page_on_its_analysis_and_parameters_which_changes_write_back(link):
    at = link("analyses", run="h2o-attention", analysis="embedding", layer="15", head="0")
    assert not at.warning, [w.value for w in at.warning]
    assert at.sidebar.selectbox(key="app_run").value == str(CACHED_RUNS / "h2o-attention")
    assert at.selectbox(key="an_kind").value == "embedding"  # not the first analysis, the default
    assert (
        at.number_input(key="an_embedding_layer").value,
        at.number_input(key="an_embedding_head").value,
    ) == (15, 0)
    want = load_run(CACHED_RUNS / "h2o-attention").figure("embedding", layer=15, head=0)
    assert charts(at)[0]["data"] == json.loads(want.to_json())["data"]
    at.selectbox(key="an_embedding_method").set_value("tsne").run()
    at.number_input(key="an_embedding_head").set_value(2).run()
    assert not at.exception and charts(at)[0]["layout"]["meta"]["params"]["method"] == "tsne"
    assert dict(at.query_params) == {
        "run": "h2o-attention",
        "analysis": "embedding",
        "layer": "15",
        "head": "2",
        "method": "tsne",
    }  # the empty query_head and step fields: not in it
    # another analysis: the URL loses embedding's parameters, and gaussian's own layer and head take none of
    # them
    at.selectbox(key="an_kind").set_value("gaussian").run()
    assert not at.exception and not at.warning
    assert (
        at.number_input(key="an_gaussian_layer").value is None
        and at.number_input(key="an_gaussian_head").value == 0
    )
    assert dict(at.query_params) == {
        "run": "h2o-attention",
        "analysis": "gaussian",
        "head": "0",
        "threshold": "0.75",
        "rule": "mean_distance,eq7",
        "sigma": "",
    }
    at.text_input(key="an_gaussian_sigma").set_value("2,4").run()
    assert at.query_params["sigma"] == "2,4"
    at.selectbox(key="an_kind").set_value("spectrum").run()
    assert dict(at.query_params) == {"run": "h2o-attention", "analysis": "spectrum", "components": "64"}


def test_a_bad_analysis_parameter_in_a_link_is_ignored_with_one_sentence(link):
    at = link("analyses", run="h2o-attention", analysis="embedding", layer="x", head="-1", method="umap")
    assert [w.value for w in at.warning] == [
        "The link's layer was ignored: layer of embedding must be an integer; got 'x'.",
        "The link's head was ignored: head of embedding must be at least 0; got -1.",
        "The link's method 'umap' is not one of pca, tsne; it was ignored.",
    ]
    assert (
        at.number_input(key="an_embedding_layer").value,
        at.number_input(key="an_embedding_head").value,
        at.selectbox(key="an_embedding_method").value,
    ) == (None, 0, "pca")
    assert charts(at) and dict(at.query_params) == {
        "run": "h2o-attention",
        "analysis": "embedding",
        "head": "0",
        "method": "pca",
    }
    at = link("analyses", run="h2o-attention", analysis="embeddings")
    assert len(at.warning) == 1 and at.warning[0].value.startswith(
        "The link's analysis 'embeddings' is not one of "
    )
    assert at.selectbox(key="an_kind").value == at.selectbox(key="an_kind").options[0].split(" (")[0]


def test_a_link_sets_the_merges_similarity_threshold_and_a_bad_one_is_one_sentence(link):
    at = link("merges", run="cam-attention", threshold="0.6")
    assert not at.warning and at.slider(key="merge_thr").value == pytest.approx(0.6)
    gaussian = next(c for c in charts(at) if c["layout"]["meta"].get("analysis") == "gaussian")
    assert gaussian["layout"]["meta"]["params"]["threshold"] == pytest.approx(0.6)
    at.slider(key="merge_thr").set_value(0.85).run()
    assert at.query_params["threshold"] == "0.85"
    at = link("merges", run="cam-attention", threshold="0.62")
    assert [w.value for w in at.warning] == [
        "The link's similarity threshold '0.62' is not one of 0.3, 0.35, 0.4, "
        "0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, …; it was ignored."
    ]
    assert at.slider(key="merge_thr").value == 0.75 and at.query_params["threshold"] == "0.75"


def test_the_runs_filter_and_policies_and_the_similarity_states_are_in_the_link(link):
    at = link("runs", filter="attention", policies="h2o,cam")
    assert not at.warning and at.text_input(key="runs_filter").value == "attention"
    assert at.multiselect(key="runs_policies").value == ["h2o", "cam"]
    assert set(at.dataframe[0].value["name"]) == {"h2o-attention", "cam-attention"}
    at.multiselect(key="runs_policies").set_value(["tova"]).run()
    at.text_input(key="runs_filter").set_value("").run()
    assert (at.query_params["policies"], at.query_params["filter"]) == ("tova", "")
    at = link("similarity", run="full-states", states="key,value")
    assert not at.warning and at.multiselect(key="sim_kinds").value == ["key", "value"]
    assert [c["layout"]["title"]["text"] for c in charts(at)[:2]] == ["layer 17, KV head 0"] * 2
    at.multiselect(key="sim_kinds").set_value([]).run()
    assert at.query_params["states"] == ""  # none picked, which the link keeps
    at = link("similarity", run="full-states", states="key,keys")
    assert [w.value for w in at.warning] == [
        "The link's choice of states was ignored: states must be comma-separated "
        "values, each one of query, key, value; got 'keys'."
    ]
    assert at.multiselect(key="sim_kinds").value == ["query", "key", "value"]


def test_the_perturbation_pages_saved_sweep_is_in_the_link(link, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    rows = [
        {"policy": "h2o", "budget": b, "budget_slots": b, "perturbation_used": 0.1, "perturbation_evict": 0.2}
        for b in (32, 64)
    ]
    for name in ("sweep_old.json", "sweep_new.json"):
        (results / name).write_text(json.dumps({"rows": rows}))
    os.utime(results / "sweep_old.json", (1, 1))  # by name, sweep_new is shown first
    at = link("perturbation", run="cam-attention", sweep="sweep_old.json")
    assert not at.warning and at.selectbox(key="pert_sweep_file").value == results / "sweep_old.json"
    assert "sweep_old.json" in charts(at)[-1]["layout"]["title"]["text"]
    at.selectbox(key="pert_sweep_file").set_value(results / "sweep_new.json").run()
    assert at.query_params["sweep"] == "sweep_new.json"


def test_browse_pages_and_the_run_page_offer_the_report_built_only_when_clicked(app, monkeypatch):
    """Beside the share link (the Run page: beside its last run's inspector), a Report download; rendering a
    page never builds the report (Streamlit calls the button's data when it is clicked)."""
    built = []
    monkeypatch.setattr("kvlens.ui.page.report_html", lambda runs: built.append(runs) or "")
    for page in ("overview", "attention", "perturbation"):
        at = open_page(
            app, page, "h2o-attention"
        )  # Perturbation stops on an unmeasured run: after the button
        assert [b.label for b in at.get("download_button") if b.label == "Report"] == ["Report"], page
    at = open_page(app, "run")
    assert "Report" not in [b.label for b in at.get("download_button")]  # no run saved yet
    at.session_state["run_last"] = str(CACHED_RUNS / "cam-attention")
    at.run()
    assert not at.exception and "Report" in [b.label for b in at.get("download_button")]
    assert not built


@pytest.mark.parametrize(
    "page, prefix, hint",
    [("compare", "cmp", "Pick the policies and press"), ("run", "run", "Set up a run on the left")],
)
def test_no_empty_state_hint_or_live_card_stays_after_a_failed_or_stopped_job(
    app, monkeypatch, page, prefix, hint
):
    """Run and Compare show their empty-state hint until something is tried; after a failure only the reason
    stays (no hint, no progress of the failed job), and after Stop only the warning."""
    import kvlens.ui.jobs
    from kvlens.errors import KvlensError

    def refuse(spec, device):
        raise KvlensError("The model could not be loaded.")

    monkeypatch.setattr(kvlens.ui.jobs, "get_model", refuse)
    at = open_page(app, page)
    assert any(hint in i.value for i in at.info)  # nothing tried yet
    at.button(key=f"{prefix}_go").click().run()
    assert not at.exception and [e.value for e in at.error] == ["The model could not be loaded."]
    assert not any(hint in i.value for i in at.info) and not at.get("progress")
    at.session_state[f"{prefix}_running"] = True  # as while a job runs: Stop's callback records it
    at.button(key=f"{prefix}_stop").click().run()
    assert [w.value.split(".")[0] for w in at.warning] == ["Stopped"]
    assert not any(hint in i.value for i in at.info)
    at.button(key=f"{prefix}_stop").click().run()  # nothing stopped: the hint again
    assert any(hint in i.value for i in at.info)


def test_a_budget_free_runs_header_names_the_compression_ratio_its_rule_reached():
    from kvlens.runs.meta import Budget, ModelInfo, PolicyInfo, RunMeta
    from kvlens.runs.run import Run
    from kvlens.ui.views import _budget

    def made(budget: Budget, metrics: dict) -> Run:
        model, policy = ModelInfo(spec="tiny", shape={}), PolicyInfo(name="h2o")
        meta = RunMeta(
            model=model, policy=policy, prompt_tokens=[], tokens=[], budget=budget, metrics=metrics
        )
        return Run(meta=meta)

    free = made(Budget(slots=None), {"compression_ratio_final": 0.4861})
    budgeted = made(Budget(slots=64, requested=0.5), {})
    assert _budget(free) == "no budget: compression ratio 0.486 reached"
    assert _budget(budgeted) == "budget 64 slots (0.5 of the prompt)"
