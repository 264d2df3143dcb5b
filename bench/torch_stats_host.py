"""The torch statistics backend's host cost per tensor: the GPU path's fixed cost, measured where it is all host.

``GradStatsComputer(..., backend="torch")`` on tiny tensors (``--width`` values each, default 4), so the per-value
work is negligible and what is timed is mostly the host's handling of the step: dispatching the ops, and whatever
Python objects they make per tensor. On a GPU the same host work is what the training loop waits for in ``record``
(issue 28's target: 10 us a tensor of fixed cost, launches constant in the number of tensors). Per tensor count,
interleaved round-robin so drift hits all alike, it times ``start`` (the ops, enqueued on a GPU; wall clock and the
thread's CPU time) and ``result`` (the host decoding; CPU time), and counts the top-level aten operators ``start``
dispatches and the tensors those operators return (a per-tensor list of 0-dim results shows there). On the CPU,
``start`` also holds work a GPU does in a few kernels: zeroing and decoding every tensor's 2 x 2,071 bucket counts
(``index_add_``), ~8 KB a tensor whatever its size; ``--profile`` (a cProfile of ``start`` at the largest count,
its 25 functions of most own time) tells it apart. Prints microseconds a tensor and writes JSON.

    python bench/torch_stats_host.py [--tensors 20 200 502] [--width 4] [--steps 200] [--threads 1]
                                     [--device cpu|cuda] [--profile] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from common import RESULTS, sync, write_result  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from mpdiag.numerics.gradstats import GradStatsComputer  # noqa: E402

SCALE = 65536.0  # a power of two, as GradScaler's: the torch backend computes the second view all the same


class _Dispatched(TorchDispatchMode):
    """Counts the aten operators dispatched under it and the tensors they return."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.returned = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        self.returned += sum(1 for x in (out if isinstance(out, (list, tuple)) else [out]) if torch.is_tensor(x))
        return out


def _setup(tensors: int, width: int, device: torch.device) -> tuple[GradStatsComputer, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(tensors)
    grads = [torch.randn(width, generator=generator).to(device) for _ in range(tensors)]
    computer = GradStatsComputer([width] * tensors, device, backend="torch")
    computer.compute(grads, SCALE)  # warm: the workspaces' views made
    return computer, grads


def _counts(computer: GradStatsComputer, grads: list[torch.Tensor]) -> dict:
    with _Dispatched() as dispatched:
        computer.start(grads, SCALE)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        computer.start(grads, SCALE)
    top_level = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
    return {"dispatched_ops": dispatched.ops, "returned_tensors": dispatched.returned, "top_level_ops": top_level}


def _profile(computer: GradStatsComputer, grads: list[torch.Tensor], steps: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        computer.start(grads, SCALE)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, nargs="+", default=[20, 200, 502])
    parser.add_argument("--width", type=int, default=4, help="values a tensor (default 4)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per tensor count")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's CPU threads (default 1: a GPU step's host work is one thread's, and on a "
                             "shared machine a parallel region waits for its slowest thread)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--profile", action="store_true", help="cProfile start() at the largest tensor count")
    parser.add_argument("--out", default=str(RESULTS / "torch_stats_host.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    setups = {n: _setup(n, args.width, device) for n in args.tensors}
    timings = {n: {"start": [], "start_cpu": [], "result_cpu": []} for n in setups}
    for _ in range(args.steps):
        for n, (computer, grads) in setups.items():
            sync(device)
            begin, begin_cpu = time.perf_counter(), time.thread_time()
            pending = computer.start(grads, SCALE)
            middle, middle_cpu = time.perf_counter(), time.thread_time()
            pending.result()
            timings[n]["result_cpu"].append(time.thread_time() - middle_cpu)
            timings[n]["start"].append(middle - begin)
            timings[n]["start_cpu"].append(middle_cpu - begin_cpu)
    rows = []
    print("medians, us a tensor (CPU: this thread's CPU time, what a busy machine's queue does not inflate)")
    print(f"{'tensors':>7} | {'start':>7} | {'start CPU':>9} | {'result CPU':>10} | {'top-level ops':>13} | "
          f"{'dispatched ops':>14} | {'tensors returned':>16}")
    for n, (computer, grads) in setups.items():
        row = {"tensors": n, **{f"{kind}_us_per_tensor": statistics.median(seconds) / n * 1e6
                                for kind, seconds in timings[n].items()},
               "workspace_bytes": computer.workspace_bytes, **_counts(computer, grads)}
        print(f"{n:>7} | {row['start_us_per_tensor']:>7.2f} | {row['start_cpu_us_per_tensor']:>9.2f} | "
              f"{row['result_cpu_us_per_tensor']:>10.2f} | {row['top_level_ops']:>13} | {row['dispatched_ops']:>14} | "
              f"{row['returned_tensors']:>16}")
        rows.append(row)
    result = {"device": str(device), "width": args.width, "steps": args.steps, "results": rows,
              "threads": args.threads}
    if args.profile:
        largest = max(setups)
        result["profile"] = _profile(*setups[largest], steps=min(args.steps, 50))
        print(f"cProfile of start() at {largest} tensors, {min(args.steps, 50)} calls:\n{result['profile']}")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
