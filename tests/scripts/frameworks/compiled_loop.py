"""A ``torch.compile``d model in a plain loop (the optimizer built on the original model's parameters).

Usage: compiled_loop.py TRUTH_JSON [--backend inductor|eager] [--steps N]
The truth is the loop's own: the loss and per-parameter gradient L2 norms before each step, by the original
model's parameter names.
"""

import argparse
import json

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("truth")
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend=args.backend)
    truth = {"loss": [], "norms": [], "names": [n for n, _ in model.named_parameters()]}
    for _ in range(args.steps):
        x = torch.randn(16, 4)
        loss = compiled(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        truth["loss"].append(loss.item())
        truth["norms"].append([p.grad.double().norm().item() for p in model.parameters()])
        optimizer.step()
    with open(args.truth, "w") as f:
        json.dump(truth, f)


if __name__ == "__main__":
    main()
