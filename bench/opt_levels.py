"""Cost of each opt level, measured side by side in one invocation.

Runs one bundled model at every opt level, each in its own child process (so peak memory is per level), and
prints median step time (after warm-up), samples/s, peak memory and the final loss, each as a ratio to O0,
plus the model-state memory account next to the 16*Psi formula. Writes the table as JSON.

    python bench/opt_levels.py [--script mpdiag/examples/transformer_lm.py] [--steps 60] [--device auto]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import write_result  # noqa: E402

from mpdiag import Store  # noqa: E402
from mpdiag.training.policies import POLICIES  # noqa: E402


def measure(script: Path, level: str, steps: int, device: str, store: Path) -> dict:
    cmd = [sys.executable, "-m", "mpdiag", "run", str(script), "--opt-level", level, "--steps", str(steps),
           "--device", device, "--store", str(store), "--name", f"bench {level}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise SystemExit(f"{level} failed:\n{done.stdout}\n{done.stderr}")
    run = Store(store).runs().iloc[0]
    state = run["model_state"]
    median = float(run["median_step_time_s"])
    return {
        "level": level,
        "device": run["device"],
        "median_step_s": median,
        "samples_per_s": run["batch_size"] / median if run["batch_size"] else None,
        "peak_mem_bytes": int(run["peak_mem_bytes"]),
        "final_loss": float(run["final_loss"]),
        "skipped_steps": int(run["skipped_steps"]),
        "model_state": state,
        "model_state_total": sum(v for k, v in state.items() if k != "params"),
        "adam_16psi_bytes": 16 * state["params"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", default=str(ROOT / "mpdiag/examples/transformer_lm.py"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--levels", default=",".join(POLICIES))
    parser.add_argument("--out", default=str(ROOT / "bench/results/opt_levels.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(Path(args.script), level, args.steps, args.device, Path(tmp) / f"{level}.db")
                for level in args.levels.split(",")]
    base = next((r for r in rows if r["level"] == "O0"), rows[0])
    for r in rows:
        r["time_vs_O0"] = r["median_step_s"] / base["median_step_s"]
        r["peak_mem_vs_O0"] = r["peak_mem_bytes"] / base["peak_mem_bytes"]
        r["final_loss_vs_O0"] = r["final_loss"] / base["final_loss"]

    memory = "CUDA allocator peak" if rows[0]["device"].startswith("cuda") else "process peak RSS (getrusage)"
    print(f"{Path(args.script).name}, {args.steps} steps on {rows[0]['device']}; peak memory = {memory}")
    print(f"{'level':<10}{'step ms':>9}{'x O0':>7}{'samples/s':>11}{'peak MB':>9}{'x O0':>7}"
          f"{'final loss':>12}{'x O0':>7}{'skipped':>9}{'state MB':>10}{'16Ψ MB':>8}")
    for r in rows:
        print(f"{r['level']:<10}{r['median_step_s'] * 1e3:>9.1f}{r['time_vs_O0']:>7.2f}{r['samples_per_s'] or 0:>11.0f}"
              f"{r['peak_mem_bytes'] / 2**20:>9.0f}{r['peak_mem_vs_O0']:>7.2f}{r['final_loss']:>12.4g}"
              f"{r['final_loss_vs_O0']:>7.2f}{r['skipped_steps']:>9}{r['model_state_total'] / 2**20:>10.2f}"
              f"{r['adam_16psi_bytes'] / 2**20:>8.2f}")
    write_result({"script": args.script, "steps": args.steps, "memory": memory, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
