"""Store size and cold page time of long runs (issue 28's scale targets): steps x tensors at the default settings.

Builds, through the real writer (mpdiag.store.StoreWriter.write_batch, in batches of --batch steps as the
Recorder's background writer commits them), what the Recorder stores at its default settings (no --every: the
default retention, mpdiag.recording.retention, deciding with the real Retention class): per step a steps row and a
step_signals row (each tensor's inf/NaN and FP16/BF16 under/overflow counts at the scale), and per kept (step,
tensor) a tensor_steps row with its exponent histogram and every registry format's counts, the running
totals and the kept step with its reasons. The histograms are realistic without training: each tensor's gradient
is drawn once as real float32 values (numel 64x64 for a weight, 64 for a bias, a spread of 2^-20..2^-6 between
tensors), binned by exponent as mpdiag bins them, and each step takes one of 16 such draws moved by a random walk
of the tensor's scale (within 2^WANDER of its start); the counts of each format follow from the histogram's bins (underflow below the format's
smallest subnormal exponent, subnormal below its smallest normal, overflow above its largest), unscaled and at the
static loss scale 2^16. Planted anomalies, as a long run has them: every PLANT_EVERY steps one tensor's gradient
holds inf and the step is skipped (kept, with its neighbours). A 200-step run of the same tensors is added for
Compare.

It reports the store's bytes per (step, tensor) (the file once the writer closed it), the steps kept, the signals'
share, the build rate, each page's cold time under AppTest (streamlit's caches cleared, one fresh AppTest per
page, bench/dashboard.py's timing) and, with the big run made live, each self-refreshing page's rerun time and
the part of it its live refresh reruns (the page's st.fragment functions), and writes JSON. The issue's targets,
reported beside the numbers, not asserted: 100k x 500 in <= 2 GB, every page < 1 s, a refresh < 100 ms.

    python bench/store_scale.py [--sizes 10000x100 40000x200 100000x500] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sqlite3
import sys
import tempfile
import time
from contextlib import closing, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from common import RESULTS, write_result  # noqa: E402
from dashboard import PAGES, apptest_page  # noqa: E402

from mpdiag.numerics.formats import EXP_MIN, LOW_PRECISION, N_EXP_BINS, SIGNAL_COUNTS, SIGNAL_FORMATS  # noqa: E402
from mpdiag.recording.retention import DENSE_START_STEPS, THIN_EVERY, Retention  # noqa: E402
from mpdiag.store import StepRow, StoreWriter, TensorBatch  # noqa: E402

WIDTH = 64
DRAWS = 16  # distinct histograms per tensor that the steps pick from
LOSS_SCALE_LOG2 = 16
#: how far (powers of two) a tensor's scale wanders from its start. Unbounded, the walk took hundreds of the 500
#: tensors 2^8 past their start within 1,500 steps, so that they overflowed FP16 at the static scale 2^16 at every
#: step (a mean of 818 values a step): no healthy run does, a loss scaler backs off first
WANDER = 4
#: a planted anomaly (an inf in one tensor, the step skipped) every this many steps, and the inf values it holds
PLANT_EVERY, PLANTED_INF = 2000, 3
#: every page, Plan beside bench/dashboard.py's
SCALE_PAGES = {**PAGES, "Plan": ("pages/8_Plan.py", {"run": "big"})}
TARGET_BYTES_100K_500, TARGET_PAGE_S, TARGET_LIVE_S = 2 * 10**9, 1.0, 0.1
#: the pages that refresh themselves while a run goes (frame.live), timed on the big run made live
LIVE_PAGES = ("Runs (home)", "Gradients", "Loss scale", "Compare", "Findings", "FP8", "Modules")
LIVE_RERUNS = 5


class DrawTable:
    """Per tensor, DRAWS exponent histograms of real float32 gradients (``hists`` (tensors, DRAWS, N_EXP_BINS)),
    their cumulative counts (``below[..., k]``: the values in bins below k), their first and last occupied bins and
    their l2: what every row of a step is computed from at once, for histograms moved by 2^shift (the tensors'
    scales wander; no value is near either end of the bins)."""

    def __init__(self, rng: np.random.Generator, tensors: int):
        hists, l2 = np.zeros((tensors, DRAWS, N_EXP_BINS), np.int64), np.zeros((tensors, DRAWS))
        for t in range(tensors):
            sigma = 2.0 ** rng.uniform(-20, -6)
            for d in range(DRAWS):
                numel = WIDTH * WIDTH if t % 2 == 0 else WIDTH
                values = np.abs(rng.standard_normal(numel).astype(np.float32) * np.float32(sigma))
                values = values[values > 0]
                exponents = np.frexp(values)[1].astype(np.int64) - 1  # 2**e <= |x| < 2**(e+1)
                hists[t, d] = np.bincount(exponents - EXP_MIN, minlength=N_EXP_BINS)
                l2[t, d] = float(np.linalg.norm(values))
        self.hists, self.l2 = hists, l2
        self.below = np.concatenate([np.zeros((tensors, DRAWS, 1), np.int64), np.cumsum(hists, axis=2)], axis=2)
        occupied = hists != 0
        self.first, self.last = occupied.argmax(axis=2), N_EXP_BINS - 1 - occupied[:, :, ::-1].argmax(axis=2)

    def count_below(self, draw: np.ndarray, shift: np.ndarray, exponent: int) -> np.ndarray:
        """Per tensor, the values below 2^exponent of its histogram ``draw`` moved by 2^``shift``."""
        at = np.clip(exponent - EXP_MIN - shift, 0, N_EXP_BINS)
        return self.below[np.arange(len(draw)), draw, at]

    def lost(self, draw: np.ndarray, shift: np.ndarray, fmt) -> np.ndarray:
        """(tensors, 3): underflow (below the smallest subnormal), subnormal, overflow (above the largest) in
        ``fmt``, by the bins alone."""
        under = self.count_below(draw, shift, fmt.min_subnormal_exponent)
        normal = self.count_below(draw, shift, fmt.min_normal_exponent)
        over = self.below[np.arange(len(draw)), draw, -1] - self.count_below(draw, shift, fmt.max_exponent + 1)
        return np.stack([under, normal - under, over], axis=1)

    def signals(self, draw: np.ndarray, shift: np.ndarray) -> np.ndarray:
        """SIGNAL_COUNTS per tensor (tensors, 7) at the loss scale: the representability counts below."""
        counts = np.zeros((len(draw), len(SIGNAL_COUNTS)), dtype=np.int64)
        for fmt in SIGNAL_FORMATS:
            under, _, over = self.lost(draw, shift + LOSS_SCALE_LOG2, LOW_PRECISION[fmt]).T
            counts[:, SIGNAL_COUNTS.index(f"{fmt}_underflow_at_scale")] = under
            counts[:, SIGNAL_COUNTS.index(f"{fmt}_overflow_at_scale")] = over
        return counts

    def kept_batch(self, step: int, draw: np.ndarray, shift: np.ndarray) -> TensorBatch:
        """A kept step's rows of every tensor (the planted inf in tensor 0's posinf count)."""
        tensors = np.arange(len(draw))
        moved = self.hists[tensors[:, None], draw[:, None], (np.arange(N_EXP_BINS)[None] - shift[:, None]) % N_EXP_BINS]
        specials = np.zeros((len(draw), 4), dtype=np.int64)
        specials[0, 2] = PLANTED_INF * (step % PLANT_EVERY == PLANT_EVERY // 2)
        representability = np.stack([np.concatenate([self.lost(draw, shift, fmt),
                                                     self.lost(draw, shift + LOSS_SCALE_LOG2, fmt)], axis=1)
                                     for fmt in LOW_PRECISION.values()], axis=1)
        return TensorBatch.of_step(step, tensors, moved, specials,
                                   2.0 ** (self.last[tensors, draw] + shift + EXP_MIN + 1) * 0.75,
                                   2.0 ** (self.first[tensors, draw] + shift + EXP_MIN),
                                   self.l2[tensors, draw] * 2.0**shift, representability)


def build_run(writer: StoreWriter, steps: int, tensors: int, name: str, batch: int, seed: int) -> tuple[int, int]:
    """One run of ``steps`` x ``tensors`` written as the Recorder writes it at the default settings; returns its id
    and the number of steps kept."""
    rng = np.random.default_rng(seed)
    run_id = writer.create_run(name=name, opt_level="O1", scaling="static", loss_scale=2.0**LOSS_SCALE_LOG2,
                               steps=steps, every=None, device="cpu")
    numel = [WIDTH * WIDTH if t % 2 == 0 else WIDTH for t in range(tensors)]
    writer.add_tensors(run_id, [(t, f"layers.{t // 2}.{'weight' if t % 2 == 0 else 'bias'}",
                                 [WIDTH, WIDTH] if t % 2 == 0 else [WIDTH], numel[t], "float32", "float32")
                                for t in range(tensors)])
    table, retention, ids = DrawTable(rng, tensors), Retention(None, numel), np.arange(tensors)
    shifts = np.zeros(tensors, dtype=np.int64)
    kept_steps = 0
    for start in range(0, steps, batch):
        step_rows, tensor_batches, kept, signals = [], [], [], []
        for step in range(start, min(start + batch, steps)):
            # the scales wander slowly, within WANDER powers of two of their start
            shifts = np.clip(shifts + rng.integers(-1, 2, tensors) * (rng.random(tensors) < 0.01), -WANDER, WANDER)
            draw = rng.integers(DRAWS, size=tensors)
            planted = step % PLANT_EVERY == PLANT_EVERY // 2  # tensor 0 holds inf: the static scaler skips
            counts = table.signals(draw, shifts)
            counts[0, SIGNAL_COUNTS.index("posinf")] = PLANTED_INF * planted
            row = StepRow(step, 2.3 * np.exp(-step / steps) + 0.05 * rng.random(), 2.0**LOSS_SCALE_LOG2, int(planted),
                          None, 2.0**LOSS_SCALE_LOG2, 0.02, 10**8, 0, 1e-3,
                          math.inf if planted else float(rng.uniform(0.5, 2.0)), 0.02 * step)
            step_rows.append(row)
            signals.append((step, ids, counts))
            retention.see_row(row, [])
            retention.see_stats(step, ids, dict(zip(SIGNAL_COUNTS, counts.T, strict=True)), (draw, shifts.copy()))
            for kept_step, (kept_draw, kept_shift), reasons in retention.decide(step if step < steps - 1 else None):
                tensor_batches.append(table.kept_batch(kept_step, kept_draw, kept_shift))
                kept += [(kept_step, reason) for reason in reasons]
                kept_steps += 1
        writer.write_batch(run_id, step_rows, TensorBatch.concat(tensor_batches), kept=kept, signals=signals)
    writer.end_run(run_id, "finished")
    return run_id, kept_steps


def measure(steps: int, tensors: int, batch: int, folder: Path) -> dict:
    path = folder / f"scale_{steps}x{tensors}.db"
    started = time.perf_counter()
    with StoreWriter(path) as writer:
        big, kept_steps = build_run(writer, steps, tensors, f"scale {steps}x{tensors}", batch, seed=0)
        build_seconds = time.perf_counter() - started  # rows made (mostly from a cache) and written
        short, _ = build_run(writer, 200, tensors, "scale short", batch, seed=1)
    size = sum(os.path.getsize(p) for p in (path, Path(f"{path}-wal")) if p.exists())
    with closing(sqlite3.connect(path)) as conn:  # the signals' own bytes: their blobs and eight integers a row
        signal_bytes = conn.execute("SELECT SUM(LENGTH(counts)) + 8 * COUNT(*) FROM step_signals").fetchone()[0]
    big_size_estimate = size * steps / (steps + 200)  # the short run's share taken out, by its steps
    ids = {"big": str(big), "short": str(short)}
    apptest_page(path, "app.py", {})  # the first AppTest pays streamlit's own imports: not a page's cost
    pages = {name: apptest_page(path, page, _resolved(query, ids)) for name, (page, query) in SCALE_PAGES.items()}
    live, fragments, firsts = live_refresh(path, big, ids)
    for leftover in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):  # the readers' -shm stays beside it
        leftover.unlink(missing_ok=True)
    return {"steps": steps, "tensors": tensors, "kept_steps": kept_steps, "store_bytes": size,
            "bytes_per_step_tensor": big_size_estimate / (steps * tensors),
            "signal_bytes_per_step": signal_bytes / (steps + 200),
            "build_seconds": build_seconds, "build_steps_per_s": steps / build_seconds,
            "apptest_page_seconds": pages, "live_rerun_seconds": live, "live_fragment_seconds": fragments,
            "live_first_fragment_seconds": firsts}


def _resolved(query: dict, ids: dict) -> dict:
    return {k: [ids[v] for v in vs] if isinstance(vs, list) else ids[vs] for k, vs in query.items()}


@contextmanager
def fragments_timed(seconds: list[float]):
    """While open, every ``st.fragment`` made (frame.live makes each page's) appends the seconds of each run of
    its function to ``seconds``: what a refresh reruns, without the rest of the page."""
    import streamlit as st

    made = st.fragment

    def timed_fragment(func, *, run_every=None):
        @functools.wraps(func)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                seconds.append(time.perf_counter() - start)
        return made(timed, run_every=run_every)

    st.fragment = timed_fragment
    try:
        yield
    finally:
        st.fragment = made


def live_refresh(path: Path, run_id: int, ids: dict) -> tuple[dict, dict, dict]:
    """The big run made live (running, owned by this process, so no page reads it as crashed or caches it):
    per page that refreshes while a run goes, the median of LIVE_RERUNS reruns in one session after its first
    run. AppTest reruns the whole page script, an upper bound of the refresh; the second dict is the refresh
    itself, what st.fragment(run_every=...) reruns: the page's fragments' own seconds in each rerun (the view:
    frame.single_run_page, Compare's compare_view; Runs: the runs panel and the console output), median. With no
    new rows between reruns, as here, a refresh finds nothing new to show. The third: the fragments of the
    session's first run, which read the live run's steps whole (a page opened on a run that goes: the 1 s target
    of a cold page)."""
    with StoreWriter(path) as writer:
        writer.update_run(run_id, status="running", finished_at=None, heartbeat_at=time.time())
        writer.hand_run_to(run_id, os.getpid())
    with sqlite3.connect(path) as conn:  # a run that goes has no stored summary yet: readers sum its steps
        conn.execute("UPDATE runs SET summary = NULL WHERE run_id = ?", (run_id,))
    pages, fragments, firsts = {}, {}, {}
    for name, (page, query) in SCALE_PAGES.items():
        if name not in LIVE_PAGES:
            continue
        seconds: list[float] = []
        with fragments_timed(seconds):
            pages[name] = float(np.median(apptest_page(path, page, _resolved(query, ids), reruns=LIVE_RERUNS)[1]))
        per_run = np.reshape(seconds, (1 + LIVE_RERUNS, -1)).sum(axis=1)  # each run makes the same fragments
        fragments[name], firsts[name] = float(np.median(per_run[1:])), float(per_run[0])
    return pages, fragments, firsts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["10000x100", "40000x200", "100000x500"], help="STEPSxTENSORS")
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
        print(f"{steps} x {tensors}: {result['store_bytes'] / 2**20:,.0f} MiB ({result['store_bytes'] / 1e9:.2f} GB; "
              f"target for 100k x 500 <= {TARGET_BYTES_100K_500 / 1e9:.0f} GB), "
              f"{result['bytes_per_step_tensor']:.1f} B per (step, tensor); {result['kept_steps']:,} steps kept; "
              f"signals {result['signal_bytes_per_step']:,.0f} B per step; built at "
              f"{result['build_steps_per_s']:,.0f} steps/s")
        for name, seconds in result["apptest_page_seconds"].items():
            live, fragment = result["live_rerun_seconds"].get(name), result["live_fragment_seconds"].get(name)
            first = result["live_first_fragment_seconds"].get(name)
            print(f"  {name:<14}{seconds * 1e3:>9.0f} ms cold{'   (over the 1 s target)' if seconds >= TARGET_PAGE_S else ''}"
                  + ("" if live is None else f"\n  {'':<14}{live * 1e3:>9.0f} ms live rerun of the page, "
                     f"{fragment * 1e3:.0f} ms of it the refresh (its fragments)"
                     + ("   (over the 100 ms target)" if fragment >= TARGET_LIVE_S else "")
                     + f"; its first render's fragments {first * 1e3:.0f} ms"
                     + ("   (over the 1 s target)" if first >= TARGET_PAGE_S else "")))
    write_result({"sizes": results, "loss_scale_log2": LOSS_SCALE_LOG2, "draws_per_tensor": DRAWS,
                  "retention": {"dense_start_steps": DENSE_START_STEPS, "thin_every": THIN_EVERY},
                  "planted_every": PLANT_EVERY}, args.out)


if __name__ == "__main__":
    main()
