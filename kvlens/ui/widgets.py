"""Policy widgets generated from the policy dataclasses (`kvlens.policies.parameters`), and the KV storage
picker."""

from __future__ import annotations

import streamlit as st

from kvlens.errors import KvlensError
from kvlens.kvcache.quantize import BITS, SCHEMES, Storage
from kvlens.params import check_budget as check_budget_value
from kvlens.policies import (
    REGISTRY,
    check_slots,
    make_policy,
    parameters,
    parse_budget,
    policy_names,
    presets,
    with_preset,
)
from kvlens.ui.params import param_widget, start_index, unset

DEFAULTS = "(defaults)"


def parameter_widgets(policy: str, prefix: str) -> dict:
    """One widget per hyperparameter of `policy` (keys `{prefix}_{policy}_{name}`, `kvlens.ui.params`);
    returns the values. The widgets start from the chosen preset's settings; nested policies come first, since
    their choice decides the parameters shown. A bad value shows its sentence under its field and raises
    `BadSetting`; a bad combination raises KvlensError (the caller shows it).
    """
    values, slots = {}, {}
    start, prefix = _preset_picker(policy, prefix)
    for p in parameters(policy):
        if p.kind == "policy":
            values[p.name] = param_widget(
                p, start.get(p.name, p.default), f"{prefix}_{policy}_{p.name}", owner=policy
            )
    specs = [p for p in parameters(policy, values) if p.kind != "policy"]
    cols = st.columns(min(3, max(1, len(specs))))
    bad = None
    for i, p in enumerate(specs):
        with cols[i % len(cols)]:
            try:
                values[p.name] = param_widget(
                    p, start.get(p.name, p.default), f"{prefix}_{policy}_{p.name}", owner=policy
                )
            except KvlensError as err:
                bad = bad or err
                st.error(str(err))
            slots[p.name.rpartition(".")[2]] = st.empty()
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


class BadSetting(KvlensError):
    """A setting whose sentence is already shown under its field."""


def _preset_picker(policy: str, prefix: str) -> tuple[dict, str]:
    """A select box of the policy's presets (if it has any): the chosen preset's settings, and the widget
    key prefix (per preset, so that choosing one resets the fields to its values)."""
    named = presets(policy)
    if not named:
        return {}, prefix
    choice = st.selectbox(
        "preset",
        [DEFAULTS, *named],
        key=f"{prefix}_{policy}_preset",
        help="Named settings from the policy's sources (see `kvlens policies`); the fields below "
        "start from it and can still be changed.",
    )
    if choice == DEFAULTS:
        return {}, prefix
    return with_preset(policy, {"preset": choice}), f"{prefix}_{choice}"


def policy_picker(prefix: str, default: str = "h2o", label: str = "Policy", budget_default: str = "0.5"):
    """Policy select box, budget field and generated parameter widgets.

    Returns `(name, params, budget)` validated, or None after showing the sentence of a bad entry under
    its field (the caller then disables its Run button).
    """
    names = policy_names()
    name = st.selectbox(
        label,
        names,
        # none beside a policy the link already put in the session
        **unset(f"{prefix}_policy", index=start_index(names, default)),
        key=f"{prefix}_policy",
        help="\n\n".join(f"**{n}**: {REGISTRY[n].description}" for n in names),
    )
    cls = REGISTRY[name]
    budget, budget_slot = None, st
    try:
        if not cls().budget_free:  # with its defaults
            key = f"{prefix}_{name}_budget"
            text = st.text_input(
                "Budget",
                # none beside a budget the link (`url_state.bind_policy`) already put in the session
                **unset(key, value=budget_default),
                key=key,
                help="Slots per KV head per layer (e.g. 64) or a share of the prompt (e.g. 0.5).",
            )
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
    if budget is not None and isinstance(check_budget_value(budget), int):
        check_slots(policy, budget)


DTYPE = 0  # the "KV storage" option of the model's dtype (None would draw the select box with a clear button)


def storage_option(bits: int) -> str:
    return {DTYPE: "model dtype (no quantization)"}.get(bits, f"{bits} bits (quantized)")


def storage_picker(prefix: str) -> Storage | None:
    """The "KV storage" select box (the model's dtype, or keys and values quantized to 8, 4 or 2 bits) and,
    when quantized, the scheme, group size and full-precision window in an expander (keys `{prefix}_kv_bits`,
    `{prefix}_kv_scheme|group|residual`; `kvlens.kvcache.quantize`, the CLI's `--kv-*`). The select box's
    values are the bits, `DTYPE` (0) for the model's dtype.

    Returns the `Storage`, or None after showing the sentence of a bad combination (the caller then disables
    its button).
    """
    bits = st.selectbox(
        "KV storage",
        [DTYPE, *sorted(BITS, reverse=True)],
        key=f"{prefix}_kv_bits",
        format_func=storage_option,
        help="How the cache holds keys and values (`--kv-bits`). Quantized: packed codes with a "
        "zero point and scale per group (KIVI, Liu et al. 2024), independent of the policy, "
        "which still chooses from the prompt in full precision.",
    )
    if bits == DTYPE:
        return Storage()
    with st.expander(f"{bits}-bit storage settings", expanded=False):
        scheme = st.selectbox(
            "Scheme",
            SCHEMES,
            key=f"{prefix}_kv_scheme",
            help="kivi: keys per channel (groups of slots), values per token, as in the paper. "
            "token: keys and values both per token (groups of channels). `--kv-scheme`",
        )
        c1, c2 = st.columns(2)
        group = c1.number_input(
            "Group size",
            1,
            4096,
            Storage.group,
            step=16,
            key=f"{prefix}_kv_group",
            help="Values sharing one zero point and scale: slots (kivi's keys) or channels "
            "(a divisor of the model's head size). `--kv-group`",
        )
        residual = c2.number_input(
            "Full-precision window",
            0,
            65536,
            Storage.residual,
            step=32,
            key=f"{prefix}_kv_residual",
            help="The newest tokens kept unquantized (KIVI's R; for kivi a multiple of the "
            "group size). `--kv-residual`",
        )
    try:
        return Storage(bits, scheme, int(group), int(residual))
    except KvlensError as err:
        st.error(str(err))
        return None
