"""The Why page in a real browser: it patches the shipped H2O run's cache and draws the recovered shares and
the minimal set. One fresh `streamlit run app.py` for the module; the explanation's time is printed, never
asserted."""

from __future__ import annotations

import time

import pytest

from kvlens.ui.browser import wait_idle
from tests.browser.conftest import chromium_app, offline_page

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.usefixtures("offline")]
RUN = "h2o-attention"
PLOTS = "[data-testid=stMain] .js-plotly-plot"
EXPLAIN_MS = 600_000  # the run's 118-token prompt: about 40 s on one thread, more on a loaded machine


@pytest.fixture(scope="module")
def why_page(tmp_path_factory, external_requests):
    with chromium_app(tmp_path_factory.mktemp("runs")) as (chromium, url):
        page = offline_page(chromium, external_requests, 1500, 1100)
        start = time.perf_counter()
        page.goto(f"{url}/why?run={RUN}&source=run&by=layer,head,span,sinks&minimal=true")
        wait_idle(page, "Why")
        # nothing is computed before the button: the estimate (30 layers, 30 x 3 heads, 4 spans, sinks)
        page.get_by_text("About 125 patched caches for these groups").wait_for()
        assert not page.locator(PLOTS).count()
        page.get_by_role("button", name="Explain this run").click()
        page.get_by_text("All groups restored").wait_for(timeout=EXPLAIN_MS)
        wait_idle(page, "Why", timeout_ms=EXPLAIN_MS)
        print(f"\nWhy page of {RUN}: {time.perf_counter() - start:.1f} s")
        yield page


def _figures(page) -> dict[str, dict]:
    """Each drawn plotly figure's title -> {trace name: trace type}."""
    return page.evaluate(f"""() => Object.fromEntries([...document.querySelectorAll('{PLOTS}')]
        .map(g => [g.layout.title.text, Object.fromEntries(g._fullData.map(d => [d.name, d.type]))]))""")


def test_the_why_page_draws_the_shares_and_the_minimal_set(why_page):
    figures = _figures(why_page)
    titles = list(figures)
    assert any(f"Recovered share by layer and KV head: h2o on run {RUN}," in t for t in titles), titles
    assert any("Recovered share by position span" in t for t in titles), titles
    minimal = next(t for t in titles if "Minimal sufficient set" in t)
    assert figures[minimal]["minimal set"] == "heatmap"
    heat = why_page.evaluate(f"""() => [...document.querySelectorAll('{PLOTS}')]
        .find(g => g.layout.title.text.includes('Minimal')).data[0].z""")
    assert len(heat) == 30 and any(v == 2 for row in heat for v in row)  # restored entries drawn in red
    assert why_page.get_by_text("Smallest sufficient set:").count() == 1
    assert why_page.get_by_text("All groups restored").count() == 1
