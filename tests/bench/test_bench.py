"""Benchmarks on the tiny model with tiny settings: well-formed results, ratios from the same run, the needle
scorer."""

from __future__ import annotations

import csv
import json
import os

import pytest

from kvlens.cli import main
from kvlens.errors import KvlensError
from kvlens.experiments.bench import needle, ppl, speed
from kvlens.experiments.bench.common import PolicySpec, label, parse_policies
from kvlens.experiments.executors import Job, in_process
from kvlens.experiments.grid import Results, run_grid
from kvlens.experiments.sweep import plan_ppl
from kvlens.policies import make_policy
from kvlens.texts import bundled


@pytest.fixture(scope="module")
def texts():
    return bundled(2)


def _run(model, cells, texts, path) -> list[dict]:
    """The rows of `cells`, run in this process into the results file `path`."""
    job = Job("tiny", texts=tuple(texts.items()))
    return run_grid(Results(path, cells, {}), in_process(lambda: model, job), "test").ordered()


def test_policy_specs_parse_and_validate():
    specs = parse_policies("full; cam:span=8,base=h2o ;corm")
    assert [s.label for s in specs] == ["full", "cam:base=h2o,span=8", "corm"]
    assert specs[1].params == (("base", "h2o"), ("span", 8))
    assert specs[0].budget_free and specs[2].budget_free and not specs[1].budget_free
    assert [s.label for s in parse_policies("full,streaming_llm, cam:span=8,base=h2o,tova")] == [
        "full",
        "streaming_llm",
        "cam:base=h2o,span=8",
        "tova",
    ]  # ',' between names, as kvpress users write it
    with pytest.raises(
        KvlensError, match="Policy 'cam:base=h2o,span=8' is given twice; give each policy once"
    ):
        parse_policies("full;cam:span=8,base=h2o;cam:base=h2o,span=8")  # the same parameters, another order
    assert len(parse_policies("cam:span=8;cam:span=4")) == 2
    with pytest.raises(KvlensError, match="no parameter"):
        PolicySpec.parse("h2o:window=3")
    with pytest.raises(KvlensError, match="Unknown policy"):
        PolicySpec.parse("nope")


def test_ppl_bench_rows_summary_table_and_figure(tiny, texts, tmp_path):
    cells = plan_ppl(
        [("full", {}), ("streaming_llm", {}), ("corm", {})], [0.5, 16], texts, [64], tokens=8, model="tiny"
    )
    rows = _run(tiny, cells, texts, tmp_path / "bench_ppl.json")
    # full and budget-free corm once per text, streaming_llm once per budget per text
    assert [(r["text"], r["policy"], r["budget"]) for r in rows] == [
        (t, p, b)
        for t in texts
        for p, b in [("full", None), ("streaming_llm", 0.5), ("streaming_llm", 16), ("corm", None)]
    ]
    assert all(
        r["prefill"] == 64 and r["tokens"] == 8 and r["model"] == "tiny" and r["kvlens_version"] for r in rows
    )
    by = {(r["policy"], r["budget"], r["text"]): r for r in rows}
    name = list(texts)[0]
    assert by[("streaming_llm", 16, name)]["budget_slots"] == 16
    assert by[("streaming_llm", 0.5, name)]["budget_slots"] == 32
    assert by[("full", None, name)]["kept_final_mean"] == 64 + 8 - 1
    result = {
        "config": {"prefill": 64, "tokens": 8, "texts": list(texts)},
        "rows": rows,
        "summary": ppl.summarise(rows),
    }
    summary = {(s["policy"], s["budget"]): s for s in result["summary"]}
    assert len(summary) == 4 and summary[("full", "full")]["vs_full"] == pytest.approx(1.0)
    assert ("corm", "auto") in summary
    s = summary[("streaming_llm", 16)]
    vals = [by[("streaming_llm", 16, t)]["ppl"] for t in texts]
    assert s["ppl_mean"] == pytest.approx(sum(vals) / 2) and s["ppl_min"] == min(vals) and s["texts"] == 2
    table = ppl.markdown_table(result["summary"])
    assert table.splitlines()[0] == "| policy | 16 slots | 50% of prompt |"
    assert "(auto)" in table and len(table.splitlines()) == 2 + 3
    fig = ppl.figure(result)
    assert [t.name for t in fig.data] == ["full (full)", "streaming_llm", "corm (auto)"]


def test_bench_labels_name_the_changed_parameters(texts):
    cells = plan_ppl([("cam", {"base": "h2o"}), ("h2o", {})], [0.5], texts, [64], tokens=8, model="tiny")
    assert "base.recent_ratio" in cells[0]["params"]  # resolved, nested parameters included
    assert [label(c) for c in cells[:2]] == ["cam:base=h2o", "h2o"]


def test_bench_ppl_command_resumes_and_writes_summary_csv(tiny_dir, tmp_path, capsys):  # noqa: F811
    argv = [
        "bench",
        "ppl",
        "--policies",
        "full;h2o",
        "--budgets",
        "0.5,16",
        "--texts",
        "1",
        "--prefill",
        "64",
        "--tokens",
        "4",
        "--model",
        str(tiny_dir),
        "--out-dir",
        str(tmp_path),
        "--no-figure",
    ]
    assert main(argv) == 0
    data = json.loads((tmp_path / "bench_ppl.json").read_text())
    assert data["status"] == "done" and data["cells_total"] == 3 and len(data["summary"]) == 3
    assert data["config"]["texts"] == ["1946-Truman"] and data["environment"]["executor"] == "in-process"
    assert len(list(csv.DictReader((tmp_path / "bench_ppl.csv").open()))) == 3
    assert "| h2o |" in capsys.readouterr().out
    assert main(argv) == 0  # nothing left to run: the same rows, timings and all
    assert json.loads((tmp_path / "bench_ppl.json").read_text())["rows"] == data["rows"]


@pytest.mark.parametrize(
    "output, found",
    [
        ("The secret passphrase is 'blue-harbor-42'.", 1.0),
        ("blue harbor 42", 1.0),
        ("BLUE-HARBOR-42<|im_end|>", 1.0),
        ('The passphrase is "blue-har', 0.0),
        ("blue-harbor-24", 0.0),
        ("", 0.0),
    ],
)
def test_needle_scorer(output, found):
    assert needle.score(output, needle.ANSWER) == found


def test_needle_scorer_refuses_an_empty_answer():
    with pytest.raises(KvlensError):
        needle.score("anything", "--")


def test_haystack_places_the_needle_at_its_depth(tiny):
    filler = needle.sentences(" ".join(f"Sentence number {i} is short." for i in range(100)))
    assert filler[3] == "Sentence number 3 is short."
    tok = tiny.tokenizer
    for depth in (0.0, 0.5, 1.0):
        ids = needle.haystack(tiny, filler, 600, depth, chat=False)
        text = tok.decode(ids)
        assert len(ids) <= 600 and len(ids) > 500
        at = text.index(needle.NEEDLE) / text.index(needle.QUESTION)
        assert at == pytest.approx(depth, abs=0.1)
        assert text.endswith(needle.QUESTION)
    with pytest.raises(KvlensError, match="depth"):
        needle.haystack(tiny, filler, 600, 1.5, chat=False)
    with pytest.raises(KvlensError, match="no room"):
        needle.haystack(tiny, filler, 60, 0.5, chat=False)


def test_needle_bench_cells_and_summary(tiny, texts, tmp_path):
    haystack = {"haystack": list(texts.values())[0]}
    cells = needle.plan_needle(
        [("full", {}), ("h2o", {})],
        [400, 500],
        [0.0, 1.0],
        budget=0.5,
        filler_text=haystack["haystack"],
        model="tiny",
        max_new_tokens=3,
        chat=False,
    )
    rows = _run(tiny, cells, haystack, tmp_path / "bench_needle.json")
    assert len(rows) == 2 * 2 * 2
    assert all(r["score"] == needle.score(r["output"], needle.ANSWER) for r in rows)
    assert {r["budget_slots"] for r in rows if r["policy"] == "full"} == {None}
    assert all(r["budget_slots"] == round(r["prompt_tokens"] / 2) for r in rows if r["policy"] == "h2o")
    assert all(r["prompt_tokens"] <= r["length"] and r["needle"] == needle.NEEDLE for r in rows)
    summary = needle.summarise(rows)
    assert [s["policy"] for s in summary] == ["full", "h2o"] and set(summary[0]["by_length"]) == {
        "400",
        "500",
    }
    fig = needle.figure(
        {"config": {"lengths": [400, 500], "depths": [0.0, 1.0], "budget": 0.5}, "rows": rows}
    )
    assert len(fig.data) == 2 and len(fig.data[0].z) == 2 and len(fig.data[0].z[0]) == 2
    with pytest.raises(KvlensError, match="depth"):
        needle.plan_needle([("full", {})], [400], [1.5], budget=0.5, filler_text="x", model="tiny")


def test_speed_bench_rows_and_ratios_from_the_same_run(tiny, texts):
    ticks, streamed = [], []
    result = speed.bench_speed(
        tiny,
        parse_policies("full;streaming_llm;cam;corm"),
        [32, 64],
        text=texts["1946-Truman"],
        steps=4,
        budget=0.5,
        repeats=2,
        ratio_length=64,
        evict_lengths=[48],
        tick=lambda: ticks.append(1),
        on_row=lambda row: streamed.append(row["policy"]),
    )
    assert len(ticks) == 4 * 2 + 8 * 2 + 4 * 2 == speed.ticks(4, [32, 64], 2, [48])  # 48 tokens: 2 rotations
    rows = result["rows"]
    assert [(r["policy"], r["prompt_tokens"]) for r in rows[:4]] == [
        ("full", 32),
        ("streaming_llm", 32),
        ("cam", 32),
        ("corm", 32),
    ]
    fields = {
        "policy",
        "prompt_tokens",
        "steps",
        "prefill_ms",
        "prefill_cpu_ms",
        "ms_per_token",
        "cpu_ms_per_token",
        "kv_bytes_peak",
        "kv_bytes_prefill",
        "kv_slots_max",
        "kv_slots_final_mean",
        "replay_passes",
        "replay_ms",
        "peak_rss",
        "rss_growth",
    }
    assert all(set(r) == fields and r["ms_per_token"] > 0 and r["peak_rss"] > 0 for r in rows)
    by = {(r["policy"], r["prompt_tokens"]): r for r in rows}
    # tiny model: 3 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes per slot
    assert streamed == [r["policy"] for r in rows]  # each row handed out as soon as it was measured
    assert by[("full", 64)]["kv_bytes_peak"] == (64 + 3) * 3 * 2 * 16 * 2 * 4
    assert by[("streaming_llm", 64)]["kv_bytes_peak"] == (32 + 1) * 3 * 2 * 16 * 2 * 4  # + the step's token
    ratios, details = result["ratios"], result["ratio_details"]
    assert set(ratios) >= {
        "engine_vs_model_loop",
        "hf_generate_vs_engine",
        "cam_vs_streaming_llm",
        "record_full_vs_none",
        "kv_bytes_half_budget_vs_full",
    }
    for key in (
        "engine_vs_model_loop",
        "hf_generate_vs_engine",
        "cam_vs_streaming_llm",
        "record_full_vs_none",
    ):
        d = details[key]
        per_repeat = [a / b for a, b in zip(d["a_ms_per_token"], d["b_ms_per_token"], strict=True)]
        assert d["ratios"] == pytest.approx(per_repeat) and len(per_repeat) == 2
        assert ratios[key] == pytest.approx(sum(per_repeat) / 2)  # median of two
        assert set(result["targets"][key]) == {"target", "met"}
        assert (
            result["ratios_cpu"][key] == pytest.approx(sum(d["cpu_ratios"]) / 2) and len(d["cpu_ratios"]) == 2
        )
    assert details["engine_vs_model_loop"]["same_tokens"] and details["hf_generate_vs_engine"]["same_tokens"]
    assert ratios["kv_bytes_half_budget_vs_full"] == pytest.approx(33 / 64)
    assert result["targets"]["kv_bytes_half_budget_vs_full"]["met"]  # 33 of 64 slots allocated: budget + 1
    evict = details["evict_half_vs_full_at_48"]
    assert evict["groups"] == [["full", "streaming_llm", "h2o", "tova"]]  # no lockstep: one group
    ms, prefill_ms = evict["ms_per_token"][0], evict["prefill_ms"][0]
    per_policy = {
        name: sorted(a / b for a, b in zip(ms[name], ms["full"], strict=True))
        for name in ("streaming_llm", "h2o")
    }
    assert ratios["evict_half_vs_full_at_48"] == pytest.approx(max(sum(v) / 2 for v in per_policy.values()))
    prefill = {
        name: sum(a / b for a, b in zip(prefill_ms[name], prefill_ms["full"], strict=True)) / 2
        for name in ("h2o", "tova")
    }
    assert ratios["prefill_stats_vs_full"] == pytest.approx(max(prefill.values()))
    assert set(result["growth"]) == {"full", "streaming_llm", "cam", "corm"}
    json.dumps(result)
    assert len(speed.markdown_table(result).splitlines()) == 2 + len(rows)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "needle", "--lengths", "a,b"], "--lengths takes comma-separated integers; got 'a,b'."),
        (["bench", "needle", "--depths", "0,2"], "--depths takes values in [0, 1]; got 2.0."),
        (["bench", "needle", "--workers", "0"], "--workers must be at least 1"),
        (["bench", "ppl", "--policies", "h2o:window=3"], "no parameter 'window'"),
        (["bench", "ppl", "--budgets", "2.5"], "fractional budget"),
        (["bench", "speed", "--repeats", "0"], "--repeats at least 1"),
    ],
)
def test_bench_cli_refuses_bad_input_before_loading(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_lockstep_advances_every_side_one_step_in_turn():
    calls = []

    def side(name, ms):
        def steps():
            for i, value in enumerate(ms):
                calls.append((name, i))
                yield value
            return {"tokens": [name]}

        return steps

    res = speed.lockstep({"b": side("b", [100.0, 3.0, 5.0, 4.0]), "a": side("a", [200.0, 1.0, 2.0])})
    assert calls == [("b", 0), ("a", 0), ("b", 1), ("a", 1), ("b", 2), ("a", 2), ("b", 3)]
    assert list(res) == ["b", "a"]
    assert res["b"]["prefill_ms"] == 100.0 and res["b"]["ms_per_token"] == 4.0 and res["b"]["tokens"] == ["b"]
    assert res["a"]["prefill_ms"] == 200.0 and res["a"]["ms_per_token"] == 1.5


def test_every_policy_runs_in_the_evict_lockstep_and_the_worst_is_named(tiny, texts, monkeypatch):
    from kvlens.policies import policy_names

    every = [n for n in policy_names() if n != "full"]
    ticks, lengths, alive = [], [], []
    rotated = speed.rotated
    monkeypatch.setattr(speed, "rotated", lambda runs, *a: alive.append(list(runs)) or rotated(runs, *a))
    result = speed.bench_speed(
        tiny,
        parse_policies("full"),
        [32],
        text=texts["1946-Truman"],
        steps=3,
        budget=0.5,
        repeats=1,
        ratio_length=64,
        evict_lengths=[160],
        every=every,
        group=4,
        tick=lambda: ticks.append(1),
        on_length=lengths.append,
    )
    (part,) = lengths  # the length's ratios handed out when measured, as the result names them
    assert part["evict_length"] == part["prompt_tokens"] == 160
    assert part["ratios"] == {k: v for k, v in result["ratios"].items() if k.endswith("_at_160")}
    assert part["ratios_cpu"] == {k: v for k, v in result["ratios_cpu"].items() if k.endswith("_at_160")}
    at_160 = {k: v for k, v in result["ratio_details"].items() if k.endswith("_at_160")}
    assert part["ratio_details"] == {k: v for k, v in at_160.items() if not k.startswith("evict")}
    free = [n for n in every if make_policy(n).budget_free]
    floor_of = {n: f"floor:{n}" if n in free else "floor" for n in every}  # half the prompt, or what it keeps
    details = result["ratio_details"]["evict_half_vs_full_at_160"]
    groups = details["groups"]
    assert alive == groups  # one group's sides alive at a time: its rounds, then the next group's
    assert groups[0][:4] == ["full", "streaming_llm", "h2o", "tova"]  # the evict and statistics ratios' sides
    sums = {"h2o", "scissorhands", "cam", "d2o", "kvmerger", "weightedkv"}  # H2O's statistic: column sums
    for group in groups:  # its own full cache, at most 4 policies (KVzap beside KVzip), and their floors
        policies = [n for n in group if n in every]
        replays = [f"replay_floor:{n}" for n in policies if n == "kvzip"]  # its passes' forward alone
        first = [f"column_sums_floor:{n}" for n in policies if n in sums][:1]  # the column sums alone, once
        assert group == ["full", *policies, *dict.fromkeys(floor_of[n] for n in policies), *replays, *first]
        assert len(policies) <= 4 or policies[-2:] == ["kvzip", "kvzap"]
    assert sorted(n for group in groups for n in group if n in every) == sorted(every)  # each policy once
    sides = sum(len(group) for group in groups)
    assert len(ticks) == speed.ticks(1, [32], 1, [160], every, 4) == 1 + 8 + 3 * sides  # 3 rounds at least
    assert details["floor_tokens"]["floor"] == 80
    ms = {n: g for g in details["ms_per_token"] for n in g if n in every}  # each policy's group
    prefill_ms = {n: g for g in details["prefill_ms"] for n in g if n in every}
    floor = result["ratio_details"]["every_policy_vs_floor_at_160"]
    for name in every:
        mine, theirs = ms[name][name], ms[name][floor_of[name]]
        ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
        assert floor["per_policy"][name] == pytest.approx(sorted(ratios)[1])  # the median of 3 rounds
        assert floor["spread"][name] == pytest.approx([min(ratios), max(ratios)])
    assert result["ratios"]["every_policy_vs_floor_at_160"] == floor["per_policy"][floor["worst"]]
    replay = result["ratio_details"]["replay_vs_full_prefill_at_160"]
    assert set(replay["per_policy"]) == {"kvzip"}  # the one method whose algorithm is an extra forward
    assert result["ratios"]["replay_vs_full_prefill_at_160"] == replay["per_policy"]["kvzip"]
    forward = result["ratio_details"]["replay_floor_vs_full_prefill_at_160"]  # the rule's forward alone
    rounds = [a / b for a, b in zip(prefill_ms["kvzip"]["replay_floor:kvzip"], prefill_ms["kvzip"]["full"])]
    assert result["ratios"]["replay_floor_vs_full_prefill_at_160"] == forward["per_policy"]["kvzip"]
    assert forward["per_policy"]["kvzip"] == pytest.approx(sorted(rounds)[1])
    prefill_cpu = result["ratio_details"]["every_policy_prefill_vs_full_at_160"]["cpu"]
    alone = result["ratio_details"]["column_sums_floor_vs_full_prefill_at_160"]  # in each reader's group
    worst = max(sums, key=prefill_cpu.__getitem__)
    assert set(alone["per_policy"]) == sums and alone["worst"] == worst
    group = next(g for g in details["prefill_ms"] if worst in g)
    side = next(s for s in group if s.startswith("column_sums_floor:"))
    rounds = [a / b for a, b in zip(group[side], group["full"], strict=True)]
    assert result["ratios"]["column_sums_floor_vs_full_prefill_at_160"] == pytest.approx(sorted(rounds)[1])
    for kind, column in (("half", "ms_per_token"), ("prefill", "prefill_ms")):
        key = f"every_policy_{kind}_vs_full_at_160"
        named = result["ratio_details"][key]
        per = named["per_policy"]
        ranked = {k: v for k, v in per.items() if kind == "half" or k not in replay["per_policy"]}
        assert set(per) == set(every) and named["worst"] == max(ranked, key=ranked.get)
        assert result["ratios"][key] == per[named["worst"]]
        measured, name = {"ms_per_token": ms, "prefill_ms": prefill_ms}[column], named["worst"]
        assert per[name] == pytest.approx(
            sorted(a / b for a, b in zip(measured[name][name], measured[name]["full"], strict=True))[1]
        )  # the median of 3 rounds, against its own group's full cache
    assert per["kvzip"] == pytest.approx(replay["per_policy"]["kvzip"])
    learned = result["ratio_details"]["kvzap_vs_kvzip_prefill_at_160"]  # the surrogate over the replay
    rounds = sorted(
        a / b for a, b in zip(prefill_ms["kvzap"]["kvzap"], prefill_ms["kvzip"]["kvzip"], strict=True)
    )
    assert result["ratios"]["kvzap_vs_kvzip_prefill_at_160"] == learned["wall"] == pytest.approx(rounds[1])
    assert learned["prefill_ms"] == {p: prefill_ms[p][p] for p in ("kvzap", "kvzip")}
    sizes = result["ratio_details"]["every_policy_bytes_half_vs_full_at_160"]
    budgeted = {n for n in every if not make_policy(n).budget_free}
    assert set(sizes["per_policy"]) == budgeted and sizes["worst"] == max(
        sizes["per_policy"], key=sizes["per_policy"].get
    )
    # 80 slots kept + the step's token, over the full cache's 160 + the 2 tokens fed after the prompt
    assert sizes["per_policy"]["streaming_llm"] == pytest.approx(81 / 162)
    assert "every_policy_half_vs_full_at_160" not in result["targets"]  # targets at 1024, 4096 and 8160 only


def test_a_resumed_speed_run_keeps_what_the_run_cut_short_measured_and_measures_the_rest(
    tiny, texts, monkeypatch
):
    settings = {
        "text": texts["1946-Truman"],
        "steps": 3,
        "budget": 0.5,
        "repeats": 1,
        "ratio_length": 64,
        "evict_lengths": [96, 160],
        "every": ["tova"],
    }
    policies = parse_policies("full;h2o")

    class CutShort(Exception):
        pass

    rows, parts = [], []

    def cut(part):
        parts.append(part)
        raise CutShort

    with pytest.raises(CutShort):  # the run ends after its first evict length
        speed.bench_speed(tiny, policies, [32], on_row=rows.append, on_length=cut, **settings)
    rows, parts = json.loads(json.dumps(rows)), json.loads(json.dumps(parts))  # as the streams hold them
    measured = []
    evict_ratios = speed.evict_ratios
    monkeypatch.setattr(
        speed,
        "evict_ratios",
        lambda model, text, n, *a, **k: measured.append(n) or evict_ratios(model, text, n, *a, **k),
    )
    ticks, new_rows, new_parts = [], [], []
    result = speed.bench_speed(
        tiny,
        policies,
        [32],
        tick=lambda: ticks.append(1),
        on_row=new_rows.append,
        on_length=new_parts.append,
        done_rows=rows,
        done_lengths=parts,
        **settings,
    )
    assert measured == [160] and new_rows == []  # only what the first run did not finish
    assert [p["evict_length"] for p in new_parts] == [160]
    assert result["rows"] == rows
    assert result["ratio_details"]["evict_half_vs_full_at_96"] == parts[0]["lockstep"]
    assert {k: v for k, v in result["ratios"].items() if k.endswith("_at_96")} == parts[0]["ratios"]
    assert (
        result["ratios"]["prefill_stats_vs_full"] == parts[0]["lockstep"]["prefill_ratio"]
    )  # the first length's
    assert "every_policy_vs_floor_at_160" in result["ratios"]
    assert len(ticks) == speed.ticks(len(policies), [32], 1, [96, 160], ["tova"])  # the bar ends full


def test_bench_speed_resumes_only_a_run_of_the_same_settings(tmp_path, capsys):
    argv = ["bench", "speed", "--policies", "full", "--lengths", "32", "--out-dir", str(tmp_path), "--resume"]
    assert main(argv) == 2
    assert "holds no run of `kvlens bench speed` to resume" in capsys.readouterr().err
    stream = tmp_path / "bench_speed.rows.jsonl"
    (tmp_path / "bench_speed.lengths.jsonl").write_text(json.dumps({"settings": {"steps": 7}}) + "\n")
    stream.write_text(json.dumps({"settings": {"steps": 7}}) + "\n" + '{"policy": "full", "prompt_tok')
    assert main(argv) == 2  # a last line cut short is left out; the settings differ
    err = capsys.readouterr().err
    assert "holds a run with other settings than these" in err and '{"steps": 7}' in err
    stream.write_text('{"settings": {"steps": 7}}\nnot json\n{}\n')
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Line 2 of" in err and "is not valid JSON (Expecting value), so the run cannot be resumed." in err


def test_bench_speed_started_afresh_never_replaces_a_run_cut_short(tmp_path, capsys):
    """A run cut short is told by what its streams hold, not by the files' times (a clone writes them in any
    order): refused unless the streams hold exactly the rows and evict lengths of the finished result."""
    argv = ["bench", "speed", "--policies", "full", "--lengths", "32", "--out-dir", str(tmp_path)]
    argv += ["--model", str(tmp_path / "no-model")]  # refused before the model, or stopped at it
    stream, final = tmp_path / "bench_speed.rows.jsonl", tmp_path / "bench_speed.json"
    lengths = tmp_path / "bench_speed.lengths.jsonl"
    settings = json.dumps({"settings": {"steps": 7}}) + "\n"
    held = settings + json.dumps({"policy": "full", "ms": 1.5}) + "\n"
    finished = {"rows": [{"policy": "full", "ms": 1.5}], "config": {"evict_lengths": [64]}}
    lengths.write_text(settings + json.dumps({"evict_length": 64}) + "\n")
    cases = [  # (the result on disk, the rows stream): refused
        (None, held),  # no result of that run
        ({**finished, "rows": [{"policy": "full", "ms": 2.5}]}, held),  # an earlier run's result
        (finished, held + '{"policy": "full", "m\n{"policy": "h2o"}\n'),  # a line that is not JSON
        ({**finished, "config": {"evict_lengths": [64, 128]}}, held),  # a length it did not finish
    ]
    for result, rows in cases:
        final.unlink(missing_ok=True)
        if result is not None:
            final.write_text(json.dumps(result))
        stream.write_text(rows)
        os.utime(stream, (1, 1))  # older than the result: the times say nothing
        assert main(argv) == 2
        assert (
            "holds the measurements of a run cut short; go on with it with --resume"
            in capsys.readouterr().err
        )
        assert stream.read_text() == rows  # kept as it was
    final.write_text(json.dumps(finished))
    stream.write_text(held)
    os.utime(final, (1, 1))  # older than its streams, as a clone may write them
    assert main(argv) == 2  # the streams are the finished run's: started afresh, up to the model
    assert "Unknown model" in capsys.readouterr().err
    assert json.loads(stream.read_text())["settings"]["steps"] == 32  # a new run's stream
