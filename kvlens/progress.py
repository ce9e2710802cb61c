"""The one progress bar of every long job (tqdm on stderr): redrawn in place on a terminal; elsewhere silent,
or, for a job left running for hours with its stderr in a log (`log=True`), a line per step."""

from __future__ import annotations

import io
import sys

from tqdm import tqdm

LINE = "{desc}: {n_fmt}/{total_fmt} {unit}s, {elapsed} elapsed, {remaining} left{postfix}"


class Progress:
    """`total` steps of `unit` (None: not known yet, `to` sets it), `initial` of them already done."""

    def __init__(self, desc: str, total: int | None, unit: str, initial: int = 0, log: bool = False):
        terminal = sys.stderr.isatty()
        self.log = log and not terminal
        self.bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit=unit,
            file=sys.stderr if terminal else io.StringIO(),
            disable=not (terminal or self.log),
            dynamic_ncols=terminal,
            leave=False,
            bar_format=None if terminal else LINE,
        )

    def advance(self, steps: int = 1, note: str | None = None) -> None:
        """`steps` more done; `note`: what the last one was, shown after the counts."""
        if note is not None:
            self.bar.set_postfix_str(note, refresh=False)
        self.bar.update(steps)
        if self.log:
            print(self.bar, file=sys.stderr, flush=True)

    def to(self, done: int, total: int | None = None) -> None:
        """`done` steps in all (of `total`, when it is known only now)."""
        if total is not None:
            self.bar.total = total
        self.advance(done - self.bar.n)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
