"""Write a figure as PNG, SVG or PDF (kaleido with a system Chromium), plus its data (CSV) and config (JSON).

`export_figure(fig, "out/fig.png")` writes `out/fig.png`, `out/fig.csv` (every trace's points in
long form: trace, x, y, value, meaning, error) and `out/fig.json` (the analysis, its parameters, the run
and the command that recorded it, kvlens version, and what every CSV column, heatmap value and code
means). Image export needs Chromium: `/usr/bin/chromium`
(Debian's `chromium` package) or a Chrome/Chromium on PATH; without one, a clear `KvlensError`.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import plotly.graph_objects as go

from kvlens.errors import KvlensError
from kvlens.figures.wording import if_none, when
from kvlens.version import __version__

FORMATS = ("png", "svg", "pdf")
CHROMIUM_CANDIDATES = (
    "/usr/bin/chromium",
    "chromium",
    "chromium-browser",
    "google-chrome",
    "google-chrome-stable",
)


def find_chromium() -> str:
    """Path of a Chromium/Chrome executable (BROWSER_PATH first), or a KvlensError saying how to get one."""
    for name in (os.environ.get("BROWSER_PATH"), *CHROMIUM_CANDIDATES):
        path = name and (name if os.path.isfile(name) and os.access(name, os.X_OK) else shutil.which(name))
        if path:
            return path
    raise KvlensError(
        "Image export needs Chromium and none was found; install it (Debian: apt-get install chromium) "
        "or set BROWSER_PATH, or export only the data with a .csv or .json --out."
    )


def image_bytes(fig: go.Figure, fmt: str, scale: float = 2.0) -> bytes:
    """The figure rendered as `fmt` (png, svg or pdf); PNG at `scale` x its layout size."""
    if fmt not in FORMATS:
        raise KvlensError(f"Unknown image format '{fmt}'; choose one of: {', '.join(FORMATS)}.")
    os.environ["BROWSER_PATH"] = find_chromium()
    return fig.to_image(format=fmt, scale=scale if fmt == "png" else 1)


COLUMNS = ["trace", "x", "y", "value", "meaning", "error"]


def _meta(obj) -> dict:
    """The `meta` of a trace or a layout: the dict a builder put there, else none."""
    return obj.meta if isinstance(obj.meta, dict) else {}


def figure_rows(fig: go.Figure) -> list[dict]:
    """Every trace's points in long form (`COLUMNS`): heatmaps one row per cell (empty cells left out,
    `value` the cell's, `meaning` its code's name where the trace has codes), lines one row per point
    (`value` empty)."""
    rows = []
    for i, tr in enumerate(fig.data):
        name = tr.name or f"trace {i}"
        if tr.type == "heatmap":
            codes = {int(k): v for k, v in (_meta(tr).get("codes") or {}).items()}
            z = tr.z or []
            xs = list(if_none(tr.x, range(max(map(len, z), default=0))))
            ys = list(if_none(tr.y, range(len(z))))
            rows += [
                {
                    "trace": name,
                    "x": xs[c],
                    "y": ys[r],
                    "value": v,
                    "meaning": codes.get(int(v)) if codes else None,
                    "error": None,
                }
                for r, zr in enumerate(z)
                for c, v in enumerate(zr)
                if v is not None and v == v
            ]
            continue
        xs, ys = tr.x, tr.y
        if ys is None or all(v is None for v in ys):
            continue
        xs = list(if_none(xs, range(len(ys))))
        err = list(if_none(getattr(getattr(tr, "error_y", None), "array", None), [None] * len(ys)))
        rows += [
            {"trace": name, "x": x, "y": y, "value": None, "meaning": None, "error": e}
            for x, y, e in zip(xs, ys, err, strict=False)
        ]
    return rows


def _axis_title(fig: go.Figure, letter: str) -> str:
    titles = [
        fig.layout[k].title.text
        for k in fig.layout
        if k.startswith(f"{letter}axis") and fig.layout[k].title.text
    ]
    return "; ".join(dict.fromkeys(titles)) or "(untitled axis)"


def describe_columns(fig: go.Figure) -> dict:
    """What every column of the figure's CSV means, and each heatmap trace's value and codes: written into
    the figure's JSON beside the CSV (`columns`, `values`)."""
    values = {}
    for i, tr in enumerate(fig.data):
        if tr.type != "heatmap":
            continue
        meta = _meta(tr)
        bar = tr.colorbar.title.text
        what = meta.get("value") or "the cell's colour value" + when(bar, f": {bar}")
        entry: dict = {"value": what}
        if meta.get("codes"):
            entry["codes"] = {str(k): v for k, v in meta["codes"].items()}
        values[tr.name or f"trace {i}"] = entry
    return {
        "columns": {
            "trace": "the series (the legend's name, or the heatmap's)",
            "x": f"the horizontal axis: {_axis_title(fig, 'x')}",
            "y": f"the vertical axis: {_axis_title(fig, 'y')} (for a line, the plotted value)",
            "value": "a heatmap cell's value (see `values`: what each trace's value is); empty for lines",
            "meaning": "the name of a heatmap cell's code, for traces whose values are codes (see `values`)",
            "error": "the error bar's size at the point (empty: none)",
        },
        "values": values,
    }


def write_csv(fig: go.Figure, path: str | Path) -> Path:
    path = Path(path)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in figure_rows(fig):
            writer.writerow({k: f"{v:.7g}" if isinstance(v, float) else v for k, v in row.items()})
    return path


def figure_config(fig: go.Figure) -> dict:
    """What reproduces the figure: the builder's `layout.meta` (analysis, parameters, run) plus versions."""
    meta = _meta(fig.layout)
    return {"kvlens_version": __version__, "title": fig.layout.title.text, **meta, **describe_columns(fig)}


def export_figure(
    fig: go.Figure, out: str | Path, scale: float = 2.0, command: str | None = None
) -> list[Path]:
    """Write `out` (.png/.svg/.pdf image, or .csv/.json only) and the CSV + JSON beside it; returns the
    paths."""
    out = Path(out)
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in (*FORMATS, "csv", "json"):
        raise KvlensError(f"--out must end in .png, .svg, .pdf, .csv or .json; got '{out.name}'.")
    if not out.parent.is_dir():
        raise KvlensError(f"The folder {out.parent} does not exist.")
    written = []
    if fmt in FORMATS:
        data = image_bytes(fig, fmt, scale)
        out.write_bytes(data)
        written.append(out)
    config = figure_config(fig)
    if command:
        config["command"] = command
    written.append(write_csv(fig, out.with_suffix(".csv")))
    json_path = out.with_suffix(".json")
    json_path.write_text(json.dumps(config, indent=1, default=str))
    written.append(json_path)
    return written
