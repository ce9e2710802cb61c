"""The browser tests' fixtures: `streamlit run app.py` with a headless Chromium whose pages must stay
offline."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest

PATIENCE_MS = 120_000  # a browser test's default wait (Playwright's is 30 s, `expect`'s 5 s)


@pytest.fixture(scope="module")
def external_requests() -> list[str]:
    """The URLs outside 127.0.0.1 that a browser test module's pages asked for (refused by
    `kvlens.ui.browser.refuse_external`, which the module's browser fixture installs with this list)."""
    return []


@pytest.fixture
def offline(external_requests):
    """Fail the browser test during which (or before which, in the module's setup) a page requested
    anything from a host other than 127.0.0.1: the app must work without internet."""
    yield
    seen = sorted(set(external_requests))
    external_requests.clear()
    assert not seen, f"the app requested {len(seen)} URL(s) outside 127.0.0.1 (it must work offline): {seen}"


@contextmanager
def chromium_app(runs_dir: Path, script: Path | None = None):
    """`streamlit run app.py` (or `script`) on the runs folder `runs_dir` and a headless Chromium: yields
    (chromium, url). Skips the module when Debian's chromium is missing."""
    from kvlens.ui.browser import CHROMIUM, CHROMIUM_ARGS, streamlit_server

    if not Path(CHROMIUM).exists():
        pytest.skip(
            f"{CHROMIUM} is missing: install Debian's chromium package (make test does so when run as root)"
        )
    from playwright.sync_api import sync_playwright

    env = {**os.environ, "KVLENS_RUNS": str(runs_dir)}
    with streamlit_server(env, script) as url, sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium, url
        finally:
            chromium.close()


def offline_page(chromium, external_requests: list[str], width: int = 1500, height: int = 1000):
    """A page in a new browser context (no cookies, no session) whose requests off 127.0.0.1 are refused and
    recorded in `external_requests` (the `offline` fixture then fails the test). Its waits and `expect`s allow
    `PATIENCE_MS`: the suite runs beside other test processes, and a loaded machine paints slowly."""
    from playwright.sync_api import expect

    from kvlens.ui.browser import refuse_external

    context = chromium.new_context(viewport={"width": width, "height": height})
    context.set_default_timeout(PATIENCE_MS)
    expect.set_options(timeout=PATIENCE_MS)
    refuse_external(context, external_requests)
    return context.new_page()
