"""FP8: an activation amax jump that delayed scaling does not see coming.

An MLP on the digits whose hidden activations are multiplied by a gain before the last Linear, and the logits
divided by it again: the gain is 1 until step JUMP, then 256 (a schedule switching on, a unit change). In
BF16 and FP32 this changes nothing: multiplying by 256 and dividing again are exact. Under FP8 with delayed
scaling, the last Linear's input scale at step JUMP comes from the amax of earlier steps, 256 times too
small, so its input saturates at 448: nearly every activation is clipped to the same value, the logits lose
the input and the loss jumps to about ln 10 for that step (the history holds the new amax from the next step
on). Current scaling takes the new amax at once and, the gain being a power of two, computes exactly what it
would have computed without the gain.

Failing: ``--opt-level fp8-sim --fp8-recipe delayed``. Fixed: ``--fp8-recipe current`` (or a margin of 8).
What you should see: recorded with ``--fp8``, the last Linear's input overflows E4M3 under delayed scaling at
step JUMP, an amax jump of about 256; the fp8-sim loss with delayed scaling spikes there, BF16's does not.
"""

import torch
from torch import nn

from mpdiag.examples.data import digits, labelled_batches

JUMP = 40
GAIN = 256.0

FAILING = {"opt_level": "fp8-sim", "fp8_recipe": "delayed"}
FIXED = {"opt_level": "fp8-sim", "fp8_recipe": "current"}


class GainedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(64, 128)
        self.head = nn.Linear(128, 10, bias=False)  # no bias: head(g * h) / g == head(h) exactly

    def forward(self, x, gain):
        return self.head(torch.relu(self.hidden(x.flatten(1))) * gain) / gain


def build(device):
    x, y, _, _ = digits(device)
    batch_of = labelled_batches(x, y, batch_size=64, device=device)

    def batches(step):
        inputs, labels = batch_of(step)
        return inputs, labels, torch.tensor(GAIN if step >= JUMP else 1.0, device=device)

    def loss_fn(model, batch):
        inputs, labels, gain = batch
        return nn.functional.cross_entropy(model(inputs, gain).float(), labels)

    return {
        "name": "FP8: activation amax jump",
        "description": "A gain of 256 switches on at step 40 before the last Linear; exact in BF16.",
        "model": GainedMLP(),
        "optimizer": lambda params: torch.optim.Adam(params, lr=1e-3),
        "batches": batches,
        "loss_fn": loss_fn,
    }
