"""Gallery: weights trained in BF16's range that overflow FP16.

BF16 has FP32's exponent range, so a model trained in BF16 can grow weights far beyond 65504 without any
problem - here an input layer whose weights reached about 10^5 to compensate features that arrive in tiny
units. Cast to FP16 (O2 stores weights in FP16; O1 casts them for every matmul) those weights become inf and
every loss is NaN; in BF16 they are fine.

Failing: ``--opt-level O2``. Fixed: ``--opt-level bf16-pure`` (weights and activations in BF16).
What you should see: with O2 a non-finite loss from step 0, every step skipped and the scale collapsing;
with bf16-pure finite losses that fall and no skipped step.
"""

import torch
from torch import nn

from mpdiag.examples.data import digits, labelled_batches

FAILING = {"opt_level": "O2"}
FIXED = {"opt_level": "bf16-pure"}
FINDING = "scale-collapse"  # what `python -m mpdiag diagnose` reports for a FAILING run
UNITS = 1e-5  # features arrive in these units; the first layer's weights are 1/UNITS larger to compensate


def build(device):
    x, y, _, _ = digits(device)
    x = x.reshape(len(x), -1) * UNITS
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    with torch.no_grad():
        model[0].weight.div_(UNITS)  # as a BF16 checkpoint would hold them: |w| up to ~1.2e4 * ... > 65504
        model[0].weight.mul_(8.0)
    batches = labelled_batches(x, y, batch_size=64, device=device)

    def loss_fn(model, batch):
        inputs, labels = batch
        return nn.functional.cross_entropy(model(inputs).float() / 8.0, labels)

    return {
        "name": "gallery: BF16-range weights overflow FP16",
        "description": "Weights above 65504: fine in BF16, inf in FP16.",
        "model": model,
        "optimizer": lambda params: torch.optim.SGD(params, lr=0.05),
        "batches": batches,
        "loss_fn": loss_fn,
    }
