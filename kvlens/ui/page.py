"""The scaffold of a browse page: `run = browse_page(title, caption, need)` draws the shell, the title,
the run picked in the sidebar, its header, a link to the view and a Report download (`report_button`: the
`kvlens report` HTML file, built only when clicked), checks what the page needs of the run,
and stops the page (`st.stop()`) when there is no run or the run lacks it, after saying why and offering
runs that have it. `pick_layer`, `pick_head` and `pick_step` keep a page's layer, head and step in the URL
(`?layer=`, `?head=`, `?step=`; the sidebar keeps `?run=`), so a copied link reopens the same view.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import streamlit as st

from kvlens.analysis.registry import get_analysis
from kvlens.analysis.report import report_html
from kvlens.errors import KvlensError
from kvlens.levels import RecordLevel
from kvlens.runs.run import Run, run_name
from kvlens.ui import session, url_state
from kvlens.ui.sidebar import app_shell
from kvlens.ui.state import RunEntry, all_runs, open_run
from kvlens.ui.views import run_header


@dataclass(frozen=True)
class Need:
    """What a page needs of a run: `accept(entry)` on the picker's entries, and `why`, the sentence shown
    when the open run lacks it (`{have}` is replaced by that run's record level)."""

    accept: Callable[[RunEntry], bool]
    why: str


MEASURED = Need(
    lambda e: e.measured,
    "This run was not measured. Record one with `kvlens generate ... --measure` "
    "(or tick *Measure* on the Run page), or open a measured run:",
)


def level_need(level: RecordLevel, what: str) -> Need:
    """A run recorded at `level` or above (`what` names what needs it, e.g. "The attention map")."""
    return Need(
        lambda e: e.level.includes(level),
        f"{what} needs a run recorded with `--record {level}`; this run was recorded at `{{have}}`. "
        f"Open one that has it, or make one on the **Run** page with *Record* set to `{level}`.",
    )


def analysis_need(kind: str) -> Need:
    """What the registered analysis `kind` declares: a measured run, or its record level."""
    analysis = get_analysis(kind)
    return (
        MEASURED
        if analysis.measured
        else level_need(analysis.level, f"The {analysis.name} analysis ({analysis.paper})")
    )


def page_top(title: str, caption: str = "") -> None:
    """Every page's start: the shell (when Streamlit runs the page on its own), the title and the caption."""
    app_shell()
    st.title(title)
    if caption:
        st.caption(caption)


def browse_page(title: str, caption: str = "", need: Need | None = None) -> Run:
    """`page_top`, the picked run's header, and `need` checked; the open run, or `st.stop()`."""
    page_top(title, caption)
    run = selected_run()
    if run is None:
        st.stop()
    run_header(run)
    link, report = st.columns([7, 1], vertical_alignment="center")
    with link:
        url_state.share_link()
    report_button([run], "page_report", report)
    if need is not None and not meets(need, "req"):
        st.stop()
    return run


def report_button(runs: list[Run], key: str, where=st) -> None:
    """A download of the runs' report (what `kvlens report` writes), built only when the button is clicked."""
    stem = "-".join(run_name(run, run.meta.policy.name) for run in runs)[:80]
    where.download_button(
        "Report",
        data=lambda: report_html(runs),
        file_name=f"{stem}-report.html",
        mime="text/html",
        key=key,
        on_click="ignore",
        icon=":material/download:",
        width="stretch",
        help="One HTML file with the settings, command, metrics, figures and kept text; it opens "
        "offline (built when clicked, a few seconds)",
    )


def pick_layer(
    layers: list[int], key: str, where=st, default: int | None = None, param: str = "layer"
) -> int:
    """A layer select box kept in the URL (`?layer=`, or `param` for a page's second one); starts at `default`
    (else the middle layer)."""
    start = default if default in layers else layers[len(layers) // 2]
    return url_state.bound(
        lambda **kw: where.selectbox("Layer", layers, **kw), param, key, layers, "layer", start
    )


# by `kv`: the shape's count of heads and the select box's label
HEADS = {True: ("kv_heads", "KV head"), False: ("heads", "Query head")}


def pick_head(
    run: Run, key: str, where=st, kv: bool = False, help: str | None = None, param: str = "head"
) -> int:
    """A query-head select box (a KV-head one when `kv`) kept in the URL (`?head=`, or `param`); a query
    head's help names its KV head."""
    shape, what = HEADS[kv]
    heads = list(range(run.shape[shape]))
    if help is None and not kv:
        help = f"KV head = query head // {run.shape['heads'] // run.shape['kv_heads']} (GQA)"
    return url_state.bound(
        lambda **kw: where.selectbox(what, heads, help=help, **kw), param, key, heads, what.lower(), 0
    )


def pick_step(
    label: str, last: int, key: str, where=st, help: str | None = None, param: str = "step", first: int = 0
) -> int:
    """A slider over steps `first`..`last` kept in the URL (`?step=`, or `param`); starts at `last`."""
    steps = list(range(first, last + 1))
    return url_state.bound(
        lambda **kw: where.slider(label, first, last, help=help, **kw), param, key, steps, label.lower(), last
    )


def fits(need: Need) -> bool:
    """Whether the open run meets `need` (nothing is shown)."""
    entry = st.session_state.get(session.RUN_ENTRY)
    return entry is not None and need.accept(entry)


def meets(need: Need, key: str) -> bool:
    """True if the open run meets `need`; else say why and offer (buttons keyed `{key}_NAME`) runs that do."""
    if fits(need):
        return True
    entry = st.session_state.get(session.RUN_ENTRY)
    st.warning(need.why.replace("{have}", getattr(entry, "level", "none")))  # none: no run entry
    offer_runs(need.accept, key)
    return False


def selected_run() -> Run | None:
    """The run chosen in the sidebar, or None (after telling the user why) if there is none."""
    entry = st.session_state.get(session.RUN_ENTRY)
    if entry is None:
        st.info("No run is selected. Pick one in the sidebar, or make one on the **Run** page.")
        return None
    try:
        return open_run(entry.path)
    except KvlensError as err:
        st.error(str(err))
    except OSError as err:
        st.error(f"The run folder {entry.path} could not be read ({err.strerror or err}).")
    return None


def offer_runs(accept: Callable[[RunEntry], bool], key: str) -> None:
    """Buttons opening the runs that `accept(entry)` (at most four)."""
    fitting = [e for e in all_runs() if accept(e)][:4]
    if fitting:
        cols = st.columns(len(fitting))
        for col, e in zip(cols, fitting, strict=True):
            col.button(f"Open {e.name}", key=f"{key}_{e.name}", on_click=_choose, args=(e.path,))


def _choose(path: str) -> None:
    st.session_state[session.RUN] = path
