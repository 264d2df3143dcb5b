"""Gallery: gradients too small for FP16 unless the loss is scaled.

The loss is down-weighted by 2^-16 (as an auxiliary loss, or a sum divided by a huge token count, often is),
so most weight gradients lie between 2^-32 and 2^-22: below FP16's smallest subnormal 2^-24 about half of them
vanish when the backward matmuls run in FP16, and the rest keep a few bits at best. This is the paper's
DeepSpeech2 situation (about 5 % of gradient exponents below -24) made stronger: strong enough that the
failing run visibly stops learning (its loss ends several times its FP32 twin's; the README's Quick start).

Failing: ``--opt-level O1 --loss-scale 1``. Fixed: ``--opt-level O1`` (dynamic loss scaling from 2^16).
What you should see: on the Gradients page, at the loss scale, a large FP16 underflow share and many exact
zeros in the weight gradients when failing, and a loss curve that leaves its FP32 twin's within a few dozen
steps; with dynamic scaling the histogram moves 16 bins up, the underflow share at the loss scale drops to
(nearly) zero, the zeros disappear and the loss follows FP32's. The finding's own fix, read from the FP32 twin's
histograms, starts the scale higher still (no value subnormal either).
"""

import torch
from torch import nn

from mpdiag.examples.data import digits, labelled_batches

FAILING = {"opt_level": "O1", "loss_scale": 1.0}
FIXED = {"opt_level": "O1"}
FINDING = "gradient-underflow"  # what `python -m mpdiag diagnose` reports for a FAILING run
DOWN_WEIGHT = 2.0**-16


def build(device):
    x, y, _, _ = digits(device)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    batches = labelled_batches(x, y, batch_size=64, device=device)

    def loss_fn(model, batch):
        inputs, labels = batch
        return nn.functional.cross_entropy(model(inputs).float(), labels) * DOWN_WEIGHT

    return {
        "name": "gallery: gradients underflow FP16",
        "description": "Down-weighted loss: FP16 gradients vanish without loss scaling.",
        "model": model,
        "optimizer": lambda params: torch.optim.SGD(params, lr=0.1 / DOWN_WEIGHT),
        "batches": batches,
        "loss_fn": loss_fn,
    }
