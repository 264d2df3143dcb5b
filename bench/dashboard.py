"""Page cost on a big run: 10k steps x 100 tensors, read + chart build, in server time.

Builds (once, cached under bench/results/) a real recorded run: a 50-layer residual MLP on the digits data trained
through the Recorder at every step, so the store holds 10k x 100 histogram rows, and a 200-step run of the same
model for Compare to set beside it. Then times what the Gradients page does for the big run called directly, and
every page as a whole under streamlit's AppTest, each in a fresh AppTest with streamlit's caches cleared (cold),
and writes JSON.

    python bench/dashboard.py [--steps 10000] [--layers 50]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from common import write_result  # noqa: E402

from mpdiag import Recorder, Store  # noqa: E402
from mpdiag.analysis import summaries  # noqa: E402
from mpdiag.dashboard import charts  # noqa: E402
from mpdiag.examples.data import digits  # noqa: E402


class ResidualMLP(torch.nn.Module):
    """``layers`` Linear layers; the hidden ones are residual so gradients reach every layer."""

    def __init__(self, layers: int, width: int = 32):
        super().__init__()
        self.inp = torch.nn.Linear(64, width)
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers - 2))
        self.out = torch.nn.Linear(width, 10)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.hidden:
            x = x + torch.relu(layer(x)) / len(self.hidden) ** 0.5
        return self.out(x)


def build_store(path: Path, steps: int, layers: int) -> int:
    torch.manual_seed(0)
    x, y, _, _ = digits(torch.device("cpu"))
    x = x.reshape(len(x), -1)
    model = ResidualMLP(layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with Recorder(model, store=path, name=f"bench {steps} steps", scaler=scaler, optimizer=opt,
                  config={"opt_level": "O1", "steps": steps}) as rec:
        for step in range(steps):
            idx = torch.randint(0, len(x), (32,))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x[idx]).float(), y[idx])
            scaler.scale(loss).backward()
            rec.record(loss)
            scaler.step(opt)
            scaler.update()
            if step % 1000 == 0:
                print(f"  building: step {step}", flush=True)
    return rec.run_id


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def page_path(store: Store, run_id: int) -> dict:
    """The reads and chart builds the Gradients page makes for one run and its worst tensor, timed."""
    t = {}
    runs, t["runs"] = timed(store.runs)
    logged, t["logged_steps"] = timed(store.logged_steps, run_id)
    totals, t["tensor_totals"] = timed(store.tensor_totals, run_id)
    ranking, t["ranking"] = timed(summaries.tensor_ranking, totals)
    tensor = ranking["tensor"].iloc[0]
    steps, t["steps"] = timed(store.steps, run_id)
    (index, counts), t["histograms of one tensor"] = timed(store.histogram_matrix, run_id, tensor)
    cells, t["heatmap cells"] = timed(summaries.heatmap_cells, index, counts, steps)
    spec, t["heatmap chart spec"] = timed(lambda: charts.exponent_heatmap(cells, summaries.format_lines(), (logged[0], logged[-1] + 1)).to_dict())
    _, t["one tensor at one step"] = timed(store.tensor_stats, run_id, tensor, -1, logged[-1])
    (step_index, step_counts), t["all tensors at one step"] = timed(store.histogram_matrix, run_id, None, -1, logged[-1])
    _, t["what-if for all tensors"] = timed(lambda: [summaries.whatif_shares(h, 8) for h in step_counts])
    t["total"] = sum(t.values())
    return {"seconds": t, "heatmap_marks": len(cells), "rows_in_run": int(len(index) * len(totals))}


#: every page, and the query that opens it on the big run (Compare: beside the short run)
PAGES = {"Runs (home)": ("app.py", {}), "Gradients": ("pages/1_Gradients.py", {"run": "big"}),
         "Loss scale": ("pages/2_Loss_scale.py", {"run": "big"}),
         "Compare": ("pages/3_Compare.py", {"runs": ["big", "short"]}), "Upload": ("pages/4_Upload.py", {}),
         "Findings": ("pages/5_Findings.py", {"run": "big"}), "FP8": ("pages/6_FP8.py", {"run": "big"}),
         "Modules": ("pages/7_Modules.py", {"run": "big"})}


def _scan_components_once() -> None:
    """Streamlit scans every installed package's metadata for components when its server starts; AppTest does it
    on every run (1-1.5 s here), which no page view in a running app pays: scan once per bench process."""
    from streamlit.components.v2 import manifest_scanner

    if not hasattr(manifest_scanner.scan_component_manifests, "cache_info"):
        manifest_scanner.scan_component_manifests = functools.cache(manifest_scanner.scan_component_manifests)


def apptest_page(store_path: Path, page: str, query: dict, reruns: int = 0) -> float | tuple[float, list[float]]:
    """Seconds of one cold run of ``page`` under AppTest (streamlit's data caches cleared first, the component
    scan a server makes once at start left out); with ``reruns``, also the seconds of each of that many reruns of
    the page in the same session, as its live refresh reruns it (an upper bound of the fragment's own time)."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    _scan_components_once()
    st.cache_data.clear()
    os.environ["MPDIAG_STORE"] = str(store_path)
    at = AppTest.from_file(str(ROOT / page), default_timeout=120)
    for key, value in query.items():
        at.query_params[key] = value
    timings = []
    for _ in range(1 + reruns):
        start = time.perf_counter()
        at.run()
        timings.append(time.perf_counter() - start)
        if at.exception:
            raise SystemExit(f"{page} raised: {at.exception[0].value}")
    return (timings[0], timings[1:]) if reruns else timings[0]


def main() -> None:
    # st.altair_chart ships every row (no 5,000-row cap); to_dict() here must measure the same spec.
    import altair as alt

    alt.data_transformers.disable_max_rows()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--layers", type=int, default=50, help="Linear layers (2 tensors each)")
    parser.add_argument("--out", default=str(ROOT / "bench/results/dashboard.json"))
    args = parser.parse_args()
    store_path = ROOT / f"bench/results/dashboard_v2_{args.steps}x{2 * args.layers}.db"
    store_path.parent.mkdir(parents=True, exist_ok=True)
    if not store_path.exists():
        print(f"building {store_path} ({args.steps} steps, {2 * args.layers} tensors) ...", flush=True)
        _, secs = timed(build_store, store_path, args.steps, args.layers)
        print(f"built in {secs:.0f} s")
    store = Store(store_path)
    if len(store.runs()) == 1:
        build_store(store_path, 200, args.layers)
    runs = store.runs().sort_values("run_id")
    ids = {"big": str(int(runs["run_id"].iloc[0])), "short": str(int(runs["run_id"].iloc[1]))}
    run_id = int(ids["big"])
    direct = page_path(store, run_id)
    apptest_page(store_path, "app.py", {})  # the first AppTest pays streamlit's own imports: not a page's cost
    pages = {}
    for name, (page, query) in PAGES.items():
        resolved = {k: [ids[v] for v in vs] if isinstance(vs, list) else ids[vs] for k, vs in query.items()}
        pages[name] = apptest_page(store_path, page, resolved)
    print(f"store: {store_path.stat().st_size / 2**20:.0f} MB, {direct['rows_in_run']} (step, tensor) rows")
    for name, secs in direct["seconds"].items():
        print(f"  {name:<28}{secs * 1e3:>9.1f} ms")
    print(f"heatmap marks sent to the browser: {direct['heatmap_marks']}")
    print("every page under AppTest, cold (caches cleared), on the big run:")
    for name, secs in pages.items():
        print(f"  {name:<28}{secs * 1e3:>9.0f} ms{'' if secs < 1 else '   (over 1 s)'}")
    result = {"steps": args.steps, "tensors": 2 * args.layers, **direct, "apptest_page_seconds": pages}
    write_result(result, args.out)


if __name__ == "__main__":
    main()
