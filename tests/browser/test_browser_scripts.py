"""Text in every script, end to end: a prompt with Polish, an emoji, Hebrew and Chinese goes through the Run
and Compare pages in Chromium, and what the pages show is the saved run's text (run.json), with no U+FFFD."""

from __future__ import annotations

import json

import pytest

from kvlens.ui.browser import wait_idle
from tests.browser.conftest import chromium_app, offline_page

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.usefixtures("offline")]

LINE = "Łódź 👧 שלום 你好"
PROMPT = f"Copy each line.\nIn: {LINE}\nOut: {LINE}\nIn: {LINE}\nOut:"
TOKENS = 24


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def page(runs_dir, external_requests):
    with chromium_app(runs_dir) as (chromium, url):
        page = offline_page(chromium, external_requests, 1400, 1000)
        page.goto(f"{url}/run?policy=h2o&budget=0.5")
        wait_idle(page, "Run")
        yield page


def _texts(page, selector: str) -> list[str]:
    return page.locator(f"[data-testid='stMain'] {selector}").evaluate_all(
        "els => els.map(e => e.textContent)"
    )


def test_run_page_shows_the_saved_text(page, runs_dir):
    page.get_by_role("textbox", name="Prompt").fill(PROMPT)
    page.get_by_role("spinbutton", name="New tokens").fill(str(TOKENS))
    page.get_by_role("spinbutton", name="New tokens").press("Enter")
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("Your last run").wait_for(timeout=240_000)
    wait_idle(page, "Run")
    (saved,) = runs_dir.glob("*/run.json")
    text = json.loads(saved.read_text(encoding="utf-8"))["text"]
    assert any(c in text for c in "👧שלום你好ŁódźŁ"), "the model copies the line, non-ASCII included"
    assert _texts(page, ".kvlens-generated") == [text]
    pills = " ".join(_texts(page, "[data-testid='stButtonGroup'] button"))
    assert "\ufffd" not in pills


def test_compare_page_shows_the_same_text(page, runs_dir):
    (saved,) = runs_dir.glob("*/run.json")
    text = json.loads(saved.read_text(encoding="utf-8"))["text"]
    page.get_by_role("link", name="Compare").click()
    wait_idle(page, "Compare")
    page.get_by_role("textbox", name="Prompt").fill(PROMPT)
    slider = page.get_by_role("slider")
    slider.focus()
    slider.press("Home")
    for _ in range((TOKENS - 4) // 4):
        slider.press("ArrowRight")
    page.get_by_role("button", name="Compare", exact=True).click()
    page.get_by_text("What each one writes").wait_for(timeout=400_000)
    wait_idle(page, "Compare")
    cards = _texts(page, ".kvlens-text")
    assert len(cards) == 6  # the full cache and two policies: their own texts, then scored on full's
    assert text in cards[:3]  # h2o at 0.5 (the second default policy) writes what the Run page saved
    assert all("\ufffd" not in card for card in cards)
