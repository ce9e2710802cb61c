"""`scripts/bench_shape.py`, the decode cost of policies on a random-init model of a real shape (8B on a lent
GPU), run on the CPU with its tiny shape: every policy measured, its KV bytes below the full cache's at ratio
0.5, its ratios computed from its rows, and the JSON written with the command."""

from __future__ import annotations

import json

import pytest

from scripts.bench_shape import SHAPES, main


def test_the_tiny_shape_runs_every_policy_and_compression_holds_fewer_bytes(tmp_path):
    out = tmp_path / "shape.json"
    assert (
        main(["--shape", "tiny", "--tokens", "256", "--steps", "4", "--device", "cpu", "--json", str(out)])
        == 0
    )
    result = json.loads(out.read_text())
    assert result["config"]["num_hidden_layers"] == SHAPES["tiny"]["num_hidden_layers"]
    assert result["command"].startswith("python scripts/bench_shape.py --shape tiny")
    rows = {r["policy"]: r for r in result["rows"]}
    assert list(rows) == ["full", "h2o", "snapkv", "adakv"]
    full = rows["full"]
    layers, kv_heads, head_dim = (
        SHAPES["tiny"][k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")
    )
    assert full["kv_bytes_peak"] == layers * kv_heads * head_dim * 2 * 4 * (256 + 3)  # K and V, fp32, 3 fed
    for name in ("h2o", "snapkv", "adakv"):
        ratio = result["ratios"][name]
        assert ratio["kv_bytes_vs_full"] == pytest.approx(rows[name]["kv_bytes_peak"] / full["kv_bytes_peak"])
        assert ratio["kv_bytes_vs_full"] < 0.7 and rows[name]["ms_per_token"] > 0
        assert ratio["decode_vs_full"] == pytest.approx(rows[name]["ms_per_token"] / full["ms_per_token"])


def test_a_bad_length_gets_one_sentence(capsys):
    assert main(["--shape", "tiny", "--tokens", "1"]) == 2
    assert capsys.readouterr().err.strip() == "bench_shape: --tokens and --steps must be at least 2."
