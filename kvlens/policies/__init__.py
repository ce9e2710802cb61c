"""The policy registry: every module in this package that `@register`s a policy is imported here.

A new policy is one new file in `kvlens/policies/`; `REGISTRY`, `kvlens policies`, validation,
`--set`, the app's widgets, the bench and sweep lists and CaM's bases all derive from it.
`make_policy(name, params)` validates and builds one; `parse_settings` turns `--set KEY=VALUE`.
A policy class may name settings in `presets` (`{"NAME": {param: value}}`): `preset=NAME` among
the parameters applies them, and explicit parameters override them.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil

from kvlens.errors import KvlensError
from kvlens.policies.base import (
    REGISTRY,
    Policy,
    ScoredEviction,
    choices_of,
    field_default,
    param,
    register,
    scored_eviction_names,
)

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

_FAMILY = {"reference": 0, "eviction": 1, "merging": 2}


def family(cls: type[Policy]) -> str:
    """`reference` (keeps everything), `eviction` or `merging`: how lists of policies are grouped."""
    if cls.merges:
        return "merging"
    return "reference" if cls.budget_free and not cls.needs_attention else "eviction"


def policy_names() -> list[str]:
    """Registered names: the reference first, then eviction, then merging policies, each by name."""
    return sorted(REGISTRY, key=lambda n: (_FAMILY[family(REGISTRY[n])], n))


def policy_class(name: str) -> type[Policy]:
    if name not in REGISTRY:
        raise KvlensError(f"Unknown policy '{name}'; choose one of: {', '.join(policy_names())}.")
    return REGISTRY[name]


def parameters(name: str, values: dict | None = None) -> list[dict]:
    """Each hyperparameter of a policy: name, type, default, choices, minimum, maximum, help.

    A nested policy field (CaM's `base`) is listed with type `policy`, followed by the parameters
    of the chosen nested policy (`values[field]`, else the default) as `field.PARAM`.
    """
    out = []
    for f in dataclasses.fields(policy_class(name)):
        default = field_default(f)
        meta = f.metadata
        if isinstance(default, Policy):
            chosen = (values or {}).get(f.name, default.name)
            chosen = chosen.name if isinstance(chosen, Policy) else chosen
            out.append({"name": f.name, "type": "policy", "default": default.name, "choices": list(choices_of(f)),
                        "minimum": None, "maximum": None, "help": meta.get("help", "")})
            if chosen in REGISTRY:
                out += [{**p, "name": f"{f.name}.{p['name']}"} for p in parameters(chosen)]
            continue
        choices = choices_of(f)
        kind = "choice" if choices is not None else type(default).__name__
        out.append({"name": f.name, "type": kind, "default": default, "choices": list(choices) if choices else None,
                    "minimum": meta.get("minimum"), "maximum": meta.get("maximum"), "help": meta.get("help", "")})
    return out


def presets(name: str) -> dict[str, dict]:
    """The named settings of a policy (`{}` if it has none)."""
    return dict(policy_class(name).presets)


def with_preset(name: str, params: dict | None) -> dict:
    """`params` with `preset=NAME` replaced by the preset's settings; explicit parameters win."""
    params = dict(params or {})
    if "preset" not in params:
        return params
    chosen, known = params.pop("preset"), presets(name)
    if chosen not in known:
        raise KvlensError(f"Policy {name} has no preset {chosen!r}"
                          + (f" (its presets: {', '.join(known)})." if known else " (it has no presets)."))
    return {**known[chosen], **params}


def make_policy(name: str, params: dict | None = None) -> Policy:
    """Build a validated policy. Nested policies: `{"base": "h2o", "base.recent_ratio": 0.3}`;
    `{"preset": NAME}` applies a named setting first."""
    cls = policy_class(name)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    own, nested = {}, {}
    for key, value in with_preset(name, params).items():
        head, dot, sub = key.partition(".")
        if dot and head in fields and isinstance(field_default(fields[head]), Policy):
            nested.setdefault(head, {})[sub] = value
        elif key in fields:
            own[key] = value
        else:
            raise _unknown(name, key, params)
    for head, f in fields.items():
        if not isinstance(field_default(f), Policy):
            continue
        inner = own.get(head, field_default(f))
        if isinstance(inner, Policy):
            inner_name, inner_params = inner.name, {**inner.params(), **nested.get(head, {})}
        else:
            inner_name, inner_params = inner, nested.get(head, {})
        choices = choices_of(f)
        if choices is not None and inner_name not in choices:
            raise KvlensError(f"{head} of {name} must be one of {', '.join(choices)}; got {inner_name!r}.")
        own[head] = make_policy(inner_name, inner_params)
    try:
        return cls(**own)
    except TypeError as err:
        raise KvlensError(f"Bad parameters for policy {name}: {err}.") from err


def _unknown(policy: str, key: str, values: dict | None) -> KvlensError:
    names = [p["name"] for p in parameters(policy, values)] + (["preset"] if presets(policy) else [])
    allowed = ", ".join(names) or "none"
    return KvlensError(f"Policy {policy} has no parameter '{key}' (its parameters: {allowed}).")


_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "tuple": "comma-separated numbers"}


def parse_value(policy: str, key: str, text: str, values: dict | None = None):
    """Turn a `--set KEY=VALUE` string into the parameter's type (int, float, bool, choice, tuple)."""
    spec = next((p for p in parameters(policy, values) if p["name"] == key), None)
    if spec is None:
        raise _unknown(policy, key, values)
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
            if not math.isfinite(value):
                raise ValueError
            return value
        if isinstance(default, tuple):
            parts = tuple(float(x) for x in text.split(","))
            if len(parts) != len(default) or not all(math.isfinite(x) for x in parts):
                raise ValueError
            return parts
        return text
    except ValueError:
        kind = f"one of {', '.join(spec['choices'])}" if spec["choices"] else _KINDS.get(spec["type"], "text")
        raise KvlensError(f"Parameter {key} of {policy} must be {kind}; got '{text}'.") from None


def parse_settings(policy: str, settings: list[str] | None) -> dict:
    """`["k=v", ...]` -> typed parameters of `policy`; nested policies (`base=h2o`) are read first."""
    pairs = []
    for item in settings or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise KvlensError(f"--set takes KEY=VALUE; got '{item}'.")
        pairs.append((key.strip(), value))
    params: dict = {}
    for key, value in sorted(pairs, key=lambda kv: "." in kv[0]):  # stable: plain keys, then dotted ones
        params[key] = value.strip() if key == "preset" else parse_value(policy, key, value, params)
    with_preset(policy, params)  # an unknown preset is refused here
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


__all__ = ["REGISTRY", "Policy", "ScoredEviction", "family", "make_policy", "param", "parameters", "parse_budget",
           "parse_settings", "parse_value", "policy_class", "policy_names", "presets", "register",
           "scored_eviction_names", "with_preset"]
