"""kvlens: see what KV-cache compression does to a language model.

The public entry: `kvlens.load_run(path)`. This module is the package's top layer: importing it also
imports the analysis registry (`kvlens.analysis.registry`), which installs itself behind
`Run.figure` and `Run.analyze` (the kinds in `kvlens/analysis/kinds/` register on first use), so
`load_run(path).figure(KIND)` works in a notebook.
"""
import kvlens.analysis.registry  # noqa: F401  (installs the analyses behind Run.figure and Run.analyze)
from kvlens.version import __version__


def load_run(path):
    """Load a recorded run directory safely (see `kvlens.runs.run`)."""
    from kvlens.runs.run import load_run as _load

    return _load(path)


__all__ = ["__version__", "load_run"]
