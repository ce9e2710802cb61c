"""Policy registry: name -> dataclass. `make_policy(name, params)` validates and builds one."""
from __future__ import annotations

import dataclasses
import typing

from kvlens.errors import KvlensError
from kvlens.policies.base import Policy
from kvlens.policies.cam import CaM
from kvlens.policies.corm import CORM
from kvlens.policies.full import Full
from kvlens.policies.h2o import H2O
from kvlens.policies.kvmerger import KVMerger
from kvlens.policies.scissorhands import Scissorhands
from kvlens.policies.streaming_llm import StreamingLLM
from kvlens.policies.tova import TOVA
from kvlens.policies.weightedkv import WeightedKV

REGISTRY: dict[str, type[Policy]] = {cls.name: cls for cls in (Full, StreamingLLM, H2O, Scissorhands, TOVA, CaM,
                                                                WeightedKV, KVMerger, CORM)}


def register(cls: type[Policy]) -> type[Policy]:
    """Add a policy class to the registry (decorator)."""
    REGISTRY[cls.name] = cls
    return cls


def policy_class(name: str) -> type[Policy]:
    if name not in REGISTRY:
        raise KvlensError(f"Unknown policy '{name}'; choose one of: {', '.join(REGISTRY)}.")
    return REGISTRY[name]


def parameters(name: str) -> list[dict]:
    """Each hyperparameter of a policy: name, type, default, allowed choices, help."""
    cls = policy_class(name)
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        hint = hints.get(f.name)
        choices = list(typing.get_args(hint)) if typing.get_origin(hint) is typing.Literal else None
        out.append({"name": f.name, "type": _type_name(hint, default), "default": default,
                    "choices": choices, "help": f.metadata.get("help", "")})
    return out


def _type_name(hint, default) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "choice"
    return type(default).__name__ if default is not None else "str"


def make_policy(name: str, params: dict | None = None) -> Policy:
    """Build a validated policy; unknown parameters are refused with one sentence."""
    cls = policy_class(name)
    known = {f.name for f in dataclasses.fields(cls)}
    params = dict(params or {})
    unknown = sorted(set(params) - known)
    if unknown:
        allowed = ", ".join(sorted(known)) or "none"
        raise KvlensError(f"Policy {name} has no parameter '{unknown[0]}' (its parameters: {allowed}).")
    try:
        return cls(**params)
    except TypeError as err:
        raise KvlensError(f"Bad parameters for policy {name}: {err}.") from err


def parse_value(policy: str, key: str, text: str):
    """Turn a `--set KEY=VALUE` string into the parameter's type (int, float, bool, choice, pair)."""
    spec = next((p for p in parameters(policy) if p["name"] == key), None)
    if spec is None:
        make_policy(policy, {key: None})  # raises the unknown-parameter sentence
    default, text = spec["default"], text.strip()
    try:
        if spec["choices"] is not None:
            if text not in spec["choices"]:
                raise ValueError
            return text
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            value = float(text)
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError
            return value
        if isinstance(default, tuple):
            parts = tuple(float(x) for x in text.split(","))
            if len(parts) != len(default):
                raise ValueError
            return parts
        if default is None and text.lower() in ("none", ""):
            return None
        if default is None:
            return int(text)
        return text
    except ValueError:
        kind = f"one of {', '.join(spec['choices'])}" if spec["choices"] else _KINDS.get(spec["type"], "text")
        raise KvlensError(f"Parameter {key} of {policy} must be {kind}; got '{text}'.") from None


_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "tuple": "comma-separated numbers"}


def parse_settings(policy: str, settings: list[str] | None) -> dict:
    """`["k=v", ...]` -> typed parameters of `policy`."""
    params = {}
    for item in settings or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise KvlensError(f"--set takes KEY=VALUE; got '{item}'.")
        params[key.strip()] = parse_value(policy, key.strip(), value)
    return params


def parse_budget(text: str | None) -> int | float | None:
    """'64' -> 64 slots, '0.5' -> half the prompt; None stays None."""
    if text is None:
        return None
    text = str(text).strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise KvlensError(f"The budget must be a number of slots (e.g. 64) or a share of the prompt "
                          f"in (0, 1] (e.g. 0.5); got '{text}'.") from None
    if not (0 < value <= 1):
        raise KvlensError(f"A fractional budget must be in (0, 1]; got {text}.")
    return value
