"""Cached resources shared by all sessions: the model, run listings and loaded runs.

The model lives in `st.cache_resource` (loaded once, shared read-only by every session; each run
gets its own engine context, so sessions never mix). Loaded runs are read-only too and sit in a
bounded `st.cache_resource` keyed by path and modification time: `st.cache_data` would pickle a
copy of every tensor on each rerun. Small derived results use `st.cache_data(max_entries=...)`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import streamlit as st

from kvlens.errors import KvlensError
from kvlens.runs import RUN_JSON, Run

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
    level: str
    mtime: float
    measured: bool  # has perturbation tensors (--measure)

    @property
    def label(self) -> str:
        return f"{self.name}  ·  {self.policy}  ·  {self.level}" + ("" if self.source == "shipped" else "  (yours)")


def _entry(directory: Path, source: str) -> RunEntry | None:
    manifest = directory / RUN_JSON
    try:
        meta = json.loads(manifest.read_text(encoding="utf-8"))
        policy = str(meta["policy"]["name"])
        level = str((meta.get("record") or {}).get("level", "summary"))
        measured = "perturbation/used" in (meta.get("tensors") or {})
        return RunEntry(str(directory), source, directory.name, policy, level, manifest.stat().st_mtime, measured)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not a run (or unreadable): left out of the picker


@st.cache_data(ttl=5, max_entries=4, show_spinner=False)
def list_runs(cached: str, user: str) -> list[RunEntry]:
    """Runs in the shipped folder, then the user's folder (newest first)."""
    out = []
    for folder, source in ((Path(cached), "shipped"), (Path(user), "yours")):
        if not folder.is_dir():
            continue
        found = [e for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".")
                 if (e := _entry(d, source)) is not None]
        found.sort(key=lambda e: (-e.mtime, e.name) if source == "yours" else (e.name,))
        out += found
    return out


def all_runs() -> list[RunEntry]:
    return list_runs(str(cached_runs_dir()), str(user_runs_dir()))


@st.cache_resource(max_entries=8, show_spinner=False)
def _open_run(path: str, mtime: float) -> Run:
    from kvlens import load_run

    return load_run(path)


def open_run(path: str) -> Run:
    """A loaded run (bounded shared cache; reloaded when the directory changes)."""
    manifest = Path(path) / RUN_JSON
    mtime = manifest.stat().st_mtime if manifest.exists() else 0.0
    return _open_run(path, mtime)


def check_app_model(spec: str) -> str:
    """The app loads 'default' or a hub id; a local path only if the server was started with it
    in $KVLENS_APP_MODEL, so nothing typed into the page reads files elsewhere on the machine."""
    from kvlens.errors import KvlensError

    spec = (spec or "default").strip()
    allowed = os.environ.get("KVLENS_APP_MODEL")
    looks_local = spec.startswith(("/", ".", "~", "\\")) or spec.lower().endswith(".gguf") or \
        Path(spec).expanduser().exists() or ".." in spec.split("/")
    if looks_local and spec != allowed:
        raise KvlensError("The app loads only 'default' or a hub id; to use a local model, start the app "
                          "with KVLENS_APP_MODEL=/path/to/model and type that path.")
    return spec


def get_model(spec: str, device: str):
    """The model, loaded once per (spec, device) and shared by every session."""
    return _load_model(check_app_model(spec), device)


@st.cache_resource(max_entries=2, show_spinner="Loading the model (a few seconds the first time)…")
def _load_model(spec: str, device: str):
    from kvlens.models import load_model

    return load_model(spec, device=device)


def selected_run() -> Run | None:
    """The run chosen in the sidebar, or None (after telling the user why) if there is none."""
    entry = st.session_state.get("app_run_entry")
    if entry is None:
        st.info("No run is selected. Pick one in the sidebar, or make one on the **Run** page.")
        return None
    try:
        return open_run(entry.path)
    except KvlensError as err:
        st.error(str(err))
    except OSError as err:
        st.error(f"The run folder {entry.path} could not be read ({err.strerror or err}).")
    return None


LEVEL_RANK = {"summary": 0, "states": 1, "full": 2}


def require(run: Run, level: str, what: str) -> bool:
    """True if `run` was recorded at `level` or above; else explain which `--record` level to use."""
    have = (run.meta.get("record") or {}).get("level", "summary")
    if LEVEL_RANK.get(have, 0) >= LEVEL_RANK[level]:
        return True
    st.warning(f"{what} needs a run recorded with `--record {level}`; this run was recorded at `{have}`. "
               f"Open one that has it, or make one on the **Run** page with *Record* set to `{level}`.")
    offer_runs(lambda e: LEVEL_RANK.get(e.level, 0) >= LEVEL_RANK[level], "req")
    return False


def offer_runs(accept, key: str) -> None:
    """Buttons opening the runs that `accept(entry)` (at most four)."""
    fitting = [e for e in all_runs() if accept(e)][:4]
    if fitting:
        cols = st.columns(len(fitting))
        for col, e in zip(cols, fitting):
            col.button(f"Open {e.name}", key=f"{key}_{e.name}", on_click=_choose, args=(e.path,))


def _choose(path: str) -> None:
    st.session_state.app_run = path


@st.cache_data(max_entries=64, show_spinner="Computing…")
def _figure(module: str, builder: str, path: str, mtime: float, args: tuple, kwargs: tuple):
    import importlib

    fn = getattr(importlib.import_module(module), builder)
    return fn(_open_run(path, mtime), *args, **dict(kwargs))


def run_figure(builder, run: Run, *args, **kwargs):
    """`builder(run, *args, **kwargs)` (a figure builder of `kvlens.plots*`), cached per run and arguments."""
    manifest = Path(run.path) / RUN_JSON
    return _figure(builder.__module__, builder.__name__, str(run.path), manifest.stat().st_mtime, args,
                   tuple(sorted(kwargs.items())))

