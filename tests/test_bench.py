"""Benchmarks on the tiny model with tiny settings: well-formed results, ratios from the same run, the needle scorer."""
from __future__ import annotations

import csv
import json

import pytest

from kvlens.bench import needle, ppl, speed
from kvlens.bench.common import PolicySpec, parse_policies, save_results
from kvlens.cli import main
from kvlens.errors import KvlensError

from tests.conftest import TEXTS


@pytest.fixture(scope="module")
def texts():
    return [(p.stem, p.read_text()) for p in sorted(TEXTS.glob("*.txt"))[:2]]


def test_policy_specs_parse_and_validate():
    specs = parse_policies("full; cam:span=8,base=h2o ;corm")
    assert [s.label for s in specs] == ["full", "cam:base=h2o,span=8", "corm"]
    assert specs[1].params == (("base", "h2o"), ("span", 8))
    assert specs[0].budget_free and specs[2].budget_free and not specs[1].budget_free
    with pytest.raises(KvlensError, match="no parameter"):
        PolicySpec.parse("h2o:window=3")
    with pytest.raises(KvlensError, match="Unknown policy"):
        PolicySpec.parse("nope")


def test_ppl_bench_rows_summary_table_and_files(tiny, texts, tmp_path):
    policies = parse_policies("full;streaming_llm;corm")
    result = ppl.bench_ppl(tiny, policies, [0.5, 16], texts, prefill=64, tokens=8)
    rows = result["rows"]
    # full and budget-free corm once per text, streaming_llm once per budget per text
    assert [(r["policy"], r["budget"]) for r in rows[::2]] == [
        ("full", "full"), ("streaming_llm", 0.5), ("streaming_llm", 16), ("corm", "auto")]
    assert {r["text"] for r in rows} == {t[0] for t in texts}
    fields = {"policy", "budget", "budget_slots", "text", "ppl", "nll", "kv_slots_final_mean", "kv_bytes_peak",
              "ms_per_token"}
    assert all(set(r) == fields for r in rows)
    by = {(r["policy"], r["budget"], r["text"]): r for r in rows}
    name = texts[0][0]
    assert by[("streaming_llm", 16, name)]["budget_slots"] == 16
    assert by[("streaming_llm", 0.5, name)]["budget_slots"] == 32
    assert by[("full", "full", name)]["kv_slots_final_mean"] == 64 + 8 - 1
    summary = {(s["policy"], s["budget"]): s for s in result["summary"]}
    assert len(summary) == 4 and summary[("full", "full")]["vs_full"] == pytest.approx(1.0)
    s = summary[("streaming_llm", 16)]
    vals = [by[("streaming_llm", 16, t[0])]["ppl"] for t in texts]
    assert s["ppl_mean"] == pytest.approx(sum(vals) / 2) and s["ppl_min"] == min(vals) and s["texts"] == 2
    table = ppl.markdown_table(result["summary"])
    assert table.splitlines()[0] == "| policy | 16 slots | 50% of prompt |"
    assert "(auto)" in table and len(table.splitlines()) == 2 + 3
    fig = ppl.figure(result)
    assert [t.name for t in fig.data] == ["full (full)", "streaming_llm", "corm (auto)"]
    paths = save_results(result, rows, None, tmp_path, "bench_ppl")
    assert json.loads(paths[0].read_text())["summary"] == json.loads(json.dumps(result["summary"]))
    assert len(list(csv.DictReader(paths[1].open()))) == len(rows)


@pytest.mark.parametrize("output, found", [
    ("The secret passphrase is 'blue-harbor-42'.", 1.0),
    ("blue harbor 42", 1.0),
    ("BLUE-HARBOR-42<|im_end|>", 1.0),
    ('The passphrase is "blue-har', 0.0),
    ("blue-harbor-24", 0.0),
    ("", 0.0),
])
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


def test_needle_bench_cells_and_summary(tiny, texts):
    result = needle.bench_needle(tiny, parse_policies("full;h2o"), [400, 500], [0.0, 1.0], budget=0.5,
                                 filler_text=texts[0][1], max_new_tokens=3, chat=False)
    cells = result["cells"]
    assert len(cells) == 2 * 2 * 2
    assert all(set(c) == {"policy", "length", "prompt_tokens", "depth", "budget_slots", "score", "output"}
               for c in cells)
    assert all(c["score"] == needle.score(c["output"], needle.ANSWER) for c in cells)
    assert {c["budget_slots"] for c in cells if c["policy"] == "full"} == {None}
    assert all(c["budget_slots"] == round(c["prompt_tokens"] / 2) for c in cells if c["policy"] == "h2o")
    assert [s["policy"] for s in result["summary"]] == ["full", "h2o"]
    assert set(result["summary"][0]["by_length"]) == {"400", "500"}
    fig = needle.figure(result)
    assert len(fig.data) == 2 and len(fig.data[0].z) == 2 and len(fig.data[0].z[0]) == 2


def test_speed_bench_rows_and_ratios_from_the_same_run(tiny, texts):
    ticks = []
    result = speed.bench_speed(tiny, parse_policies("full;streaming_llm;cam;corm"), [32, 64], text=texts[0][1],
                               steps=4, budget=0.5, repeats=2, ratio_length=64, tick=lambda: ticks.append(1))
    assert len(ticks) == 4 * 2 + 6 * 2
    rows = result["rows"]
    assert [(r["policy"], r["prompt_tokens"]) for r in rows[:4]] == [
        ("full", 32), ("streaming_llm", 32), ("cam", 32), ("corm", 32)]
    fields = {"policy", "prompt_tokens", "steps", "prefill_ms", "ms_per_token", "cpu_ms_per_token", "kv_bytes_peak",
              "kv_bytes_prefill",
              "kv_slots_max", "peak_rss", "rss_growth"}
    assert all(set(r) == fields and r["ms_per_token"] > 0 and r["peak_rss"] > 0 for r in rows)
    by = {(r["policy"], r["prompt_tokens"]): r for r in rows}
    # tiny model: 3 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes per slot
    assert by[("full", 64)]["kv_bytes_peak"] == (64 + 3) * 3 * 2 * 16 * 2 * 4
    assert by[("streaming_llm", 64)]["kv_bytes_peak"] == 32 * 3 * 2 * 16 * 2 * 4
    ratios, details = result["ratios"], result["ratio_details"]
    assert set(ratios) >= {"engine_vs_model_loop", "cam_vs_streaming_llm", "record_full_vs_none",
                           "kv_bytes_half_budget_vs_full"}
    for key in ("engine_vs_model_loop", "cam_vs_streaming_llm", "record_full_vs_none"):
        d = details[key]
        per_repeat = [a / b for a, b in zip(d["a_ms_per_token"], d["b_ms_per_token"])]
        assert d["ratios"] == pytest.approx(per_repeat) and len(per_repeat) == 2
        assert ratios[key] == pytest.approx(sum(per_repeat) / 2)  # median of two
        assert set(result["targets"][key]) == {"target", "met"}
        assert result["ratios_cpu"][key] == pytest.approx(sum(d["cpu_ratios"]) / 2) and len(d["cpu_ratios"]) == 2
    assert details["engine_vs_model_loop"]["same_tokens"]
    assert ratios["kv_bytes_half_budget_vs_full"] == pytest.approx(0.5)
    assert result["targets"]["kv_bytes_half_budget_vs_full"]["met"]
    assert set(result["growth"]) == {"full", "streaming_llm", "cam", "corm"}
    json.dumps(result)
    assert len(speed.markdown_table(result).splitlines()) == 2 + len(rows)


@pytest.mark.parametrize("argv, message", [
    (["bench", "needle", "--lengths", "a,b"], "--lengths takes comma-separated numbers"),
    (["bench", "ppl", "--policies", "h2o:window=3"], "no parameter 'window'"),
    (["bench", "ppl", "--budgets", "2.5"], "fractional budget"),
    (["bench", "speed", "--repeats", "0"], "--repeats at least 1"),
])
def test_bench_cli_refuses_bad_input_before_loading(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
