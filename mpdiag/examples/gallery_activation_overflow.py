"""Gallery: an activation that overflows FP16 in the forward pass.

Raw 8-bit pixel values (0-255, never normalised) feed a wide first layer, so its outputs reach about 10^5:
above FP16's largest finite value 65504. Under O1 that matmul runs in FP16, its output holds inf, and the
loss is inf or NaN at every step. Loss scaling cannot help - the overflow is in the forward pass - so
GradScaler skips every step and halves the scale each time: the scale collapses far below 1.

Failing: ``--opt-level O1``. Fixed: ``--opt-level bf16`` (BF16 has FP32's range).
What you should see: on the Loss scale page every step skipped and the scale falling by half per step;
non-finite losses drawn as red rules. With bf16 the loss is finite and falls.
"""

import torch
from torch import nn

from mpdiag.examples.data import digits, labelled_batches

FAILING = {"opt_level": "O1"}
FIXED = {"opt_level": "bf16"}
FINDING = "scale-collapse"  # what `python -m mpdiag diagnose` reports for a FAILING run


def build(device):
    x, y, _, _ = digits(device)
    x = (x * 255).reshape(len(x), -1)  # raw pixel values, not normalised
    first = nn.Linear(64, 256)
    with torch.no_grad():
        first.weight.mul_(1000.0)  # a badly scaled (or badly loaded) first layer
    model = nn.Sequential(first, nn.ReLU(), nn.Linear(256, 10))
    batches = labelled_batches(x, y, batch_size=64, device=device)

    def loss_fn(model, batch):
        inputs, labels = batch
        return nn.functional.cross_entropy(model(inputs).float() * 1e-4, labels)

    return {
        "name": "gallery: activation overflows FP16",
        "description": "Unnormalised inputs: first-layer outputs above 65504.",
        "model": model,
        "optimizer": lambda params: torch.optim.SGD(params, lr=0.01),
        "batches": batches,
        "loss_fn": loss_fn,
    }
