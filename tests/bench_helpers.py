"""Running a bench/ script as a user would, at its smallest settings: the smoke tests of tests/bench/ check that
every script still runs against the current code and writes its JSON (a bench that no test runs rots unseen: one
stubbed ``EventLog.see`` with a function returning None after the Recorder began to read what it returns)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the transformer benches' smallest model (bench/common.py's options)
TINY_TRANSFORMER = ["--steps", "2", "--d-model", "32", "--layers", "1", "--batch", "2", "--device", "cpu"]
#: each training bench's smallest settings (its --out is added)
TRAINING_BENCHES = {
    **{script: TINY_TRANSFORMER for script in
       ("recorder_overhead", "events_overhead", "fp8_overhead", "fp8_sim_cost", "replay_overhead")},
    "many_tensors": ["--steps", "2", "--tensors", "8", "--width", "4"],
    "step_check_hooks": ["--steps", "2", "--tensors", "8"],
    "torch_stats_host": ["--tensors", "4", "8", "--steps", "3"],
    "retention_size": ["--steps", "70", "--tensors", "8", "--plant", "57"],
    "update_tracking": ["--repeats", "1"],
    "watch_overhead": ["--steps", "2"],
    "opt_levels": ["--steps", "2", "--device", "cpu", "--levels", "O1"],
}
#: each dashboard and store bench's smallest settings (its --out is added)
DASHBOARD_BENCHES = {
    "store_scale": ["--sizes", "200x10"],
    "dashboard": ["--steps", "200", "--layers", "3"],
    "dashboard_startup": ["--repeat", "1"],
    "events_latency": ["--repeat", "1"],
}
#: the benches with their own way of running (a distributed launch), and bench/'s modules that are no bench
OTHER_BENCHES, NOT_BENCHES = {"distributed_overhead"}, {"common", "transformer_loop"}


def run_bench(script: str, args: list[str], out: Path, timeout: int = 240) -> list[dict]:
    """Run ``bench/{script}.py`` with ``args`` from the repository root; returns the JSON it wrote under ``out`` (a
    file given as ``--out``, or a folder whose JSON files are read), failing with its output's tail if it failed."""
    ran = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"), *args], cwd=ROOT, timeout=timeout,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ran.returncode == 0, f"bench/{script}.py exited {ran.returncode}:\n{(ran.stdout + ran.stderr)[-3000:]}"
    files = sorted(out.glob("*.json")) if out.is_dir() else [out]
    assert files and all(f.stat().st_size for f in files), f"bench/{script}.py wrote no JSON under {out}"
    return [json.loads(f.read_text()) for f in files]


def smoke(script: str, args: list[str], tmp_path: Path) -> None:
    """``bench/{script}.py`` at ``args``, its JSON written to a temporary file and not empty."""
    out = tmp_path / "out.json"
    (result,) = run_bench(script, [*args, "--out", str(out)], out)
    assert result
