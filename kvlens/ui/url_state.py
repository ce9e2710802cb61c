"""Page state in the URL's query parameters, so that a copied link reopens the same view.

`bind(key, param, options)` goes right before the widget keyed `key`: on the session's first render of
that widget it takes the value of `?param=` when it names one of `options` (an unknown value is ignored
with one sentence); `publish(param, value)` right after the widget writes the value back, so the address
bar always holds the view; `bound(widget, ...)` does the three. `bound_many` keeps a multiselect, and
`bind_param`/`publish_param` a widget generated from a declared parameter (`kvlens.ui.params`), under the
parameter's name. `share_link()` shows that address with a button that copies it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import streamlit as st

from kvlens.errors import KvlensError
from kvlens.figures.wording import when
from kvlens.params import Param
from kvlens.policies import policy_names, presets
from kvlens.ui.params import widget_of
from kvlens.ui.widgets import DEFAULTS

READ = "url_read"  # session key: the widget keys already set from the URL in this session
MAX_TEXT = 200  # longest free-text value taken from a link


def bind(
    key: str,
    param: str,
    options: Sequence | None,
    what: str,
    show: Callable[[Any], str] = str,
    parse: Callable[[str], Any] | None = None,
) -> None:
    """Set `st.session_state[key]` from `?param=` once per session: to the option `o` with `show(o)` equal
    to the parameter; when `options` is None, to `parse(text)` (which raises KvlensError with the sentence of
    a bad text), or without `parse` to any text up to `MAX_TEXT` characters. Otherwise warn once."""
    done = st.session_state.setdefault(READ, set())
    if key in done:
        return
    done.add(key)
    text = st.query_params.get(param)
    if text is None:
        return
    if options is None:
        if len(text) > MAX_TEXT or not text.isprintable():
            st.warning(f"The link's {what} is not a short line of text; it was ignored.")
            return
        try:
            st.session_state[key] = (parse or str)(text)
        except KvlensError as err:
            st.warning(f"The link's {what} was ignored: {err}")
        return
    by_text = {show(o): o for o in options}
    if text in by_text:
        st.session_state[key] = by_text[text]
        return
    shown = ", ".join(list(by_text)[:12]) + when(len(by_text) > 12, ", …")
    st.warning(f"The link's {what} {_quote(text)} is not one of {shown}; it was ignored.")


def reread(*keys: str) -> None:
    """Let the widgets keyed `keys` take their value from the link again on their next render (a page that
    sends the user to another with `st.switch_page(..., query_params=...)` calls this first)."""
    st.session_state[READ] = st.session_state.get(READ, set()) - set(keys)


def publish(param: str, value: Any, show: Callable[[Any], str] = str) -> None:
    """Write the widget's current value into the URL as `?param=` (removed when the value is None)."""
    if value is None:
        if param in st.query_params:
            del st.query_params[param]
        return
    text = show(value)
    if st.query_params.get(param) != text:
        st.query_params[param] = text


def bound(
    widget: Callable[..., Any],
    param: str,
    key: str,
    options: Sequence | None,
    what: str,
    default: Any,
    show: Callable[[Any], str] = str,
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """`bind`, then `widget(key=key)` starting at `default` unless the link or the user set it, then
    `publish`: the widget's value, kept in the URL. `widget` must not pass a default of its own (Session State
    holds it)."""
    bind(key, param, options, what, show, parse)
    st.session_state.setdefault(key, default)
    value = widget(key=key)
    publish(param, value, show)
    return value


def bound_many(
    widget: Callable[..., Any],
    param: str,
    key: str,
    options: Sequence[str],
    what: str,
    default: Sequence[str],
) -> list[str]:
    """`bound` for a multiselect over `options` (texts without commas): `?param=a,b`, `?param=` for none."""
    spec = Param(param, tuple(default), "", choices=tuple(options), many=True)
    return bound(
        widget,
        param,
        key,
        None,
        what,
        list(default),
        show=",".join,
        parse=lambda text: list(dict.fromkeys(spec.parse(text))),
    )


def bind_param(p: Param, key: str, owner: str) -> None:
    """Before `kvlens.ui.params.param_widget(p, ..., key)`: its value from `?{p.name}=`, an option of its
    select box, true or false, or text that `p.parse` accepts (a number, or what a text field would hold)."""
    widget = widget_of(p)
    if widget == "select":
        bind(key, p.name, p.allowed(), p.name)
    elif widget == "check":
        bind(key, p.name, [True, False], p.name, show=_flag)
    else:

        def parse(text: str) -> Any:
            value = p.parse(text, owner)
            return value if widget == "number" else text  # a text field holds the text itself

        bind(key, p.name, None, p.name, parse=parse)


def publish_param(p: Param, key: str) -> None:
    """After `param_widget(p, ..., key)`: its value (a text field's text) into the URL; none for an empty
    number."""
    publish(p.name, st.session_state.get(key), {"check": _flag}.get(widget_of(p), str))


def bind_policy(prefix: str) -> None:
    """Before `kvlens.ui.widgets.policy_picker(prefix)`: its policy, preset and budget from `?policy=`,
    `?preset=` and `?budget=` (the picker's keys: `{prefix}_policy`, `{prefix}_{policy}_preset|budget`)."""
    bind(f"{prefix}_policy", "policy", policy_names(), "policy")
    policy = st.session_state.get(f"{prefix}_policy")
    if policy in policy_names():
        bind(f"{prefix}_{policy}_preset", "preset", [DEFAULTS, *presets(policy)], f"preset of {policy}")
        bind(f"{prefix}_{policy}_budget", "budget", None, "budget")


def publish_policy(prefix: str) -> None:
    """After `policy_picker(prefix)`: its policy, preset and budget into the URL (removed where it has
    none)."""
    policy = st.session_state.get(f"{prefix}_policy")
    publish("policy", policy)
    preset = st.session_state.get(f"{prefix}_{policy}_preset")
    publish("preset", None if preset == DEFAULTS else preset)
    publish("budget", st.session_state.get(f"{prefix}_{policy}_budget"))


def _flag(value: bool) -> str:
    return str(value).lower()


def _quote(text: str) -> str:
    text = text[:40] + when(len(text) > 40, "…")
    return "'" + "".join(c if c.isprintable() else "?" for c in text) + "'"


_SHARE = """
<div style="display:flex;gap:8px;align-items:center;font-family:'Source Sans Pro',sans-serif;font-size:14px">
  <button id="copy" style="padding:4px 12px;border:1px solid #ccc;border-radius:8px;background:#fff;
          cursor:pointer;white-space:nowrap">Copy link</button>
  <input id="link" readonly aria-label="Link to this view" style="flex:1;min-width:0;
         padding:4px 8px;border:1px solid #ddd;border-radius:6px;font-family:monospace;font-size:12px;
         color:#333;background:#fafafa">
  <span id="done" style="color:#2e7d32;min-width:50px"></span>
</div>
<script>
  const link = document.getElementById("link");
  const show = () => { if (document.activeElement !== link) link.value = window.parent.location.href; };
  show(); setInterval(show, 500);
  document.getElementById("copy").onclick = async () => {
    show(); link.select();
    try { await navigator.clipboard.writeText(link.value); }
    catch (e) { document.execCommand("copy"); }
    document.getElementById("done").textContent = "Copied";
    setTimeout(() => { document.getElementById("done").textContent = ""; }, 2000);
  };
</script>
"""


def share_link() -> None:
    """The address of this view (what the widgets published) and a button copying it to the clipboard."""
    st.iframe(_SHARE, height=44)
