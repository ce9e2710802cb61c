"""Export: valid PNG, SVG and PDF through kaleido + Chromium, the figure's data as CSV and its config as
JSON."""

from __future__ import annotations

import csv
import json
import os

import pytest

from kvlens.analysis.kinds.adjacency import adjacency_figure
from kvlens.analysis.kinds.similarity import similarity_figure
from kvlens.cli import main
from kvlens.errors import KvlensError
from kvlens.figures import export
from tests.conftest import ROOT, every_figure, tiny_run

CHROMIUM = os.path.exists("/usr/bin/chromium")
needs_chromium = pytest.mark.skipif(
    not CHROMIUM,
    reason="/usr/bin/chromium is not installed (`make test` installs "
    "Debian's chromium package); image export needs it",
)

MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-"}


@pytest.fixture(scope="module")
def fig():
    return adjacency_figure(tiny_run())


@needs_chromium
@pytest.mark.parametrize("fmt", ["png", "svg", "pdf"])
def test_export_writes_a_valid_image_with_csv_and_json(fig, tmp_path, fmt):
    out = tmp_path / f"adjacency.{fmt}"
    written = export.export_figure(fig, out, command="kvlens figure adjacency --run r --out x")
    assert written == [out, out.with_suffix(".csv"), out.with_suffix(".json")]
    data = out.read_bytes()
    if fmt == "svg":
        assert data.lstrip().startswith(b"<svg") and b"</svg>" in data[-200:]
    else:
        assert data.startswith(MAGIC[fmt])
    assert len(data) > 2000
    config = json.loads(out.with_suffix(".json").read_text())
    assert config["analysis"] == "adjacency" and config["command"].startswith("kvlens figure")


def test_csv_holds_every_trace_point(fig, tmp_path):
    export.export_figure(fig, tmp_path / "adj.csv")  # data only: no Chromium needed
    rows = list(csv.DictReader((tmp_path / "adj.csv").open()))
    points = sum(len(t.y) for t in fig.data)
    assert len(rows) == points
    keys = [r for r in rows if r["trace"] == "keys"]
    assert [float(r["y"]) for r in keys] == pytest.approx(
        list(next(t for t in fig.data if t.name == "keys").y)
    )


def test_heatmap_csv_is_long_form(tmp_path):
    fig = similarity_figure(tiny_run(), 0, 0, "key", max_size=10)
    rows = export.figure_rows(fig)
    assert len(rows) == 55 and {r["trace"] for r in rows} == {"key"}  # lower triangle: empty cells left out
    assert (rows[1]["x"], rows[1]["y"]) == (fig.data[0].x[0], fig.data[0].y[1])
    assert rows[1]["value"] == fig.data[0].z[1][0]


def test_missing_chromium_is_one_clear_sentence(fig, tmp_path, monkeypatch):
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-browser"))
    monkeypatch.setattr(export, "CHROMIUM_CANDIDATES", ("/nonexistent/chromium", "no-such-browser-xyz"))
    with pytest.raises(KvlensError, match="needs Chromium"):
        export.export_figure(fig, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_unknown_suffix_is_refused(fig, tmp_path):
    with pytest.raises(KvlensError, match="must end in"):
        export.export_figure(fig, tmp_path / "x.gif")


@needs_chromium
def test_cli_figure_writes_image_csv_and_json(tmp_path, capsys):
    tiny_run(str(tmp_path / "run"))
    out = tmp_path / "sim.svg"
    assert (
        main(
            [
                "figure",
                "similarity",
                "--run",
                str(tmp_path / "run"),
                "--layer",
                "1",
                "--state",
                "key,value",
                "--max-size",
                "40",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert out.read_bytes().lstrip().startswith(b"<svg")
    config = json.loads(out.with_suffix(".json").read_text())
    assert config["params"] == {"layer": 1, "head": 0, "kind": ["key", "value"], "max_size": 40}
    assert (
        main(
            [
                "figure",
                "similarity",
                "--run",
                str(tmp_path / "run"),
                "--state",
                "keys",
                "--out",
                str(tmp_path / "y.png"),
            ]
        )
        == 2
    )


def test_a_notebooks_run_figure_is_the_cli_figure(tmp_path, capsys):
    from kvlens import load_run

    tiny_run(str(tmp_path / "run"))
    assert (
        main(
            [
                "figure",
                "gaussian",
                "--run",
                str(tmp_path / "run"),
                "--layer",
                "1",
                "--threshold",
                "0.5",
                "--sigma",
                "2",
                "--out",
                str(tmp_path / "cli.csv"),
            ]
        )
        == 0
    )
    fig = load_run(tmp_path / "run").figure("gaussian", layer=1, threshold=0.5, sigma=[2.0])
    export.export_figure(fig, tmp_path / "notebook.csv")
    assert (tmp_path / "notebook.csv").read_text() == (tmp_path / "cli.csv").read_text()
    cli, notebook = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("cli", "notebook"))
    assert (
        cli["params"]
        == notebook["params"]
        == {
            "layer": 1,
            "head": 0,
            "threshold": 0.5,
            "position": None,
            "sigmas": ["mean_distance", "eq7", 2.0],
        }
    )


@pytest.mark.parametrize("name", list(every_figure()))
def test_every_exported_csv_column_heatmap_value_and_code_is_described(name, tmp_path):
    fig = every_figure()[name]
    written = export.export_figure(fig, tmp_path / "fig.csv")
    header = next(csv.reader(written[0].open()))
    described = json.loads(written[1].read_text())
    assert header == export.COLUMNS and set(described["columns"]) == set(header)
    heatmaps = {t.name for t in fig.data if t.type == "heatmap"}
    assert set(described["values"]) == heatmaps
    for trace, what in described["values"].items():
        assert what["value"] != "the cell's colour value", (
            f"{name}: heatmap {trace!r} says nothing of its value"
        )
    rows = list(csv.DictReader(written[0].open()))
    for row in rows:
        codes = described["values"].get(row["trace"], {}).get("codes")
        if codes:
            assert row["meaning"] == codes[str(int(float(row["value"])))]


SHIPPED = sorted((ROOT / "docs" / "img").glob("*.csv"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_figure_csv_has_the_exporters_columns_and_its_json_describes_them(path):
    """docs/img's figure data reads as `kvlens figure` writes it now: the exporter's plain column names (a
    heatmap's cells in `value`, no log column) and, in the JSON beside it, a sentence for every column and
    for the value of every heatmap trace the CSV holds."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
        header = list(rows[0]) if rows else []
    described = json.loads(path.with_suffix(".json").read_text())
    assert header == export.COLUMNS and set(described["columns"]) == set(export.COLUMNS)
    assert all(isinstance(v, str) and v for v in described["columns"].values())
    cells = {r["trace"] for r in rows if r["value"] != ""}  # heatmap rows carry a value
    assert cells == set(described["values"])
    assert all(described["values"][t]["value"] != "the cell's colour value" for t in cells)
