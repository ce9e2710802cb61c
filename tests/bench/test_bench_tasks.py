"""`kvlens bench tasks`: a user's samples file through the CLI (resumable, scored from the answers), the
leaderboard's summary and intervals, a generated needle found by the full cache, bad input in one sentence."""

from __future__ import annotations

import json

import pytest

from kvlens.cli import main
from kvlens.experiments.bench import ruler, tasks
from kvlens.experiments.bench.common import parse_policies
from kvlens.texts import bundled

LINES = [
    {
        "context": "The code word is amber. " * 20,
        "question": "What is the code word?",
        "answers": ["amber"],
        "task": "mine",
        "max_new_tokens": 6,
    },
    {
        "context": "Paris is in France. Rome is in Italy. " * 10,
        "question": ["Where is Paris?", "Where is Rome?"],
        "answers": [["France"], ["Italy"]],
        "task": "mine",
        "max_new_tokens": 5,
    },
]


def test_a_users_samples_file_is_scored_for_every_policy_and_ratio(tiny_dir, tmp_path, capsys):  # noqa: F811
    samples = tmp_path / "mine.jsonl"
    samples.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    argv = [
        "bench",
        "tasks",
        "--samples",
        str(samples),
        "--policies",
        "streaming_llm;h2o",
        "--ratios",
        "0.5,0.75",
        "--model",
        str(tiny_dir),
        "--no-chat",
        "--out-dir",
        str(tmp_path),
        "--no-figure",
        "--json",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    data = json.loads((tmp_path / "bench_tasks_mine.json").read_text())
    assert data["status"] == "done" and data["cells_total"] == 2
    for row, line in zip(data["rows"], LINES, strict=True):
        labels = [(r["policy"], r["ratio"]) for r in row["results"]]
        assert labels == [
            ("full", 0.0),
            ("streaming_llm", 0.5),
            ("streaming_llm", 0.75),
            ("h2o", 0.5),
            ("h2o", 0.75),
        ]
        sample = ruler.Sample.from_json(line, 1)
        for r in row["results"]:
            assert len(r["outputs"]) == len(sample.questions)
            assert r["score"] == ruler.score_sample(r["outputs"], sample)
            assert r["kept_share"] == pytest.approx(
                1 - r["ratio"], abs=0.01
            )  # kvpress's count: len - int(len * r)
    cells = {(s["policy"], s["ratio"], s["task"]): s for s in result["summary"]}
    assert set(cells) >= {("full", 0.0, "all"), ("h2o", 0.75, "mine"), ("streaming_llm", 0.5, "all")}
    for s in result["summary"]:
        assert s["samples"] == 2 and s["ci_low"] <= s["score"] <= s["ci_high"]
        assert s["full_score"] == cells[("full", 0.0, s["task"])]["score"]
    assert main(argv) == 0  # resumed: nothing left to run, the same rows
    assert json.loads((tmp_path / "bench_tasks_mine.json").read_text())["rows"] == data["rows"]


def _rows(scores: dict[tuple[str, float], list[float]], task: str, length: int) -> list[dict]:
    """Cell rows of one (task, length), a sample per position of each score list."""
    n = len(next(iter(scores.values())))
    return [
        {
            "suite_task": task,
            "length": length,
            "index": i,
            "shared_prefill_ms": 1.0,
            "answers": [["42"]],
            "results": [
                {
                    "policy": p,
                    "ratio": r,
                    "score": s[i],
                    "outputs": ["42" if s[i] else "no"],
                    "kept_share": 1 - (r or 0),
                    "prepare_ms": 1.0,
                    "answer_ms": 4.0,
                }
                for (p, r), s in scores.items()
            ],
        }
        for i in range(n)
    ]


def test_a_task_asking_several_questions_of_one_context_has_each_turns_score():
    """niah_multiquery's questions share one compressed cache: the summary scores each turn, with its
    interval."""
    rows = _rows({("full", 0.0): [1, 1, 1, 1], ("h2o", 0.5): [1, 1, 1, 0]}, "multi", 1024)
    for row in rows:
        row["answers"] = [["7"], ["8"], ["9"]]
        for res in row["results"]:  # h2o answers the first question of every sample, the last of none
            found = [True, True, True] if res["policy"] == "full" else [True, row["index"] < 2, False]
            res["outputs"] = [f"it is {a[0]}" if f else "no idea" for a, f in zip(row["answers"], found)]
    cells = {(s["policy"], s["task"]): s for s in tasks.summarise(rows)}
    assert [t["score"] for t in cells[("h2o", "multi")]["turns"]] == [1.0, 0.5, 0.0]
    assert [t["score"] for t in cells[("full", "multi")]["turns"]] == [1.0, 1.0, 1.0]
    middle = cells[("h2o", "multi")]["turns"][1]
    assert 0 <= middle["ci_low"] < 0.5 < middle["ci_high"] <= 1
    assert cells[("h2o", "all")]["turns"] is None  # turns are per task
    single = {(s["policy"], s["task"]): s for s in tasks.summarise(_rows({("full", 0.0): [1]}, "one", 1024))}
    assert single[("full", "one")]["turns"] is None


def test_the_summary_averages_tasks_equally_and_bootstraps_within_them():
    rows = _rows({("full", 0.0): [1, 1, 1, 1], ("h2o", 0.5): [1, 0, 1, 0]}, "a", 1024) + _rows(
        {("full", 0.0): [0.5, 0.5], ("h2o", 0.5): [0, 0]}, "b", 1024
    )
    for row in rows[
        :4
    ]:  # h2o on task a with a pass of its own, as KVzip's replay (rows without one read as 0)
        row["results"][1]["own_ms"] = 2.0
    cells = {(s["policy"], s["task"]): s for s in tasks.summarise(rows)}
    assert cells[("h2o", "a")]["score"] == 0.5 and cells[("h2o", "b")]["score"] == 0.0
    assert cells[("h2o", "all")]["score"] == 0.25  # the mean of the tasks' means, not of the 6 samples (1/3)
    assert cells[("h2o", "all")]["full_score"] == 0.75 and cells[("h2o", "all")]["samples"] == 6
    assert cells[("h2o", "b")]["ci_low"] == cells[("h2o", "b")]["ci_high"] == 0.0  # no spread, no interval
    assert 0 <= cells[("h2o", "a")]["ci_low"] < 0.5 < cells[("h2o", "a")]["ci_high"] <= 1
    assert cells[("h2o", "a")]["cost_vs_answer"] == 1.25  # its own pass is not counted against the grid
    assert cells[("h2o", "a")]["own_vs_answer"] == 0.5 and cells[("h2o", "b")]["own_vs_answer"] == 0.0
    # its half of the shared prefill, compression, own pass, answers
    assert cells[("h2o", "a")]["cell_ms"] == 0.5 + 1.0 + 2.0 + 4.0
    assert "h2o" in tasks.table(tasks.summarise(rows))


def test_a_budget_free_policy_is_shown_at_the_share_its_own_rule_removed():
    rows = _rows({("full", 0.0): [1, 1], ("h2o", 0.5): [1, 0], ("corm", None): [0, 1]}, "a", 1024)
    for row in rows:
        row["results"][-1]["kept_share"] = 0.6
    summary = tasks.summarise(rows)
    line = next(x for x in tasks.table(summary).splitlines() if x.startswith("corm"))
    assert "50.0% [0%, 100%] keeps 60%" in line
    fig = tasks.figure({"summary": summary})
    corm = [t for t in fig.data if t.name == "corm"]
    assert [t.marker.symbol for t in corm] == ["diamond", "diamond"]  # the average panel and the task's
    assert corm[0].x[0] == pytest.approx(0.4, abs=0.02) and corm[0].y == (0.5,)


def test_the_full_cache_finds_a_generated_needle_and_one_prefill_serves_every_policy(smol):
    haystack = " ".join(bundled(2).values())
    cells = tasks.plan_tasks(
        parse_policies("streaming_llm;snapkv"),
        [0.5],
        ["niah_single"],
        [512],
        1,
        model="default",
        seed=0,
        query_aware=False,
        chat=True,
        source="x",
    )
    row = tasks.tasks_cell(smol, {"haystack": haystack}, cells[0])
    by = {(r["policy"], r["ratio"]): r for r in row["results"]}
    assert set(by) == {("full", 0.0), ("streaming_llm", 0.5), ("snapkv", 0.5)}
    assert by[("full", 0.0)]["score"] == 1.0, by[("full", 0.0)]["outputs"]
    assert row["answers"][0][0] in by[("full", 0.0)]["outputs"][0]
    assert 400 < row["prompt_tokens"] <= 512


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["bench", "tasks", "--ratios", "0.5,1"],
            "A compression ratio is the share of the context removed, in (0, 1)",
        ),
        (["bench", "tasks", "--tasks", "niah_single,nope"], "Unknown task 'nope'"),
        (
            ["bench", "tasks", "--samples", "/nonexistent.jsonl"],
            "There is no samples file /nonexistent.jsonl.",
        ),
        (["bench", "tasks", "--count", "0"], "--count must be at least 1."),
    ],
)
def test_bench_tasks_refuses_bad_input_in_one_sentence(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_bad_line_in_a_samples_file_is_named(tmp_path, capsys):
    samples = tmp_path / "bad.jsonl"
    samples.write_text(json.dumps(LINES[0]) + "\n" + json.dumps({"context": "x", "question": "y"}) + "\n")
    assert main(["bench", "tasks", "--samples", str(samples)]) == 2
    assert f"The sample on line 2 of {samples} has no 'answers' field." in capsys.readouterr().err


def test_kvzips_replay_runs_once_for_all_its_ratios(smol, monkeypatch):
    from kvlens.engine.loop import _Loop

    calls, replay = [], _Loop.replay
    monkeypatch.setattr(
        _Loop, "replay", lambda loop, prompt: calls.append(loop.policy.name) or replay(loop, prompt)
    )
    haystack = " ".join(bundled(2).values())
    cells = tasks.plan_tasks(
        parse_policies("kvzip"),
        [0.5, 0.75],
        ["niah_single"],
        [256],
        1,
        model="default",
        seed=0,
        query_aware=False,
        chat=True,
        source="x",
    )
    row = tasks.tasks_cell(smol, {"haystack": haystack}, cells[0])
    assert calls.count("kvzip") == 1
    kept = {r["ratio"]: r["kept_share"] for r in row["results"]}
    assert kept[0.0] == 1 and kept[0.5] > kept[0.75] > 0  # the copied scores served a second budget


def test_a_batch_pads_little_when_caches_of_one_ratio_are_answered_together(tiny_dir, monkeypatch):  # noqa: F811
    """Caches are prepared ratio by ratio and a batch is closed by its padded size: with room for about two
    caches of the least compressed ratio, the batches' padded slots stay within 25 % of the slots kept
    (prepared policy by policy, each batch would pair a 0.5 cache with a 0.875 one: 39 % more)."""
    from kvlens.engine.models import load_model

    model, batches = load_model(str(tiny_dir)), []
    answer_many = tasks.answer_many
    monkeypatch.setattr(
        tasks,
        "answer_many",
        lambda caches, *a, **k: batches.append([c.nbytes for c in caches]) or answer_many(caches, *a, **k),
    )
    text = json.dumps(LINES[0]) + "\n"
    cell = tasks.plan_file(
        ruler.parse_lines(text),
        parse_policies("streaming_llm;h2o;tova"),
        [0.875, 0.5],
        model="tiny",
        query_aware=False,
        chat=False,
        text=text,
    )[0]
    tasks.tasks_cell(model, {"samples": text}, cell)
    assert len(batches) == 1 and len(batches[0]) == 7  # the default room answers them all at once
    caches = sorted(batches.pop())
    monkeypatch.setattr(tasks, "ANSWER_BATCH_BYTES", caches[-1])  # the full cache's slots
    tasks.tasks_cell(model, {"samples": text}, cell)
    assert sorted(n for b in batches for n in b) == caches  # every cache once
    padded, kept = sum(len(b) * max(b) for b in batches), sum(n for b in batches for n in b)
    assert len(batches) > 2 and padded <= 1.25 * kept, (padded / kept, batches)


def test_generated_rows_record_their_conventions_and_needle_depths(tiny_dir, tmp_path, capsys):  # noqa: F811
    argv = [
        "bench",
        "tasks",
        "--tasks",
        "niah_single",
        "--lengths",
        "900",
        "--count",
        "2",
        "--policies",
        "streaming_llm",
        "--ratios",
        "0.5",
        "--model",
        str(tiny_dir),
        "--no-chat",
        "--out-dir",
        str(tmp_path),
        "--no-figure",
        "--json",
    ]
    code = main(argv)
    result = json.loads(capsys.readouterr().out)
    assert code == 0, json.loads((tmp_path / "bench_tasks.json").read_text())["failed"]
    assert {k: result["config"][k] for k in ("rounding", "depths", "count")} == {
        "rounding": "kvpress",
        "depths": "stratified",
        "count": 2,
    }
    for row in result["rows"]:
        assert (row["rounding"], row["depths"], row["count"]) == ("kvpress", "stratified", 2)
        k = len(row["answers"][0])  # needles of the sample, one per expected number
        assert sorted(d for ds in row["needle_depths"] for d in ds) == sorted(row["needle_depths"][0])
        for j, depth in enumerate(sorted(row["needle_depths"][0])):  # needle j of k of sample i of 2
            assert (j + row["index"] / 2) / k <= depth < (j + (row["index"] + 1) / 2) / k
        kept = {r["policy"]: r["kept_share"] * row["prompt_tokens"] for r in row["results"]}
        assert round(kept["streaming_llm"]) == row["prompt_tokens"] // 2  # kvpress: int(T * 0.5)
    assert main([*argv, "--rounding", "kvlens"]) == 0  # other cells: the same file gets a second set of rows
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["rounding"] for r in rows} == {"kvlens"}
    for row in rows:
        kept = {r["policy"]: r["kept_share"] * row["prompt_tokens"] for r in row["results"]}
        assert round(kept["streaming_llm"]) == row["prompt_tokens"] - row["prompt_tokens"] // 2


def test_rows_from_before_the_options_resume_as_kvlens_rounding_and_random_depths(tmp_path):
    from kvlens.experiments.grid import Results

    cells = tasks.plan_tasks(
        parse_policies("h2o"),
        [0.5],
        ["niah_single"],
        [512],
        2,
        model="m",
        seed=0,
        query_aware=False,
        chat=True,
        source="x",
        rounding="kvlens",
        depths="random",
    )
    old = [{k: v for k, v in c.items() if k not in ("rounding", "depths")} | {"results": []} for c in cells]
    (tmp_path / "r.json").write_text(json.dumps({"rows": old}))
    assert Results(tmp_path / "r.json", cells, {}, implied=ruler.IMPLIED).todo() == []
    assert len(Results(tmp_path / "r.json", cells, {}).todo()) == 2
    now = tasks.plan_tasks(
        parse_policies("h2o"),
        [0.5],
        ["niah_single"],
        [512],
        2,
        model="m",
        seed=0,
        query_aware=False,
        chat=True,
        source="x",
    )
    assert (
        len(Results(tmp_path / "r.json", now, {}, implied=ruler.IMPLIED).todo()) == 2
    )  # kvpress, stratified


def test_the_needle_grid_counts_each_needle_found_by_depth_and_length():
    from kvlens.experiments.bench import task_needles

    rows = [
        {
            "suite_task": "niah_multivalue",
            "length": 1024,
            "answers": [["11", "22", "33", "44"]],
            "needle_depths": [[0.05, 0.3, 0.55, 0.99]],
            "results": [
                {"policy": "full", "ratio": 0.0, "outputs": ["11 22 33 44"]},
                {"policy": "h2o", "ratio": 0.5, "outputs": ["11 and 44"]},
            ],
        },
        {
            "suite_task": "niah_single",
            "length": 2048,
            "answers": [["55"]],
            "needle_depths": [[0.31]],
            "results": [
                {"policy": "full", "ratio": 0.0, "outputs": ["55"]},
                {"policy": "h2o", "ratio": 0.5, "outputs": ["none"]},
            ],
        },
        {
            "suite_task": "fwe",
            "length": 1024,
            "answers": [["a"]],
            "needle_depths": None,
            "results": [{"policy": "h2o", "ratio": 0.5, "outputs": ["a"]}],
        },
    ]
    cells = {
        (c["policy"], c["length"], c["depth"]): (c["found"], c["needles"]) for c in task_needles.grid(rows)
    }
    assert cells == {
        ("full", 1024, 0.0): (1, 1),
        ("full", 1024, 0.3): (1, 1),
        ("full", 1024, 0.5): (1, 1),
        ("full", 1024, 0.9): (1, 1),
        ("full", 2048, 0.3): (1, 1),
        ("h2o", 1024, 0.0): (1, 1),
        ("h2o", 1024, 0.3): (0, 1),
        ("h2o", 1024, 0.5): (0, 1),
        ("h2o", 1024, 0.9): (1, 1),
        ("h2o", 2048, 0.3): (0, 1),
    }
    grid = task_needles.grid(rows)
    assert task_needles.default_ratio(grid) == 0.5
    fig = task_needles.figure(grid, 0.5)
    assert [t.name for t in fig.data] == ["full", "h2o"]
    assert [list(line) for line in fig.data[1].z] == [
        [1, None],
        [0, 0],
        [0, None],
        [1, None],
    ]  # depth x length
    assert task_needles.figure(grid, 0.75).data[0].name == "full" and task_needles.figure([], 0.5) is None
    assert fig.layout.title.text == "Needles found by depth and context length, compression ratio 0.5"
    aware = task_needles.figure(grid, 0.5, tasks.protocol({"query_aware": True}))
    assert aware.layout.title.text.endswith("compression ratio 0.5 (query-aware)")


def test_rows_without_depths_get_their_regenerated_samples(tmp_path):
    from kvlens.experiments.bench import task_needles
    from tests.bench.conftest import ESSAY, words

    sample = ruler.generate("niah_multikey", 800, 3, words, ESSAY, 0, depths="random")
    row = {
        "suite_task": "niah_multikey",
        "length": 800,
        "index": 3,
        "seed": 0,
        "answers": [list(a) for a in sample.answers],
    }
    other = {**row, "index": 4}  # its answers are not sample 4's: left without depths
    stratified = {
        **row,
        "depths": "stratified",
        "count": 8,
        "answers": [list(a) for a in ruler.generate("niah_multikey", 800, 3, words, ESSAY, 0).answers],
    }
    assert task_needles.fill_depths([row, other, stratified], words, ESSAY) == 2
    assert row["needle_depths"] == [list(d) for d in sample.depths] and "needle_depths" not in other
    assert stratified["needle_depths"] == [
        list(d) for d in ruler.generate("niah_multikey", 800, 3, words, ESSAY, 0).depths
    ]


def test_the_summary_averages_tasks_at_each_length():
    """("all", length): the tasks' mean at that length, beside ("all", "all") over every length."""
    rows = (
        _rows({("full", 0.0): [1, 1], ("h2o", 0.5): [1, 1]}, "a", 1024)
        + _rows({("full", 0.0): [1, 1], ("h2o", 0.5): [0, 1]}, "b", 1024)
        + _rows({("full", 0.0): [1, 1], ("h2o", 0.5): [0, 0]}, "a", 4096)
    )
    cells = {(s["policy"], s["task"], s["length"]): s for s in tasks.summarise(rows)}
    assert cells[("h2o", "all", 1024)]["score"] == 0.75 and cells[("h2o", "all", 1024)]["samples"] == 4
    assert cells[("h2o", "all", 4096)]["score"] == 0.0
    assert cells[("h2o", "all", "all")]["score"] == 0.5  # tasks a@1024, b@1024, a@4096 weigh alike
    assert (
        "h2o" in tasks.table(tasks.summarise(rows)) and tasks.table(tasks.summarise(rows)).count("h2o") == 1
    )


def test_the_protocols_are_compared_sample_for_sample_on_what_both_grids_ran():
    """Query-aware minus question-agnostic, paired by (task, length, sample): a gain whose interval excludes 0
    is named, a spread that straddles it is a tie, and samples only one grid ran are left out."""
    from kvlens.experiments.bench.protocols import paired

    agnostic = _rows({("snapkv", 0.5): [0, 0, 1, 0], ("h2o", 0.5): [1, 0, 1, 0]}, "a", 1024) + _rows(
        {("snapkv", 0.5): [0, 0], ("h2o", 0.5): [1, 1]}, "a", 4096
    )
    aware = _rows({("snapkv", 0.5): [1, 1, 1, 1], ("h2o", 0.5): [0, 1, 1, 0]}, "a", 1024)
    snap = paired(agnostic, aware, "snapkv", 0.5)
    assert (snap["samples"], snap["lengths"]) == (4, [1024])  # 4096 ran question-agnostic only
    assert (snap["agnostic"], snap["aware"], snap["diff"]) == (0.25, 1.0, 0.75)
    assert snap["verdict"] == "query-aware" and 0 < snap["ci_low"] <= 0.75 <= snap["ci_high"] <= 1
    h2o = paired(agnostic, aware, "h2o", 0.5)  # one sample gained, one lost: a tie
    assert h2o["diff"] == 0.0 and h2o["verdict"] == "tie" and h2o["ci_low"] < 0 < h2o["ci_high"]
    assert paired(agnostic, aware, "snapkv", 0.25) is None


def test_two_policies_of_one_grid_are_compared_sample_for_sample_with_the_share_the_second_kept():
    """kvzap (its threshold mode at its own size, ratio None) against kvzip at 0.5 in the same cells: the
    difference's interval names the better one or a tie, and the mean share kept is the second's own."""
    from kvlens.experiments.bench.protocols import against

    rows = _rows(
        {
            ("kvzip", 0.5): [1, 1, 1, 1],
            ("kvzap", 0.5): [0, 0, 0, 1],
            ("kvzap:mode=threshold", None): [1, 0, 1, 1],
        },
        "a",
        1024,
    )
    worse = against(rows, ("kvzip", 0.5), ("kvzap", 0.5))
    assert (worse["first"], worse["second"], worse["diff"]) == (1.0, 0.25, -0.75)
    assert worse["verdict"] == "kvzip" and worse["ci_high"] < 0 and worse["kept_share"] == 0.5
    tie = against(rows, ("kvzip", 0.5), ("kvzap:mode=threshold", None))
    assert tie["verdict"] == "tie" and tie["ci_low"] < 0 <= tie["ci_high"] and tie["kept_share"] == 1.0
    assert against(rows, ("kvzip", 0.25), ("kvzap", 0.5)) is None


def test_twenty_policies_get_twenty_distinct_styles_on_a_grid_of_panels():
    names = [f"p{i}" for i in range(20)]
    rows = _rows({(n, 0.5): [1, 0] for n in names}, "a", 1024) + _rows(
        {(n, 0.5): [0, 1] for n in names}, "b", 1024
    )
    fig = tasks.figure({"summary": tasks.summarise(rows)})
    shown = [t for t in fig.data if t.showlegend]
    assert len({(t.line.color, t.line.dash, t.marker.symbol) for t in shown}) == len(shown) == 20
    assert [a.text for a in fig.layout.annotations] == ["average over tasks", "a", "b"]
