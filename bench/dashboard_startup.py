"""Dashboard server start-up: seconds from ``streamlit run app.py`` to the first HTTP 200, and the server's
resident memory then and after a browser has rendered a page (home by default; whether torch got loaded shows
as libtorch mapped into the server process).

Runs against an empty store in a temporary folder. ``--root`` picks the checkout to serve (compare two
commits by pointing it at two worktrees). Timings on a shared machine are noisy: repeat with ``--repeat``.

    python bench/dashboard_startup.py [--root PATH] [--repeat 3] [--page Loss_scale] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
from common import RESULTS, write_result

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def _torch_mapped(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def measure_once(root: Path, browser, path: str, expect: str) -> dict:
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MPDIAG_STORE": str(Path(tmp) / "bench.db"), "PYTHONPATH": str(root)}
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port), "--server.headless",
             "true", "--server.address", "127.0.0.1"],
            cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            while True:
                try:
                    if urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).status == 200:
                        break
                except OSError:
                    if time.perf_counter() - started > 120:
                        raise RuntimeError("the server did not answer within 120 s") from None
                    time.sleep(0.05)
            first_200 = time.perf_counter() - started
            rss_at_200 = _rss_mb(proc.pid)
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}/{path}")
            page.get_by_text(expect).first.wait_for(timeout=120_000)
            rendered = time.perf_counter() - started
            page.close()
            return {"first_http_200_s": first_200, "page_rendered_s": rendered, "rss_at_200_mb": rss_at_200,
                    "rss_after_render_mb": _rss_mb(proc.pid), "torch_loaded": _torch_mapped(proc.pid)}
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=RESULTS / "dashboard_startup.json")
    parser.add_argument("--page", default="", help="URL path of the page to render ('' for home, e.g. Loss_scale)")
    parser.add_argument("--expect", default="No runs", help="text that shows once that page has rendered")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        runs = [measure_once(args.root.resolve(), browser, args.page, args.expect) for _ in range(args.repeat)]
        browser.close()
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "torch_loaded"}
    result = {"root": str(args.root.resolve()), "page": args.page or "home", "runs": runs, "median": medians,
              "torch_loaded": any(r["torch_loaded"] for r in runs)}
    for key, value in medians.items():
        print(f"{key}: {value:.2f}")
    print(f"torch loaded in the server: {result['torch_loaded']}")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
