"""`kvlens sweep`: one row per policy x budget (x prompt length), JSON + CSV."""
from __future__ import annotations

import csv
import json

import pytest

from kvlens.errors import KvlensError
from kvlens.sweep import plan

IDS = bytes(b"Attention sinks and heavy hitters keep the cache small. " * 3)


def test_plan_runs_budget_free_policies_once_per_length():
    runs = plan(["full", "h2o", "corm"], [0.2, 0.5], [64, 96], {"corm": {"window": 8}})
    assert [(r["policy"], r["budget"], r["prefill"]) for r in runs] == [
        ("full", None, 64), ("h2o", 0.2, 64), ("h2o", 0.5, 64), ("corm", None, 64),
        ("full", None, 96), ("h2o", 0.2, 96), ("h2o", 0.5, 96), ("corm", None, 96)]
    assert runs[3]["params"] == {"window": 8}
    with pytest.raises(KvlensError, match="not in --policies"):
        plan(["h2o"], [0.5], [64], {"cam": {"mask": "never"}})
    with pytest.raises(KvlensError, match="needs --budgets"):
        plan(["h2o"], [], [64], {})
    with pytest.raises(KvlensError, match="Unknown policy"):
        plan(["nope"], [0.5], [64], {})


def test_sweep_command_writes_json_and_csv(tiny, monkeypatch, tmp_path, capsys):
    from kvlens.cli import main

    text = tmp_path / "t.txt"
    text.write_bytes(IDS)
    monkeypatch.setattr("kvlens.cli.sweep_commands.load", lambda args: tiny)
    out = tmp_path / "res" / "s.json"
    code = main(["sweep", "--policies", "streaming_llm,cam,corm", "--budgets", "0.25,0.5", "--text-file", str(text),
                 "--prefill", "80", "--tokens", "6", "--measure", "--set", "cam.base=h2o", "--set", "corm.window=4",
                 "--out", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["policy"], r["budget"]) for r in rows] == [("streaming_llm", 0.25), ("streaming_llm", 0.5),
                                                         ("cam", 0.25), ("cam", 0.5), ("corm", None)]
    assert rows[2]["params"]["base"] == "h2o" and rows[2]["budget_slots"] == 20
    assert rows[0]["kept_share"] == pytest.approx(20 / 85)
    assert rows[0]["perturbation_used"] == pytest.approx(rows[0]["perturbation_evict"], rel=1e-4)
    assert 0 < rows[4]["kept_share"] <= 1 and rows[4]["budget_slots"] is None
    with out.with_suffix(".csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == 5 and "perturbation_used_per_layer" not in table[0] and float(table[1]["ppl"]) > 1


def test_sweep_refuses_bad_settings_before_loading(monkeypatch, tmp_path, capsys):
    from kvlens.cli import main

    def boom(args):
        raise AssertionError("model loaded")

    monkeypatch.setattr("kvlens.cli.sweep_commands.load", boom)
    text = tmp_path / "t.txt"
    text.write_bytes(IDS)
    assert main(["sweep", "--policies", "cam", "--budgets", "0.5", "--text-file", str(text), "--set", "cam=1",
                 "--out", str(tmp_path / "x.json")]) == 2
    assert main(["sweep", "--policies", "cam", "--budgets", "2.5", "--text-file", str(text),
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "POLICY.KEY=VALUE" in capsys.readouterr().err
