"""timm's training loop (train.py's train_one_epoch, condensed): autocast FP16 on the CPU, timm's NativeScaler
(GradScaler inside; it unscales, clips with dispatch_clip_grad, steps and updates), accumulation by ``need_update``,
the loss divided by the accumulation count, timm's CosineLRScheduler stepped per update with warmup.

Usage: timm_loop.py TRUTH_JSON [--accumulate N] [--clip-mode norm|value] [--clip X]
The modules used are timm 1.0.31's own (tests/real_code/timm). The truth is the loop's own: per optimizer step,
the sum of the (divided) losses it back-propagated, the gradients in ``.grad`` at the clip (timm calls it after
unscaling) or, without a clip, as GradScaler.step unscaled them for the optimizer, the learning rate the step used and
the scale it ran at, and whether GradScaler skipped it (the scale fell).
"""

import argparse
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "real_code", "timm"))
from timm.scheduler import CosineLRScheduler  # noqa: E402
from timm.utils import NativeScaler  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("truth")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip-mode", default="norm")
    parser.add_argument("--clip", type=float, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    updates_per_epoch, epochs = 6, 2
    scheduler = CosineLRScheduler(optimizer, t_initial=updates_per_epoch * epochs, warmup_t=3, warmup_lr_init=1e-4,
                                  t_in_epochs=False)
    loss_scaler = NativeScaler(device="cpu")
    amp_autocast = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731 - as train.py's partial
    x = torch.randn(updates_per_epoch * args.accumulate * 4, 8)
    y = torch.stack([x[:, :2].sum(1), x[:, 2] * x[:, 3], x[:, 4].abs(), x[:, 5] - x[:, 6]], dim=1)

    truth = {"loss": [], "norms": [], "lr": [], "scale": [], "skipped": [], "names": [n for n, _ in model.named_parameters()]}
    grads_at_clip = []
    real_clip = {"norm": torch.nn.utils.clip_grad_norm_, "value": torch.nn.utils.clip_grad_value_}[args.clip_mode]

    def clip_and_remember(parameters, *a, **kw):  # the truth: .grad as timm's dispatch_clip_grad receives it
        parameters = list(parameters)
        grads_at_clip.append([p.grad.double().norm().item() for p in parameters])
        return real_clip(parameters, *a, **kw)

    setattr(torch.nn.utils, {"norm": "clip_grad_norm_", "value": "clip_grad_value_"}[args.clip_mode], clip_and_remember)

    num_updates, window_loss = 0, 0.0
    for epoch in range(epochs):
        for batch_idx in range(updates_per_epoch * args.accumulate):
            inputs, target = x[batch_idx * 4:(batch_idx + 1) * 4], y[batch_idx * 4:(batch_idx + 1) * 4]
            need_update = (batch_idx + 1) % args.accumulate == 0
            with amp_autocast():
                output = model(inputs)
                loss = nn.functional.mse_loss(output.float(), target)
            if args.accumulate > 1:
                loss /= args.accumulate
            window_loss += loss.item()
            scale = loss_scaler._scaler.get_scale()
            if need_update:
                truth["lr"].append(optimizer.param_groups[0]["lr"])
                truth["scale"].append(scale)
            loss_scaler(loss, optimizer, clip_grad=args.clip, clip_mode=args.clip_mode,
                        parameters=model.parameters(), need_update=need_update)
            if need_update:
                if args.clip is None:  # GradScaler.step unscaled .grad in place: what the optimizer received
                    grads_at_clip.append([p.grad.double().norm().item() for p in model.parameters()])
                truth["loss"].append(window_loss)
                truth["norms"].append(grads_at_clip[-1])
                truth["skipped"].append(loss_scaler._scaler.get_scale() < scale)
                window_loss = 0.0
                optimizer.zero_grad()
                num_updates += 1
                scheduler.step_update(num_updates=num_updates)
        scheduler.step(epoch + 1)
    with open(args.truth, "w") as f:
        json.dump(truth, f)


if __name__ == "__main__":
    main()
