"""``optimizer.step(closure)``: SGD, or LBFGS (several evaluations per step, optionally a strong-Wolfe line search).

Usage: closure_loop.py TRUTH_JSON [--optimizer sgd|lbfgs] [--max-iter N] [--line-search] [--steps N]
The truth is the loop's own: per step, the loss of the closure's first evaluation (what ``step`` returns for
LBFGS, and the loss at the weights the step starts from) and the gradients that evaluation left, as L2 norms.
"""

import argparse
import json

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("truth")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--max-iter", type=int, default=1)
    parser.add_argument("--line-search", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=args.max_iter,
                                      line_search_fn="strong_wolfe" if args.line_search else None)
    x = torch.randn(64, 6)
    y = x.sum(dim=1, keepdim=True).sin()
    truth = {"loss": [], "norms": [], "returned": [], "names": [n for n, _ in model.named_parameters()]}
    for _ in range(args.steps):

        def closure(evaluations=[]):  # noqa: B006 - a new list per step: it counts this step's evaluations
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if not evaluations:
                truth["loss"].append(loss.item())
                truth["norms"].append([p.grad.double().norm().item() for p in model.parameters()])
            evaluations.append(loss.item())
            return loss

        truth["returned"].append(float(optimizer.step(closure)))
    with open(args.truth, "w") as f:
        json.dump(truth, f)


if __name__ == "__main__":
    main()
