"""Widgets generated from a registered analysis' parameters (`kvlens.analysis.registry.Param`):
labels, defaults, bounds and tooltips come from its declaration, as the CLI's flags do."""
from __future__ import annotations

import streamlit as st

from kvlens.analysis.registry import Param, get_analysis
from kvlens.errors import KvlensError
from kvlens.lists import parse_list


def analysis_widgets(kind: str, prefix: str) -> dict | None:
    """One widget per parameter of analysis `kind` (keys `{prefix}_{kind}_{name}`); returns the values
    given (an empty field leaves the analysis' own default), or None after showing why an entry is bad."""
    params = get_analysis(kind).params
    values = {}
    cols = st.columns(max(1, min(4, len(params))))
    try:
        for i, prm in enumerate(params):
            value = _widget(cols[i % len(cols)], prm, f"{prefix}_{kind}_{prm.name}")
            if value is not None:
                values[prm.name] = value
    except KvlensError as err:
        st.error(str(err))
        return None
    return values


def _widget(col, prm: Param, key: str):
    label, help_ = prm.name.replace("_", " "), prm.help
    if prm.many or prm.type is str:
        shown = ",".join(map(str, prm.default)) if prm.many else prm.default
        text = col.text_input(label, value=shown, key=key, help=help_ + (" (comma-separated)" if prm.many else ""))
        if not prm.many:
            return text
        return parse_list(text, label, prm.type) if text.strip() else []
    step = 1 if prm.type is int else 0.05
    value = col.number_input(label, value=prm.default, min_value=prm.minimum, step=step, key=key, help=help_,
                             placeholder="default")
    return None if value is None else prm.type(value)
