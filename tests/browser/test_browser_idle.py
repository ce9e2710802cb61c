"""`kvlens.ui.browser.wait_idle`, which every browser test and screenshot waits on: a page is idle when its
script has finished, not merely when Streamlit's running indicator is absent (it shows only 500 ms into a
run, so a page still drawing looked idle before)."""

from __future__ import annotations

import pytest

from kvlens.ui.browser import wait_idle
from tests.browser.conftest import chromium_app, offline_page

pytestmark = [pytest.mark.browser, pytest.mark.usefixtures("offline")]

SCRIPT = """import time

import streamlit as st

st.title("Idle")
if st.button("Draw"):
    st.subheader("Header")
    time.sleep(1.5)  # the card comes after the header; the running indicator shows from 500 ms on
    st.markdown("<div class='card'>card</div>", unsafe_allow_html=True)
"""


def test_a_page_is_idle_only_once_its_script_has_drawn_everything(tmp_path, external_requests):
    script = tmp_path / "idle_app.py"
    script.write_text(SCRIPT, encoding="utf-8")
    with chromium_app(tmp_path, script) as (chromium, url):
        page = offline_page(chromium, external_requests, 800, 600)
        page.goto(url)
        wait_idle(page, "Idle")
        page.get_by_role("button", name="Draw").click()
        page.get_by_text("Header").wait_for()
        wait_idle(page, "Idle")
        assert page.locator("[data-testid='stMain'] .card").count() == 1
