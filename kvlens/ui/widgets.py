"""Policy widgets generated from the policy dataclasses (`kvlens.policies.parameters`)."""
from __future__ import annotations

import streamlit as st

from kvlens.errors import KvlensError
from kvlens.policies import (
    REGISTRY,
    make_policy,
    parameters,
    parse_budget,
    parse_value,
    policy_names,
    presets,
    with_preset,
)

DEFAULTS = "(defaults)"


def parameter_widgets(policy: str, prefix: str) -> dict:
    """One widget per hyperparameter of `policy` (keys `{prefix}_{policy}_{name}`); returns the values.

    Bools are checkboxes, choices (and nested policies such as CaM's base) select boxes, ints and
    floats number inputs, tuples text fields parsed like the CLI's `--set`. Help texts come from the
    policy's `param()` declarations. A bad value shows its sentence under its field and raises
    `BadSetting`; a bad combination raises KvlensError (the caller shows it).
    """
    values, slots = {}, {}
    start, prefix = _preset_picker(policy, prefix)  # the widgets start from the chosen preset's settings
    for spec in parameters(policy):  # nested policies first: their choice decides the parameters shown
        if spec["type"] == "policy":
            default = start.get(spec["name"], spec["default"])
            values[spec["name"]] = st.selectbox(spec["name"], spec["choices"], index=spec["choices"].index(default),
                                                key=f"{prefix}_{policy}_{spec['name']}", help=spec["help"] or None)
    specs = [s for s in parameters(policy, values) if s["type"] != "policy"]
    cols = st.columns(min(3, max(1, len(specs))))
    bad = None
    for i, spec in enumerate(specs):
        with cols[i % len(cols)]:
            try:
                values[spec["name"]] = _field(policy, spec, start.get(spec["name"], spec["default"]),
                                              f"{prefix}_{policy}_{spec['name']}", values)
            except KvlensError as err:
                bad = bad or err
                st.error(str(err))
            slots[spec["name"].rpartition(".")[2]] = st.empty()
    if bad is not None:
        raise BadSetting(str(bad))
    try:
        make_policy(policy, values)
    except KvlensError as err:  # a value out of its bounds goes under its field (the sentence names it)
        slot = next((v for k, v in slots.items() if str(err).startswith(f"{k} of ")), None)
        if slot is None:
            raise
        slot.error(str(err))
        raise BadSetting(str(err)) from None
    return values


def _field(policy: str, spec: dict, default, key: str, values: dict):
    """The widget of one parameter (no bounds of its own: a value out of bounds gets the policy's sentence)."""
    name, help_ = spec["name"], spec["help"] or None
    if spec["choices"] is not None:
        return st.selectbox(name, spec["choices"], index=spec["choices"].index(default), key=key, help=help_)
    if isinstance(default, bool):
        return st.checkbox(name, value=default, key=key, help=help_)
    if isinstance(default, int):
        return int(st.number_input(name, value=default, step=1, key=key, help=help_))
    if isinstance(default, float):
        return float(st.number_input(name, value=default, step=0.05, format="%.3g", key=key, help=help_))
    shown = "none" if default is None else ",".join(str(x) for x in default) \
        if isinstance(default, tuple) else str(default)
    return parse_value(policy, name, st.text_input(name, value=shown, key=key, help=help_), values)


class BadSetting(KvlensError):
    """A setting whose sentence is already shown under its field."""


def _preset_picker(policy: str, prefix: str) -> tuple[dict, str]:
    """A select box of the policy's presets (if it has any): the chosen preset's settings, and the widget
    key prefix (per preset, so that choosing one resets the fields to its values)."""
    named = presets(policy)
    if not named:
        return {}, prefix
    choice = st.selectbox("preset", [DEFAULTS, *named], key=f"{prefix}_{policy}_preset",
                          help="Named settings from the policy's sources (see `kvlens policies`); the fields below "
                               "start from it and can still be changed.")
    if choice == DEFAULTS:
        return {}, prefix
    return with_preset(policy, {"preset": choice}), f"{prefix}_{choice}"


def policy_picker(prefix: str, default: str = "h2o", label: str = "Policy", budget_default: str = "0.5"):
    """Policy select box, budget field and generated parameter widgets.

    Returns `(name, params, budget)` validated, or None after showing the sentence of a bad entry under
    its field (the caller then disables its Run button).
    """
    names = policy_names()
    name = st.selectbox(label, names, index=names.index(default) if default in names else 0, key=f"{prefix}_policy",
                        help="\n\n".join(f"**{n}**: {REGISTRY[n].description}" for n in names))
    cls = REGISTRY[name]
    budget, budget_slot = None, st
    try:
        if not cls.budget_free:
            text = st.text_input("Budget", value=budget_default, key=f"{prefix}_{name}_budget",
                                 help="Slots per KV head per layer (e.g. 64) or a share of the prompt (e.g. 0.5).")
            budget_slot = st.empty()
            budget = parse_budget(text)
        elif name == "full":
            st.caption("full keeps every slot: the uncompressed reference.")
        else:
            st.caption(f"{name} decides its own cache size (no budget).")
    except KvlensError as err:
        budget_slot.error(str(err))
        budget_slot = None
    try:
        params = {}
        if parameters(name):
            with st.expander("Parameters", expanded=False):
                params = parameter_widgets(name, prefix)
        policy = make_policy(name, params)
    except BadSetting:
        return None
    except KvlensError as err:  # a combination of values: under the parameters
        st.error(str(err))
        return None
    if budget_slot is None:
        return None
    try:
        check_budget(policy, budget)
    except KvlensError as err:
        budget_slot.error(str(err))
        return None
    return name, params, budget


def check_budget(policy, budget) -> None:
    """Refuse a slot budget of 0 or below what the policy always keeps, before anything runs."""
    if isinstance(budget, int) and budget < max(1, policy.min_budget()):
        raise KvlensError(f"The budget must be a positive number of slots; got {budget}." if budget < 1 else
                          f"Budget {budget} is below the {policy.min_budget()} slots that {policy.name} always keeps.")
