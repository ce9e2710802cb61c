"""The analysis registry: each analysis is declared once, and `kvlens analyze`, `kvlens figure`,
`Run.figure` and the app's pages all go through it.

An analysis is one file in `kvlens/analysis/kinds/`: a subclass of `Analysis` decorated with
`@register_analysis`, naming the paper figure it reproduces, what it reads (`inputs`: one run,
several runs, or the model itself), the record level its runs need, and its parameters; it
provides `compute`, `to_json` and `figure`, and the file holds the computation and the figure
code too. Files in that folder are found by themselves. An analysis that `replays` a run feeds its
tokens through the run's model again: `compute` and `figure` get the model as `model=` too (the run's
own, loaded by `replay_model`, unless the caller passes one).

Importing this module installs its dispatcher behind `Run.figure` and `Run.analyze`
(`kvlens.runs.run.set_analyses`: the run format sits below the analyses and names none of them);
`import kvlens` imports it.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import ClassVar

from kvlens.errors import KvlensError
from kvlens.levels import RecordLevel
from kvlens.params import Param
from kvlens.runs.run import Run, run_name, set_analyses

INPUTS = ("run", "runs", "model")  # one recorded run, several, or a loaded model (the analysis runs it)
_REGISTRY: dict[str, type[Analysis]] = {}


# parameters several analyses share
LAYER = Param("layer", None, "layer (default: the middle recorded layer)", kind="int", optional=True)
THRESHOLD = Param("threshold", 0.75, "cosine-similarity threshold of the merging sets")
TEXTS = Param("texts", 4, "how many bundled texts", minimum=1)


def check_threshold(threshold: float) -> None:
    """THRESHOLD's range, checked by the functions of the analyses that take it (also when called
    directly)."""
    if not -1 <= threshold <= 1:
        raise KvlensError(f"The cosine-similarity threshold must lie in [-1, 1]; got {threshold}.")


class Analysis:
    """Declare `name`, `paper`, `inputs`, `level` and `params`; implement the three methods."""

    name: ClassVar[str]
    paper: ClassVar[str]  # the figure it reproduces, e.g. "KVMerger Fig. 2"
    inputs: ClassVar[str] = "run"
    level: ClassVar[RecordLevel] = RecordLevel.SUMMARY  # the record level each run needs
    measured: ClassVar[bool] = False  # each run needs the perturbation tensors of --measure
    replays: ClassVar[bool] = (
        False  # feeds the run's tokens through its model again (`model=` in compute, figure)
    )
    see_also: ClassVar[str] = ""  # a sentence the command's help adds (related analyses)
    params: ClassVar[tuple[Param, ...]] = ()

    def compute(self, source, **params):
        """The analysis result (any object) of `source`: a Run, a list of Runs, or a LoadedModel."""
        raise NotImplementedError

    def to_json(self, result, **params) -> dict:
        """The result as a JSON-able dict (what `kvlens analyze --json` prints)."""
        raise NotImplementedError

    def text(self, found: dict) -> str | None:
        """What `kvlens analyze` prints without --json, from `to_json`'s dict (None: a generic rendering)."""
        return None

    def figure(self, source, **params):
        """The plotly figure (what `kvlens figure`, `Run.figure` and the app show)."""
        raise NotImplementedError

    @classmethod
    def describe(cls) -> dict:
        """Name, paper figure, inputs, level and parameters, for `kvlens analyze --list`."""
        return {
            "name": cls.name,
            "paper": cls.paper,
            "inputs": cls.inputs,
            "level": None if cls.inputs == "model" else cls.level,
            "measured": cls.measured,
            "replays": cls.replays,
            "params": [p.describe() for p in cls.params],
        }


def register_analysis(cls: type[Analysis]) -> type[Analysis]:
    """Class decorator adding an analysis to the registry under `cls.name`."""
    if cls.inputs not in INPUTS or not isinstance(cls.level, RecordLevel):
        raise TypeError(f"{cls.__name__}: inputs must be one of {INPUTS} and level a RecordLevel.")
    other = _REGISTRY.get(cls.name)
    if other is not None and (other.__module__, other.__qualname__) != (cls.__module__, cls.__qualname__):
        raise TypeError(f"Two analyses are called '{cls.name}': {other.__module__} and {cls.__module__}.")
    _REGISTRY[cls.name] = cls
    return cls


def analyses() -> dict[str, type[Analysis]]:
    """Every registered analysis by name (the files of `kvlens/analysis/kinds/` are imported first)."""
    from kvlens.analysis import kinds

    for module in pkgutil.iter_modules(kinds.__path__):
        importlib.import_module(f"{kinds.__name__}.{module.name}")
    return dict(sorted(_REGISTRY.items()))


def get_analysis(name: str) -> Analysis:
    """The analysis called `name`, or one sentence naming the known ones."""
    known = analyses()
    if name not in known:
        raise KvlensError(f"Unknown analysis '{name}'; choose one of: {', '.join(known)}.")
    return known[name]()


def run_level(run: Run) -> RecordLevel:
    """The level a run was recorded at."""
    return RecordLevel.parse(run.meta.record.level or RecordLevel.SUMMARY)


def nan_to_none(t) -> list:
    """A tensor as nested lists with NaN as None (valid JSON)."""

    def clean(x):
        if isinstance(x, list):
            return [clean(v) for v in x]
        return None if x != x else x

    return clean(t.tolist())


def checked_params(name: str, **params) -> dict:
    """The parameters of analysis `name` with defaults filled in, or one sentence about the first bad one."""
    analysis = get_analysis(name)
    known = {p.name: p for p in analysis.params}
    unknown = [k for k in params if k not in known]
    if unknown:
        takes = "it takes " + (", ".join(known) or "none")
        raise KvlensError(f"The analysis '{analysis.name}' has no parameter '{unknown[0]}'; {takes}.")
    return {name: p.check(params.get(name, p.default)) for name, p in known.items()}


READS = {"run": "one run", "runs": "runs"}  # what an analysis of each input reads, in words


def _checked_source(analysis: Analysis, source):
    """`source` as the analysis reads it (several runs as a list), after checking what each run recorded."""
    runs = []
    if isinstance(source, Run):
        runs = [source]
    elif isinstance(source, (list, tuple)):
        runs = list(source)
    if analysis.inputs == "model" and runs:
        raise KvlensError(
            f"The analysis '{analysis.name}' runs the model over the bundled texts; pass it the "
            "loaded model, not a run."
        )
    if analysis.inputs != "model" and (not runs or analysis.inputs == "run" and len(runs) > 1):
        raise KvlensError(f"The analysis '{analysis.name}' reads {READS[analysis.inputs]}.")
    for run in runs:
        if why := lacks(analysis, run):
            raise KvlensError(why)
    return runs if analysis.inputs == "runs" else source


def lacks(analysis: Analysis, run: Run) -> str | None:
    """The sentence saying what `run` lacks for `analysis` (the tensors of --measure, a record level), or
    None."""
    name = run_name(run, "this run")
    if analysis.measured and not run.has("perturbation/used"):
        return f"The analysis '{analysis.name}' needs a run made with --measure; {name} was not measured."
    if not run_level(run).includes(analysis.level):
        return (
            f"The analysis '{analysis.name}' needs a run recorded with --record {analysis.level}; "
            f"{name} was recorded at {run_level(run)}."
        )
    return None


def replay_model(run: Run, device: str = "auto", dtype: str | None = None):
    """The model `run` was made with (its spec; its dtype unless `dtype`), for the analyses that replay it."""
    from kvlens.engine.models import load_model

    made = run.meta.model
    return load_model(made.spec, device=device, dtype=dtype or made.dtype or "auto")


def _with_model(analysis: Analysis, source, model, params: dict) -> dict:
    """`params`, and the model for an analysis that replays its run (the run's own unless `model` is
    given)."""
    if not analysis.replays:
        return params
    return {**params, "model": model or replay_model(source)}


def analysis_json(name: str, source, model=None, **params) -> dict:
    """`kvlens analyze NAME --json` on `source` (a Run, a list of Runs, or a LoadedModel); `model`: the model
    an analysis that replays its run feeds it through (default: the run's own)."""
    analysis, p = get_analysis(name), checked_params(name, **params)
    source = _checked_source(analysis, source)
    return analysis.to_json(analysis.compute(source, **_with_model(analysis, source, model, p)), **p)


def analysis_figure(name: str, source, model=None, **params):
    """`kvlens figure NAME` on `source`: the plotly figure (`model` as for `analysis_json`)."""
    analysis, p = get_analysis(name), checked_params(name, **params)
    source = _checked_source(analysis, source)
    return analysis.figure(source, **_with_model(analysis, source, model, p))


set_analyses(figure=analysis_figure, analyze=analysis_json)
