"""kvpress's benchmark files read as they are (`tests/data/kvpress/`: RULER rows as JSON lines, LongBench rows
as parquet), grouped by context, and scored with kvpress's metric for each task."""

from __future__ import annotations

import json

import pytest

from kvlens.cli import main
from kvlens.errors import KvlensError
from kvlens.experiments.bench import kvpress_format, kvpress_metrics, ruler
from tests.conftest import ROOT

DATA = ROOT / "tests" / "data" / "kvpress"


def test_rows_of_one_context_become_one_sample_of_several_questions():
    ruler_samples = kvpress_format.samples(kvpress_format.read_rows(DATA / "ruler.jsonl"))
    multi, qa = ruler_samples
    assert (multi.task, len(multi.questions), multi.answers) == (
        "niah_multiquery",
        2,
        (("3017812",), ("5521904",)),
    )
    assert multi.answer_prefix.startswith(" The special magic number for gentle-dolphin")
    assert qa.kvpress["dataset"] == "ruler" and qa.answers == (("Ostrava Nova", "Ostrava"),)
    longbench = kvpress_format.samples(kvpress_format.read_rows(DATA / "longbench.parquet"))
    assert [s.task for s in longbench] == ["qasper", "trec", "passage_count"]  # one context, three tasks
    assert longbench[1].kvpress["extra"][0]["all_classes"] == ["Date", "Number", "Person", "Location"]
    text = kvpress_format.to_jsonl(DATA / "longbench.parquet")
    assert ruler.parse_lines(text) == longbench  # kvlens's samples text reads back the same samples
    assert kvpress_format.is_kvpress(DATA / "ruler.jsonl") and kvpress_format.is_kvpress(
        DATA / "longbench.parquet"
    )
    assert not kvpress_format.is_kvpress(ROOT / "tests" / "data" / "kvpress_task_samples.jsonl")


def _sample(dataset, task, answers, extra=None):
    return ruler.Sample(
        task,
        "c",
        ("q",),
        (tuple(answers),),
        8,
        kvpress={"dataset": dataset, "extra": [extra or {"question": "q"}]},
    )


@pytest.mark.parametrize(
    "dataset, task, answers, extra, output, expected",
    [
        ("ruler", "niah_multikey_1", ["123", "456"], None, "It is 123.", 0.5),  # string_match_all
        ("ruler", "qa_1", ["Paris", "the city of Paris"], None, "paris", 1.0),  # string_match_part
        ("longbench", "qasper", ["the red fox"], None, "A red fox!", 1.0),  # QA F1 after normalising
        ("longbench", "hotpotqa", ["red fox"], None, "red dog", 0.5),
        (
            "longbench",
            "trec",
            ["Date"],
            {"all_classes": ["Date", "Number"]},
            "Date\nNumber",
            1.0,
        ),  # first line
        ("longbench", "trec", ["Date"], {"all_classes": ["Date", "Number"]}, "Date or Number", 0.5),
        ("longbench", "passage_count", ["3"], None, "3 or 4", 0.5),
        ("longbench", "passage_retrieval_en-e", ["Paragraph 7"], None, "Paragraph 7", 1.0),
        ("infinite_bench", "passkey", ["71432"], None, "The pass key is 71432.", 1.0),
        ("infinite_bench", "kv_retrieval", ["ab-12"], None, 'value: "ab-12".', 1.0),
        ("infinite_bench", "math_calc", ["3", "5", "9"], None, "3, 5, 8", 2 / 3),
        (
            "infinite_bench",
            "longbook_choice_eng",
            ["B"],
            {"question": "Q?\nA. x\nB. y\nC. z\nD. w"},
            "B",
            1.0,
        ),
        (
            "infinite_bench",
            "longbook_choice_eng",
            ["B"],
            {"question": "Q?\nA. x\nB. y\nC. z\nD. w"},
            "y",
            1.0,
        ),
        ("infinite_bench", "code_run", ["42"], None, "The output is 42", 1.0),
        (
            "needle_in_haystack",
            "needle",
            ["x"],
            {"needle": "the best thing is a sandwich"},
            "a sandwich",
            0.5,
        ),
    ],
)
def test_each_task_is_scored_with_kvpress_metric(dataset, task, answers, extra, output, expected):
    if dataset == "needle_in_haystack":
        pytest.importorskip("rouge_score")
    assert kvpress_metrics.score_sample([output], _sample(dataset, task, answers, extra)) == pytest.approx(
        expected
    )


def test_a_bad_kvpress_file_is_refused_in_one_sentence(tmp_path, monkeypatch):
    rows = [json.loads(line) for line in (DATA / "ruler.jsonl").read_text().splitlines()]
    with pytest.raises(KvlensError, match="^Row 1 of x has no answer_prefix column"):
        kvpress_format.samples([{k: v for k, v in rows[0].items() if k != "answer_prefix"}], "x")
    with pytest.raises(KvlensError, match="kvpress's metric for task 'summarise_this'"):
        kvpress_format.samples([{**rows[0], "task": "summarise_this"}])
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(KvlensError, match="^kvpress scores gov_report with the rouge package"):
        kvpress_format.samples([{**rows[0], "task": "gov_report"}])


@pytest.mark.slow
def test_kvpress_ruler_file_gets_the_leaderboard_in_one_command(tmp_path, capsys):
    argv = ["bench", "tasks", "--samples", str(DATA / "ruler.jsonl"), "--policies", "full,snapkv,kvzip",
            "--ratios", "0.5", "--out-dir", str(tmp_path), "--no-figure", "--json"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((tmp_path / "bench_tasks_ruler.json").read_text())
    samples = kvpress_format.samples(kvpress_format.read_rows(DATA / "ruler.jsonl"))
    for row, sample in zip(data["rows"], samples, strict=True):
        assert [r["policy"] for r in row["results"]] == ["full", "snapkv", "kvzip"]
        for r in row["results"]:
            assert r["score"] == kvpress_metrics.score_sample(r["outputs"], sample)
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert {(s["policy"], s["task"]) for s in summary} >= {("snapkv", "qa_1"), ("kvzip", "niah_multiquery")}
