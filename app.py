"""kvlens app: browse recorded runs, run policies live, compare them, export figures.

`make run` starts it (`streamlit run app.py` on 127.0.0.1). Navigation and the shared sidebar
live here; each page in `pages/` holds widgets and layout only.
"""
import logging

import streamlit as st

from kvlens.errors import KvlensError
from kvlens.ui import session
from kvlens.ui.sidebar import page_config, sidebar

page_config()

PAGES = {
    "Browse": [
        st.Page("pages/overview.py", title="Overview", icon=":material/description:", default=True),
        st.Page("pages/attention.py", title="Attention", icon=":material/grid_on:"),
        st.Page("pages/similarity.py", title="Similarity", icon=":material/compare_arrows:"),
        st.Page("pages/spectra.py", title="Spectra", icon=":material/show_chart:"),
        st.Page("pages/merges.py", title="Merges", icon=":material/call_merge:"),
        st.Page("pages/perturbation.py", title="Perturbation", icon=":material/ssid_chart:"),
    ],
    "Run": [
        st.Page("pages/run.py", title="Run", icon=":material/play_arrow:"),
        st.Page("pages/compare.py", title="Compare", icon=":material/view_column:"),
        st.Page("pages/benchmarks.py", title="Benchmarks", icon=":material/speed:"),
    ],
}

page = st.navigation(PAGES)
sidebar(PAGES["Run"][0])
st.session_state[session.SHELL] = True
try:
    page.run()
except KvlensError as err:
    st.error(str(err))
except Exception as err:  # noqa: BLE001  (the page shows a sentence, the log keeps the traceback)
    logging.getLogger("kvlens.app").exception("page %s failed", page.title)
    st.error(f"This page hit an unexpected error ({type(err).__name__}: {str(err)[:200]}). "
             "The details are in the terminal running `make run`; please report them.")
finally:
    st.session_state[session.SHELL] = False
