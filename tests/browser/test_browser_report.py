"""A `kvlens report` file opened from disk in a real browser (Playwright + Debian's Chromium): every figure
draws from the inlined plotly.js and not one request leaves the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvlens.cli import main
from kvlens.ui.browser import CHROMIUM, CHROMIUM_ARGS, refuse_external
from tests.conftest import CACHED_RUNS

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.usefixtures("offline")]
DRAWN = """() => Array.from(document.querySelectorAll('.plotly-graph-div'))
                   .filter(div => div.querySelector('.main-svg .xtick')).length"""


def test_a_report_of_two_runs_draws_every_figure_from_the_file_alone(tmp_path, external_requests):
    if not Path(CHROMIUM).exists():
        pytest.skip(
            f"{CHROMIUM} is missing: install Debian's chromium package (make test does so when run as root)"
        )
    from playwright.sync_api import sync_playwright

    out = tmp_path / "report.html"
    assert (
        main(
            [
                "report",
                "--run",
                str(CACHED_RUNS / "h2o-attention"),
                "--run",
                str(CACHED_RUNS / "cam-attention"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = chromium.new_context(viewport={"width": 1400, "height": 1000})
        refuse_external(
            context, external_requests, hosts=()
        )  # any request but the file's own read is refused
        page = context.new_page()
        errors = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.goto(out.as_uri())
        page.wait_for_function(f"({DRAWN})() === 13", timeout=60_000)  # 1 + 5 (h2o) + 7 (cam, measured)
        assert page.locator(".plotly-graph-div").count() == 13 and not errors
        assert page.locator(".kvlens-kept-text").count() == 2
        query = page.locator(".kvlens-kept-text span[title][style*='outline:2px']").first
        assert "the query of step 39" in query.get_attribute("title")
        if os.environ.get("KVLENS_SCREENSHOTS"):
            page.screenshot(path=os.environ["KVLENS_SCREENSHOTS"], full_page=True)
        chromium.close()
    assert not external_requests
