"""The bundled transformer trained by a plain AMP loop that knows nothing of mpdiag: what `mpdiag run` does at
O1 (autocast FP16, GradScaler, AdamW from the example), written as a user's script, for watch_overhead.py.
Prints its own median step time (steps after the first) as JSON on the last line.

    python bench/transformer_loop.py STEPS DEVICE
"""

import json
import statistics
import sys
import time

import torch

from mpdiag.examples.transformer_lm import build

steps, device = int(sys.argv[1]), torch.device(sys.argv[2])
torch.manual_seed(0)
spec = build(device)
model = spec["model"].to(device)
optimizer = spec["optimizer"](model.parameters())
scaler = torch.amp.GradScaler(device.type)
times = []
for step in range(steps):
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.float16):
        loss = spec["loss_fn"](model, spec["batches"](step))
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
print(json.dumps({"median_step_s": statistics.median(times[1:])}))
