"""`kvlens sweep`: a grid of cells, the same rows on every executor, resumable after `kill -9`."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvlens.cli import main
from kvlens.errors import KvlensError
from kvlens.experiments.grid import TIMINGS, Results, key, plan, run_grid
from kvlens.experiments.sweep import plan_ppl
from kvlens.lists import parse_list
from kvlens.policies import make_policy
from tests.conftest import ROOT

TEXT = "Attention sinks and heavy hitters keep the cache small. " * 6
GRID = [
    "--policies",
    "full,h2o,corm,cam",
    "--budgets",
    "0.25,0.5",
    "--prefill",
    "64",
    "--tokens",
    "6",
]  # 6 cells


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("texts") / "t.txt"
    path.write_text(TEXT)
    return path


def _sweep(tiny_dir, text_file, out, *extra) -> int:
    return main(
        ["sweep", *GRID, "--text-file", str(text_file), "--model", str(tiny_dir), "--out", str(out), *extra]
    )


def _rows(out) -> list[dict]:
    return json.loads(out.read_text())["rows"]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]


def _same_rows(got: list[dict], want: list[dict]) -> None:
    """Rows equal field by field: counts, shares and bytes exactly; the NLL, perplexity and perturbation
    within 1e-6 relative. Worker processes run torch on 1/N of the threads, and a matrix product summed in
    another order rounds differently: the embedded model's `full` cell moved by 1.4e-8 relative (5.498275518
    with 2 threads, 5.498275598 with 1), measured with `tests/bench/test_sweep.py`'s tiny model."""
    assert len(got) == len(want)
    for a, b in zip(_untimed(got), _untimed(want), strict=True):
        assert a.keys() == b.keys()
        floats = {"nll", "ppl"}  # this grid measures no perturbation
        assert {k: v for k, v in a.items() if k not in floats} == {
            k: v for k, v in b.items() if k not in floats
        }
        assert {k: a[k] for k in floats} == pytest.approx({k: b[k] for k in floats}, rel=1e-6, abs=1e-12)


@pytest.fixture(scope="module")
def uninterrupted(tiny_dir, text_file, tmp_path_factory):
    """The rows of the 6-cell sweep run in this process, from start to end."""
    out = tmp_path_factory.mktemp("in-process") / "s.json"
    assert _sweep(tiny_dir, text_file, out) == 0
    return _rows(out)


def test_plan_runs_budget_free_policies_once_and_resolves_parameters():
    texts = {"a": "one", "b": "two"}
    cells = plan_ppl(
        [("full", {}), ("h2o", {}), ("corm", {"window": 8})],
        [0.2, 16],
        texts,
        [64, 96],
        tokens=8,
        model="tiny",
    )
    assert [(c["text"], c["policy"], c["budget"], c["prefill"]) for c in cells[:8]] == [
        ("a", "full", None, 64),
        ("a", "full", None, 96),
        ("a", "h2o", 0.2, 64),
        ("a", "h2o", 0.2, 96),
        ("a", "h2o", 16, 64),
        ("a", "h2o", 16, 96),
        ("a", "corm", None, 64),
        ("a", "corm", None, 96),
    ]
    assert len(cells) == 16 and cells[8]["text"] == "b" and cells[8]["text_digest"] != cells[0]["text_digest"]
    assert cells[6]["params"] == make_policy("corm", {"window": 8}).params()  # resolved, not as given
    assert cells[2]["params"] == make_policy("h2o").params() and cells[0]["params"] == {}
    assert len({key(c) for c in cells}) == 16


def test_seeds_set_the_run_seed_and_the_seed_parameter_of_policies_that_have_one():
    cells = plan("ppl", [("cam", {}), ("h2o", {})], [0.5], {}, {}, seeds=[0, 3])
    assert [(c["policy"], c["seed"], c["params"].get("seed")) for c in cells] == [
        ("cam", 0, 0),
        ("cam", 3, 3),
        ("h2o", 0, None),
        ("h2o", 3, None),
    ]
    with pytest.raises(KvlensError, match="either with --seeds"):
        plan("ppl", [("cam", {"seed": 2})], [0.5], {}, {}, seeds=[1])
    with pytest.raises(KvlensError, match="needs a budget"):
        plan("ppl", [("h2o", {})], [], {}, {})
    with pytest.raises(KvlensError, match="Unknown policy"):
        plan("ppl", [("nope", {})], [0.5], {}, {})


@pytest.mark.parametrize(
    "text, kwargs, message",
    [
        ("1,x", {}, "--n takes comma-separated integers; got '1,x'."),
        (" , ", {}, "--n needs at least one value; got ' , '."),
        ("0,2", {"minimum": 1}, "--n takes values at least 1; got 0."),
        ("0.5,2", {"kind": float, "minimum": 0, "maximum": 1}, "--n takes values in [0, 1]; got 2.0."),
    ],
)
def test_one_list_parser_one_sentence(text, kwargs, message):
    with pytest.raises(KvlensError) as err:
        parse_list(text, "--n", **kwargs)
    assert str(err.value) == message
    assert parse_list(" 3, 1,2 ", "--n") == [3, 1, 2]


def test_results_keep_finished_cells_and_other_grids_rows_retry_failed_ones_start_over_when_fresh(tmp_path):
    cells = plan("ppl", [("full", {}), ("h2o", {})], [0.5, 8], {}, {"model": "m"})
    out = tmp_path / "r.json"
    results = Results(out, cells, {"command": "x"})
    results.add(cells[0], {"row": {"ppl": 2.0}})
    results.add(cells[2], {"error": "It broke."})
    again = Results(out, cells, {"command": "x"})
    assert again.todo() == [cells[1], cells[2]]  # the failed cell is retried
    data = json.loads(out.read_text())
    assert (data["cells_total"], data["cells_done"], data["cells_failed"], data["status"]) == (
        3,
        1,
        1,
        "running",
    )
    assert data["failed"][0]["error"] == "It broke." and data["rows"][0]["kvlens_version"]
    again.add(cells[2], {"row": {"ppl": 3.0}})
    assert not json.loads(out.read_text())["failed"]
    smaller = Results(out, cells[1:], {})  # another grid in the same file: the first cell's row is kept aside
    smaller.add(cells[1], {"row": {"ppl": 4.0}})
    data = json.loads(out.read_text())
    assert [r["ppl"] for r in data["other_rows"]] == [2.0] and [r["ppl"] for r in data["rows"]] == [4.0, 3.0]
    assert Results(out, cells, {}).todo() == []  # ... and counts again for the grid that plans it
    assert Results(out, cells, {}, fresh=True).todo() == cells
    out.write_text("not json")
    with pytest.raises(KvlensError, match="--fresh"):
        Results(out, cells, {})


def test_a_grid_logged_to_a_file_prints_a_line_per_finished_cell_with_its_count_and_label(tmp_path, capsys):
    cells = plan("ppl", [("full", {}), ("h2o", {})], [0.5], {}, {"model": "m"})
    results = Results(tmp_path / "r.json", cells, {})
    results.add(cells[0], {"row": {"ppl": 2.0}})  # done before: the count starts after it
    run_grid(
        Results(tmp_path / "r.json", cells, {}),
        lambda todo: ((c, {"row": {"ppl": 1.0}}) for c in todo),
        "grid",
    )
    lines = capsys.readouterr().err.splitlines()  # pytest's stderr is not a terminal
    assert len(lines) == 1 and lines[0].startswith("grid: 2/2 cells, ") and lines[0].endswith(" left, h2o")


def test_sweep_writes_json_and_csv_with_full_parameters(tiny_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "res" / "s.json"
    code = main(
        [
            "sweep",
            "--policies",
            "streaming_llm,cam,corm",
            "--budgets",
            "0.25,0.5",
            "--text-file",
            str(text),
            "--prefill",
            "80",
            "--tokens",
            "6",
            "--measure",
            "--set",
            "cam.base=h2o",
            "--set",
            "corm.window=4",
            "--model",
            str(tiny_dir),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["policy"], r["budget"]) for r in rows] == [
        ("streaming_llm", 0.25),
        ("streaming_llm", 0.5),
        ("cam", 0.25),
        ("cam", 0.5),
        ("corm", None),
    ]
    assert rows[2]["params"]["base"] == "h2o" and rows[2]["budget_slots"] == 20
    assert all(
        r["model"] == str(tiny_dir) and r["text"] == str(text) and r["measure"] and r["kvlens_version"]
        for r in rows
    )
    assert rows[0]["kept_share"] == pytest.approx(20 / 85)
    assert rows[0]["perturbation_used"] == pytest.approx(rows[0]["perturbation_evict"], rel=1e-4)
    assert 0 < rows[4]["kept_share"] <= 1 and rows[4]["budget_slots"] is None
    assert data["status"] == "done" and data["cells_done"] == 5
    with out.with_suffix(".csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == 5 and "perturbation_used_per_layer" not in table[0] and float(table[1]["ppl"]) > 1


def test_sweep_runs_several_variants_of_one_policy(tiny_dir, text_file, tmp_path):
    out = tmp_path / "v.json"
    assert (
        main(
            [
                "sweep",
                "--policies",
                "cam:base=h2o,span=1;cam:base=tova,span=2",
                "--budgets",
                "16",
                "--seeds",
                "0,1",
                "--prefill",
                "32",
                "--tokens",
                "2",
                "--text-file",
                str(text_file),
                "--model",
                str(tiny_dir),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert [(r["params"]["base"], r["params"]["span"], r["params"]["seed"]) for r in _rows(out)] == [
        ("h2o", 1, 0),
        ("h2o", 1, 1),
        ("tova", 2, 0),
        ("tova", 2, 1),
    ]


def test_a_failed_cell_is_recorded_with_its_reason_and_retried(
    tiny_dir, text_file, tmp_path, monkeypatch, capsys
):
    import kvlens.experiments.sweep

    real = kvlens.experiments.sweep.ppl_cell

    def flaky(model, texts, cell):
        if cell["policy"] == "cam":
            raise RuntimeError("the GPU fell off\nsecond line")
        return real(model, texts, cell)

    out = tmp_path / "s.json"
    monkeypatch.setattr(kvlens.experiments.sweep, "ppl_cell", flaky)
    assert _sweep(tiny_dir, text_file, out) == 1
    data = json.loads(out.read_text())
    assert [f["policy"] for f in data["failed"]] == ["cam", "cam"]
    assert data["failed"][0]["error"] == "RuntimeError: the GPU fell off" and data["cells_done"] == 4
    assert "failed: cam budget 0.25: RuntimeError: the GPU fell off" in capsys.readouterr().out
    monkeypatch.setattr(kvlens.experiments.sweep, "ppl_cell", real)
    assert _sweep(tiny_dir, text_file, out) == 0
    rows = _rows(out)
    assert [r for r in rows if r["policy"] != "cam"] == [
        r for r in data["rows"]
    ]  # not recomputed: same timings
    assert [r["policy"] for r in rows].count("cam") == 2 and not json.loads(out.read_text())["failed"]


def test_six_cells_give_the_same_rows_in_process_with_workers_and_on_ray(
    tiny_dir, text_file, uninterrupted, tmp_path
):
    assert len(uninterrupted) == 6
    for name, flags in [("workers", ["--workers", "2"]), ("ray", ["--ray", "--workers", "2"])]:
        out = tmp_path / name / "s.json"
        assert _sweep(tiny_dir, text_file, out, *flags) == 0, name
        _same_rows(_rows(out), uninterrupted)


def test_a_sweep_killed_after_its_first_cell_resumes_without_recomputing(
    tiny_dir, text_file, uninterrupted, tmp_path
):
    out = tmp_path / "s.json"
    argv = [
        sys.executable,
        "-m",
        "kvlens",
        "sweep",
        *GRID,
        "--text-file",
        str(text_file),
        "--model",
        str(tiny_dir),
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (out.is_file() and json.loads(out.read_text())["cells_done"] >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended before its first cell"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = _rows(out)  # whole cells only: the file parses and each row is complete
    assert 1 <= len(before) < 6 and all(set(r) == set(uninterrupted[0]) for r in before)
    assert _sweep(tiny_dir, text_file, out) == 0
    after = _rows(out)
    assert [r for r in after if r in before] == before  # finished cells kept, timings and all
    assert _untimed(after) == _untimed(uninterrupted)


def test_sweep_refuses_bad_settings_before_loading(monkeypatch, tmp_path, capsys):
    def boom(args):
        raise AssertionError("model loaded")

    monkeypatch.setattr("kvlens.cli.sweep_commands.load", boom)
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    base = ["sweep", "--text-file", str(text), "--out", str(tmp_path / "x.json")]
    assert main([*base, "--policies", "cam", "--budgets", "0.5", "--set", "cam=1"]) == 2
    assert "POLICY.KEY=VALUE" in capsys.readouterr().err
    assert main([*base, "--policies", "cam", "--budgets", "2.5"]) == 2
    assert "fractional budget" in capsys.readouterr().err
    assert main([*base, "--policies", "h2o", "--budgets", "0.5", "--prefill", "64,x"]) == 2
    assert "--prefill takes comma-separated integers; got '64,x'." in capsys.readouterr().err
    assert main([*base, "--policies", "h2o", "--budgets", "0.5", "--workers", "0"]) == 2
    assert "--workers must be at least 1" in capsys.readouterr().err
    assert main(["sweep", "--policies", "h2o", "--budgets", "0.5", "--out", str(tmp_path / "x.json")]) == 2
    assert "--texts N" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_progress_whose_total_is_known_late_logs_its_count_of_that_total(capsys):
    """`Progress.to`: the count reached, of a total given only then (`kvlens train-scorer`'s pieces), one
    line per advance when stderr is a log; silent there when not asked to log."""
    from kvlens.progress import Progress

    with Progress("targets", None, "piece", log=True) as bar:
        bar.to(2, 5)
        bar.to(5)
    with Progress("quiet", 3, "tok") as bar:
        bar.advance(note="slots=4")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(",")[0] for line in lines] == ["targets: 2/5 pieces", "targets: 5/5 pieces"]
