"""Drive the app in a real browser: `streamlit run app.py` on a free 127.0.0.1 port and Debian's Chromium.

Used by the browser tests and `scripts/app_screenshots.py`. The app and its reports work offline:
`refuse_external` aborts (and records) any request a page makes to another host, and the browser tests fail on
one.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
LOCAL_HOSTS = ("127.0.0.1", "localhost")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def streamlit_server(env: dict | None = None, script: Path | None = None):
    """`streamlit run app.py` (or `script`) headless on a free local port; yields its base URL. No file
    watcher: an edited source file would otherwise leave a "Source file changed" prompt on the page."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamlit",
            "run",
            str(script or ROOT / "app.py"),
            "--server.address",
            "127.0.0.1",
            "--server.port",
            str(port),
            "--server.headless",
            "true",
            "--browser.gatherUsageStats",
            "false",
            "--server.fileWatcherType",
            "none",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{url}/_stcore/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError("streamlit did not start within 60 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def refuse_external(target, seen: list[str], hosts: tuple[str, ...] = LOCAL_HOSTS) -> None:
    """Abort every request of `target` (a Playwright page or browser context) to a host not in `hosts` (the
    app's: 127.0.0.1 or localhost; none for a file opened from disk), appending its URL to `seen`: nothing the
    app or a report shows may come from outside the machine. Reads of file:// URLs always pass."""

    def handle(route):
        url = route.request.url
        if urlparse(url).scheme == "file" or urlparse(url).hostname in hosts:
            route.continue_()
        else:
            seen.append(url)
            route.abort("blockedbyclient")

    target.route("**/*", handle)


def wait_idle(page, title: str | None = None, timeout_ms: int = 120000) -> None:
    """Wait until the page titled `title` (any page if None) is drawn and its script has finished: the app's
    script state `notRunning`, no running indicator, no skeleton. The state is what decides: the running
    indicator shows only 500 ms after a run starts (Streamlit's status widget), so its absence alone passes
    for idle early in a run. States only, never a fixed time: after a click the previous page's title is
    still there until the next one replaces it, so pass the title of the page being opened."""
    heading = page.locator("[data-testid='stMain'] h1")
    (heading.filter(has_text=title) if title else heading).first.wait_for(timeout=timeout_ms)
    page.wait_for_function(
        '() => document.querySelector(\'[data-testid="stApp"][data-test-script-state="notRunning"]\') && '
        "!document.querySelector('[data-testid=\"stStatusWidget\"]') && "
        "!document.querySelector('[data-testid=\"stSkeleton\"]')",
        timeout=timeout_ms,
    )
