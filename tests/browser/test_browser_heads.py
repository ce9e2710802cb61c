"""The Head grid in a real browser: scrub the step, click a head, land on the Attention page with the
inspector open.

One fresh `streamlit run app.py` for the module, on the shipped run that records all 30 layers
(`adakv-heads`). The step change's redraw time is measured and printed (never asserted: these machines are
noisy).
"""

from __future__ import annotations

import statistics
import time

import pytest

from kvlens.ui.browser import wait_idle
from tests.browser.conftest import chromium_app, offline_page

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.usefixtures("offline")]
RUN = "adakv-heads"


@pytest.fixture(scope="module")
def heads_page(tmp_path_factory, external_requests):
    with chromium_app(tmp_path_factory.mktemp("runs")) as (chromium, url):
        page = offline_page(chromium, external_requests, 1500, 1100)
        page.goto(f"{url}/heads?run={RUN}")
        wait_idle(page, "Head grid")
        yield page


def _title(page) -> str:
    return page.locator("[data-testid='stMain'] .js-plotly-plot .gtitle").first.text_content()


def _click_head(page, layer: int, head: int) -> None:
    """Click the middle of `layer`'s strip of `head`, where plotly's own axes put it."""
    plot = page.locator("[data-testid='stMain'] .js-plotly-plot").first
    x, y = plot.evaluate(
        """(g, [layer, head]) => {
             const t = g._fullData.find(d => d.name === 'heads');
             const i = t.customdata.findIndex(c => c[0] === layer && c[1] === head);
             const L = g._fullLayout, r = g.getBoundingClientRect();
             return [r.left + L._size.l + L.xaxis.d2p(t.x[i]), r.top + L._size.t + L.yaxis.d2p(t.y[i])];
           }""",
        [layer, head],
    )
    page.mouse.move(x, y)
    page.mouse.click(x, y)


def test_scrubbing_the_step_redraws_every_head_and_a_click_opens_it_with_the_inspector(heads_page):
    last = 23  # the run's 24 tokens: steps 0-23
    assert f"at step {last} " in _title(heads_page)
    strips = heads_page.evaluate(
        "() => document.querySelector('[data-testid=stMain] .js-plotly-plot')._fullData"
        ".find(d => d.name === 'heads').customdata.length"
    )
    assert strips == 30 * 9  # every layer and head of the model
    slider = heads_page.get_by_role("slider").first
    times = []
    for step in (last - 1, last - 2, last - 3):
        slider.focus()
        start = time.perf_counter()
        heads_page.keyboard.press("ArrowLeft")
        heads_page.locator("[data-testid='stMain'] .gtitle", has_text=f"at step {step} ").wait_for(
            timeout=60_000
        )
        times.append(time.perf_counter() - start)
    print(
        f"\nHead grid: a step change redrew 30 layers x 9 heads in {statistics.median(times):.2f} s "
        f"(median of {[round(t, 2) for t in times]})"
    )
    assert "step=20" in heads_page.url
    _click_head(heads_page, 15, 4)
    wait_idle(heads_page, "Attention")
    heads_page.get_by_text("Token inspector: row 20, layer 15, head 4").wait_for(timeout=60_000)
    assert all(p in heads_page.url for p in (f"run={RUN}", "layer=15", "head=4", "step=20", "inspect=1"))
    inspector = heads_page.locator("[data-testid='stExpander']", has_text="Token inspector")
    inspector.locator(".gtitle", has_text="layer 15, head 4").wait_for(timeout=60_000)  # open: its chart drew
    assert inspector.get_by_text("came from the query of").is_visible()
