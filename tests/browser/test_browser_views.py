"""The token inspector, shareable links and the first paint, in a real browser (Playwright + Debian's
Chromium).

One fresh `streamlit run app.py` for the module: the first test is its first request, a page's URL.
"""

from __future__ import annotations

import os

import pytest

from kvlens import load_run
from kvlens.figures.inspect_token import token_strings
from kvlens.ui.browser import wait_idle
from kvlens.ui.inspector import label
from tests.browser.conftest import chromium_app, offline_page
from tests.conftest import CACHED_RUNS

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.usefixtures("offline")]
RAW = {
    "app",
    "overview",
    "heads",
    "attention",
    "similarity",
    "spectra",
    "merges",
    "perturbation",
    "analyses",
    "run",
    "compare",
    "benchmarks",
    "why",
}  # Streamlit's own list of pages/: lower-case file names and `app`
RECORD_LINKS = """
window.__links = new Set();
new MutationObserver(() => {
  for (const a of document.querySelectorAll('[data-testid="stSidebar"] a, [data-testid="stSidebarNav"] *'))
    window.__links.add(a.textContent.trim());
}).observe(document, {childList: true, subtree: true, characterData: true});
"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory, external_requests):
    with chromium_app(tmp_path_factory.mktemp("runs")) as (chromium, url):
        yield chromium, url, external_requests


def new_page(browser):
    """A page in a new browser context: no cookies, no session, no request off 127.0.0.1 (`offline` fails on
    one)."""
    chromium, _, seen = browser
    return offline_page(chromium, seen)


def test_first_paint_of_a_page_url_never_shows_the_raw_page_list(browser):
    url = browser[1]
    page = new_page(browser)
    page.add_init_script(RECORD_LINKS)  # every link text the sidebar ever shows, from the first paint on
    page.goto(f"{url}/attention", wait_until="commit")
    page.locator("[data-testid='stMain'] h1", has_text="Attention").wait_for(timeout=120_000)
    page.locator("[data-testid='stSidebar'] a", has_text="Similarity").wait_for(timeout=60_000)
    seen = set(page.evaluate("() => Array.from(window.__links)"))
    assert any(text.endswith("Overview") for text in seen)  # the app's own links were recorded
    assert not seen & RAW, seen & RAW
    assert page.locator("[data-testid='stSidebarNav']").count() == 0
    page.context.close()


def _pick_token(page, run) -> tuple[int, str]:
    """Click the first of a generated word that the run repeats later (from step 5 on); its step and label.
    Pills report a click by their text, so a wrong pick would land on the word's last occurrence."""
    labels = [label(s) for s in token_strings(run)]
    step = next(i for i in range(5, len(labels)) if labels[i].isalpha() and labels[i] in labels[i + 1 :])
    page.locator("[data-testid='stMain']").get_by_role("radio", name=labels[step], exact=True).first.click()
    return step, labels[step]


def _choose(page, name: str, option: str) -> None:
    """Pick `option` in the main area's select box labelled `name` by typing it (the option list is
    virtualised: an option far down is not in the page until scrolled to), then wait until it shows."""
    from playwright.sync_api import expect

    box = page.locator("[data-testid='stMain']").get_by_role("combobox", name=name, exact=True)
    box.click()
    box.fill(option)
    page.get_by_role("option", name=option, exact=True).wait_for()  # the typed text left this option listed
    box.press("Enter")
    expect(box).to_have_value(option, timeout=60_000)


def _title(page, text: str) -> None:
    page.locator("[data-testid='stMain'] .gtitle", has_text=text).first.wait_for(timeout=60_000)


def test_inspector_row_of_a_clicked_token_and_a_copied_link_reopens_it(browser):
    from playwright.sync_api import expect

    url = browser[1]
    run = load_run(CACHED_RUNS / "h2o-attention")
    page = new_page(browser)
    page.goto(f"{url}/?run=h2o-attention")
    wait_idle(page, "kvlens")
    step, text = _pick_token(page, run)
    _title(page, f"Token {step} «{text}» under h2o: layer 15, head 0")
    _choose(page, "Layer", "29")
    _choose(page, "Query head", "4")
    want = f"Token {step} «{text}» under h2o: layer 29, head 4 (KV head 1)"
    _title(page, want)
    main = page.locator("[data-testid='stMain']")
    assert main.get_by_text(f"Token {step} «{text}» came from the query of").is_visible()
    assert main.locator(".js-plotly-plot .bars path").count() > 0  # the row's bars
    page.wait_for_function(
        f"() => window.location.href.includes('step={step}') && "
        "window.location.href.includes('layer=29') && window.location.href.includes('head=4')"
    )
    share = page.frame_locator("iframe").first
    expect(share.locator("#link")).to_have_value(
        page.url, timeout=10_000
    )  # the shown link refreshes every 0.5 s
    shown = share.locator("#link").input_value()  # the link is shown as text
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    share.get_by_role("button", name="Copy link").click()
    share.get_by_text("Copied").wait_for()
    copied = page.evaluate("() => navigator.clipboard.readText()")
    assert copied == shown == page.url and "run=h2o-attention" in copied
    if os.environ.get("KVLENS_SCREENSHOTS"):
        page.screenshot(path=os.environ["KVLENS_SCREENSHOTS"])
    page.context.close()

    other = new_page(browser)  # only the link carries the view
    other.goto(copied)
    wait_idle(other, "kvlens")
    _title(other, want)
    assert (
        other.locator("[data-testid='stSidebar']")
        .get_by_role("combobox", name="Run")
        .input_value()
        .startswith("h2o-attention")
    )
    main = other.locator("[data-testid='stMain']")
    assert [
        main.get_by_role("combobox", name=n, exact=True).input_value() for n in ("Layer", "Query head")
    ] == ["29", "4"]
    assert main.get_by_role("radio", name=text, exact=True).first.is_checked()
    other.context.close()


PAGES = {
    "": "kvlens",
    "runs": "Runs",
    "heads": "Head grid",
    "attention": "Attention",
    "similarity": "Similarity",
    "spectra": "Spectra",
    "merges": "Merges",
    "perturbation": "Perturbation",
    "analyses": "Analyses",
    "run": "Run",
    "compare": "Compare",
    "benchmarks": "Benchmarks",
    "why": "Why",
}  # URL path: title (app.py's NAVIGATION)


def test_every_page_draws_offline_and_a_link_sets_the_attention_pages_layer_head_and_row(browser):
    """Each page of the navigation, opened by its URL, draws its title (`offline` fails the test on any
    request off 127.0.0.1); the Attention page takes its layer, head and query row from the link."""
    from playwright.sync_api import expect

    url = browser[1]
    page = new_page(browser)
    for path, title in PAGES.items():
        page.goto(f"{url}/{path}?run=full-states")
        wait_idle(page, title)
    page.goto(f"{url}/attention?run=h2o-attention&layer=29&head=4&step=3")
    wait_idle(page, "Attention")
    _title(page, "Attention of layer 29, head 4")
    main = page.locator("[data-testid='stMain']")
    assert [
        main.get_by_role("combobox", name=n, exact=True).input_value() for n in ("Layer", "Query head")
    ] == ["29", "4"]
    expect(main.get_by_test_id("stSliderThumbValue")).to_have_text("3")  # the query row
    page.context.close()


def test_a_link_opens_the_analyses_page_and_another_analysis_leaves_its_parameters_behind(browser):
    """The Analyses page takes its analysis and parameters from the link; choosing another analysis rewrites
    the address bar with that one's parameters only."""
    from kvlens.analysis.registry import analyses

    url = browser[1]
    page = new_page(browser)
    page.goto(f"{url}/analyses?run=h2o-attention&analysis=embedding&layer=15&head=2&method=tsne")
    wait_idle(page, "Analyses")
    _title(page, "Queries and keys, layer 15, KV head 2 (t-SNE")
    _choose(page, "Analysis", f"gaussian ({analyses()['gaussian'].paper})")
    page.wait_for_function("() => new URL(window.location.href).searchParams.get('threshold') === '0.75'")
    wait_idle(page, "Analyses")
    params = page.evaluate("() => Object.fromEntries(new URL(window.location.href).searchParams)")
    assert params == {
        "run": "h2o-attention",
        "analysis": "gaussian",
        "head": "0",
        "threshold": "0.75",
        "rule": "mean_distance,eq7",
        "sigma": "",
    }
    page.context.close()
