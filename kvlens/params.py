"""One parameter system for policies and analyses, and the one budget validator.

A `Param` declares a parameter once: name, default, help, bounds, choices. `Param.check` is the
one validator (a value of the right type, in bounds, among the choices, or one sentence saying
what it must be), `Param.parse` the one parser (command-line or text-field input to a value, then
checked), `Param.describe` what listings print (`kvlens policies --json`, `kvlens analyze
--list`), and the app builds every widget from the same declaration (`kvlens.ui.params`).

Kinds: `int`, `float`, `bool`, `text`, `choice` (one of `choices`, which may be a callable
resolved when checking, e.g. the registered names of a kind), `numbers` (a fixed-length tuple of
numbers, e.g. CaM's `clamp`) and `policy` (a nested policy, e.g. CaM's `base`). `many` makes a
list of the kind (an analysis' repeatable flag); `optional` lets None stand for "worked out from
the input" (the help says how).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlens.errors import KvlensError

KINDS = ("int", "float", "bool", "text", "choice", "numbers", "policy")
_WHAT = {"int": "an integer", "float": "a number", "bool": "true or false", "text": "text"}
_MANY = {"int": "integers", "float": "numbers", "bool": "true/false values", "text": "texts"}
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def kind_of(default) -> str:
    """The kind a default value declares (bool before int: a bool is an int in Python)."""
    for kind, types in (("bool", bool), ("int", int), ("float", float), ("numbers", tuple), ("text", str)):
        if isinstance(default, types):
            return kind
    raise TypeError(f"no parameter kind for a default of type {type(default).__name__}")


@dataclass(frozen=True)
class Param:
    """One declared parameter (see the module docstring)."""

    name: str
    default: Any
    help: str
    kind: str = ""  # worked out from the default when empty
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple | Callable[[], tuple] | None = None
    many: bool = False
    optional: bool = False
    cli: str = ""  # the command-line flag, when not `--name` with dashes

    def __post_init__(self):
        kind = self.kind or ("choice" if self.choices is not None else kind_of(self.default))
        if kind not in KINDS:
            raise TypeError(f"parameter {self.name}: unknown kind {kind!r}")
        object.__setattr__(self, "kind", kind)

    @property
    def flag(self) -> str:
        return self.cli or "--" + self.name.replace("_", "-")

    def allowed(self) -> tuple | None:
        """The choices, resolved (None when any value of the kind is allowed)."""
        if callable(self.choices):
            return tuple(self.choices())
        return tuple(self.choices or ()) or None

    def check(self, value, owner: str = "") -> Any:
        """`value` normalised (floats as float, numbers as a tuple, `many` as a list), or one sentence."""
        if value is None and self.optional:
            return None
        if self.many:
            if not isinstance(value, (list, tuple)):
                raise self._bad(value, owner, plural=True)
            return [self._one(v, owner, plural=True) for v in value]
        return self._one(value, owner)

    def parse(self, text: str, owner: str = "") -> Any:
        """Command-line or text-field input as a checked value (`many`: comma-separated)."""
        text = str(text).strip()
        if self.many:
            try:
                items = [self.parse_item(t.strip(), owner) for t in text.split(",") if t.strip()]
            except KvlensError:
                raise self._bad(text, owner, plural=True) from None
            return self.check(items, owner)
        if self.optional and text.lower() in ("", "none"):
            return None
        if self.kind == "policy":  # a nested policy is named; its owner builds it
            if text not in (self.allowed() or ()):
                raise self._bad(text, owner)
            return text
        return self.check(self.parse_item(text, owner), owner)

    def describe(self) -> dict:
        """What listings show: name, kind, default, choices, bounds, help (and `many`, the flag)."""
        default = getattr(self.default, "name", self.default)  # a policy by its name
        choices = self.allowed()
        return {
            "name": self.name,
            "type": self.kind,
            "default": default,
            "choices": None if choices is None else list(choices),
            "minimum": self.minimum,
            "maximum": self.maximum,
            "help": self.help,
            "many": self.many,
            "flag": self.flag,
        }

    # -- one value -------------------------------------------------------------------------------
    def _one(self, value, owner: str, plural: bool = False):
        kind, bad = self.kind, lambda: self._bad(value, owner, plural)
        if kind == "policy":
            name = getattr(value, "name", None)
            if name is None or name not in (self.allowed() or (name,)):
                raise bad()
            return value
        if kind == "choice":
            if value not in (self.allowed() or ()):
                raise bad()
            return value
        if kind == "bool":
            if not isinstance(value, bool):
                raise bad()
            return value
        if kind == "text":
            if not isinstance(value, str):
                raise bad()
            return value
        if kind == "numbers":
            ok = (
                isinstance(value, (tuple, list))
                and len(value) == len(self.default)
                and all(_finite_number(x) for x in value)
            )
            if not ok:
                raise bad()
            return tuple(float(x) for x in value)
        if not (isinstance(value, int) if kind == "int" else _finite_number(value)) or isinstance(
            value, bool
        ):
            raise bad()
        self._bounds(value, owner)
        return value if kind == "int" else float(value)

    def _bounds(self, value, owner: str) -> None:
        lo, hi = self.minimum, self.maximum
        where = self._where(owner)
        if lo is not None and hi is not None and not lo <= value <= hi:
            raise KvlensError(f"{where} must be in [{lo}, {hi}]; got {value!r}.")
        if lo is not None and hi is None and value < lo:
            raise KvlensError(f"{where} must be at least {lo}; got {value!r}.")
        if hi is not None and lo is None and value > hi:
            raise KvlensError(f"{where} must be at most {hi}; got {value!r}.")

    def parse_item(self, text: str, owner: str = ""):
        """One item of the kind from text, unchecked (a `many` flag's single occurrence)."""
        kind = self.kind
        try:
            if kind in ("choice", "text", "policy"):
                return text
            if kind == "bool":
                if text.lower() not in _TRUE + _FALSE:
                    raise ValueError
                return text.lower() in _TRUE
            if kind == "int":
                return int(text)
            if kind == "float":
                return float(text)
            return tuple(float(x) for x in text.split(","))
        except ValueError:
            raise self._bad(text, owner) from None

    def _what(self, plural: bool = False) -> str:
        if self.kind in ("choice", "policy"):
            what = f"one of {', '.join(map(str, self.allowed() or ()))}"
            return f"comma-separated values, each {what}" if plural else what
        if self.kind == "numbers":
            return f"{len(self.default)} comma-separated numbers"
        return f"comma-separated {_MANY[self.kind]}" if plural else _WHAT[self.kind]

    def _where(self, owner: str) -> str:
        return " of ".join(filter(None, (self.name, owner)))

    def _bad(self, value, owner: str, plural: bool = False) -> KvlensError:
        shown = getattr(value, "name", value)
        return KvlensError(f"{self._where(owner)} must be {self._what(plural)}; got {shown!r}.")


def _finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# -- the budget ------------------------------------------------------------------------------------
def check_budget(value) -> int | float:
    """A budget as given: a positive integer is slots per KV head per layer, a float in (0, 1] a share of
    the prompt; anything else is one sentence. The one validator of a budget (CLI, app, sweeps, policies)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KvlensError(
            f"The budget must be a number of slots (e.g. 64) or a share of the prompt in (0, 1] "
            f"(e.g. 0.5); got {value!r}."
        )
    if isinstance(value, int):
        if value < 1:
            raise KvlensError(f"The budget must be a positive number of slots; got {value}.")
        return value
    if not (math.isfinite(value) and 0 < value <= 1):
        raise KvlensError(f"A fractional budget must be in (0, 1]; got {value}.")
    return float(value)


def parse_budget(text) -> int | float | None:
    """'64' -> 64 slots, '0.5' -> half the prompt; None (or an empty text) stays None."""
    if text is None or not str(text).strip():
        return None
    text = str(text).strip()
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        return check_budget(value)
    return check_budget(text)
