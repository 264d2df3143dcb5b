"""MLP on scikit-learn's handwritten digits (8x8 images, 10 classes).

A healthy model: loss falls from about 2.3 to below 0.3 within 200 steps in FP32, and O1 / bf16 track it.
Its weight gradients sit well inside FP16's normal range at the default loss scale, so the Gradients page
shows almost no FP16 underflow once the loss is scaled.
"""

import torch
from torch import nn

from mpdiag.examples.data import digits, labelled_batches


def build(device):
    x, y, _, _ = digits(device)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )
    batches = labelled_batches(x, y, batch_size=64, device=device)

    def loss_fn(model, batch):
        inputs, labels = batch
        return nn.functional.cross_entropy(model(inputs), labels)

    return {
        "name": "MLP on digits",
        "description": "3-layer MLP, Adam, scikit-learn digits (1,500 training images).",
        "model": model,
        "optimizer": lambda params: torch.optim.Adam(params, lr=1e-3),
        "batches": batches,
        "loss_fn": loss_fn,
    }
