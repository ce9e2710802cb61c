"""Every figure reads cleanly: drawn by plotly.js in Chromium, no two of its titles (the figure's, each
subplot's, each axis'), and no title and its legend, overlap on the page.

The figures: `tests.conftest.every_figure`."""

from __future__ import annotations

import json
from pathlib import Path

import plotly
import pytest

from tests.conftest import every_figure

pytestmark = [pytest.mark.browser, pytest.mark.slow]

# the boxes plotly.js draws, by class: the figure's title, annotations (subplot titles), axis titles, legends
BOXES = """fig => {
  const out = [];
  const add = (kind, el) => {
    const r = el.getBoundingClientRect();
    if (r.width > 0 && r.height > 0 && (el.textContent || kind === 'legend'))
      out.push({kind, text: (el.textContent || '').slice(0, 60),
                x0: r.left, y0: r.top, x1: r.right, y1: r.bottom});
  };
  fig.querySelectorAll('.gtitle').forEach(e => add('title', e));
  fig.querySelectorAll('.annotation-text-g').forEach(e => add('annotation', e));
  fig.querySelectorAll('.xtitle, .ytitle').forEach(e => add('axis title', e));
  fig.querySelectorAll('.legend .bg').forEach(e => add('legend', e));
  return out;
}"""


def _overlaps(boxes: list[dict]) -> list[str]:
    found = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if a["kind"] == b["kind"] == "legend":
                continue
            if (
                min(a["x1"], b["x1"]) - max(a["x0"], b["x0"]) > 1
                and min(a["y1"], b["y1"]) - max(a["y0"], b["y0"]) > 1
            ):
                found.append(f"{a['kind']} «{a['text']}» over {b['kind']} «{b['text']}»")
    return found


@pytest.fixture(scope="module")
def chromium_page(tmp_path_factory):
    from kvlens.ui.browser import CHROMIUM, CHROMIUM_ARGS

    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium package")
    from playwright.sync_api import sync_playwright

    page_file = tmp_path_factory.mktemp("figures") / "page.html"
    js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    page_file.write_text(
        f"<html><head><script>{js.read_text(encoding='utf-8')}</script></head>"
        "<body><div id='f'></div></body></html>",
        encoding="utf-8",
    )
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(page_file.as_uri())
        yield page
        browser.close()


FIGURES = every_figure()


@pytest.mark.parametrize("width", [900, 1300])  # the app draws every figure at its column's width
@pytest.mark.parametrize("name", list(FIGURES))
def test_no_titles_or_legends_overlap(chromium_page, name, width):
    fig = FIGURES[name]
    spec = json.loads(fig.to_json())
    chromium_page.evaluate(
        "([spec, width]) => { const f = document.getElementById('f'); Plotly.purge(f);"
        " const layout = {...spec.layout, width};"
        " return Plotly.newPlot(f, spec.data, layout, {staticPlot: true}); }",
        [spec, width],
    )
    boxes = chromium_page.evaluate(BOXES, chromium_page.query_selector("#f"))
    assert not _overlaps(boxes), name
