"""A Lightning ``Trainer`` run as users write one (tests/test_watch_frameworks.py runs it unmodified under watch).

Usage: lightning_trainer.py TRUTH_JSON [--precision P] [--accumulate N] [--clip V] [--manual] [--max-steps N]
                            [--mpdiag-callback STORE]
``--precision 16-mixed`` falls back to bf16-mixed on the CPU (Lightning's own choice); ``--precision cpu-fp16`` is
Lightning's 16-mixed plugin given a CPU GradScaler (init scale 2^10), so the scaled path runs on the CPU too.
Automatic optimization by default (Lightning runs ``optimizer.step(closure)``), AdamW with two parameter groups and a
per-step scheduler. The truth is Lightning's own: the loss it hands ``on_before_backward`` (divided by the loss
scale under 16-mixed, where it is the scaled loss), summed per optimizer step, and the gradients it hands
``on_before_optimizer_step`` (unscaled, before clipping), written as per-parameter L2 norms.
"""

import argparse
import json

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningModule):
    def __init__(self, manual: bool):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.automatic_optimization = not manual
        self.truth = {"loss": [], "norms": [], "names": [n for n, _ in self.named_parameters()]}
        self._loss = 0.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.body(x).float(), y)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.lr_schedulers().step()
        return None

    def on_before_backward(self, loss):
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        self._loss += float(loss.detach().double() / (scaler.get_scale() if scaler is not None else 1.0))

    def on_before_optimizer_step(self, optimizer):
        self.truth["loss"].append(self._loss)
        self.truth["norms"].append([float(p.grad.double().norm()) if p.grad is not None else None
                                    for p in self.parameters()])
        self._loss = 0.0

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                      lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("truth")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--manual", action="store_true")
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--mpdiag-callback", metavar="STORE", help="record with mpdiag's Lightning callback")
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=generator)
    data = DataLoader(TensorDataset(x, x[:, :1] * 3 + 0.1 * torch.randn(96, 1, generator=generator)), batch_size=8)
    model = Regression(args.manual)
    callbacks = []
    if args.mpdiag_callback:
        from mpdiag.integrations.lightning import MpdiagCallback

        callbacks.append(MpdiagCallback(store=args.mpdiag_callback, name="lightning callback"))
    precision = {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10))]} \
        if args.precision == "cpu-fp16" else {"precision": args.precision}
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.max_steps, callbacks=callbacks, **precision,
                         accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data)
    with open(args.truth, "w") as f:
        json.dump(model.truth, f)


if __name__ == "__main__":
    main()
