"""The Why page explains a task sample under the conventions of the leaderboard it comes from
(`results/bench_tasks.json`'s `config`), not under fixed ones."""

import json

from kvlens.cli import build_parser
from kvlens.cli.bench_commands import _apply_quick
from kvlens.experiments.bench.ruler import SUITE
from kvlens.ui.why import suite


def write_config(folder, config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench_tasks.json").write_text(json.dumps({"config": config, "rows": []}))


def test_without_a_leaderboard_the_suite_is_bench_tasks_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_RESULTS", str(tmp_path / "results"))
    assert (
        dict(suite())
        == SUITE
        == {
            "seed": 0,
            "count": 8,
            "chat": True,
            "depths": "stratified",
            "rounding": "kvpress",
        }
    )


def test_the_suite_is_what_bench_tasks_runs_without_options():
    args = build_parser().parse_args(["bench", "tasks"])
    _apply_quick(args)  # the defaults `bench tasks` fills in when it runs
    ran = {"seed": args.seed, "count": args.count, "chat": not args.no_chat}
    assert {**ran, "depths": args.depths, "rounding": args.rounding} == SUITE


def test_a_leaderboard_made_before_the_options_keeps_random_depths_and_kvlens_rounding(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_RESULTS", str(tmp_path))
    write_config(tmp_path, {"seed": 3, "count": 6, "chat": False})
    assert dict(suite()) == {"seed": 3, "count": 6, "chat": False, "depths": "random", "rounding": "kvlens"}


def test_a_leaderboard_with_the_options_is_read_as_written(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_RESULTS", str(tmp_path))
    write_config(
        tmp_path, {"seed": 0, "count": 8, "chat": True, "depths": "stratified", "rounding": "kvpress"}
    )
    assert dict(suite())["depths"] == "stratified" and dict(suite())["rounding"] == "kvpress"


def test_an_unreadable_leaderboard_falls_back_to_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_RESULTS", str(tmp_path))
    (tmp_path / "bench_tasks.json").write_text("{not json")
    assert dict(suite()) == SUITE
