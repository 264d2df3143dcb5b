"""Events while training, live: seconds from an event's commit to its banner in a browser on the Runs page.

A Streamlit server on a fresh store and the Runs page open in headless Chromium (1400 px); in this process a
Recorder trains a small model in its own loop (as a user's script does) for a few healthy steps, then records a
non-finite loss, and one step more (the event is raised at that step's ``record``). Its ``flush()`` returns once the step's rows and the event are committed: the clock starts there
and stops when the page's banner names the run (the page is never reloaded: the live fragment's refresh,
``LIVE_REFRESH_S``, finds it). Repeated with a new run each time; prints each latency, the median and the worst,
and writes JSON. The target (issue 30): within ~3 s.

    python bench/events_latency.py [--repeat 5] [--out bench/results/events_latency.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the browser tests' server and Chromium settings

import torch  # noqa: E402
from browser_helpers import CHROMIUM, CHROMIUM_ARGS, Server, settle  # noqa: E402
from common import RESULTS, write_result  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

from mpdiag import Recorder, Store  # noqa: E402
from mpdiag.dashboard.frame import LIVE_REFRESH_S  # noqa: E402


def one_event(store: Path, page, name: str) -> float:
    """Train ``name`` for 5 healthy steps, then one with a NaN loss and one more (whose record raises the event);
    seconds from the event's commit to the banner."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = Recorder(model, Store(store), optimizer=optimizer, name=name)
    try:
        for step in range(7):  # an event is raised at the next step's record, once its step's rows are complete
            loss = model(torch.randn(4, 8)).square().mean() * (float("nan") if step == 5 else 1.0)
            loss.backward()
            recorder.record(loss)
            optimizer.step()
            optimizer.zero_grad()
        recorder.flush()
        committed = time.perf_counter()
        page.locator("[data-testid='stAlert']", has_text=name).first.wait_for(timeout=60_000)
        return time.perf_counter() - committed
    finally:
        recorder.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "events_latency.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        store = Path(folder) / "bench.db"
        Store(store)  # created before the server opens it
        server = Server(store)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 1800})
                page.goto(server.url)
                settle(page)
                latencies = []
                for trial in range(args.repeat):
                    latencies.append(one_event(store, page, f"latency-trial-{trial}"))
                    print(f"trial {trial}: banner {latencies[-1]:.2f} s after the commit")
                browser.close()
        finally:
            server.stop()
    result = {"live_refresh_s": LIVE_REFRESH_S, "latencies_s": latencies,
              "median_s": statistics.median(latencies), "worst_s": max(latencies)}
    print(f"median {result['median_s']:.2f} s, worst {result['worst_s']:.2f} s (the live refresh every "
          f"{LIVE_REFRESH_S:g} s)")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
