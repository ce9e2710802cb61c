"""The shared sidebar: the page links, model, device, run picker, "new run", paper-style toggle (keys
prefixed `app_`).

The app draws its own page links (app.py calls `st.navigation(..., position="hidden")`, and
`.streamlit/config.toml` sets `client.showSidebarNavigation = false`): Streamlit's own sidebar list
would first show the raw file names of `pages/` when a fresh server's first request is a page's URL.
"""

from __future__ import annotations

import streamlit as st
from streamlit import config
from streamlit.runtime.pages_manager import PagesManager

from kvlens.levels import LEVELS
from kvlens.ui import session, url_state
from kvlens.ui.state import RunEntry, all_runs, cached_runs_dir, user_runs_dir

DEVICES = ["auto", "cpu", "cuda", "mps"]
# The tab's icon, inline: a `:material/...:` page icon makes the browser fetch it from fonts.gstatic.com, and
# the app requests nothing outside the machine. The "memory" icon of Google's Material Icons (Apache License
# 2.0).
ICON = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><path d="M15 9H9v6h6V9zm-2 4h-2v-2h2v2z'
    "m8-2V9h-2V7c0-1.1-.9-2-2-2h-2V3h-2v2h-2V3H9v2H7c-1.1 0-2 .9-2 2v2H3v2h2v2H3v2h2v2c0 1.1.9 2 "
    "2 2h2v2h2v-2h2v2"
    'h2v-2h2c1.1 0 2-.9 2-2v-2h2v-2h-2v-2h2zm-4 6H7V7h10v10z"/></svg>'
)


def default_run(runs: list[RunEntry]) -> RunEntry:
    """The run that fills the most pages: highest recording level, merging policies first."""
    return max(runs, key=lambda e: (LEVELS.index(e.level), e.merging, e.source == "shipped"))


def page_config() -> None:
    st.set_page_config(page_title="kvlens", page_icon=ICON, layout="wide")


def app_shell() -> None:
    """Pages call this first. app.py draws the shell (page config, sidebar) around the page and
    marks it in `session.SHELL`. When a fresh server's first request is a page's URL, Streamlit runs that
    `pages/` file on its own (its legacy multipage mode, left once app.py calls `st.navigation`): the
    page then reruns at once through app.py. Under AppTest, which restarts that mode before every run
    (`switch_page` runs the file on its own each time), and without app.py, the page draws the shell."""
    if st.session_state.get(session.SHELL):
        return
    if PagesManager.uses_pages_directory and not config.get_option("global.appTest"):
        PagesManager.uses_pages_directory = False  # what app.py's st.navigation sets: from now on app.py runs
        st.rerun()
    page_config()
    sidebar()


def page_links(pages: dict[str, list]) -> None:
    """The navigation: each section's `st.Page`s as links (the current page highlighted)."""
    for section, entries in pages.items():
        st.caption(section)
        for page in entries:
            st.page_link(page)


def sidebar(pages: dict[str, list] | None = None, run_page="pages/run.py") -> None:
    """Draw the sidebar (the page links of `pages`: section -> `st.Page`s, when given); the chosen run's entry
    lands in `st.session_state[session.RUN_ENTRY]`."""
    with st.sidebar:
        if pages:
            page_links(pages)
            st.divider()
        runs = all_runs()
        if not runs:
            st.session_state[session.RUN_ENTRY] = None
            st.info(
                f"No runs yet: {cached_runs_dir()} and {user_runs_dir()} hold none. "
                "Make one on the Run page, or regenerate the shipped ones with "
                "`python scripts/make_cached_runs.py`."
            )
        else:
            by_path = {e.path: e for e in runs}

            def name(p: str) -> str:  # how the URL names a run: `?run=h2o-attention`
                return by_path[p].name

            url_state.bind(session.RUN, "run", list(by_path), "run", show=name)
            request = st.session_state.pop(session.RUN_REQUEST, None)  # set by pages that saved a run
            if request in by_path:
                st.session_state[session.RUN] = request
            if st.session_state.get(session.RUN) not in by_path:
                st.session_state[session.RUN] = default_run(runs).path
            path = st.selectbox(
                "Run",
                list(by_path),
                key=session.RUN,
                format_func=lambda p: by_path[p].label,
                help="Shipped runs from cached_runs/, then yours from runs/ (newest first).",
            )
            url_state.publish("run", path, show=name)
            st.session_state[session.RUN_ENTRY] = by_path[path]
        if st.button(
            "New run", icon=":material/add:", width="stretch", help="Run a policy on your own prompt"
        ):
            st.switch_page(run_page)
        st.divider()
        st.toggle(
            "Paper style",
            key=session.PAPER,
            help="Show charts in the style they are exported in (white, one font, no grid).",
        )
        with st.expander("Model", expanded=False):
            st.text_input(
                "Model",
                value="default",
                key=session.MODEL,
                help="'default' (embedded SmolLM2-135M-Instruct) or a hub id; a local folder or .gguf "
                "file only if the app was started with KVLENS_APP_MODEL set to it. "
                "Used by the Run and Compare pages.",
            )
            st.selectbox("Device", DEVICES, key=session.DEVICE, help="auto = CUDA, then MPS, then CPU.")
