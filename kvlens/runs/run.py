"""A run on disk: `run.json` + `tensors.safetensors` + `decisions.parquet`.

Saving is atomic (a temporary directory beside the target, then a rename). Loading is safe for
files from strangers: no pickle, fixed file names (never taken from the manifest), size limits,
every run.json entry validated (`RunMeta`), every tensor's dtype and shape checked against the manifest.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from kvlens.errors import KvlensError
from kvlens.levels import RecordLevel
from kvlens.runs.decisions import COLUMNS, decisions_frame
from kvlens.runs.meta import SCHEMA_VERSION, RunMeta, TensorInfo
from kvlens.version import __version__

RUN_JSON, TENSORS, DECISIONS = "run.json", "tensors.safetensors", "decisions.parquet"
MAX_JSON_BYTES = 64 << 20
MAX_TENSOR_BYTES = 8 << 30


# What `Run.figure` and `Run.analyze` call: the analyses sit above the run format, so this module names
# none of them; `kvlens.analysis.registry` installs its dispatcher here when imported (`import kvlens` does).
_ANALYSES: dict[str, Callable] = {}


def set_analyses(figure: Callable, analyze: Callable) -> None:
    """Install the analysis dispatcher: `figure(kind, run, **params)` -> a plotly figure and
    `analyze(kind, run, **params)` -> a JSON-able dict (`kvlens.analysis.registry` installs its own)."""
    _ANALYSES.update(figure=figure, analyze=analyze)


def _analyses(what: str) -> Callable:
    if what not in _ANALYSES:
        raise KvlensError(
            "No analyses are installed for Run.figure and Run.analyze; import kvlens (which "
            "installs its analysis registry) first."
        )
    return _ANALYSES[what]


@dataclass
class Run:
    """One recorded run: `meta` its run.json (`RunMeta`), `tensors` named CPU tensors, `decisions` a table."""

    meta: RunMeta
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    decisions: pd.DataFrame = field(default_factory=decisions_frame)
    path: Path | None = None

    @property
    def shape(self) -> dict:
        return self.meta.model.shape

    @property
    def metrics(self) -> dict:
        return self.meta.metrics

    def tokens(self) -> list[int]:
        """Prompt (or prefill) tokens followed by the generated (or scored) tokens."""
        return self.meta.prompt_tokens + self.meta.tokens

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            level = RecordLevel.ATTENTION if name.startswith("attn") else RecordLevel.STATES
            raise KvlensError(f"This run has no tensor '{name}'; record it with --record {level}.")
        return self.tensors[name]

    def figure(self, kind: str, **params):
        """The plotly figure of the analysis `kind` on this run: the one `kvlens figure KIND` and the app
        draw."""
        return _analyses("figure")(kind, self, **params)

    def analyze(self, kind: str, **params) -> dict:
        """The analysis `kind` on this run as a dict: what `kvlens analyze KIND --json` prints."""
        return _analyses("analyze")(kind, self, **params)

    def save(self, path: str | Path) -> Path:
        """Write the run atomically; an existing run directory at `path` is replaced, anything else
        refused."""
        from safetensors.torch import save_file

        target = Path(path)
        if target.exists() and not (target / RUN_JSON).is_file():
            if not target.is_dir() or any(target.iterdir()):
                raise KvlensError(f"{target} exists and is not a kvlens run; choose another --out.")
        target.parent.mkdir(parents=True, exist_ok=True)
        meta = self.meta.model_copy(deep=True)
        meta.schema_version = SCHEMA_VERSION
        meta.kvlens_version = __version__
        meta.tensors = {
            k: TensorInfo(dtype=str(v.dtype).removeprefix("torch."), shape=list(v.shape))
            for k, v in sorted(self.tensors.items())
        }
        meta.decisions = len(self.decisions)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            (tmp / RUN_JSON).write_text(meta.to_json())
            save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(tmp / TENSORS))
            self.decisions.to_parquet(tmp / DECISIONS, index=False)
            old = None
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                os.replace(target, old / "run")
            os.replace(tmp, target)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.meta, self.path = meta, target
        return target


def _inside(directory: Path, name: str) -> Path:
    """The file `name` of a run directory, refusing links that lead out of it."""
    path = directory / name
    if path.is_symlink() and directory.resolve() not in path.resolve().parents:
        raise KvlensError(
            f"{directory}/{name} is a link leading out of the run directory; refusing to read it."
        )
    if not path.exists():
        raise KvlensError(f"{directory} is not a complete kvlens run: {name} is missing.")
    if not path.is_file():
        raise KvlensError(f"{directory}/{name} is not a regular file.")
    return path


def read_meta(directory: str | Path) -> RunMeta:
    """The validated run.json of a run directory, without reading its tensors (listings use this)."""
    path = _inside(Path(directory), RUN_JSON)
    if path.stat().st_size > MAX_JSON_BYTES:
        raise KvlensError(f"{path} is larger than {MAX_JSON_BYTES >> 20} MB; refusing to read it.")
    return RunMeta.from_json(path.read_bytes(), path)


def _read_tensors(directory: Path, manifest: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    path = _inside(directory, TENSORS)
    if path.stat().st_size > MAX_TENSOR_BYTES:
        raise KvlensError(f"{path} is larger than {MAX_TENSOR_BYTES >> 30} GB; refusing to read it.")
    tensors = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            if names != set(manifest):
                diff = sorted(names ^ set(manifest))[0]
                raise KvlensError(f"{path} and run.json disagree about tensor '{diff[:80]}'.")
            for name in names:
                t = f.get_tensor(name)
                want = manifest[name]
                if list(t.shape) != want.shape or str(t.dtype).removeprefix("torch.") != want.dtype:
                    raise KvlensError(
                        f"Tensor '{name[:80]}' in {path} has shape {list(t.shape)}, "
                        f"which contradicts run.json."
                    )
                tensors[name] = t
    except (SafetensorError, OSError, ValueError) as err:
        if isinstance(err, KvlensError):
            raise
        raise KvlensError(f"{path} is truncated or corrupt ({str(err).splitlines()[0][:120]}).") from err
    return tensors


def _read_decisions(directory: Path, count: int | None) -> pd.DataFrame:
    import pyarrow.parquet as pq

    path = _inside(directory, DECISIONS)
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several unrelated types for corrupt files
        raise KvlensError(f"{path} is truncated or corrupt ({type(err).__name__}).") from err
    if table.column_names != COLUMNS or (count is not None and table.num_rows != count):
        raise KvlensError(f"{path} does not hold the decision table that run.json describes.")
    return table.to_pandas()


def load_run(path: str | Path) -> Run:
    """Load a run directory written by `Run.save`, checking everything (see module docstring)."""
    directory = Path(path)
    if not directory.is_dir():
        raise KvlensError(f"{directory} is not a run directory.")
    meta = read_meta(directory)
    tensors = _read_tensors(directory, meta.tensors)
    decisions = _read_decisions(directory, meta.decisions)
    return Run(meta=meta, tensors=tensors, decisions=decisions, path=directory)


def run_name(run: Run, unsaved: str) -> str:
    """The run's folder name, or `unsaved` for a run that was never saved."""
    return getattr(run.path, "name", unsaved)
