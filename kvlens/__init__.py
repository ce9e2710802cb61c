"""kvlens: see what KV-cache compression does to a language model."""
__version__ = "0.1.0"


def load_run(path):
    """Load a recorded run directory safely (see `kvlens.runs`)."""
    from kvlens.runs import load_run as _load

    return _load(path)


__all__ = ["__version__", "load_run"]
