"""The Recorder's fixed cost per tensor, on the shapes real models have: hundreds of small parameter tensors.

Residual MLPs (width 64) of about 200 and 500 parameter tensors, fp16 autocast with GradScaler, the Recorder at
every step. Per model, interleaved round-robin so drift hits all of them alike, it times:

* plain     - the AMP step alone (forward, scaled backward, scaler.step, update);
* recorded  - the same step with ``Recorder.record`` (every tensor, every step, writing to SQLite);
* record    - ``Recorder.record`` alone, inside the recorded step;
* yardstick - one read of all gradients: ``torch._foreach_norm`` over the grads.

It prints medians, the record call's cost per tensor, its ratio to the yardstick and the recorded step's to
the plain one, and the torch backend's top-level operator launches per step (the GPU path, counted on the CPU
with the profiler: it should not grow with the number of tensors), and writes JSON.

    python bench/many_tensors.py [--steps 20] [--tensors 200 500] [--out bench/results/many_tensors.json]
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
from common import write_result  # noqa: E402
from torch import nn  # noqa: E402

from mpdiag import Recorder  # noqa: E402
from mpdiag.numerics.gradstats import GradStatsComputer  # noqa: E402

WIDTH, BATCH = 64, 32


class Block(nn.Module):
    """x + W2 relu(W1 x): four parameter tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


def residual_mlp(tensors: int) -> nn.Module:
    return nn.Sequential(*[Block() for _ in range(tensors // 4)], nn.Linear(WIDTH, 1))


def torch_backend_launches(grads: list[torch.Tensor]) -> int:
    """Top-level aten operators one statistics pass of the torch backend (the CUDA path) dispatches."""
    computer = GradStatsComputer([g.numel() for g in grads], torch.device("cpu"), backend="torch")
    computer.compute(grads, 65536.0)  # warm: buffers allocated
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        computer.compute(grads, 65536.0)
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def measure(tensors: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = residual_mlp(tensors)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, 1)
    recorder = Recorder(model, store=Path(tempfile.mkdtemp()) / "bench.db", scaler=scaler, optimizer=opt,
                        name=f"many_tensors_{tensors}")
    record_s = []

    def step(record: bool) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if record:
            start = time.perf_counter()
            recorder.record(loss)
            record_s.append(time.perf_counter() - start)
        scaler.step(opt)
        scaler.update()

    def yardstick() -> None:
        torch._foreach_norm([p.grad for p in params])

    kinds = {"plain": lambda: step(False), "recorded": lambda: step(True), "yardstick": yardstick}
    times = {k: [] for k in kinds}
    for _ in range(3):  # warm: numba compiled, buffers allocated, the store created
        for fn in kinds.values():
            fn()
    record_s.clear()
    for _ in range(steps):
        for kind, fn in kinds.items():
            start = time.perf_counter()
            fn()
            times[kind].append(time.perf_counter() - start)
    recorder.close()
    median = {k: statistics.median(v) for k, v in times.items()}
    median["record"] = statistics.median(record_s)
    return {"tensors": len(params), "median_s": median,
            "record_us_per_tensor": median["record"] / len(params) * 1e6,
            "record_over_yardstick": median["record"] / median["yardstick"],
            "recorded_over_plain": median["recorded"] / median["plain"],
            "torch_backend_launches": torch_backend_launches([p.grad for p in params])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tensors", type=int, nargs="+", default=[200, 500])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "many_tensors.json"))
    args = parser.parse_args()
    results = []
    for n in args.tensors:
        r = measure(n, args.steps)
        m = r["median_s"]
        print(f"{r['tensors']:>4} tensors: plain {m['plain'] * 1e3:.2f} ms, recorded {m['recorded'] * 1e3:.2f} ms "
              f"({r['recorded_over_plain']:.2f}x), record {m['record'] * 1e3:.2f} ms = "
              f"{r['record_us_per_tensor']:.1f} us/tensor, {r['record_over_yardstick']:.1f}x one _foreach_norm "
              f"({m['yardstick'] * 1e3:.3f} ms); torch backend {r['torch_backend_launches']} launches/step")
        results.append(r)
    write_result({"results": results, "threads": torch.get_num_threads()}, args.out)


if __name__ == "__main__":
    main()
