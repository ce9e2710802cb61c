"""`scripts/resummarise.py`: a stored grid's summary recomputed from its rows, the rest of the file kept."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kvlens.experiments.bench import tasks
from scripts.resummarise import main

STORED = Path(__file__).resolve().parents[2] / "results" / "kvzap" / "bench_tasks.json"


def test_a_stored_task_grid_gets_the_summary_its_rows_give_and_keeps_everything_else(tmp_path):
    path = tmp_path / "bench_tasks.json"
    shutil.copy(STORED, path)
    before = json.loads(path.read_text())
    before["summary"] = [{"policy": "stale"}]
    path.write_text(json.dumps(before))
    assert main([str(path)]) == 0
    after = json.loads(path.read_text())
    assert after["summary"] == json.loads(json.dumps(tasks.summarise(before["rows"]), default=str))
    assert {k: v for k, v in after.items() if k != "summary"} == {
        k: v for k, v in before.items() if k != "summary"
    }
    assert not path.with_suffix(".png").exists()  # no figure beside it: none drawn
