"""End to end in a real browser: `streamlit run app.py` headless, driven by Playwright and Debian's Chromium.

Opens the Compare page, runs two policies on a short prompt and checks that the texts (the full
cache's reference plus the two policies) and the aligned chart appear; then starts a long run on
the Run page, presses Stop and checks that it stopped and saved nothing.
"""

from __future__ import annotations

import os

import pytest

from kvlens.ui.browser import wait_idle
from tests.browser.conftest import chromium_app, offline_page
from tests.conftest import CACHED_RUNS

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.usefixtures("offline")]


@pytest.fixture(scope="module")
def empty_runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def browser_page(empty_runs_dir, external_requests):
    with chromium_app(empty_runs_dir) as (chromium, url):
        page = offline_page(chromium, external_requests, 1400, 1000)
        page.goto(url)
        wait_idle(page, "kvlens")
        yield page


def test_compare_two_policies_in_chromium(browser_page):
    page = browser_page
    assert page.get_by_text("cam-attention").first.is_visible()  # a shipped run is open
    page.get_by_role("link", name="Compare").click()
    wait_idle(page, "Compare")
    prompt = page.get_by_label("Prompt")
    prompt.fill("The President spoke to the Congress about the state of the economy and the")
    slider = page.get_by_role("slider")
    slider.focus()
    slider.press("Home")  # fewest new tokens (4): keeps the test short
    page.get_by_role("button", name="Compare", exact=True).click()
    page.get_by_text("What each one writes").wait_for(timeout=240_000)
    main = page.locator("[data-testid='stMain']")
    main.locator(".js-plotly-plot").first.wait_for(timeout=60_000)
    labels = [main.get_by_text(name, exact=False).first for name in ("full", "streaming_llm", "h2o")]
    assert all(label.is_visible() for label in labels)
    captions = (
        main.get_by_text("The reference.").count()
        + main.get_by_text("Same as the full cache").count()
        + main.get_by_text("Diverges from the full cache").count()
    )
    assert captions == 6  # the reference and the two policies, their own texts and their choices on full's
    assert page.locator(".js-plotly-plot").count() >= 1
    table = main.locator("[data-testid='stDataFrame']").first  # the metrics table (drawn on a canvas)
    table.wait_for(timeout=60_000)
    assert table.is_visible()
    if os.environ.get("KVLENS_SCREENSHOTS"):
        page.screenshot(path=os.environ["KVLENS_SCREENSHOTS"], full_page=True)


def test_stop_cancels_a_run_and_saves_nothing(browser_page, empty_runs_dir):
    page = browser_page
    page.get_by_role("link", name="Run", exact=True).click()
    wait_idle(page, "Run")
    page.get_by_label("New tokens").fill("400")
    page.get_by_label("New tokens").press("Enter")
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("Press Stop to cancel").wait_for(timeout=120_000)  # live status: steps are running
    page.locator("[data-testid='stMain']").get_by_role("button", name="Stop").click()  # not the header one
    page.get_by_text("Stopped. The run was cancelled and nothing was saved.").wait_for(timeout=60_000)
    assert list(empty_runs_dir.iterdir()) == []


def _runs_table(page):
    """Open the Runs page; its table (drawn on a canvas, with an accessible copy of the cells for reading)."""
    page.get_by_role("link", name="Runs", exact=True).click()
    wait_idle(page, "Runs")
    return page.locator("[data-testid='stMain'] [data-testid='stDataFrame']").first


def test_runs_table_lists_the_shipped_runs_and_filtering_narrows_it(browser_page):
    from playwright.sync_api import expect

    page = browser_page
    table = _runs_table(page)
    shipped = sorted(p.parent.name for p in CACHED_RUNS.glob("*/run.json"))
    first_cells = table.locator("tbody tr td:first-child")
    expect(first_cells).to_have_text(shipped, timeout=60_000)  # one row per shipped run, in name order
    page.get_by_text(f"{len(shipped)} of {len(shipped)} runs").wait_for(timeout=60_000)
    page.get_by_role("textbox", name="Filter").fill("summary")
    page.get_by_role("textbox", name="Filter").press("Enter")
    page.get_by_text(f"1 of {len(shipped)} runs").wait_for(timeout=60_000)
    expect(first_cells).to_have_text(["tova-summary"], timeout=60_000)
    page.get_by_role("textbox", name="Filter").fill("")
    page.get_by_role("textbox", name="Filter").press("Enter")
    expect(first_cells).to_have_text(shipped, timeout=60_000)


def test_uploading_a_zip_that_is_not_a_run_is_refused_with_one_sentence(browser_page, empty_runs_dir):
    page = browser_page
    _runs_table(page)
    page.get_by_role("button", name="Import .zip").click()
    page.locator("[data-testid='stFileUploaderDropzoneInput']").set_input_files(
        files=[{"name": "notes.zip", "mimeType": "application/zip", "buffer": b"these are notes, not a zip"}]
    )
    refusal = page.locator("[data-testid='stMain'] [data-testid='stAlert']").get_by_text(
        "notes.zip is not a zip archive (or it is damaged).", exact=True
    )
    refusal.wait_for(timeout=60_000)
    assert refusal.count() == 1 and list(empty_runs_dir.iterdir()) == []
