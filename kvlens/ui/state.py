"""Cached resources shared by all sessions: the model, run listings and loaded runs.

The model lives in `st.cache_resource` (loaded once, shared read-only by every session; each run
gets its own engine context, so sessions never mix). Loaded runs are read-only too and sit in a
bounded `st.cache_resource` keyed by path and modification time: `st.cache_data` would pickle a
copy of every tensor on each rerun. Figures of registered analyses (`run_figure`) are small and use
`st.cache_data(max_entries=...)`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

from kvlens.errors import KvlensError
from kvlens.figures.wording import when
from kvlens.levels import RecordLevel
from kvlens.policies import REGISTRY
from kvlens.runs.run import RUN_JSON, Run, read_meta

ROOT = Path(__file__).resolve().parents[2]
CACHED_DIR = ROOT / "cached_runs"


def user_runs_dir() -> Path:
    """Where the app saves new runs: $KVLENS_RUNS or `runs/` beside app.py (gitignored)."""
    return Path(os.environ.get("KVLENS_RUNS") or ROOT / "runs")


def cached_runs_dir() -> Path:
    """Shipped runs: $KVLENS_CACHED_RUNS (tests point it at an empty folder) or `cached_runs/`."""
    return Path(os.environ.get("KVLENS_CACHED_RUNS") or CACHED_DIR)


@dataclass(frozen=True)
class RunEntry:
    """One run directory as the picker shows it."""

    path: str
    source: str  # "shipped" or "yours"
    name: str
    policy: str
    level: RecordLevel
    mtime: float
    measured: bool  # has perturbation tensors (--measure)

    @property
    def merging(self) -> bool:
        """Whether its policy merges slots (the policy class's `merge_rule` is set)."""
        return getattr(REGISTRY.get(self.policy), "merge_rule", None) is not None

    @property
    def label(self) -> str:
        return f"{self.name}  ·  {self.policy}  ·  {self.level}" + when(self.source != "shipped", "  (yours)")


def _entry(directory: Path, source: str) -> RunEntry | None:
    try:
        meta = read_meta(directory)
        mtime = (directory / RUN_JSON).stat().st_mtime
    except (OSError, KvlensError):
        return None  # not a run (or unreadable): left out of the picker
    measured = "perturbation/used" in meta.tensors
    return RunEntry(
        str(directory), source, directory.name, meta.policy.name, meta.record.level, mtime, measured
    )


@st.cache_data(ttl=5, max_entries=4, show_spinner=False)
def list_runs(cached: str, user: str) -> list[RunEntry]:
    """Runs in the shipped folder, then the user's folder (newest first)."""
    out = []
    for folder, source in ((Path(cached), "shipped"), (Path(user), "yours")):
        if not folder.is_dir():
            continue
        found = [
            e
            for d in folder.iterdir()
            if d.is_dir() and not d.name.startswith(".")
            if (e := _entry(d, source)) is not None
        ]
        found.sort(key=lambda e: (-e.mtime, e.name) if source == "yours" else (e.name,))
        out += found
    return out


def all_runs() -> list[RunEntry]:
    return list_runs(str(cached_runs_dir()), str(user_runs_dir()))


@st.cache_resource(max_entries=8, show_spinner=False)
def _open_run(path: str, mtime: float) -> Run:
    from kvlens.runs.run import load_run

    return load_run(path)


def open_run(path: str) -> Run:
    """A loaded run (bounded shared cache; reloaded when the directory changes)."""
    return _open_run(path, stamp(path))


def stamp(path: str) -> float:
    """When the run's manifest last changed (0 without one): what the caches of a run directory key on."""
    manifest = Path(path) / RUN_JSON
    return manifest.stat().st_mtime if manifest.exists() else 0.0


def check_app_model(spec: str) -> str:
    """The app loads 'default' or a hub id; a local path only if the server was started with it
    in $KVLENS_APP_MODEL, so nothing typed into the page reads files elsewhere on the machine."""
    spec = (spec or "default").strip()
    allowed = os.environ.get("KVLENS_APP_MODEL")
    looks_local = (
        spec.startswith(("/", ".", "~", "\\"))
        or spec.lower().endswith(".gguf")
        or Path(spec).expanduser().exists()
        or ".." in spec.split("/")
    )
    if looks_local and spec != allowed:
        raise KvlensError(
            "The app loads only 'default' or a hub id; to use a local model, start the app "
            "with KVLENS_APP_MODEL=/path/to/model and type that path."
        )
    return spec


def get_model(spec: str, device: str):
    """The model, loaded once per (spec, device) and shared by every session."""
    return _load_model(check_app_model(spec), device)


@st.cache_resource(max_entries=2, show_spinner="Loading the model (a few seconds the first time)…")
def _load_model(spec: str, device: str):
    from kvlens.engine.models import load_model

    return load_model(spec, device=device)


@st.cache_data(max_entries=64, show_spinner="Computing…")
def _figure(kind: str, path: str, mtime: float, params: tuple):
    from kvlens.analysis.registry import get_analysis

    run = _open_run(path, mtime)
    if get_analysis(kind).replays:  # the app's own copy of the run's model (`get_model`: no local paths)
        return run.figure(kind, model=get_model(run.meta.model.spec, "auto"), **dict(params))
    return run.figure(kind, **dict(params))


def run_figure(run: Run, kind: str, **params):
    """`run.figure(kind, **params)`: the registered analysis' figure, as `kvlens figure` draws it, cached
    per run and parameters (an analysis that replays the run gets the app's copy of its model)."""
    manifest = Path(run.path) / RUN_JSON
    return _figure(kind, str(run.path), manifest.stat().st_mtime, tuple(sorted(params.items())))


@st.cache_resource(max_entries=4, show_spinner="Reading every layer's attention rows…")
def _head_grid(path: str, mtime: float):
    from kvlens.figures.head_grid import head_grid

    return head_grid(_open_run(path, mtime))


def run_head_grid(run: Run):
    """`kvlens.figures.head_grid.head_grid(run)`, computed once per run and shared read-only (scrubbing the
    step then only slices it)."""
    manifest = Path(run.path) / RUN_JSON
    return _head_grid(str(run.path), manifest.stat().st_mtime)
