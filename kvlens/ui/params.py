"""The one widget builder: a Streamlit widget from a declared `kvlens.params.Param` (policies and analyses).

Choices and nested policies are select boxes, booleans checkboxes, integers and numbers number
inputs (empty when the default is worked out from the input), tuples, lists and text text fields
read by `Param.parse`. The widget carries the declaration's help as its tooltip and no bounds of
its own: a value out of bounds gets the declaration's one sentence, shown by the caller.
"""

from __future__ import annotations

import streamlit as st

from kvlens.figures.wording import if_none, when
from kvlens.params import Param

WIDGETS = {"choice": "select", "policy": "select", "bool": "check", "int": "number", "float": "number"}
NUMBERS = {"int": (1, None, int), "float": (0.05, "%.3g", float)}  # a number input's step, format and type


def start_index(options: list, value) -> int:
    """Where a select box of `options` starts: at `value`, else at the first option."""
    return next((i for i, option in enumerate(options) if option == value), 0)


def unset(key: str, **start) -> dict:
    """A widget's `start` arguments (`value=`, `index=`), or none when the link or the user already put its
    value in the session under `key` (Streamlit would warn about a default beside it)."""
    return {k: v for k, v in start.items() if key not in st.session_state}


def widget_of(p: Param) -> str:
    """The widget `param_widget` draws for `p`: "select", "check", "number" or (lists and the other kinds)
    "text"."""
    return "text" if p.many else WIDGETS.get(p.kind, "text")


def param_widget(p: Param, value, key: str, where=st, owner: str = ""):
    """The widget of `p` starting at `value` (keyed `key`); the value entered (text kinds parsed)."""
    help_ = p.help or None
    widget = widget_of(p)
    if key in st.session_state:  # the link or the user set it: no default beside it (Streamlit would warn)
        value = None
    if widget == "select":
        options = list(p.allowed() or ())
        start = getattr(value, "name", value)
        return where.selectbox(p.name, options, index=start_index(options, start), key=key, help=help_)
    if widget == "check":
        return where.checkbox(p.name, value=bool(value), key=key, help=help_)
    if widget == "number":
        step, fmt, kind = NUMBERS[p.kind]
        number = where.number_input(
            p.name, value=value, step=step, key=key, help=help_, format=fmt, placeholder="default"
        )
        if number is None:
            return None
        return kind(number)
    shown = str(if_none(value, ""))
    if isinstance(value, (tuple, list)):
        shown = ",".join(map(str, value))
    text = where.text_input(
        p.name, value=shown, key=key, help=(help_ or "") + when(p.many, " (comma-separated)")
    )
    return p.parse(text, owner=owner)
