"""What anomaly-preserving retention costs in store size and step time at ``--every 10``.

Two identical 200-tensor residual MLPs (bench/many_tensors.py's, width 64), fp16 autocast with GradScaler on the
same batch, trained side by side in one process, step by step in turn: one recorded by ``Recorder(every=10)``
(statistics computed at every step, stored at the multiples of 10 and around anomalies), the other by
``Recorder(every=10, retain_anomalies=False)`` (statistics computed and stored at the multiples of 10 only). One
overflow is planted at step ``--plant`` (the loss times 1e6: GradScaler skips the step and backs off), which the
first keeps with its neighbours and the second loses. It prints, per variant, the store's bytes per (step, tensor)
(the database file once the Recorder closed it, every table included), the steps kept and why, and the median
recorded step; then the ratios, and writes JSON.

    python bench/retention_size.py [--steps 200] [--tensors 200] [--plant 57] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from common import RESULTS, timed, write_result  # noqa: E402
from many_tensors import BATCH, WIDTH, residual_mlp  # noqa: E402
from torch import nn  # noqa: E402

from mpdiag import Recorder, Store  # noqa: E402

EVERY = 10
VARIANTS = {"retained": True, "multiples only": False}


def store_bytes(path: Path) -> int:
    """The store's size on disk: the database and whatever write-ahead log is left beside it."""
    return sum(os.path.getsize(p) for p in (path, Path(f"{path}-wal")) if p.exists())


def measure(steps: int, tensors: int, plant: int) -> dict:
    device = torch.device("cpu")
    folder = Path(tempfile.mkdtemp())
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, 1)
    loops = {}
    for name, retain in VARIANTS.items():
        torch.manual_seed(0)  # the same weights: both variants see the same gradients
        model = residual_mlp(tensors)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu")
        path = folder / f"{name.replace(' ', '_')}.db"
        recorder = Recorder(model, store=path, scaler=scaler, optimizer=opt, every=EVERY, name=name,
                            retain_anomalies=retain)
        loops[name] = (model, opt, scaler, recorder, path)

    def step(name: str, index: int) -> None:
        model, opt, scaler, recorder, _ = loops[name]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss * (1e6 if index == plant else 1.0)).backward()
        recorder.record(loss)
        scaler.step(opt)
        scaler.update()

    times = {name: [] for name in loops}
    for index in range(steps):
        for name in loops:
            times[name].append(timed(lambda name=name, index=index: step(name, index), device))
    result = {"steps": steps, "every": EVERY, "planted_overflow_at": plant, "variants": {}}
    for name, (model, _, _, recorder, path) in loops.items():
        recorder.close()
        n_tensors = sum(1 for p in model.parameters() if p.requires_grad)
        kept = Store(path).kept_steps(recorder.run_id)
        size = store_bytes(path)
        result["variants"][name] = {
            "tensors": n_tensors, "store_bytes": size, "bytes_per_step_tensor": size / (steps * n_tensors),
            "kept_steps": int(kept["step"].nunique()),
            "kept_beyond_multiples": {int(s): g["reason"].tolist() for s, g in kept.groupby("step")
                                      if (g["reason"] != "every").any()},
            "median_step_s": statistics.median(times[name][3:])}
    retained, multiples = (result["variants"][name] for name in VARIANTS)
    result["size_ratio"] = retained["store_bytes"] / multiples["store_bytes"]
    result["step_time_ratio"] = retained["median_step_s"] / multiples["median_step_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--plant", type=int, default=57, help="the step whose loss is multiplied by 1e6")
    parser.add_argument("--out", default=str(RESULTS / "retention_size.json"))
    args = parser.parse_args()
    result = measure(args.steps, args.tensors, args.plant)
    for name, v in result["variants"].items():
        print(f"{name:15s} {v['tensors']} tensors: {v['store_bytes'] / 1e6:.2f} MB, "
              f"{v['bytes_per_step_tensor']:.1f} B per (step, tensor), {v['kept_steps']} steps kept "
              f"(beyond the multiples of {EVERY}: {v['kept_beyond_multiples']}), median step "
              f"{v['median_step_s'] * 1e3:.1f} ms")
    print(f"retained / multiples only: store size {result['size_ratio']:.3f}x, step time {result['step_time_ratio']:.2f}x")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
