"""A plain torch.amp training loop, written as people write them: autocast, GradScaler, gradient accumulation,
unscale_ then clip_grad_norm_, an LR scheduler. It knows nothing of mpdiag. Besides training, it writes what
it computed itself (the unscaled gradient norm clip_grad_norm_ returned, the scaler's own trajectory, the
accumulated loss) as JSON to the path in argv[1], for the tests to compare with what watch stored."""

import argparse
import json

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--accumulate", type=int, default=2)
parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
parser.add_argument("--init-scale", type=float, default=2.0**16)
parser.add_argument("--fail-at", type=int, default=-1)
parser.add_argument("--exit-at", type=int, default=-1)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
use_amp = args.dtype != "float32"
scaler = torch.amp.GradScaler("cpu", init_scale=args.init_scale, enabled=args.dtype == "float16")
log = {"grad_norm": [], "scale": [], "scale_after": [], "tracker_after": [], "loss": [], "lr": []}

for step in range(args.steps):
    if step == args.fail_at:
        raise RuntimeError(f"the loop broke at step {step}")
    if step == args.exit_at:
        json.dump(log, open(args.out, "w"))
        raise SystemExit(3)
    total = 0.0
    for _ in range(args.accumulate):
        x = torch.randn(4, 8)
        y = torch.randint(0, 3, (4,))
        with torch.autocast("cpu", dtype=getattr(torch, args.dtype), enabled=use_amp):
            # at step 2 the scaled gradients overflow FP16: GradScaler skips that step
            loss = nn.functional.cross_entropy(model(x), y) * (1e6 if step == 2 else 1.0) / args.accumulate
        total += loss.item()
        scaler.scale(loss).backward()
    log["scale"].append(scaler.get_scale() if scaler.is_enabled() else 1.0)
    scaler.unscale_(optimizer)
    log["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    log["loss"].append(total)
    log["lr"].append(scheduler.get_last_lr()[0])
    log["scale_after"].append(scaler.get_scale() if scaler.is_enabled() else 1.0)
    log["tracker_after"].append(scaler.state_dict().get("_growth_tracker", 0) if scaler.is_enabled() else None)

json.dump(log, open(args.out, "w"))
print("done", len(log["loss"]), "steps")
