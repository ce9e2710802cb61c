"""What each rank does to the outputs (`kvlens.analysis.kinds.rank_perturbation`): the run replayed with
low-rank storage is the run itself at full rank (within float rounding), its bytes are the stored tensors',
its reconstruction error never rises with the rank, its output error splits as the perturbation meter's (no
merging part without merging, a positions part only with eviction), and `kvlens analyze rank_perturbation`
prints it."""

from __future__ import annotations

import json

import pytest
import torch

from kvlens.analysis.kinds.rank_perturbation import default_ranks, rank_perturbation
from kvlens.cli import main
from kvlens.engine.loop import RunOptions
from kvlens.errors import KvlensError
from kvlens.experiments.api import perplexity
from kvlens.kvcache.lowrank import seal_low_rank

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 4
D = 16  # the tiny model's head size


@pytest.fixture(scope="module")
def runs(tiny):
    """A full-cache and an H2O run of the tiny model, recorded with their prompt states, and their replays."""
    out = {}
    for policy, budget in (("full", None), ("h2o", 64)):
        run = perplexity(
            tiny, TEXT, policy, prefill=200, tokens=12, opts=RunOptions(budget=budget, record="states")
        )
        out[policy] = run, rank_perturbation(run, tiny, [2, 4, D])
    return out


def test_the_default_ladder_is_sixteenths_to_the_head_size():
    assert default_ranks(64) == [4, 8, 16, 32, 64] and default_ranks(16) == [1, 2, 4, 8, 16]


def test_at_full_rank_a_full_cache_run_is_unperturbed_and_low_ranks_perturb_only_through_storage(runs):
    _, found = runs["full"]
    full, low = found.rows()[-2], found.rows()[0]
    assert full["rank"] == D and abs(full["kl"]) < 1e-6 and abs(full["nll_change"]) < 1e-5
    assert full["top1_agreement"] == 1.0 and abs(full["sources"]["storage"]) < 1e-5
    assert low["rank"] == 2 and low["sources"]["storage"] > 0.1 and low["kl"] > 100 * abs(full["kl"])
    for row in found.rows():  # no position removed, nothing merged
        assert abs(row["sources"]["selection"]) < 1e-6 and row["sources"]["merging"] == 0.0


def test_an_evicting_runs_positions_part_is_its_eviction_and_full_rank_adds_nothing(runs):
    _, found = runs["h2o"]
    *ranked, reference = found.rows()
    assert reference["rank"] is None and reference["sources"]["selection"] > 0.05
    assert reference["sources"]["storage"] == 0.0 and all(
        r["sources"]["merging"] == 0.0 for r in found.rows()
    )
    full = ranked[-1]
    assert full["kl"] == pytest.approx(reference["kl"], rel=1e-3, abs=1e-7)
    assert full["nll_change"] == pytest.approx(reference["nll_change"], abs=1e-5)
    assert full["top1_agreement"] == reference["top1_agreement"] and abs(full["sources"]["storage"]) < 1e-5
    assert ranked[0]["sources"]["storage"] > 0.05 and ranked[0]["sources"]["selection"] > 0.05


@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_bytes_are_the_stored_tensors_and_errors_never_rise_with_the_rank(runs, tiny, policy):
    run, found = runs[policy]
    layers, rows = tiny.shape()["layers"], tiny.shape()["kv_heads"]
    slots = found.reference.kv_bytes // (layers * 2 * rows * D * 4)  # float32 keys and values, every layer
    x = torch.randn(rows, slots, D)
    for row in found.rows()[:-1]:
        stored = seal_low_rank(row["rank"], x, torch.ones(rows, slots, dtype=torch.bool), slots)
        assert row["kv_bytes"] == layers * 2 * stored.nbytes(rows)  # keys and values of every layer
        assert row["bytes_share"] == row["kv_bytes"] / found.reference.kv_bytes
    for res in found.errors.values():
        assert bool((res.error[..., 1:] <= res.error[..., :-1]).all())  # exactly: more rank, never more error
    keys = [row["key_error"] for row in found.rows()[:-1]]
    assert keys == sorted(keys, reverse=True) and keys[-1] < 1e-6


def test_analyze_prints_the_table_and_the_json_replaying_the_runs_model(
    runs, tiny, tmp_path, capsys, monkeypatch
):
    import kvlens.analysis.registry as registry

    run, _ = runs["full"]
    path = run.save(tmp_path / "full")
    monkeypatch.setattr(registry, "replay_model", lambda run, device="auto", dtype=None: tiny)
    assert (
        main(["analyze", "rank_perturbation", "--run", str(path), "--ranks", "4", "--ranks", "16", "--json"])
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in printed["rows"]] == [4, 16, None] and len(
        printed["rank_for_error"]["key"]
    ) == 3
    loaded = registry.analysis_json("rank_perturbation", run, ranks=[4, 16])  # the run's model, as on the CLI
    assert printed == json.loads(json.dumps(loaded))
    assert main(["analyze", "rank_perturbation", "--run", str(path), "--ranks", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:7] == ["rank", "bytes", "key", "err", "value", "err", "KL"]
    assert lines[2].split()[0] == "4" and lines[3].startswith("model dtype")
    with pytest.raises(KvlensError, match="above the model's head size"):
        rank_perturbation(run, tiny, [32])


def test_the_spectrum_command_names_what_each_rank_costs(capsys):
    with pytest.raises(SystemExit):
        main(["analyze", "spectrum", "--help"])
    assert "kvlens analyze rank_perturbation" in capsys.readouterr().out
