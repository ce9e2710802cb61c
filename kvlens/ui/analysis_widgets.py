"""Widgets generated from a registered analysis' parameters (`kvlens.ui.params`): labels, defaults and
tooltips come from its declaration, as the CLI's flags do."""
from __future__ import annotations

import streamlit as st

from kvlens.analysis.registry import get_analysis
from kvlens.errors import KvlensError
from kvlens.ui.params import param_widget


def analysis_widgets(kind: str, prefix: str) -> dict | None:
    """One widget per parameter of analysis `kind` (keys `{prefix}_{kind}_{name}`); returns the values
    given (an empty field leaves the analysis' own default), or None after showing why an entry is bad."""
    params = get_analysis(kind).params
    values = {}
    cols = st.columns(max(1, min(4, len(params))))
    try:
        for i, prm in enumerate(params):
            value = param_widget(prm, prm.default, f"{prefix}_{kind}_{prm.name}", where=cols[i % len(cols)])
            if value is not None:
                values[prm.name] = prm.check(value)
    except KvlensError as err:
        st.error(str(err))
        return None
    return values
