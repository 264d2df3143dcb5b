"""A model script for `mpdiag run --nproc 2` (used by tests/test_distributed.py): a small MLP whose rank 1
batch at step PLANT_STEP is scaled by 1e6, so under FP16 autocast that rank's gradients overflow; rank 0's
batches stay normal. Its loss_fn checks at every step that the ranks' (full) weights agree (a step skipped on one
rank and taken on the other would make them differ). With MPDIAG_TEST_KILL_STEP set, rank 1 kills itself
with SIGKILL when it fetches that step's batch; with MPDIAG_TEST_RAISE_STEP set, rank 1 raises ValueError there."""

import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

PLANT_STEP = 2


def build(device):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    rank = dist.get_rank()
    kill_step = int(os.environ.get("MPDIAG_TEST_KILL_STEP", "-1"))
    raise_step = int(os.environ.get("MPDIAG_TEST_RAISE_STEP", "-1"))
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))  # from the rank's seed

    def batches(step):
        if rank == 1 and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 1 and step == raise_step:
            raise ValueError(f"rank 1's data loader broke at step {step}")
        x, y = torch.randn(32, 8, generator=generator), torch.randn(32, 1, generator=generator)
        return (x * 1e6 if rank == 1 and step == PLANT_STEP else x), y

    def loss_fn(model, batch):
        weights = [p.detach().full_tensor() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]
        total = torch.stack([w.double().sum() for w in weights]).sum().reshape(1)
        everyone = [torch.empty_like(total) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, total)
        if not all(torch.equal(everyone[0], other) for other in everyone):
            raise RuntimeError(f"the ranks' weights differ: {[float(t) for t in everyone]}")
        x, y = batch
        return nn.functional.mse_loss(model(x).float(), y)

    return {"model": model, "optimizer": lambda params: torch.optim.SGD(params, lr=0.01),
            "batches": batches, "loss_fn": loss_fn}
