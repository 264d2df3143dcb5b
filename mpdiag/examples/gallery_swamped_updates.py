"""Gallery: weight updates too small for FP16 weights, lost in pure FP16 (O3) and kept by FP32 masters (O2).

Fine-tuning with plain SGD at a small learning rate: each step changes a weight by lr·g, about 10^-6 here,
while an FP16 weight of magnitude 0.05 can only move in steps of about 2^-11·0.05 ≈ 2.4·10^-5. Adding the
update rounds back to the same FP16 number, so the weights never change and the model does not learn.
This is the paper's "weight update" argument for FP32 master weights (docs/background.md: weight-update swamping). O2 keeps an
FP32 master copy that accumulates the small updates, and the FP16 weights follow it.

Failing: ``--opt-level O3``. Fixed: ``--opt-level O2``.
What you should see: with O3 most updates of values with a non-zero gradient leave the weight unchanged
(the Findings page states the share) and the loss does not move; with O2 the same updates are below FP16's
resolution but the masters keep them and the loss falls.
"""

import torch
from torch import nn

from mpdiag.examples.data import digits, labelled_batches

FAILING = {"opt_level": "O3"}
FIXED = {"opt_level": "O2"}
FINDING = "update-swamping"  # what `python -m mpdiag diagnose` reports for a FAILING run


def build(device):
    x, y, _, _ = digits(device)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    batches = labelled_batches(x, y, batch_size=64, device=device)

    def loss_fn(model, batch):
        inputs, labels = batch
        return nn.functional.cross_entropy(model(inputs).float(), labels)

    return {
        "name": "gallery: updates swamped by FP16 weights",
        "description": "Plain SGD with a small learning rate: pure FP16 weights cannot take the updates.",
        "model": model,
        "optimizer": lambda params: torch.optim.SGD(params, lr=1e-3),
        "batches": batches,
        "loss_fn": loss_fn,
    }
