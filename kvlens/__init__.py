"""kvlens: see what KV-cache compression does to a language model.

The public entry: `kvlens.load_run(path)`. This module is the package's top layer: importing it also
registers every analysis kind, so `load_run(path).figure(KIND)` works in a notebook.
"""
from kvlens.version import __version__


def load_run(path):
    """Load a recorded run directory safely (see `kvlens.runs.run`)."""
    from kvlens.runs.run import load_run as _load

    return _load(path)


__all__ = ["__version__", "load_run"]
