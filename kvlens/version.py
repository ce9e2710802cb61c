"""The package version (written into every run, result file and figure config)."""

__version__ = "0.1.0"
