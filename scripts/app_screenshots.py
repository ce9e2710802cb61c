"""Screenshots of every app page from a real headless Chromium (docs/img/app-*.png; `make screenshots`).

Starts `streamlit run app.py` on a free 127.0.0.1 port, opens each page with Playwright and
Debian's /usr/bin/chromium, waits for the charts and saves full-page PNGs.

    .venv/bin/python scripts/app_screenshots.py [OUT_DIR] [page ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # this checkout's kvlens and app, whatever is installed

from kvlens.ui.browser import CHROMIUM, CHROMIUM_ARGS, ROOT, streamlit_server, wait_idle  # noqa: E402

PAGES = [
    "overview",
    "runs",
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
    "inspector",
]
SIZES = {"runs": (1500, 1000), "inspector": (1500, 1000)}  # the rest are 1500 x 1800
ADDRESS = {
    "overview": "",
    "inspector": "?run=cam-attention&step=10&layer=15&head=4",  # the rest: /{name}
    "heads": "heads?run=adakv-heads",
    "analyses": "analyses?run=full-states&analysis=embedding",
}
WINDOW = {"inspector", "spectra"}  # shots of the window scrolled to a part of the page, not of the full page
ROW = 35  # a table row's height in pixels (header included)


def tick_rows(page, rows: list[int]) -> None:
    """Tick rows of the page's first table, which is drawn on a canvas: click each row's checkbox."""
    box = page.locator("[data-testid='stMain'] [data-testid='stDataFrame']").first.bounding_box()
    for i in rows:
        page.mouse.click(box["x"] + 15, box["y"] + ROW * (i + 1.5))
        wait_idle(page)
    page.mouse.move(0, 0)  # no hover toolbar over the table


def scroll_to(page, heading: str) -> None:
    """Scroll the page so that the heading `heading` is at the top of the window."""
    page.get_by_role("heading", name=heading).first.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(500)


def compare(page) -> None:
    """Run the Compare page's default policies on its default prompt (loads the model: about a minute)."""
    page.get_by_role("button", name="Compare", exact=True).click()
    page.get_by_text("What each one writes").wait_for(timeout=600_000)
    wait_idle(page, "Compare")
    page.locator("[data-testid='stMain'] [data-testid='stDataFrame']").first.wait_for(timeout=60_000)
    page.wait_for_timeout(1500)


def replay(page) -> None:
    """Replay the run at each rank on the Spectra page (loads the model: about a minute on a CPU)."""
    page.get_by_role("button", name="Replay the run at each rank").click()
    page.locator(".js-plotly-plot").nth(2).wait_for(timeout=600_000)
    wait_idle(page, "Spectra", timeout_ms=600_000)
    page.mouse.move(0, 0)  # no tooltip over the charts
    scroll_to(page, "What the decay buys: low-rank storage")


def settled(page) -> None:
    """Wait until no element is faded as stale (a live results file reruns its section every few seconds)."""
    page.wait_for_function("() => !document.querySelector('[data-stale=\"true\"]')", timeout=60_000)


def overlay(page) -> None:
    """Tick cam, h2o and streaming_llm in the Runs table (rows sorted by name) and wait for their overlay."""
    tick_rows(page, [1, 3, 5])
    page.locator("[data-testid='stMain'] .js-plotly-plot").first.wait_for(timeout=60_000)
    wait_idle(page, "Runs")
    page.wait_for_timeout(1500)


PREPARE = {
    "runs": overlay,
    "inspector": lambda page: scroll_to(page, "Token inspector"),  # CaM's merged slots in layer 15
    "spectra": replay,  # what each rank costs, on the default run (CaM: all three sources of error)
    "compare": compare,
    "benchmarks": settled,
}


def main(out: Path, pages: list[str]) -> None:
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    with streamlit_server() as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1800})
        page.goto(url)
        wait_idle(page)
        for name in pages:
            width, height = SIZES.get(name, (1500, 1800))
            page.set_viewport_size({"width": width, "height": height})
            page.goto(f"{url}/{ADDRESS.get(name, name)}")
            wait_idle(page)
            page.wait_for_timeout(1500)  # a picture, not a test: let the charts finish their transitions
            PREPARE.get(name, lambda _: None)(page)
            page.screenshot(path=str(out / f"app-{name}.png"), full_page=name not in WINDOW)
            print(out / f"app-{name}.png")
        browser.close()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0]) if args else ROOT / "docs" / "img", args[1:] or PAGES)
