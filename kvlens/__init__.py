"""kvlens: see what KV-cache compression does to a language model.

The public entries: `kvlens.load_run(path)`; in the caller's own transformers code `kvlens.cache`,
`kvlens.press`, `kvlens.pipeline` and `kvlens.attach` (`kvlens.hf`, imported on first use);
`kvlens.model_path()`, the embedded model's directory; `kvlens.texts`, the bundled public-domain texts.

This module is the package's top layer: importing it also imports the analysis registry
(`kvlens.analysis.registry`), which installs itself behind `Run.figure` and `Run.analyze` (the kinds in
`kvlens/analysis/kinds/` register on first use), so `load_run(path).figure(KIND)` works in a notebook.
"""

import kvlens.analysis.registry  # noqa: F401  (installs the analyses behind Run.figure and Run.analyze)
from kvlens import texts
from kvlens.version import __version__


def load_run(path):
    """Load a recorded run directory safely (see `kvlens.runs.run`)."""
    from kvlens.runs.run import load_run as _load

    return _load(path)


_INTEGRATION = ("KvlensCache", "attach", "cache", "pipeline", "press")


def __getattr__(name: str):
    """`kvlens.cache` and the rest of `kvlens.hf` on first use (they import transformers' generation code)."""
    if name in _INTEGRATION:
        import kvlens.hf

        return getattr(kvlens.hf, name)
    if name == "model_path":
        from kvlens.engine.models import model_path

        return model_path
    raise AttributeError(f"module 'kvlens' has no attribute {name!r}")


__all__ = ["__version__", "load_run", "model_path", "texts", *_INTEGRATION]
