"""A user's own training loop under torchrun with a Recorder (used by tests/test_distributed.py).

Usage: torchrun --nproc_per_node 2 user_loop.py STORE OUT ddp|fsdp [watched]
With MPDIAG_TEST_KILL_STEP=k, rank 1 kills itself with SIGKILL when step k starts.
With "watched" it has no line of mpdiag (run it as `torchrun ... -m mpdiag watch user_loop.py ...`).
Trains a small model whose shapes shard unevenly over 2 ranks (5 rows, and a 1-row weight that leaves rank
1 an empty shard), O1-style (autocast FP16 on the CPU, a dynamic scaler), each rank on its own batches.
Rank 0 saves, per step, the full gradients as the Recorder saw them (FSDP2: gathered with full_tensor(),
outside the Recorder) and the scale, for the test to compute single-process statistics from.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

from mpdiag.recording.recorder import Recorder

STEPS = 3


def main(store: str, out: str, parallel: str, watched: bool) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 1))
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        for layer in (model[0], model[2]):
            fully_shard(layer, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        scaler = ShardedGradScaler(device="cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = None if watched else \
        Recorder(model, store=store, name=f"user loop {parallel}", scaler=scaler, optimizer=optimizer)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    saved = []
    kill_step = int(os.environ.get("MPDIAG_TEST_KILL_STEP", "-1"))
    for step in range(STEPS):
        if rank == 1 and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = torch.randn(16, 7, generator=generator), torch.randn(16, 1, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if recorder is not None:
            recorder.record(loss)
        grads = [p.grad.full_tensor() if parallel == "fsdp" else p.grad.clone() for p in model.parameters()]
        saved.append({"scale": scaler.get_scale(), "grads": grads, "loss": float(loss)})
        scaler.step(optimizer)
        scaler.update()
    if recorder is not None:
        recorder.close()
    if rank == 0:
        torch.save({"steps": saved, "run_id": recorder and recorder.run_id,
                    "shapes": {n.removeprefix("module."): list(p.shape) for n, p in model.named_parameters()}}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    watched = sys.argv[4:5] == ["watched"]
    main(*sys.argv[1:4], watched=watched)
    if not watched:  # under watch, watch ends the process the same way once it has closed the run
        # Skip interpreter finalization: gloo's worker threads outlive destroy_process_group() and may still be
        # releasing a finished collective's tensors, which needs the GIL; during finalization that aborts the
        # process ("terminate called without an active exception", seen under CPU load with FSDP2's async
        # all_reduce, and reproduced without mpdiag). Everything this rank had to do is done and flushed.
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
