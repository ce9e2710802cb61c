"""kvlens app: browse recorded runs, run policies live, compare them, export figures.

`make run` starts it (`streamlit run app.py` on 127.0.0.1). Navigation and the shared sidebar
live here; each page in `pages/` holds widgets and layout only, and a new file there is a new page.
"""

import logging
from pathlib import Path

import streamlit as st

from kvlens.errors import KvlensError
from kvlens.ui import session
from kvlens.ui.sidebar import page_config, sidebar

page_config()

# section: (file in pages/, title, icon); any other file in pages/ joins Browse under its own name
NAVIGATION = {
    "Browse": [
        ("overview", "Overview", ":material/description:"),
        ("runs", "Runs", ":material/table_rows:"),
        ("heads", "Head grid", ":material/apps:"),
        ("attention", "Attention", ":material/grid_on:"),
        ("similarity", "Similarity", ":material/compare_arrows:"),
        ("spectra", "Spectra", ":material/show_chart:"),
        ("merges", "Merges", ":material/call_merge:"),
        ("perturbation", "Perturbation", ":material/ssid_chart:"),
        ("why", "Why", ":material/help:"),
        ("analyses", "Analyses", ":material/analytics:"),
    ],
    "Run": [
        ("run", "Run", ":material/play_arrow:"),
        ("compare", "Compare", ":material/view_column:"),
        ("benchmarks", "Benchmarks", ":material/speed:"),
    ],
}
PAGES = {
    section: [
        st.Page(f"pages/{name}.py", title=title, icon=icon, default=name == "overview")
        for name, title, icon in entries
    ]
    for section, entries in NAVIGATION.items()
}
listed = {name for entries in NAVIGATION.values() for name, _, _ in entries}
PAGES["Browse"] += [
    st.Page(f"pages/{p.name}", title=p.stem.replace("_", " ").capitalize(), icon=":material/insights:")
    for p in sorted((Path(__file__).parent / "pages").glob("*.py"))
    if p.stem not in listed
]

page = st.navigation(PAGES, position="hidden")  # the sidebar draws the links (see kvlens/ui/sidebar.py)
sidebar(PAGES, PAGES["Run"][0])
st.session_state[session.SHELL] = True
try:
    page.run()
except KvlensError as err:
    st.error(str(err))
except Exception as err:  # noqa: BLE001  (the page shows a sentence, the log keeps the traceback)
    logging.getLogger("kvlens.app").exception("page %s failed", page.title)
    st.error(
        f"This page hit an unexpected error ({type(err).__name__}: {str(err)[:200]}). "
        "The details are in the terminal running `make run`; please report them."
    )
finally:
    st.session_state[session.SHELL] = False
