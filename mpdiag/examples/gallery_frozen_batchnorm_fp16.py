"""Gallery: BatchNorm statistics that break in pure FP16 (O3) but not with BatchNorm kept in FP32 (O2).

Fine-tuning with frozen BatchNorm (eval-mode BatchNorm using its running statistics, as detection models
do) on 12-bit images that were never normalised (values 0-4095): the first convolution's output variance is
about 10^7, and that is what the BatchNorm's running_var holds. Pure FP16 stores running_var in FP16, where
10^7 is inf, so the layer outputs zeros, the network sees nothing, and the first convolution's gradients
are exactly zero. O2 keeps BatchNorm (parameters and statistics) in FP32 and trains normally.

Failing: ``--opt-level O3``. Fixed: ``--opt-level O2``.
What you should see: with O3 the loss stays at about ln(10) = 2.30 and the Gradients page shows every value
of the first convolution's gradient as an exact zero; with O2 the loss falls and the gradients are alive.
"""

import torch
from torch import nn

from mpdiag.examples.data import digits, labelled_batches

FAILING = {"opt_level": "O3"}
FIXED = {"opt_level": "O2"}
FINDING = "dead-gradients"  # what `python -m mpdiag diagnose` reports for a FAILING run


class FrozenBNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.head = nn.Sequential(nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 4 * 4, 10))

    def forward(self, x):
        self.bn.eval()  # frozen BatchNorm: normalise with the running statistics
        return self.head(self.bn(self.conv(x)))


def build(device):
    x, y, _, _ = digits(device)
    x = (x * 4095).unsqueeze(1)  # 12-bit sensor values, not normalised
    model = FrozenBNNet().to(device)
    with torch.no_grad():  # the "pretrained" statistics: one pass in train mode, in FP32
        model.bn.train()
        model.bn.momentum = 1.0
        model.bn(model.conv(x[:512]))
        model.bn.momentum = 0.1
    batches = labelled_batches(x, y, batch_size=64, device=device)

    def loss_fn(model, batch):
        images, labels = batch
        return nn.functional.cross_entropy(model(images).float(), labels)

    return {
        "name": "gallery: frozen BatchNorm in FP16",
        "description": "running_var above 65504 becomes inf in pure FP16.",
        "model": model,
        "optimizer": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
        "batches": batches,
        "loss_fn": loss_fn,
    }
