"""Widgets generated from a registered analysis' parameters (`kvlens.ui.params`): labels, defaults and
tooltips come from its declaration, as the CLI's flags do. The chosen analysis and its parameters live in
the URL (`?analysis=embedding&layer=15&method=tsne`), each parameter under its own name."""

from __future__ import annotations

import streamlit as st

from kvlens.analysis.registry import analyses, get_analysis
from kvlens.errors import KvlensError
from kvlens.ui import url_state
from kvlens.ui.params import param_widget

PARAM = "analysis"  # the URL's name of the chosen analysis


def pick_analysis(kinds: list[str], key: str) -> str:
    """A select box of the analyses `kinds` kept in the URL (`?analysis=`); choosing another removes the
    parameters of the one left from the URL, so the new one's widgets start from their own defaults."""
    known = analyses()
    return url_state.bound(
        lambda **kw: st.selectbox(
            "Analysis", kinds, on_change=_drop_left, format_func=lambda n: f"{n} ({known[n].paper})", **kw
        ),
        PARAM,
        key,
        kinds,
        "analysis",
        kinds[0],
    )


def _drop_left() -> None:
    """The select box's callback: the URL still names the analysis left, whose parameters go."""
    left = analyses().get(st.query_params.get(PARAM))
    for prm in getattr(left, "params", ()):  # none: the URL named no analysis
        url_state.publish(prm.name, None)


def analysis_widgets(kind: str, prefix: str) -> dict | None:
    """One widget per parameter of analysis `kind` (keys `{prefix}_{kind}_{name}`, kept in the URL as
    `?name=`); returns the values given (an empty field leaves the analysis' own default), or None after
    showing under its field why an entry is bad."""
    params = get_analysis(kind).params
    values, bad = {}, False
    cols = st.columns(max(1, min(4, len(params))))
    for i, prm in enumerate(params):
        key, where = f"{prefix}_{kind}_{prm.name}", cols[i % len(cols)]
        url_state.bind_param(prm, key, kind)
        try:
            value = param_widget(prm, prm.default, key, where=where)
            if value is not None:
                values[prm.name] = prm.check(value)
        except KvlensError as err:
            where.error(str(err))
            bad = True
        url_state.publish_param(prm, key)
    return None if bad else values
