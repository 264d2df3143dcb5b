"""Recording overhead under torchrun: 2 ranks, gloo on the CPU, DDP and FSDP2, per step.

Run plainly, it launches itself through ``torch.distributed.run`` once per mode. In each rank it trains an
MLP (4 x Linear(width, width), fp16 autocast, GradScaler / ShardedGradScaler) and times, alternating in
blocks so drift hits both alike:

* plain    - the data-parallel AMP step alone;
* recorded - the same step with ``Recorder.record`` (every tensor, every step; rank 0 writes to SQLite).

Each step's time is the slowest rank's (the job waits for it). Rank 0 prints medians and writes JSON.

    python bench/distributed_overhead.py [--steps 20] [--width 1024] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import write_result  # noqa: E402
from torch import nn  # noqa: E402

from mpdiag.recording.recorder import Recorder  # noqa: E402

BLOCK = 5  # steps per block; blocks alternate plain / recorded


def _model(width: int, parallel: str):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(4)])
    if parallel == "ddp":
        return nn.parallel.DistributedDataParallel(model), torch.amp.GradScaler("cpu")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    for layer in model:
        fully_shard(layer, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    return model, ShardedGradScaler(device="cpu")


def rank_main(parallel: str, steps: int, width: int, store: str, out: str) -> None:
    dist.init_process_group("gloo")
    model, scaler = _model(width, parallel)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    recorder = Recorder(model, store=store, name=f"bench {parallel}", scaler=scaler, optimizer=optimizer)
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(dist.get_rank()))
    times = {"plain": [], "recorded": []}

    def step(record: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if record:
            recorder.record(loss)
        scaler.step(optimizer)
        scaler.update()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the job's step is its slowest rank's
        return float(elapsed)

    for _ in range(3):
        step(False)
    for block in range(2 * -(-steps // BLOCK)):
        kind = "recorded" if block % 2 else "plain"
        times[kind] += [step(kind == "recorded") for _ in range(BLOCK)]
    recorder.close()
    if dist.get_rank() == 0:
        medians = {k: statistics.median(v) for k, v in times.items()}
        result = {"parallel": parallel, "ranks": dist.get_world_size(), "width": width,
                  "params": sum(p.numel() for p in model.parameters()), "steps": len(times["plain"]),
                  "median_s": medians, "ratio": medians["recorded"] / medians["plain"],
                  "added_ms": 1e3 * (medians["recorded"] - medians["plain"])}
        print(f"{parallel}: plain {1e3 * medians['plain']:.1f} ms, recorded {1e3 * medians['recorded']:.1f} ms "
              f"({result['ratio']:.3f}x, +{result['added_ms']:.1f} ms)", flush=True)
        write_result(result, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per variant (after 3 warm-up)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--out-dir", default=str(ROOT / "bench/results"),
                        help="the folder of distributed_overhead_ddp.json and distributed_overhead_fsdp.json")
    parser.add_argument("--rank", nargs=3, metavar=("PARALLEL", "STORE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        parallel, store, out = args.rank
        rank_main(parallel, args.steps, args.width, store, out)
        return
    with tempfile.TemporaryDirectory() as folder:
        for parallel in ("ddp", "fsdp"):
            out = Path(args.out_dir) / f"distributed_overhead_{parallel}.json"
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            __file__, "--steps", str(args.steps), "--width", str(args.width),
                            "--rank", parallel, os.path.join(folder, "runs.db"), str(out)],
                           check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    main()
