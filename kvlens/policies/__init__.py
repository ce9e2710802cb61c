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
import pkgutil
from typing import Any

from kvlens.errors import KvlensError
from kvlens.params import Param, parse_budget
from kvlens.policies.base import (
    REGISTRY,
    MergesEvicted,
    Policy,
    PrunesKeys,
    Replays,
    ScoredEviction,
    check_slots,
    evicted_lowest,
    param,
    register,
    resolve_budget,
    scored_eviction_names,
    select_lowest,
)

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

_FAMILY = {"reference": 0, "eviction": 1, "merging": 2}


def family(cls: type[Policy]) -> str:
    """`reference` (keeps everything), `eviction` or `merging`: how lists of policies are grouped."""
    if cls.merge_rule is not None:
        return "merging"
    needs = cls().needs()  # with its defaults
    return "reference" if needs.budget_free and not needs.decode_rows else "eviction"


def policy_names() -> list[str]:
    """Registered names: the reference first, then eviction, then merging policies, each by name."""
    return sorted(REGISTRY, key=lambda n: (_FAMILY[family(REGISTRY[n])], n))


def policy_class(name: str) -> type[Policy]:
    if name not in REGISTRY:
        raise KvlensError(f"Unknown policy '{name}'; choose one of: {', '.join(policy_names())}.")
    return REGISTRY[name]


def parameters(name: str, values: dict[str, Any] | None = None) -> list[Param]:
    """Each declared hyperparameter of a policy (`kvlens.params.Param`).

    A nested policy (CaM's `base`, kind `policy`) is followed by the parameters of the chosen nested
    policy (`values[field]`, else the default) named `field.PARAM`.
    """
    out = []
    for p in policy_class(name).declared():
        out.append(p)
        if p.kind == "policy":
            chosen = (values or {}).get(p.name, p.default)
            chosen = getattr(chosen, "name", chosen)
            if chosen in REGISTRY:
                out += [dataclasses.replace(q, name=f"{p.name}.{q.name}") for q in parameters(chosen)]
    return out


def changed_params(policy: str, params: dict[str, Any]) -> dict[str, Any]:
    """The parameters that differ from the policy's defaults (all of them for an unknown policy)."""
    try:
        defaults = {p.name: p.describe()["default"] for p in parameters(policy, params)}
    except KvlensError:
        return dict(params)

    def plain(v: Any) -> Any:  # run.json stores tuples as lists
        return list(v) if isinstance(v, (tuple, list)) else v

    return {k: v for k, v in params.items() if k not in defaults or plain(defaults[k]) != plain(v)}


def presets(name: str) -> dict[str, dict[str, Any]]:
    """The named settings of a policy (`{}` if it has none)."""
    return dict(policy_class(name).presets)


def with_preset(name: str, params: dict[str, Any] | None) -> dict[str, Any]:
    """`params` with `preset=NAME` replaced by the preset's settings; explicit parameters win."""
    params = dict(params or {})
    if "preset" not in params:
        return params
    chosen, known = params.pop("preset"), presets(name)
    if chosen not in known:
        raise KvlensError(
            f"Policy {name} has no preset {chosen!r}"
            + (f" (its presets: {', '.join(known)})." if known else " (it has no presets).")
        )
    return {**known[chosen], **params}


def make_policy(name: str, params: dict[str, Any] | None = None) -> Policy:
    """Build a validated policy. Nested policies: `{"base": "h2o", "base.recent_ratio": 0.3}`;
    `{"preset": NAME}` applies a named setting first."""
    cls = policy_class(name)
    declared = {p.name: p for p in cls.declared()}
    own: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in with_preset(name, params).items():
        head, dot, sub = key.partition(".")
        if dot and head in declared and declared[head].kind == "policy":
            nested.setdefault(head, {})[sub] = value
        elif key in declared:
            own[key] = value
        else:
            raise _unknown(name, key, params)
    for head, p in declared.items():
        if p.kind != "policy":
            continue
        inner = own.get(head, p.default)
        if isinstance(inner, Policy):
            inner_name, inner_params = inner.name, {**inner.params(), **nested.get(head, {})}
        else:
            inner_name, inner_params = inner, nested.get(head, {})
        p.parse(inner_name, owner=name)  # a name among the allowed ones, or one sentence
        own[head] = make_policy(inner_name, inner_params)
    try:
        return cls(**own)
    except TypeError as err:
        raise KvlensError(f"Bad parameters for policy {name}: {err}.") from err


def _unknown(policy: str, key: str, values: dict[str, Any] | None) -> KvlensError:
    names = [p.name for p in parameters(policy, values)] + ["preset"] * bool(presets(policy))
    allowed = ", ".join(names) or "none"
    return KvlensError(f"Policy {policy} has no parameter '{key}' (its parameters: {allowed}).")


def parse_value(policy: str, key: str, text: str, values: dict[str, Any] | None = None) -> Any:
    """Turn a `--set KEY=VALUE` string into the parameter's value (its `Param.parse`)."""
    spec = next((p for p in parameters(policy, values) if p.name == key), None)
    if spec is None:
        raise _unknown(policy, key, values)
    return spec.parse(text, owner=policy)


def parse_settings(policy: str, settings: list[str] | None) -> dict[str, Any]:
    """`["k=v", ...]` -> typed parameters of `policy`; nested policies (`base=h2o`) are read first."""
    pairs = []
    for item in settings or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise KvlensError(f"--set takes KEY=VALUE; got '{item}'.")
        pairs.append((key.strip(), value))
    params: dict[str, Any] = {}
    for key, value in sorted(pairs, key=lambda kv: "." in kv[0]):  # stable: plain keys, then dotted ones
        params[key] = value.strip() if key == "preset" else parse_value(policy, key, value, params)
    with_preset(policy, params)  # an unknown preset is refused here
    return params


__all__ = [
    "REGISTRY",
    "MergesEvicted",
    "Param",
    "Policy",
    "PrunesKeys",
    "Replays",
    "ScoredEviction",
    "changed_params",
    "check_slots",
    "evicted_lowest",
    "family",
    "make_policy",
    "param",
    "parameters",
    "parse_budget",
    "parse_settings",
    "parse_value",
    "policy_class",
    "policy_names",
    "presets",
    "register",
    "resolve_budget",
    "scored_eviction_names",
    "select_lowest",
    "with_preset",
]
