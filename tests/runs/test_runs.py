"""Runs on disk: round trip, atomic saves, and untrusted run directories refused with one sentence."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvlens
from kvlens.engine.loop import RunOptions, run
from kvlens.errors import KvlensError
from kvlens.policies import make_policy
from kvlens.runs.run import DECISIONS, RUN_JSON, TENSORS


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    r = run(
        tiny,
        make_policy("h2o"),
        list(b"Runs are shared between researchers. " * 3),
        prefill=60,
        steps=10,
        teacher=True,
        opts=RunOptions(budget=20, record="attention"),
    )
    return r.save(tmp_path_factory.mktemp("runs") / "good")


def copy_run(saved: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(saved, target)
    return target


def edit_meta(path: Path, change) -> None:
    meta = json.loads((path / RUN_JSON).read_text())
    change(meta)
    (path / RUN_JSON).write_text(json.dumps(meta))


def test_round_trip_keeps_everything(saved):
    r = kvlens.load_run(saved)
    assert r.meta.policy.name == "h2o" and r.meta.budget.slots == 20
    assert r.tensor("attn/0").shape[0] == 10 and r.tensor("prefill/k/1").shape == (2, 60, 16)
    assert r.tensor("steps/kv_slots").max() == 20
    assert len(r.decisions) == r.meta.decisions > 0
    assert list(r.decisions.columns)[:5] == ["step", "layer", "kv_head", "action", "position"]
    with pytest.raises(KvlensError, match="--record"):
        r.tensor("attn/99")


def test_save_replaces_a_run_but_never_other_data(saved, tmp_path):
    r = kvlens.load_run(saved)
    target = tmp_path / "precious"
    target.mkdir()
    (target / "thesis.tex").write_text("years of work")
    with pytest.raises(KvlensError, match="not a kvlens run"):
        r.save(target)
    assert (target / "thesis.tex").read_text() == "years of work"
    again = r.save(tmp_path / "again")
    r.meta.seed = 99
    r.save(again)
    assert kvlens.load_run(again).meta.seed == 99


@pytest.mark.parametrize("failure", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_interrupted_save_leaves_nothing(saved, tmp_path, monkeypatch, failure):
    r = kvlens.load_run(saved)

    def broken(*args, **kwargs):
        raise failure

    monkeypatch.setattr(type(r.decisions), "to_parquet", broken)
    with pytest.raises(type(failure)):
        r.save(tmp_path / "half")
    assert list(tmp_path.iterdir()) == []


def test_interrupted_overwrite_keeps_the_old_run(saved, tmp_path, monkeypatch):
    old = copy_run(saved, tmp_path)
    r = kvlens.load_run(old)
    monkeypatch.setattr(
        type(r.decisions), "to_parquet", lambda *a, **k: (_ for _ in ()).throw(OSError("boom"))
    )
    with pytest.raises(OSError):
        r.save(old)
    assert kvlens.load_run(old).meta.policy.name == "h2o"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_planted_pickle_never_runs(saved, tmp_path):
    bad = copy_run(saved, tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for name in ("tensors.pt", "run.pkl", "decisions.pkl", "tensors.npy"):
        (bad / name).write_bytes(pickle.dumps(Payload()))
    kvlens.load_run(bad)  # loads the real files only
    (bad / TENSORS).write_bytes(pickle.dumps(Payload()))  # a pickle where the tensors belong
    with pytest.raises(KvlensError, match="truncated or corrupt"):
        kvlens.load_run(bad)
    assert not marker.exists()


CORRUPTIONS = {
    "not json": (lambda p: (p / RUN_JSON).write_text("{not json"), "not valid JSON"),
    "newer schema": (
        lambda p: edit_meta(p, lambda m: m.update(schema=99, kvlens_version="9.0")),
        "newer kvlens",
    ),
    "no schema": (lambda p: edit_meta(p, lambda m: m.pop("schema")), "no integer 'schema'"),
    "traversal name": (
        lambda p: edit_meta(p, lambda m: m["tensors"].update({"../../etc/passwd": {}})),
        "not a plain kvlens tensor name",
    ),
    "absolute name": (
        lambda p: edit_meta(p, lambda m: m["tensors"].update({"/etc/passwd": {}})),
        "not a plain kvlens tensor name",
    ),
    "lying shape": (
        lambda p: edit_meta(p, lambda m: m["tensors"]["steps/nll"].update(shape=[999])),
        "contradicts run.json",
    ),
    "missing tensor": (
        lambda p: edit_meta(p, lambda m: m["tensors"].update({"attn/7": {"shape": [1], "dtype": "float16"}})),
        "disagree about tensor",
    ),
    "truncated tensors": (
        lambda p: (p / TENSORS).write_bytes((p / TENSORS).read_bytes()[:500]),
        "truncated or corrupt",
    ),
    "truncated decisions": (
        lambda p: (p / DECISIONS).write_bytes((p / DECISIONS).read_bytes()[:100]),
        "truncated or corrupt",
    ),
    "wrong decision count": (lambda p: edit_meta(p, lambda m: m.update(decisions=1)), "decision table"),
    "missing file": (lambda p: (p / DECISIONS).unlink(), "decisions.parquet is missing"),
    "huge json": (lambda p: (p / RUN_JSON).write_bytes(b" " * (65 << 20)), "larger than"),
    "link out": (
        lambda p: ((p / TENSORS).unlink(), (p / TENSORS).symlink_to("/etc/hostname")),
        "link leading out",
    ),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_untrusted_runs_are_refused_with_one_sentence(saved, tmp_path, kind):
    bad = copy_run(saved, tmp_path)
    corrupt, message = CORRUPTIONS[kind]
    corrupt(bad)
    with pytest.raises(KvlensError, match=message):
        kvlens.load_run(bad)


def test_cli_show_refuses_a_corrupt_run_with_exit_2(saved, tmp_path):
    bad = copy_run(saved, tmp_path)
    (bad / RUN_JSON).write_text("[]")
    proc = subprocess.run(
        [sys.executable, "-m", "kvlens", "show", "--run", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "not a kvlens run manifest" in proc.stderr


ILL_TYPED = {
    "token not an id": (lambda m: m["tokens"].__setitem__(0, "x"), "lacks a valid 'tokens.0' entry"),
    "no model spec": (lambda m: m["model"].pop("spec"), "lacks a valid 'model.spec' entry"),
    "policy a string": (lambda m: m.update(policy="h2o"), "lacks a valid 'policy' entry"),
    "unknown mode": (lambda m: m.update(mode="sing"), "lacks a valid 'mode' entry"),
    "unknown level": (lambda m: m["record"].update(level="most"), "has an unknown record level 'most'"),
}


@pytest.mark.parametrize("kind", sorted(ILL_TYPED))
def test_ill_typed_entries_are_refused_with_one_sentence(saved, tmp_path, kind):
    bad = copy_run(saved, tmp_path)
    change, message = ILL_TYPED[kind]
    edit_meta(bad, change)
    with pytest.raises(KvlensError, match=message) as err:
        kvlens.load_run(bad)
    assert str(err.value).startswith(str(bad / RUN_JSON)) and str(err.value).count(".\n") == 0


def test_older_level_name_and_missing_entries_still_load(saved, tmp_path):
    old = copy_run(saved, tmp_path)
    edit_meta(old, lambda m: (m["record"].update(level="full"), m.pop("storage"), m.pop("prefill_chunk")))
    r = kvlens.load_run(old)
    assert r.meta.record.level == "attention" and r.meta.storage is None
    r.save(tmp_path / "again")  # what run.json lacked stays out
    assert "storage" not in json.loads((tmp_path / "again" / RUN_JSON).read_text())
