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
    floats number inputs within their bounds; tuples are text fields parsed like the CLI's `--set`
    (a bad entry raises KvlensError). Help texts come from the policy's `param()` declarations.
    """
    values = {}
    start, prefix = _preset_picker(policy, prefix)  # the widgets start from the chosen preset's settings
    for spec in parameters(policy):  # nested policies first: their choice decides the parameters shown
        if spec["type"] == "policy":
            default = start.get(spec["name"], spec["default"])
            values[spec["name"]] = st.selectbox(spec["name"], spec["choices"], index=spec["choices"].index(default),
                                                key=f"{prefix}_{policy}_{spec['name']}", help=spec["help"] or None)
    specs = [s for s in parameters(policy, values) if s["type"] != "policy"]
    cols = st.columns(min(3, max(1, len(specs))))
    for i, spec in enumerate(specs):
        name, default, help_ = spec["name"], start.get(spec["name"], spec["default"]), spec["help"] or None
        key = f"{prefix}_{policy}_{name}"
        with cols[i % len(cols)]:
            if spec["choices"] is not None:
                values[name] = st.selectbox(name, spec["choices"], index=spec["choices"].index(default), key=key,
                                            help=help_)
            elif isinstance(default, bool):
                values[name] = st.checkbox(name, value=default, key=key, help=help_)
            elif isinstance(default, int):
                values[name] = int(st.number_input(name, value=default, step=1, key=key, help=help_,
                                                   min_value=spec["minimum"], max_value=spec["maximum"]))
            elif isinstance(default, float):
                lo, hi = spec["minimum"], spec["maximum"]
                values[name] = float(st.number_input(name, value=default, step=0.05, format="%.3g", key=key,
                                                     help=help_, min_value=None if lo is None else float(lo),
                                                     max_value=None if hi is None else float(hi)))
            else:
                shown = "none" if default is None else ",".join(str(x) for x in default) \
                    if isinstance(default, tuple) else str(default)
                text = st.text_input(name, value=shown, key=key, help=help_)
                values[name] = parse_value(policy, name, text, values)
    return values


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

    Returns `(name, params, budget)` validated, or None after showing the sentence of a bad entry.
    """
    names = policy_names()
    name = st.selectbox(label, names, index=names.index(default) if default in names else 0, key=f"{prefix}_policy",
                        help="\n\n".join(f"**{n}**: {REGISTRY[n].description}" for n in names))
    cls = REGISTRY[name]
    budget = None
    try:
        if not cls.budget_free:
            text = st.text_input("Budget", value=budget_default, key=f"{prefix}_{name}_budget",
                                 help="Slots per KV head per layer (e.g. 64) or a share of the prompt (e.g. 0.5).")
            budget = parse_budget(text)
        elif name == "full":
            st.caption("full keeps every slot: the uncompressed reference.")
        else:
            st.caption(f"{name} decides its own cache size (no budget).")
        params = {}
        if parameters(name):
            with st.expander("Parameters", expanded=False):
                params = parameter_widgets(name, prefix)
        make_policy(name, params)
    except KvlensError as err:
        st.error(str(err))
        return None
    return name, params, budget
