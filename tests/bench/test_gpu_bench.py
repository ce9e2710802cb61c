"""`scripts/gpu_bench.py`, the one command a lent GPU runs, on the CPU: its smoke pass names a policy that
fails and leaves it out of the table's policies and lockstep, and its shape part writes the 8B-shaped run's
file (here the tiny shape)."""

from __future__ import annotations

import json

import pytest

from kvlens.policies import REGISTRY, policy_names
from scripts import gpu_bench


@pytest.mark.slow
def test_a_policy_failing_the_smoke_is_named_and_left_out_of_the_table(tmp_path, monkeypatch):
    def broken(self, rows, step):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(REGISTRY["tova"], "score", broken)
    seen: list[list[str]] = []
    monkeypatch.setattr(gpu_bench, "kvlens_main", lambda argv: seen.append(argv) or 0)
    args = ["--device", "cpu", "--dtype", "float32", "--parts", "smoke,table", "--out", str(tmp_path)]
    assert gpu_bench.main(args) == 1
    status = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert status["failed"] == {"tova": "RuntimeError: no kernel for this device"}
    assert set(status["seconds"]) == {"smoke", "table"}
    (argv,) = seen
    assert argv[:2] == ["bench", "speed"] and argv[-1] == "--no-figure"
    option = dict(zip(argv[2:-1:2], argv[3:-1:2], strict=True))
    assert option["--device"] == "cpu" and option["--steps"] == "16" and option["--out-dir"] == str(tmp_path)
    assert option["--policies"].split(";") == [n for n in policy_names() if n != "tova"]
    assert option["--lockstep"].split(",") == [n for n in policy_names() if n not in ("full", "tova")]


def test_the_shape_part_writes_its_run(tmp_path):
    args = ["--device", "cpu", "--dtype", "float32", "--parts", "shape", "--shape", "tiny", "--tokens", "256"]
    assert gpu_bench.main([*args, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_shape_tiny.json").read_text())
    assert [r["policy"] for r in result["rows"]] == ["full", "h2o", "snapkv", "adakv"]
    assert all(r["memory"] == "process peak RSS" and r["peak_memory"] > 0 for r in result["rows"])


def test_an_unknown_part_gets_one_sentence(capsys, tmp_path):
    assert gpu_bench.main(["--parts", "smoke,plot", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        "gpu_bench: --parts takes some of smoke, shape, table; got 'smoke,plot'."
    )
