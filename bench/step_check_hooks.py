"""The optimizer-step check's own host time: its two hooks around each optimizer step, timed directly.

The check (``check_optimizer_step``, on by default) runs outside ``record``: before each checked optimizer step it
asks whether the loss, gradients, weights and optimizer state are all finite, after it which weights and state
no longer are. On a GPU both are enqueued without a synchronisation, so what they cost the training loop is the
host time of the two hooks; a step-time difference of twins (``many_tensors.py``'s "check") is that cost plus the
noise of two processes' steps. Here a timer wraps the hooks themselves, over the residual MLPs of
``many_tensors.py`` (about 200 and 500 parameter tensors, width 64, FP32) under SGD (no state) and Adam (two state
tensors per weight), the Recorder recording every step; it prints the medians per step and writes JSON.

    python bench/step_check_hooks.py [--steps 20] [--tensors 200 500] [--device cpu|cuda] [--out FILE.json]
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

import torch  # noqa: E402
from common import RESULTS, write_result  # noqa: E402
from many_tensors import BATCH, WIDTH, residual_mlp  # noqa: E402

from mpdiag import Recorder  # noqa: E402
from mpdiag.recording.nonfinite_step import OptimizerStepCheck  # noqa: E402

OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
              "adam": lambda params: torch.optim.Adam(params, lr=1e-4)}


def timing_hooks() -> dict[str, list[float]]:
    """Wrap the check's two hooks in a timer; returns the list each appends its seconds to."""
    spent: dict[str, list[float]] = {"before": [], "after": []}
    for hook, key in (("before_optimizer_step", "before"), ("after_optimizer_step", "after")):
        real = getattr(OptimizerStepCheck, hook)

        def timed(self, optimizer, _real=real, _seconds=spent[key]):
            start = time.perf_counter()
            _real(self, optimizer)
            _seconds.append(time.perf_counter() - start)

        setattr(OptimizerStepCheck, hook, timed)
    return spent


def measure(tensors: int, optimizer: str, steps: int, device: torch.device, spent: dict[str, list[float]]) -> dict:
    torch.manual_seed(0)
    model = residual_mlp(tensors).to(device)
    x, y = torch.randn(BATCH, WIDTH, device=device), torch.randn(BATCH, 1, device=device)
    opt = OPTIMIZERS[optimizer](model.parameters())
    recorder = Recorder(model, store=Path(tempfile.mkdtemp()) / "bench.db", optimizer=opt, name="step_check_hooks")
    for step in range(steps + 5):
        if step == 5:  # warm: numba compiled, the optimizer's state made, the store created
            for seconds in spent.values():
                seconds.clear()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        recorder.record(loss)
        opt.step()
    recorder.close()
    before, after = statistics.median(spent["before"]), statistics.median(spent["after"])
    return {"tensors": sum(1 for _ in model.parameters()), "optimizer": optimizer, "steps": len(spent["before"]),
            "before_ms": before * 1e3, "after_ms": after * 1e3, "both_ms": (before + after) * 1e3,
            "finding": recorder.optimizer_step_nonfinite}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tensors", type=int, nargs="+", default=[200, 500])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", default=str(RESULTS / "step_check_hooks.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    spent = timing_hooks()
    results = [measure(tensors, optimizer, args.steps, device, spent)
               for tensors in args.tensors for optimizer in OPTIMIZERS]
    name = f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu"
    print(f"{name}: the optimizer-step check's host time per step (medians of {args.steps} steps)")
    print(f"{'tensors':>7} | {'optimizer':>9} | {'before ms':>9} | {'after ms':>8} | {'both ms':>7}")
    for r in results:
        print(f"{r['tensors']:>7} | {r['optimizer']:>9} | {r['before_ms']:>9.3f} | {r['after_ms']:>8.3f} | "
              f"{r['both_ms']:>7.3f}")
    if any(r["finding"] for r in results):
        print("a step broke something (the bench's models should not): the timings include the finding")
    write_result({"device": name, "results": results}, args.out)


if __name__ == "__main__":
    main()
