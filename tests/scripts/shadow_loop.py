"""An FP16 autocast loop with GradScaler, dropout and two micro-batches per step that computes, itself, what
`mpdiag watch --shadow-every` must store: at every step, each parameter's relative error and cosine between
its unscaled mixed-precision gradient and an FP32 gradient of the same weights, batch and dropout draws. It
knows nothing of mpdiag: its FP32 reference is a deep copy of the model run without autocast, seeded with
the generator state saved before each mixed forward.

--loss inside: the model returns the loss (nanoGPT's `model(X, Y)`); the reference is the whole step in FP32.
--loss outside: the loop computes cross-entropy from the logits; the reference back-propagates, through the
FP32 model, the gradient the logits received in the mixed step divided by the scale (what watch documents).
--autocast-decorator: no `with` region; the forward is wrapped in one autocast object (made before watch's
replay could change it), as Accelerate does.
Writes {"rel_error": [[per parameter] per step], "cosine": ..., "names": [...]} to argv[1]."""

import argparse
import contextlib
import copy
import json
import types

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--loss", choices=["inside", "outside"], default="inside")
# autocast as Accelerate sets it: the model's forward wrapped in one autocast object, made once
parser.add_argument("--autocast-decorator", action="store_true")
args = parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 3))

    def forward(self, x, y=None):
        logits = self.body(x)
        if y is None:
            return logits
        return logits, nn.functional.cross_entropy(logits.float(), y)


torch.manual_seed(0)
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
names = [n for n, _ in model.named_parameters()]
if args.autocast_decorator:
    model.forward = types.MethodType(torch.autocast("cpu", dtype=torch.float16)(Net.forward), model)
mixed = contextlib.nullcontext if args.autocast_decorator else lambda: torch.autocast("cpu", dtype=torch.float16)
log = {"names": names, "rel_error": [], "cosine": []}
for _ in range(args.steps):
    fp32 = copy.deepcopy(model).float()  # the step's weights; its .grad accumulates both micro-batches in FP32
    fp32.zero_grad(set_to_none=True)
    for _micro in range(2):
        x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
        rng = torch.get_rng_state()
        with mixed():
            if args.loss == "inside":
                loss = model(x, y)[1] / 2
            else:
                logits = model(x)
                logits.retain_grad()
                loss = nn.functional.cross_entropy(logits, y) / 2
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(rng)
            # Net.forward itself: the copy's own forward attribute would autocast (Accelerate's wrapping)
            if args.loss == "inside":
                (Net.forward(fp32, x, y)[1] / 2).backward()
            else:
                Net.forward(fp32, x).backward(logits.grad.float() / scale)
    reference = [p.grad.double() for p in fp32.parameters()]
    rel, cos = [], []
    for p, r in zip(model.parameters(), reference, strict=True):
        g = p.grad.double() / scale
        rel.append(float((g - r).norm() / r.norm()))
        cos.append(float((g * r).sum() / (g.norm() * r.norm())))
    log["rel_error"].append(rel)
    log["cosine"].append(cos)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
json.dump(log, open(args.out, "w"))
