"""Accelerate's documented accumulation loop, clipping guarded by ``sync_gradients`` or on every micro-batch.

Usage: accelerate_loop.py TRUTH_JSON [--mixed-precision no|bf16] [--accumulate N] [--clip guarded|every|none]
Accelerate skips the optimizer step on micro-batches that do not sync, so an unguarded clip runs on each of
them. The truth is the loop's own: per optimizer step, the sum of the losses it back-propagated (each divided by
N, as Accelerate's ``backward`` does) and the gradients in ``.grad`` just before the clip that precedes the step.
"""

import argparse
import json

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("truth")
    parser.add_argument("--mixed-precision", default="no")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--clip", default="every")
    args = parser.parse_args()
    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.accumulate,
                              cpu=True)
    model = nn.Sequential(nn.Linear(5, 10), nn.ReLU(), nn.Linear(10, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(48, 5)
    data = DataLoader(TensorDataset(x, x[:, :1] - x[:, 1:2]), batch_size=4)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    truth = {"loss": [], "norms": [], "names": [n for n, _ in model.named_parameters()]}
    window_loss = 0.0
    for inputs, targets in data:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(inputs).float(), targets)
            accelerator.backward(loss)
            window_loss += loss.item() / args.accumulate
            if accelerator.sync_gradients:
                truth["loss"].append(window_loss)
                truth["norms"].append([p.grad.double().norm().item() for p in model.parameters()])
                window_loss = 0.0
            if args.clip == "every" or (args.clip == "guarded" and accelerator.sync_gradients):
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    with open(args.truth, "w") as f:
        json.dump(truth, f)


if __name__ == "__main__":
    main()
