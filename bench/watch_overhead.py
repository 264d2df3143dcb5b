"""Overhead of `mpdiag watch` against `mpdiag run` on the bundled transformer: same model, O1 (autocast FP16 +
GradScaler), every tensor's statistics at every step, same number of steps.

* plain - bench/transformer_loop.py alone (its own median step time);
* watch - the same script under `mpdiag watch` (median stored step time);
* run   - mpdiag/examples/transformer_lm.py under `mpdiag run --opt-level O1` (median stored step time).

Each variant runs in its own process, one after the other; medians skip the first step (compilation, warm-up).

    python bench/watch_overhead.py [--steps 30] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import write_result  # noqa: E402

from mpdiag.store import Store  # noqa: E402

LOOP = ROOT / "bench" / "transformer_loop.py"
EXAMPLE = ROOT / "mpdiag" / "examples" / "transformer_lm.py"


def _python(*argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, check=True)
    return done.stdout


def _median_stored_step_s(store: Store, run_id: int) -> float:
    return float(store.steps(run_id)["step_time_s"].iloc[1:].median())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(ROOT / "bench/results/watch_overhead.json"))
    args = parser.parse_args()
    steps = str(args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "runs.db")
        plain = json.loads(_python(str(LOOP), steps, args.device).strip().splitlines()[-1])["median_step_s"]
        _python("-m", "mpdiag", "watch", "--store", db, "--name", "watch", str(LOOP), steps, args.device)
        _python("-m", "mpdiag", "run", str(EXAMPLE), "--store", db, "--name", "run", "--opt-level", "O1",
                "--steps", steps, "--device", args.device)
        store = Store(db)
        ids = store.runs().set_index("name")["run_id"]
        watched, ran = _median_stored_step_s(store, ids["watch"]), _median_stored_step_s(store, ids["run"])
    result = {"device": args.device, "steps": args.steps, "plain_median_step_s": plain,
              "watch_median_step_s": watched, "run_median_step_s": ran,
              "watch_over_plain": watched / plain, "watch_over_run": watched / ran}
    for key, value in result.items():
        print(f"{key:>22}: {value}")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
