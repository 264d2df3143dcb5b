"""The Recorder's fixed cost per tensor, on the shapes real models have: hundreds of small parameter tensors.

Residual MLPs (width 64, or ``--width``) of about 78, 200 and 500 parameter tensors, fp16 autocast with GradScaler, the Recorder
at every step. Per model, interleaved round-robin so drift hits all of them alike, it times:

* plain      - the AMP step alone (forward, scaled backward, scaler.step, update);
* recorded   - the same step with ``Recorder.record`` (every tensor, every step, writing to SQLite);
* every N    - the same step on an identical twin model recorded with ``--every N`` (default 10): statistics
  stored at the multiples of N and where something happened; between multiples, on the CPU, a copy of the
  gradients and a light pass (mean over the measured steps, so the multiples count at their share);
* unchecked  - the recorded step on a twin recorded with ``check_optimizer_step=False``: the difference from
  ``recorded`` (the median of the rounds' differences) is what the optimizer-step check costs (its passes before
  and after the optimizer step);
* record     - ``Recorder.record`` alone, inside the recorded step;
* statistics - ``GradStatsComputer.compute`` alone, on a copy of one step's gradients at scale 2**16;
* yardstick  - one read of all gradients: ``torch._foreach_norm`` over the grads.

Each is timed twice: wall clock, and CPU seconds - the training thread's own, plus, for the recorded kinds,
their writer thread's CPU over the run shared equally among their steps. On a machine shared with other jobs the
wall clock mostly measures the queue for a core; the CPU seconds measure the work. It prints medians and,
beside the targets of issue 28, the record call's cost per tensor (target <= 10 us), the
statistics' and the record call's ratio to the yardstick (target <= 5x at 500 tensors, goal 3x) and the torch
backend's top-level operator launches per step (the GPU path, counted on the CPU with the profiler: constant in
the number of tensors), and writes JSON.

On CUDA (``--device cuda``) every timing waits for the device's queued work, except ``record``, which is the
time the training loop waits for the call (the statistics are read back a step later); the launches are then
also counted as the CUDA kernels one statistics pass runs.

``--fp32`` trains in FP32 instead (no autocast, no GradScaler): issue 28's recorded-step target (<= 1.10x plain on
the 200-tensor MLP) is stated for FP32, where the step is short.

    python bench/many_tensors.py [--steps 20] [--tensors 78 200 500] [--every 10] [--fp32] [--device cpu|cuda]
                                 [--width 64] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from common import sync, timed, write_result  # noqa: E402
from torch import nn  # noqa: E402

from mpdiag import Recorder  # noqa: E402
from mpdiag.numerics.gradstats import GradStatsComputer  # noqa: E402

WIDTH, BATCH = 64, 32
#: issue 28's targets: record()'s cost per tensor, and the statistics' multiple of one _foreach_norm read
TARGET_US_PER_TENSOR, TARGET_OVER_YARDSTICK, GOAL_OVER_YARDSTICK = 10.0, 5.0, 3.0


class Block(nn.Module):
    """x + W2 relu(W1 x): four parameter tensors."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


def residual_mlp(tensors: int, width: int = WIDTH) -> nn.Module:
    """``tensors // 4`` blocks and a head. Each block's second layer starts scaled by 1/sqrt(blocks) (GPT-2's
    residual init): at PyTorch's default init the 125-block stack's activations grew until its loss was NaN within
    30 steps, in FP32 and FP16 alike, so the timed steps of the 500-tensor model were GradScaler's skipped ones."""
    blocks = [Block(width) for _ in range(tensors // 4)]
    with torch.no_grad():
        for block in blocks:
            block.b.weight.mul_(len(blocks) ** -0.5)
    return nn.Sequential(*blocks, nn.Linear(width, 1))


def torch_backend_launches(grads: list[torch.Tensor]) -> int:
    """Top-level aten operators one statistics pass of the torch backend (the CUDA path) dispatches."""
    computer = GradStatsComputer([g.numel() for g in grads], torch.device("cpu"), backend="torch")
    computer.compute(grads, 65536.0)  # warm: buffers allocated
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        computer.compute(grads, 65536.0)
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def cuda_kernels(grads: list[torch.Tensor]) -> int:
    """CUDA kernels one statistics pass runs on the GPU (the number the CPU count above stands in for)."""
    computer = GradStatsComputer([g.numel() for g in grads], grads[0].device)
    computer.compute(grads, 65536.0)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        computer.compute(grads, 65536.0)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


class Trained:
    """A model, its SGD and GradScaler (disabled, with autocast, when not ``amp``), and a Recorder recording it every
    ``every`` steps into a fresh store."""

    def __init__(self, model: nn.Module, device: torch.device, every: int, amp: bool, check: bool = True):
        self.model, self.device, self.amp = model, device, amp
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.scaler = torch.amp.GradScaler(device.type, enabled=amp)
        self.recorder = Recorder(model, store=Path(tempfile.mkdtemp()) / "bench.db", scaler=self.scaler,
                                 optimizer=self.opt, every=every, name=f"many_tensors_every_{every}",
                                 check_optimizer_step=check)
        self.record_s: list[float] = []
        self.record_cpu_s: list[float] = []

    def writer_cpu_s(self) -> float:
        """CPU seconds the Recorder's writer thread has used so far."""
        return time.clock_gettime(time.pthread_getcpuclockid(self.recorder._writer._thread.ident))

    def step(self, x: torch.Tensor, y: torch.Tensor, record: bool) -> None:
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.amp):
            loss = nn.functional.mse_loss(self.model(x).float(), y)
        self.scaler.scale(loss).backward()
        if record:
            sync(self.device)
            start, start_cpu = time.perf_counter(), time.thread_time()
            self.recorder.record(loss)
            self.record_s.append(time.perf_counter() - start)
            self.record_cpu_s.append(time.thread_time() - start_cpu)
        self.scaler.step(self.opt)
        self.scaler.update()


def measure(tensors: int, steps: int, every: int, device: torch.device, amp: bool, width: int = WIDTH) -> dict:
    torch.manual_seed(0)
    model = residual_mlp(tensors, width).to(device)
    params = list(model.parameters())
    x, y = torch.randn(BATCH, width, device=device), torch.randn(BATCH, 1, device=device)
    each, sparse = Trained(model, device, 1, amp), Trained(copy.deepcopy(model), device, every, amp)
    unchecked = Trained(copy.deepcopy(model), device, 1, amp, check=False)

    def yardstick() -> None:
        torch._foreach_norm([p.grad for p in params])

    each.step(x, y, False)
    grads = [p.grad.clone() for p in params]  # one step's gradients, kept for the statistics alone
    computer = GradStatsComputer([g.numel() for g in grads], device)
    kinds = {"plain": lambda: each.step(x, y, False), "recorded": lambda: each.step(x, y, True),
             "every": lambda: sparse.step(x, y, True), "unchecked": lambda: unchecked.step(x, y, True),
             "statistics": lambda: computer.compute(grads, 65536.0), "yardstick": yardstick}
    times, cpu = {k: [] for k in kinds}, {k: [] for k in kinds}
    for _ in range(3):  # warm: numba compiled, buffers allocated, the stores created
        for fn in kinds.values():
            fn()
    each.record_s.clear()
    each.record_cpu_s.clear()
    writers = {"recorded": each, "every": sparse, "unchecked": unchecked}
    writer_start = {kind: trained.writer_cpu_s() for kind, trained in writers.items()}
    for _ in range(steps):
        for kind, fn in kinds.items():
            start_cpu = time.thread_time()
            times[kind].append(timed(fn, device))
            cpu[kind].append(time.thread_time() - start_cpu)
    for trained in writers.values():
        trained.recorder.flush()
    for kind, trained in writers.items():  # the writer's work for these steps, done by now
        trained.recorder._writer.call(lambda w: None)
        share = (trained.writer_cpu_s() - writer_start[kind]) / steps
        cpu[kind] = [seconds + share for seconds in cpu[kind]]
    for trained in writers.values():
        trained.recorder.close()
    median = {k: statistics.median(v) for k, v in times.items()}
    median["record"] = statistics.median(each.record_s)
    cpu_median = {k: statistics.median(v) for k, v in cpu.items()}
    cpu_median["record"] = statistics.median(each.record_cpu_s)
    cpu_mean = {k: statistics.mean(cpu[k]) for k in ("plain", "recorded", "every")}
    mean_every, mean_recorded = statistics.mean(times["every"]), statistics.mean(times["recorded"])
    return {"tensors": len(params), "every": every, "median_s": median,
            "mean_s": {"every": mean_every, "recorded": mean_recorded, "plain": statistics.mean(times["plain"])},
            "every_over_plain": mean_every / statistics.mean(times["plain"]),
            "every_over_recorded": mean_every / mean_recorded,
            "cpu_median_s": cpu_median, "cpu_mean_s": cpu_mean,
            "cpu_record_us_per_tensor": cpu_median["record"] / len(params) * 1e6,
            "cpu_statistics_over_yardstick": cpu_median["statistics"] / cpu_median["yardstick"],
            "cpu_record_over_yardstick": cpu_median["record"] / cpu_median["yardstick"],
            "cpu_recorded_over_plain": cpu_mean["recorded"] / cpu_mean["plain"],
            "cpu_every_over_plain": cpu_mean["every"] / cpu_mean["plain"],
            "record_us_per_tensor": median["record"] / len(params) * 1e6,
            "record_over_yardstick": median["record"] / median["yardstick"],
            "statistics_us_per_tensor": median["statistics"] / len(params) * 1e6,
            "statistics_over_yardstick": median["statistics"] / median["yardstick"],
            "recorded_over_plain": median["recorded"] / median["plain"],
            # paired by round (the two twins step one after the other): drift between rounds cancels, where a
            # difference of two medians was as noisy as the steps themselves (-1.8 to +9.2 ms on one GPU start)
            "check_ms": statistics.median(a - b for a, b in zip(times["recorded"], times["unchecked"], strict=True)) * 1e3,
            "cpu_check_ms": statistics.median(a - b for a, b in zip(cpu["recorded"], cpu["unchecked"], strict=True)) * 1e3,
            "torch_backend_launches": torch_backend_launches([p.grad.cpu() for p in params]),
            "cuda_kernels": cuda_kernels([p.grad for p in params]) if device.type == "cuda" else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tensors", type=int, nargs="+", default=[78, 200, 500])
    parser.add_argument("--every", type=int, default=10, help="the twin model's --every (default 10)")
    parser.add_argument("--fp32", action="store_true", help="train in FP32 (no autocast, no GradScaler)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--width", type=int, default=WIDTH,
                        help=f"the MLP's width (default {WIDTH}); a small one (4) leaves the cost per tensor alone")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "many_tensors.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    results = []
    for n in args.tensors:
        r = measure(n, args.steps, args.every, device, amp=not args.fp32, width=args.width)
        m, mean = r["median_s"], r["mean_s"]
        print(f"{r['tensors']:>4} tensors: plain {m['plain'] * 1e3:.2f} ms, recorded {m['recorded'] * 1e3:.2f} ms "
              f"({r['recorded_over_plain']:.2f}x), one _foreach_norm {m['yardstick'] * 1e3:.3f} ms; means: plain "
              f"{mean['plain'] * 1e3:.2f} ms, --every 1 {mean['recorded'] * 1e3:.2f} ms, --every {args.every} "
              f"{mean['every'] * 1e3:.2f} ms ({r['every_over_plain']:.2f}x plain, {r['every_over_recorded']:.2f}x "
              "--every 1)")
        print(f"{'':>12} the optimizer-step check: recorded - recorded without it, median of the rounds = "
              f"{r['check_ms']:.2f} ms a step (wall), {r['cpu_check_ms']:.2f} ms (CPU)")
        results.append(r)
    print(f"{'tensors':>7} | {'record us/tensor':>16} | {'record / norm':>13} | {'statistics us/tensor':>20} | "
          f"{'statistics / norm':>17} | torch launches")
    for r in results:
        print(f"{r['tensors']:>7} | {r['record_us_per_tensor']:>16.1f} | {r['record_over_yardstick']:>12.1f}x | "
              f"{r['statistics_us_per_tensor']:>20.1f} | {r['statistics_over_yardstick']:>16.1f}x | "
              f"{r['torch_backend_launches']:>14}")
    print(f"{'target':>7} | {'<= ' + str(TARGET_US_PER_TENSOR):>16} | {'':>13} | {'':>20} | "
          f"{f'<= {TARGET_OVER_YARDSTICK:g}x ({GOAL_OVER_YARDSTICK:g}x)':>17} | constant")
    print("CPU seconds (the training thread's, plus the writer thread's share for the recorded steps):")
    print(f"{'tensors':>7} | record us/tensor | record / norm | statistics / norm | recorded / plain | "
          f"--every {args.every} / plain")
    for r in results:
        print(f"{r['tensors']:>7} | {r['cpu_record_us_per_tensor']:>16.1f} | "
              f"{r['cpu_record_over_yardstick']:>12.1f}x | {r['cpu_statistics_over_yardstick']:>16.1f}x | "
              f"{r['cpu_recorded_over_plain']:>15.2f}x | {r['cpu_every_over_plain']:>11.2f}x")
    targets = {"record_us_per_tensor_max": TARGET_US_PER_TENSOR, "statistics_over_yardstick_max": TARGET_OVER_YARDSTICK,
               "statistics_over_yardstick_goal": GOAL_OVER_YARDSTICK, "torch_backend_launches": "constant"}
    if device.type == "cuda":
        print("CUDA kernels per statistics pass: " + ", ".join(f"{r['cuda_kernels']} at {r['tensors']} tensors"
                                                              for r in results))
    device_name = str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    write_result({"device": device_name, "precision": "fp32" if args.fp32 else "fp16 autocast + GradScaler",
                  "width": args.width, "results": results, "targets": targets,
                  "threads": torch.get_num_threads()}, args.out)


if __name__ == "__main__":
    main()
