"""Store size and cold page time of long runs (issue 28's scale targets): steps x tensors at the default settings.

Builds, through the real writer (mpdiag.store.StoreWriter.write_batch, in batches of --batch steps as the
Recorder's background writer commits them), the rows the Recorder stores at its default settings (statistics at
every step): per step a steps row, and per (step, tensor) a tensor_steps row with its exponent histogram, a
representability row per registry format, the running totals and the kept step. The histograms are realistic
without training: each tensor's gradient is drawn once as real float32 values (numel 64x64 for a weight, 64 for a
bias, a spread of 2^-20..2^-6 between tensors), binned by exponent as mpdiag bins them, and each step takes one of
16 such draws moved by a random walk of the tensor's scale; the counts of each format follow from the histogram's
bins (underflow below the format's smallest subnormal exponent, subnormal below its smallest normal, overflow
above its largest), unscaled and at the loss scale 2^16. A 200-step run of the same tensors is added for Compare.

It reports the store's bytes per (step, tensor) (the file once the writer closed it), each page's cold time
under AppTest (streamlit's caches cleared, one fresh AppTest per page, bench/dashboard.py's timing) and, with the
big run made live, each self-refreshing page's rerun time (its live refresh), and writes JSON. The issue's
targets, reported beside the numbers, not asserted: 100k x 500 in <= 2 GB, every page < 1 s, a refresh < 100 ms.

    python bench/store_scale.py [--sizes 10000x100 40000x200] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from common import RESULTS, write_result  # noqa: E402
from dashboard import PAGES, apptest_page  # noqa: E402

from mpdiag.numerics.formats import EXP_MIN, LOW_PRECISION, N_EXP_BINS  # noqa: E402
from mpdiag.store import Representability, StepRow, StoreWriter, TensorRow, encode_hist  # noqa: E402

WIDTH = 64
DRAWS = 16  # distinct histograms per tensor that the steps pick from
LOSS_SCALE_LOG2 = 16
#: every page, Plan beside bench/dashboard.py's
SCALE_PAGES = {**PAGES, "Plan": ("pages/8_Plan.py", {"run": "big"})}
TARGET_BYTES_100K_500, TARGET_PAGE_S, TARGET_LIVE_S = 2 * 10**9, 1.0, 0.1
#: the pages that refresh themselves while a run goes (frame.live), timed on the big run made live
LIVE_PAGES = ("Runs (home)", "Gradients", "Loss scale", "Compare", "Findings", "FP8", "Modules")
LIVE_RERUNS = 5


def _lost(hist: np.ndarray, exps: np.ndarray, fmt) -> tuple[int, int, int]:
    """(underflow, subnormal, overflow) in ``fmt`` of the values in ``hist``'s bins, the bins' exponents ``exps``."""
    return (int(hist[exps < fmt.min_subnormal_exponent].sum()),
            int(hist[(exps >= fmt.min_subnormal_exponent) & (exps < fmt.min_normal_exponent)].sum()),
            int(hist[exps > fmt.max_exponent].sum()))


def _representability(hist: np.ndarray, shift: int) -> dict[str, Representability]:
    """Each format's counts of the values whose exponents ``hist`` holds, unscaled and times 2^LOSS_SCALE_LOG2,
    from the bins alone (``shift``: the exponent offset of bin 0 from EXP_MIN, i.e. the tensor's scale move)."""
    exps = np.arange(N_EXP_BINS) + EXP_MIN + shift
    return {name: Representability(*_lost(hist, exps, fmt), *_lost(hist, exps + LOSS_SCALE_LOG2, fmt))
            for name, fmt in LOW_PRECISION.items()}


def tensor_draws(rng: np.random.Generator, tensors: int) -> list[list[tuple[np.ndarray, float]]]:
    """Per tensor, DRAWS exponent histograms of real float32 gradients, each with its l2."""
    draws = []
    for t in range(tensors):
        numel = WIDTH * WIDTH if t % 2 == 0 else WIDTH
        sigma = 2.0 ** rng.uniform(-20, -6)
        per_tensor = []
        for _ in range(DRAWS):
            values = np.abs(rng.standard_normal(numel).astype(np.float32) * np.float32(sigma))
            values = values[values > 0]
            exponents = np.frexp(values)[1].astype(np.int64) - 1  # 2**e <= |x| < 2**(e+1)
            per_tensor.append((np.bincount(exponents - EXP_MIN, minlength=N_EXP_BINS), float(np.linalg.norm(values))))
        draws.append(per_tensor)
    return draws


def row_fields(hist: np.ndarray, l2: float, shift: int) -> tuple:
    """A TensorRow's fields after (step, tensor_id) for a histogram whose scale moved by 2^shift."""
    moved = np.roll(hist, shift)  # its bins move with it (no value is near either end)
    occupied = np.flatnonzero(moved)
    return (encode_hist(moved), 0, 0, 0, 0, 2.0 ** (occupied[-1] + EXP_MIN + 1) * 0.75,
            2.0 ** (occupied[0] + EXP_MIN), l2 * 2.0**shift, _representability(hist, shift))


def build_run(writer: StoreWriter, steps: int, tensors: int, name: str, batch: int, seed: int) -> int:
    """One run of ``steps`` x ``tensors`` written as the Recorder writes it at every=1; returns its id."""
    rng = np.random.default_rng(seed)
    run_id = writer.create_run(name=name, opt_level="O1", scaling="dynamic", steps=steps, every=1, device="cpu")
    writer.add_tensors(run_id, [(t, f"layers.{t // 2}.{'weight' if t % 2 == 0 else 'bias'}",
                                 [WIDTH, WIDTH] if t % 2 == 0 else [WIDTH], WIDTH * WIDTH if t % 2 == 0 else WIDTH,
                                 "float32", "float32") for t in range(tensors)])
    draws = tensor_draws(rng, tensors)
    shifts = np.zeros(tensors, dtype=np.int64)
    fields = {}  # (tensor, draw, shift) -> row fields: built once, so the writer is what is measured
    for start in range(0, steps, batch):
        step_rows, tensor_rows = [], []
        for step in range(start, min(start + batch, steps)):
            shifts += rng.integers(-1, 2, tensors) * (rng.random(tensors) < 0.01)  # the scales wander slowly
            step_rows.append(StepRow(step, 2.3 * np.exp(-step / steps) + 0.05 * rng.random(), 65536.0, 0, step % 2000,
                                     65536.0, 0.02, 10**8, 1, 1e-3, float(rng.uniform(0.5, 2.0)), 0.02 * step))
            for t, draw, shift in zip(range(tensors), rng.integers(DRAWS, size=tensors).tolist(), shifts.tolist(),
                                      strict=True):
                if (t, draw, shift) not in fields:
                    fields[t, draw, shift] = row_fields(*draws[t][draw], shift)
                tensor_rows.append(TensorRow(step, t, *fields[t, draw, shift]))
        writer.write_batch(run_id, step_rows, tensor_rows, kept=[(row.step, "every") for row in step_rows])
    writer.end_run(run_id, "finished")
    return run_id


def measure(steps: int, tensors: int, batch: int, folder: Path) -> dict:
    path = folder / f"scale_{steps}x{tensors}.db"
    started = time.perf_counter()
    with StoreWriter(path) as writer:
        big = build_run(writer, steps, tensors, f"scale {steps}x{tensors}", batch, seed=0)
        build_seconds = time.perf_counter() - started  # rows made (mostly from a cache) and written
        short = build_run(writer, 200, tensors, "scale short", batch, seed=1)
    size = sum(os.path.getsize(p) for p in (path, Path(f"{path}-wal")) if p.exists())
    big_size_estimate = size * steps / (steps + 200)  # the short run's share taken out, by its rows
    ids = {"big": str(big), "short": str(short)}
    apptest_page(path, "app.py", {})  # the first AppTest pays streamlit's own imports: not a page's cost
    pages = {name: apptest_page(path, page, _resolved(query, ids)) for name, (page, query) in SCALE_PAGES.items()}
    live = live_refresh(path, big, ids)
    for leftover in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):  # the readers' -shm stays beside it
        leftover.unlink(missing_ok=True)
    return {"steps": steps, "tensors": tensors, "store_bytes": size,
            "bytes_per_step_tensor": big_size_estimate / (steps * tensors),
            "build_seconds": build_seconds, "build_rows_per_s": steps * tensors / build_seconds,
            "apptest_page_seconds": pages, "live_rerun_seconds": live}


def _resolved(query: dict, ids: dict) -> dict:
    return {k: [ids[v] for v in vs] if isinstance(vs, list) else ids[vs] for k, vs in query.items()}


def live_refresh(path: Path, run_id: int, ids: dict) -> dict:
    """The big run made live (running, owned by this process, so no page reads it as crashed or caches it):
    per page that refreshes while a run goes, the median of LIVE_RERUNS reruns in one session after its first
    run, as its st.fragment(run_every=...) reruns it. AppTest reruns the whole page script, so each is an upper
    bound of the refresh itself (the fragment is the page's view: frame.single_run_page, Compare's compare_view;
    Runs: the runs panel)."""
    with StoreWriter(path) as writer:
        writer.update_run(run_id, status="running", finished_at=None, heartbeat_at=time.time())
        writer.hand_run_to(run_id, os.getpid())
    with sqlite3.connect(path) as conn:  # a run that goes has no stored summary yet: readers sum its steps
        conn.execute("UPDATE runs SET summary = NULL WHERE run_id = ?", (run_id,))
    return {name: float(np.median(apptest_page(path, page, _resolved(query, ids), reruns=LIVE_RERUNS)[1]))
            for name, (page, query) in SCALE_PAGES.items() if name in LIVE_PAGES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["10000x100", "40000x200"], help="STEPSxTENSORS")
    parser.add_argument("--batch", type=int, default=50, help="steps per writer commit")
    parser.add_argument("--folder", default=None, help="where the stores are built (default: a temporary folder)")
    parser.add_argument("--out", default=str(RESULTS / "store_scale.json"))
    args = parser.parse_args()
    folder = Path(args.folder or tempfile.mkdtemp(prefix="mpdiag-scale-"))
    results = []
    for size in args.sizes:
        steps, tensors = map(int, size.split("x"))
        print(f"building {steps} steps x {tensors} tensors in {folder} ...", flush=True)
        result = measure(steps, tensors, args.batch, folder)
        results.append(result)
        print(f"{steps} x {tensors}: {result['store_bytes'] / 2**20:,.0f} MiB, "
              f"{result['bytes_per_step_tensor']:.0f} B per (step, tensor) -> 100k x 500 would be "
              f"{result['bytes_per_step_tensor'] * 100_000 * 500 / 1e9:.1f} GB (target <= "
              f"{TARGET_BYTES_100K_500 / 1e9:.0f} GB); built at {result['build_rows_per_s']:,.0f} rows/s")
        for name, seconds in result["apptest_page_seconds"].items():
            live = result["live_rerun_seconds"].get(name)
            print(f"  {name:<14}{seconds * 1e3:>9.0f} ms cold{'   (over the 1 s target)' if seconds >= TARGET_PAGE_S else ''}"
                  + ("" if live is None else f"\n  {'':<14}{live * 1e3:>9.0f} ms live rerun"
                     + ("   (over the 100 ms target)" if live >= TARGET_LIVE_S else "")))
    write_result({"sizes": results, "loss_scale_log2": LOSS_SCALE_LOG2, "draws_per_tensor": DRAWS}, args.out)


if __name__ == "__main__":
    main()
