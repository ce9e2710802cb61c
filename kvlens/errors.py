"""User-facing errors: one clear sentence, never a traceback."""


class KvlensError(ValueError):
    """Bad input or an unusable resource. `str(err)` is the one sentence shown to the user."""


class Cancelled(RuntimeError):
    """A run was stopped by its caller (Stop button, Ctrl-C); nothing was saved."""
