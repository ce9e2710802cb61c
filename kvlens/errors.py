"""User-facing errors: one clear sentence, never a traceback."""


def one_line(message: str) -> str:
    """The message on one printable line: control characters from user input are escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


class KvlensError(ValueError):
    """Bad input or an unusable resource. `str(err)` is the one sentence shown to the user.

    The sentence is escaped when the error is made, so a user-typed string that reaches it
    (a `--set` key, a file name, a prompt) can never break it over several lines.
    """

    def __init__(self, message: str = ""):
        super().__init__(one_line(str(message)))


class Cancelled(RuntimeError):
    """A run was stopped by its caller (Stop button, Ctrl-C); nothing was saved."""
