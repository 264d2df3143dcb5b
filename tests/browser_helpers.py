"""Driving the app in a real browser: a Streamlit server on a store, Debian's headless Chromium, and the waits
and checks the browser tests share (a page settled, no exception, charts inside their elements, screenshots)."""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

from conftest import ROOT

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = ROOT / "artifacts" / "screenshots"  # test-results/ is pytest-playwright's and is cleared by it
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving(url: str, seconds: float) -> bool:
    """Whether a Streamlit server answers its health check at ``url`` within ``seconds``."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                return True
        except OSError:
            time.sleep(0.3)
    return False


class Server:
    def __init__(self, store):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "MPDIAG_STORE": str(store), "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(self.port),
             "--server.headless", "true", "--server.address", "127.0.0.1"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        if not serving(self.url, 60):
            self.stop()
            raise RuntimeError("streamlit did not start")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


#: every Altair chart on the page has been drawn (its canvas or svg exists)
CHARTS_DRAWN = """() => [...document.querySelectorAll("[data-testid='stVegaLiteChart']")]
    .every(el => el.querySelector('canvas, svg.marks'))"""
#: true once the page's chart drawings have kept their sizes and places for ``ms`` milliseconds (polled every
#: animation frame): Vega sizes a drawing again after Streamlit measured its element, so the first frame is not
#: its final size; waiting for stillness, not a fixed pause, costs a settled page ~one frame's polling
CHARTS_STILL = """ms => {
    const now = performance.now();
    const layout = [...document.querySelectorAll("[data-testid='stVegaLiteChart'] :is(canvas, svg.marks)")]
        .map(d => { const r = d.getBoundingClientRect(); return [r.x, r.y, r.width, r.height].join(); }).join('|');
    if (window.__mpdiagLayout !== layout) { window.__mpdiagLayout = layout; window.__mpdiagSince = now; }
    return now - window.__mpdiagSince >= ms;
}"""


def settle(page, text=None, timeout=60_000, still_ms=150):
    """Wait for the app to finish running its script (and for ``text`` to appear), then for the charts to be
    drawn and to keep their sizes for ``still_ms``."""
    # the script has run to its end once (right after goto the app reads "initial", then "running")
    page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']", timeout=timeout)
    page.wait_for_selector("[data-testid='stMain'] [data-testid='stElementContainer']", timeout=timeout)
    if text:
        page.get_by_text(text, exact=False).first.wait_for(timeout=timeout)
    page.wait_for_function(
        "() => !document.querySelector(\"[data-testid='stStatusWidget']\")", timeout=timeout
    )
    # every chart element holds its drawing (Vega draws after the element exists), and the drawings took their
    # final size
    page.wait_for_function(CHARTS_DRAWN, timeout=timeout)
    page.evaluate("() => { window.__mpdiagLayout = undefined; }")
    page.wait_for_function(CHARTS_STILL, arg=still_ms, polling="raf", timeout=timeout)


def choose_run(page, run_id: int, label: str = "Run", timeout=60_000):
    """Pick run ``run_id`` in the page's run selector (labelled ``label``) as a user does, typing its ``#id ·``
    prefix and clicking its option, and wait until the page shows it (the URL names it) and has settled. No
    page reload: loading a page again costs the browser seconds of CPU on CI's two cores."""
    box = page.locator("[data-testid='stSelectbox']").filter(has_text=label).first
    box.locator("input").click()
    box.locator("input").fill(f"#{run_id} ·")
    # the selector's filter is fuzzy ("#13 ·" also lists #14, and may focus it): click the one option
    page.locator("[role='option']").filter(has_text=re.compile(rf"^#{run_id} ·")).first.click(timeout=timeout)
    page.wait_for_function("id => new URLSearchParams(location.search).getAll('run').join() === id", arg=str(run_id),
                           timeout=timeout)
    settle(page, timeout=timeout)


def no_exception(page):
    assert page.locator("[data-testid='stException']").count() == 0, page.locator("[data-testid='stException']").first.inner_text()


def charts_fit(page) -> list[str]:
    """The charts on the page whose drawing (canvas or svg) reaches past their Streamlit element's right edge."""
    return page.evaluate("""() => [...document.querySelectorAll("[data-testid='stVegaLiteChart']")].flatMap(el => {
        const box = el.getBoundingClientRect();
        return [...el.querySelectorAll('canvas, svg.marks')]
            .filter(d => d.getBoundingClientRect().right > box.right + 1)
            .map(d => `${el.innerText.slice(0, 40)}: ${Math.round(d.getBoundingClientRect().right - box.right)} px past`);
    })""")


def shot(page, name):
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
