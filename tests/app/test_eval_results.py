"""The Benchmarks page's lm-eval tab: each `kvlens eval --out` folder under the results folder, in a table."""

from __future__ import annotations

import json

from streamlit.testing.v1 import AppTest

from kvlens.ui.eval_results import eval_folders, eval_table
from tests.conftest import ROOT


def _write(folder, policy: str, acc: float) -> None:
    folder.mkdir(parents=True)
    results = {"results": {"kvlens_cloze": {"alias": "kvlens_cloze", "sample_len": 2, "acc,none": acc}}}
    (folder / "results.json").write_text(json.dumps(results))
    summary = {"policy": policy, "ratio": 0.5, "requests": 8, "kept_share": 0.5, "seconds": 3.0}
    (folder / "kvlens.json").write_text(json.dumps(summary))


def test_the_table_has_a_row_per_folder_task_and_metric(tmp_path):
    _write(tmp_path / "eval" / "snapkv", "snapkv", 0.5)
    _write(tmp_path / "full", "full", 1.0)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "kvlens.json").write_text("{}")  # no results.json: not an output folder
    folders = eval_folders(tmp_path)
    assert folders == [tmp_path / "eval" / "snapkv", tmp_path / "full"]
    table = eval_table(folders, tmp_path)
    assert table[["folder", "policy", "metric", "value"]].values.tolist() == [
        ["eval/snapkv", "snapkv", "acc,none", 0.5],
        ["full", "full", "acc,none", 1.0],
    ]


def test_the_benchmarks_page_shows_the_eval_outputs_in_their_tab(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("KVLENS_RESULTS", str(tmp_path / "results"))
    _write(tmp_path / "results" / "eval-snapkv", "snapkv", 0.25)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.run()
    at.switch_page("pages/benchmarks.py")
    at.run()
    assert not at.exception
    assert "lm-eval tasks" in [t.label for t in at.tabs]
    shown = [d.value for d in at.dataframe if "metric" in d.value.columns]
    assert shown and shown[0]["value"].tolist() == [0.25]
