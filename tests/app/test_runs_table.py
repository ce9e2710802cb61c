"""The runs table (kvlens.figures.run_table), zip export/import/delete (kvlens.runs.archive), the `steps`
overlay analysis and the Runs page under AppTest."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import zipfile
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from kvlens import load_run
from kvlens.analysis.registry import analysis_figure
from kvlens.errors import KvlensError
from kvlens.figures.run_table import filter_table, run_table
from kvlens.runs.archive import delete_run, export_run, import_run
from kvlens.runs.run import MAX_JSON_BYTES
from tests.conftest import CACHED_RUNS, ROOT

FILES = ("run.json", "tensors.safetensors", "decisions.parquet")


def shipped() -> list[tuple[Path, str]]:
    return [(p, "shipped") for p in sorted(CACHED_RUNS.iterdir()) if (p / "run.json").is_file()]


@pytest.fixture
def mine_runs_dir(tmp_path) -> Path:
    """A user runs folder holding a copy of the small shipped run as `mine`."""
    shutil.copytree(CACHED_RUNS / "tova-summary", tmp_path / "runs" / "mine")
    return tmp_path / "runs"


def zip_of(members: dict[str, bytes]) -> io.BytesIO:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    buffer.seek(0)
    return buffer


def run_files(path: Path, folder: str = "r") -> dict[str, bytes]:
    return {f"{folder}/{name}": (path / name).read_bytes() for name in FILES}


# ---- the index ----


def test_the_table_holds_every_shipped_run_with_its_run_json_values():
    frame, skipped = run_table(shipped())
    assert skipped == [] and list(frame["name"]) == [p.name for p, _ in shipped()]
    for row in frame.to_dict("records"):
        meta = json.loads((Path(row["path"]) / "run.json").read_text())
        m = meta["metrics"]
        assert row["policy"] == meta["policy"]["name"] and row["new tokens"] == len(meta["tokens"])
        assert row["ppl"] == pytest.approx(m["ppl"])
        assert row["peak KV (MiB)"] == pytest.approx(m["kv_bytes_peak"] / 2**20)
        assert (
            (row["KL"] == pytest.approx(m["kl"])) if "kl" in m else row["KL"] != row["KL"]
        )  # NaN when not measured
    cam = frame.set_index("name").loc["cam-attention"]
    assert (
        cam["params"] == "base=h2o"
        and cam["budget"] == "48 slots"
        and cam["model"] == "SmolLM2-135M-Instruct"
    )
    assert frame.set_index("name").loc["full-states", "budget"] == "none"


def test_the_table_reads_run_json_only_and_says_which_folders_it_left_out(mine_runs_dir):
    (mine_runs_dir / "mine" / "tensors.safetensors").write_bytes(b"not tensors")  # the table never opens it
    (mine_runs_dir / "junk").mkdir()
    (mine_runs_dir / "junk" / "run.json").write_text("{not json")
    frame, skipped = run_table([(mine_runs_dir / "mine", "yours"), (mine_runs_dir / "junk", "yours")])
    assert list(frame["name"]) == ["mine"] and frame["source"].tolist() == ["yours"]
    assert len(skipped) == 1 and "junk/run.json is not valid JSON" in skipped[0]


def test_filtering_keeps_rows_holding_every_word_and_the_chosen_policies():
    frame, _ = run_table(shipped())
    assert filter_table(frame, "ATTENTION h2o")["name"].tolist() == [
        "cam-attention",
        "h2o-attention",
    ]  # base=h2o
    assert filter_table(frame, "", ["tova", "full"])["name"].tolist() == ["full-states", "tova-summary"]
    assert filter_table(frame, "attention", ["tova"]).empty
    assert len(filter_table(frame, "  ")) == len(frame)


# ---- zip export, import, delete ----


def test_export_then_import_gives_an_identical_run(mine_runs_dir, tmp_path):
    source = CACHED_RUNS / "cam-attention"
    target = import_run(io.BytesIO(export_run(source)), mine_runs_dir, "upload.zip")
    assert target == mine_runs_dir / "cam-attention"
    for name in FILES:
        assert (target / name).read_bytes() == (source / name).read_bytes()
    a, b = load_run(source), load_run(target)
    assert a.meta == b.meta and a.decisions.equals(b.decisions)
    assert a.tensors.keys() == b.tensors.keys() and all(
        torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors
    )
    assert (
        abs((target / "run.json").stat().st_mtime - (source / "run.json").stat().st_mtime) <= 2
    )  # zip: 2 s steps


def test_import_never_overwrites_a_run(mine_runs_dir):
    before = {name: (mine_runs_dir / "mine" / name).read_bytes() for name in FILES}
    other = CACHED_RUNS / "h2o-attention"
    first = import_run(zip_of(run_files(other, "mine")), mine_runs_dir, "mine.zip")
    top = {k.removeprefix("mine/"): v for k, v in run_files(other, "mine").items()}
    second = import_run(zip_of(top), mine_runs_dir, "mine.zip")  # files at the top: named after the zip
    assert (first.name, second.name) == ("mine-2", "mine-3")
    assert {name: (mine_runs_dir / "mine" / name).read_bytes() for name in FILES} == before
    assert load_run(second).meta.policy.name == "h2o"


def _bad_archives(tmp_path: Path) -> dict[str, tuple[object, str]]:
    good = run_files(CACHED_RUNS / "tova-summary")
    corrupt = {**good, "r/tensors.safetensors": good["r/tensors.safetensors"][:100]}
    link = io.BytesIO()
    with zipfile.ZipFile(link, "w") as zf:
        info = zipfile.ZipInfo("r/run.json")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, "/etc/passwd")
    link.seek(0)
    big = io.BytesIO()
    with zipfile.ZipFile(big, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("r/run.json", b" " * (MAX_JSON_BYTES + 1))
    big.seek(0)
    damaged = bytearray(zip_of(good).getvalue())
    damaged[damaged.index(good["r/run.json"][:64]) + 10] ^= (
        1  # one bit of run.json's stored bytes: its CRC fails
    )
    plain = tmp_path / "notes.zip"
    plain.write_text("these are notes, not a zip")
    return {
        "not a zip": (plain, "notes.zip is not a zip archive (or it is damaged)."),
        "no run.json": (
            zip_of({k: v for k, v in good.items() if not k.endswith("run.json")}),
            "x.zip holds no run.json, so it is not a kvlens run.",
        ),
        "no tensors": (
            zip_of({k: v for k, v in good.items() if not k.endswith("safetensors")}),
            "x.zip holds no tensors.safetensors, so it is not a complete kvlens run.",
        ),
        "traversal": (
            zip_of({**good, "../run.json": b"{}"}),
            "x.zip names a file outside its folder ('../run.json'); refusing to unpack it.",
        ),
        "absolute": (
            zip_of({"/tmp/r/run.json": b"{}"}),
            "x.zip names a file outside its folder ('/tmp/r/run.json'); refusing to unpack it.",
        ),
        "link": (link, "x.zip holds a link ('r/run.json'); refusing to unpack it."),
        "other file": (
            zip_of({**good, "r/evil.py": b"import os"}),
            "x.zip holds 'r/evil.py', which is not part of a kvlens run (run.json, tensors.safetensors, "
            "decisions.parquet).",
        ),
        "two folders": (
            zip_of({**good, "s/decisions.parquet": b""}),
            "x.zip holds files in more than one folder; zip one run at a time.",
        ),
        "too large": (big, "x.zip: run.json is larger than 64 MB; refusing to unpack it."),
        "damaged": (io.BytesIO(bytes(damaged)), "x.zip is damaged (BadZipFile); nothing was imported."),
        "invalid": (
            zip_of(corrupt),
            "x.zip is not a valid kvlens run: tensors.safetensors is truncated or corrupt",
        ),
    }


@pytest.mark.parametrize(
    "kind",
    [
        "not a zip",
        "no run.json",
        "no tensors",
        "traversal",
        "absolute",
        "link",
        "other file",
        "two folders",
        "too large",
        "damaged",
        "invalid",
    ],
)
def test_each_kind_of_bad_zip_is_refused_with_its_sentence_and_leaves_nothing(kind, mine_runs_dir, tmp_path):
    archive, sentence = _bad_archives(tmp_path)[kind]
    with pytest.raises(KvlensError) as err:
        import_run(archive, mine_runs_dir, "" if isinstance(archive, Path) else "x.zip")
    assert str(err.value).startswith(sentence) and "\n" not in str(err.value)
    assert sorted(p.name for p in mine_runs_dir.iterdir()) == ["mine"]  # no new run, no temporary folder left
    assert not (tmp_path / "run.json").exists() and not Path("/tmp/r").exists()


def test_delete_removes_only_runs_inside_the_runs_folder(mine_runs_dir, tmp_path):
    shipped_copy = tmp_path / "cached" / "tova-summary"
    shutil.copytree(CACHED_RUNS / "tova-summary", shipped_copy)
    with pytest.raises(KvlensError, match="is not one of your runs"):
        delete_run(shipped_copy, mine_runs_dir)
    (mine_runs_dir / "empty").mkdir()
    with pytest.raises(KvlensError, match="is not a kvlens run; nothing was deleted"):
        delete_run(mine_runs_dir / "empty", mine_runs_dir)
    os.symlink(shipped_copy, mine_runs_dir / "alias")
    with pytest.raises(KvlensError, match="is not one of your runs"):
        delete_run(mine_runs_dir / "alias", mine_runs_dir)
    delete_run(mine_runs_dir / "mine", mine_runs_dir)
    assert sorted(p.name for p in mine_runs_dir.iterdir()) == ["alias", "empty"]
    assert (shipped_copy / "run.json").is_file()


def test_export_refuses_a_folder_that_is_not_a_valid_run(mine_runs_dir):
    (mine_runs_dir / "mine" / "decisions.parquet").unlink()
    with pytest.raises(KvlensError, match="decisions.parquet is missing"):
        export_run(mine_runs_dir / "mine")


# ---- the overlay analysis ----


def test_the_steps_overlay_draws_each_runs_curves_and_perturbation_only_where_measured():
    cam, tova = load_run(CACHED_RUNS / "cam-attention"), load_run(CACHED_RUNS / "tova-summary")
    fig = analysis_figure("steps", [cam, tova])
    by = {(t.name, t.xaxis): t for t in fig.data}
    assert set(by) == {
        ("cam-attention", "x"),
        ("cam-attention", "x2"),
        ("cam-attention", "x3"),
        ("tova-summary", "x"),
        ("tova-summary", "x2"),
    }
    assert list(by["tova-summary", "x"].y) == pytest.approx(tova.tensor("steps/nll").tolist())
    assert list(by["cam-attention", "x2"].y) == pytest.approx(
        cam.tensor("steps/kv_slots").float().flatten(1).mean(1).tolist()
    )
    pert = by["cam-attention", "x3"]
    assert pert.x[0] == 1 and list(pert.y) == pytest.approx(
        cam.tensor("perturbation/used").mean(dim=(1, 2)).tolist()
    )
    assert len(analysis_figure("steps", [tova]).layout.annotations) == 2  # no perturbation panel at all
    assert [t.name for t in analysis_figure("steps", [tova, tova], label=["a"]).data[::2]] == [
        "a",
        "tova-summary",
    ]


# ---- the page ----


@pytest.fixture
def runs_page(mine_runs_dir, monkeypatch):
    monkeypatch.setenv("KVLENS_RUNS", str(mine_runs_dir))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120).run()
    at.switch_page("pages/runs.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def select(at: AppTest, rows: list[int], text: str = "", policies=()) -> AppTest:
    from kvlens.ui.runs_table import table_key

    at.session_state[table_key(0, text, list(policies))] = {
        "selection": {"rows": rows, "columns": [], "cells": []}
    }
    return at.run()


def shown_names(at: AppTest) -> list[str]:
    return list(at.dataframe[0].value["name"])


def test_runs_page_lists_filters_overlays_and_opens_a_run(runs_page):
    assert shown_names(runs_page) == [p.name for p, _ in shipped()] + ["mine"]
    runs_page.text_input(key="runs_filter").set_value("summary").run()
    assert shown_names(runs_page) == ["tova-summary", "mine"]
    select(runs_page, [0, 1], "summary")
    spec = json.loads(runs_page.get("plotly_chart")[0].proto.spec)
    assert {t["name"] for t in spec["data"]} == {"tova-summary", "mine"}
    assert runs_page.button(key="runs_open").disabled  # a shipped one too
    assert runs_page.button(key="runs_delete").disabled
    select(runs_page, [1], "summary")
    assert not runs_page.button(key="runs_delete").disabled
    assert runs_page.get("download_button")[0].label == "Download .zip"
    runs_page.button(key="runs_open").click().run()
    assert not runs_page.exception and runs_page.session_state["app_run"].endswith("/mine")
    assert runs_page.title[0].value == "kvlens"  # the Overview page


def test_runs_page_deletes_one_of_your_runs_after_confirming(runs_page, mine_runs_dir):
    select(runs_page, [len(shipped())])  # `mine`
    runs_page.button(key="runs_delete").click().run()
    assert (mine_runs_dir / "mine").is_dir()  # only asked so far
    runs_page.button(key="runs_delete_yes").click().run()
    assert not runs_page.exception and not (mine_runs_dir / "mine").exists()
    assert shown_names(runs_page) == [p.name for p, _ in shipped()]


def test_the_table_shows_each_prompt_and_groups_runs_by_their_text():
    frame, _ = run_table(shipped())
    by = frame.set_index("name")
    prompts = {p.name: load_run(p).meta.prompt_tokens for p, _ in shipped()}
    for a in prompts:
        assert by.loc[a, "prompt"].split()[:3] == load_run(CACHED_RUNS / a).meta.prompt.split()[:3]
        for b in prompts:
            assert (by.loc[a, "text"] == by.loc[b, "text"]) == (prompts[a] == prompts[b]), (a, b)
    assert by.loc["full-states", "text"] != by.loc["h2o-attention", "text"]  # 4.25 and 2.72: other texts


def test_the_runs_page_says_when_its_metrics_span_several_texts(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_RUNS", str(tmp_path / "runs"))  # the shipped runs only
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.run()
    at.switch_page("pages/runs.py").run()
    assert not at.exception
    assert any("on 2 different texts" in c.value for c in at.caption)


def test_the_key_columns_come_first_and_fit_a_laptop_window_without_scrolling_sideways():
    """Name, text, prompt, policy, budget, ppl, peak KV, KL and perturbation lead the table, each with a width
    in pixels, and together (with the selection column) fit the content of a 1280-px window."""
    from kvlens.ui import runs_table as rt

    assert rt.ORDER[: len(rt.KEY_COLUMNS)] == rt.KEY_COLUMNS
    assert rt.KEY_COLUMNS[:5] == ["name", "text", "prompt", "policy", "budget"]
    assert {"ppl", "peak KV (MiB)"} <= set(rt.KEY_COLUMNS)
    frame, _ = run_table(shipped())
    assert set(rt.ORDER) <= set(frame.columns)  # every column shown is one the table has
    widths = [rt.COLUMN_CONFIG[c]["width"] for c in rt.KEY_COLUMNS]
    assert all(isinstance(w, int) for w in widths)
    assert sum(widths) + 35 <= rt.KEY_WIDTH  # 35 px: the row selection's check boxes
