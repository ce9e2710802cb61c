"""docs/notebook.md runs: every python block, in order, in one namespace (as a notebook would), and the
figure a notebook gets is the one `kvlens figure` exports."""

from __future__ import annotations

import re

import plotly.graph_objects as go
import pytest

from kvlens import load_run
from kvlens.cli import main
from kvlens.figures.export import write_csv
from tests.conftest import CACHED_RUNS, ROOT

DOC = ROOT / "docs" / "notebook.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


@pytest.mark.slow  # its last cell loads the embedded model
def test_every_cell_of_the_notebook_doc_runs_in_order(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    cells = blocks()
    assert len(cells) >= 5
    namespace: dict = {}
    for i, code in enumerate(cells):
        exec(compile(code, f"docs/notebook.md cell {i + 1}", "exec"), namespace)
    out = capsys.readouterr().out
    figures = [namespace[n] for n in ("occupancy", "attention", "merges", "steps", "compared")]
    assert all(isinstance(f, go.Figure) and f.data for f in figures)
    assert [f.layout.meta["analysis"] for f in figures[:2]] == ["occupancy", "attention"]
    assert {t.name for t in namespace["steps"].data} == {
        "adakv-heads",
        "cam-attention",
        "h2o-attention",
        "streaming_llm-attention",
    }  # the shipped runs at 48 slots
    assert {t.name for t in namespace["compared"].data} == {"streaming_llm", "h2o"}
    assert re.search(r"streaming_llm +ppl \d+\.\d{3} +KL \d\.\d{4}", out) and re.search(r"h2o +ppl", out)
    assert all(r.metrics["kv_slots_max"] == 32 for r in namespace["results"].values())


def test_a_notebook_figure_is_the_one_kvlens_figure_exports(tmp_path):
    run_dir = CACHED_RUNS / "cam-attention"
    assert (
        main(
            [
                "figure",
                "attention",
                "--run",
                str(run_dir),
                "--layer",
                "15",
                "--head",
                "1",
                "--out",
                str(tmp_path / "cli.csv"),
            ]
        )
        == 0
    )
    write_csv(load_run(run_dir).figure("attention", layer=15, head=1), tmp_path / "notebook.csv")
    cli = (tmp_path / "cli.csv").read_text()
    assert cli == (tmp_path / "notebook.csv").read_text() and len(cli.splitlines()) > 1000
