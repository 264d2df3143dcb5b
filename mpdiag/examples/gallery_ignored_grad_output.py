"""Gallery: a custom autograd Function whose backward ignores its incoming gradient.

The fused loss below returns the analytic gradient of the mean squared error, assuming it is the last op
and so grad_output is 1. Under loss scaling grad_output is S, so every gradient upstream of it is S times
too small after unscaling, and training silently stalls (docs/background.md: custom autograd functions; the fix is to multiply by
grad_output and to decorate with torch.amp.custom_fwd/custom_bwd).

Failing: ``--opt-level O1`` (dynamic scale 2^16). Fixed: ``--opt-level bf16`` (no loss scaling).
What you should see: with O1 the unscaled gradient norms are 2^16 times smaller than under bf16 for the
same weights and batch, and the loss barely moves; ``mpdiag check`` warns about the Function.
"""

import torch
from torch import nn

from mpdiag.examples.data import digits, labelled_batches

FAILING = {"opt_level": "O1"}
FIXED = {"opt_level": "bf16"}
FINDING = "scale-ignored"  # what `python -m mpdiag diagnose` reports for a FAILING run


class FusedMSE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, prediction, target):
        ctx.save_for_backward(prediction, target)
        return ((prediction.float() - target) ** 2).mean()

    @staticmethod
    def backward(ctx, grad_output):
        prediction, target = ctx.saved_tensors
        # BUG (deliberate): grad_output is ignored, as if the loss were always the last op.
        grad = 2 * (prediction.float() - target) / prediction.numel()
        return grad.to(prediction.dtype), None


def build(device):
    x, y, _, _ = digits(device)
    x = x.reshape(len(x), -1)
    targets = nn.functional.one_hot(y, 10).float()
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    batches = labelled_batches(x, targets, batch_size=64, device=device)

    def loss_fn(model, batch):
        inputs, target = batch
        return FusedMSE.apply(model(inputs), target)

    return {
        "name": "gallery: backward ignores grad_output",
        "description": "Custom Function breaks under loss scaling.",
        "model": model,
        "optimizer": lambda params: torch.optim.SGD(params, lr=0.5),
        "batches": batches,
        "loss_fn": loss_fn,
    }
