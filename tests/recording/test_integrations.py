"""The framework callbacks (mpdiag/integrations/) record the run `mpdiag watch` records of the same script, seed
and settings: the same steps (loss, scale, skipped), the same tensors and, per step and tensor, the same
statistics; and both hold the framework's own numbers (Lightning's tensors handed to its hooks)."""

import json
import os
import runpy
import sys

import pandas as pd
import pytest
from conftest import FIXTURES

from mpdiag.store import Store
from mpdiag.training.watch import WatchConfig, watch

pytestmark = pytest.mark.slow

SCRIPTS = os.fspath(FIXTURES / "scripts")
STATS = ["step", "tensor", "numel", "zeros", "nan", "posinf", "neginf", "absmax", "min_nonzero", "l2",
         "fp16_underflow", "fp16_subnormal", "fp16_overflow", "bf16_underflow", "bf16_subnormal", "bf16_overflow"]


def run_as_main(monkeypatch, script, *args):
    """``python SCRIPT ARGS`` in this process, without mpdiag watch."""
    monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
    runpy.run_path(script, run_name="__main__")


def assert_same_run(store, callback_run, watched_run):
    steps = [store.steps(run)[["step", "loss", "loss_scale", "scale_after", "skipped"]] for run in (callback_run, watched_run)]
    assert len(steps[0]) > 0
    pd.testing.assert_frame_equal(*steps)
    tensors = [store.tensors(run)[["tensor_id", "name", "shape", "numel"]] for run in (callback_run, watched_run)]
    pd.testing.assert_frame_equal(*tensors)
    stats = [store.tensor_stats(run)[STATS].sort_values(["step", "tensor"], ignore_index=True)
             for run in (callback_run, watched_run)]
    assert len(stats[0]) > 0
    pd.testing.assert_frame_equal(*stats)
    assert store.run(callback_run)["status"] == "finished"


@pytest.mark.parametrize("args", [("--precision", "32-true", "--clip", "0.5"),
                                  ("--precision", "bf16-mixed", "--accumulate", "2"),
                                  ("--precision", "cpu-fp16", "--accumulate", "2", "--clip", "0.1"),
                                  ("--manual",), ("--two-optimizers",), ("--precision", "cpu-fp16", "--two-optimizers"),
                                  ("--two-optimizers", "--shared"),
                                  ("--precision", "cpu-fp16", "--two-optimizers", "--shared")],
                         ids=["32-clip", "bf16-accumulate", "16-mixed-scaled", "manual", "two-optimizers",
                              "two-optimizers-scaled", "two-optimizers-shared", "two-optimizers-shared-scaled"])
def test_lightning_callback_records_what_watch_records(store_path, tmp_path, monkeypatch, args):
    script = os.path.join(SCRIPTS, "frameworks", "lightning_trainer.py")
    truth_path = tmp_path / "truth.json"
    run_as_main(monkeypatch, script, truth_path, *args, "--max-steps", 4, "--mpdiag-callback", store_path)
    truth = json.loads(truth_path.read_text())
    watched_run, code = watch(WatchConfig(target=script, args=(str(tmp_path / "watched.json"), *args, "--max-steps", "4")),
                              store_path)
    store = Store(store_path)
    callback_run = int(store.runs()["run_id"].min())
    assert code == 0 and store.run(callback_run)["name"] == "lightning callback"
    assert_same_run(store, callback_run, watched_run)
    assert store.steps(callback_run)["loss"].tolist() == pytest.approx(truth["loss"], rel=1e-6)
    stats = store.tensor_stats(callback_run)
    for step, norms in enumerate(truth["norms"]):  # the stepping optimizer's tensors (None: another's), no other
        rows = stats[stats["step"] == step].set_index("tensor")["l2"]
        held = [name for name, norm in zip(truth["names"], norms, strict=True) if norm is not None]
        assert sorted(rows.index) == sorted(held), step
        assert [rows[name] for name in held] == pytest.approx([n for n in norms if n is not None], rel=1e-6)
    # the per-step global norm and learning rate: Lightning's gradients as its hook saw them (before its clip) and
    # the script's StepLR (1e-2, halved every 2 steps of the first optimizer, whose rate is recorded; with two
    # optimizers it steps at the even steps)
    steps = store.steps(callback_run)
    global_norms = [sum(n**2 for n in norms if n is not None) ** 0.5 for norms in truth["norms"]]
    assert steps["grad_norm"].tolist() == pytest.approx(global_norms, rel=1e-6)
    first_steps = [(step + 1) // 2 if "--two-optimizers" in args else step for step in steps["step"]]
    assert steps["lr"].tolist() == [1e-2 * 0.5 ** (count // 2) for count in first_steps]


def test_lightning_callback_under_watch_stands_aside(store_path, tmp_path):
    script = os.path.join(SCRIPTS, "frameworks", "lightning_trainer.py")
    run_id, code = watch(WatchConfig(target=script, args=(str(tmp_path / "t.json"), "--max-steps", "2",
                                                          "--mpdiag-callback", str(store_path))), store_path)
    assert code == 0 and Store(store_path).runs()["run_id"].tolist() == [run_id]


def test_hugging_face_callback_records_what_watch_records(store_path, tmp_path, monkeypatch):
    """The Trainer clips through Accelerate (max_grad_norm) and accumulates 2 micro-batches: both runs hold the
    gradients before the clip; the Trainer's own logged grad_norm is their global norm."""
    script = os.path.join(SCRIPTS, "hf_trainer.py")
    out = tmp_path / "callback"
    run_as_main(monkeypatch, script, out, "--mpdiag-callback", store_path)
    watched_run, code = watch(WatchConfig(target=script, args=(str(tmp_path / "watched"),)), store_path)
    store = Store(store_path)
    callback_run = int(store.runs()["run_id"].min())
    assert code == 0 and store.run(callback_run)["name"] == "trainer callback"
    assert_same_run(store, callback_run, watched_run)
    logged = [entry["grad_norm"] for entry in json.loads((out / "log_history.json").read_text()) if "grad_norm" in entry]
    stats = store.tensor_stats(callback_run)
    norms = stats.groupby("step")["l2"].apply(lambda l2: float((l2 ** 2).sum() ** 0.5)).tolist()
    assert norms == pytest.approx(logged, rel=1e-5)
    # the per-step global norm (before Accelerate's clip) and learning rate against the Trainer's own log
    log = [entry for entry in json.loads((out / "log_history.json").read_text()) if "grad_norm" in entry]
    steps = store.steps(callback_run)
    assert steps["grad_norm"].tolist() == pytest.approx(logged, rel=1e-5)
    assert steps["lr"].tolist() == [entry["learning_rate"] for entry in log]


def _module_skipping_batches(skip: set[int]):
    """A LightningModule whose ``training_step`` returns None on the batches in ``skip`` (Lightning's documented way
    to skip a batch in automatic optimization); LambdaLR changes the rate at every optimizer step."""
    import pytorch_lightning as pl
    import torch
    from torch import nn

    class SkipsBatches(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            if batch_idx in skip:
                return None
            x, y = batch
            return nn.functional.mse_loss(self.body(x).float(), y)

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda count: 1.0 / (count + 1))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return SkipsBatches()


def _lightning_steps_truth():
    """A callback collecting Lightning's own numbers per optimizer step of its (one per ``on_before_optimizer_step``):
    ``global_step`` then, the optimizer's rate, the loss it handed ``on_before_backward`` since its previous optimizer
    step (unscaled), the global L2 norm of the gradients there (None: no gradient), GradScaler's scale, and whether
    torch's ``optimizer.step`` then ran."""
    import pytorch_lightning as pl
    import torch

    class LightningSteps(pl.Callback):
        def __init__(self):
            self.steps, self._loss = [], 0.0

        def _scale(self, trainer) -> float:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            return 1.0 if scaler is None else float(scaler.get_scale())

        def on_train_start(self, trainer, pl_module):
            trainer.optimizers[0].register_step_post_hook(lambda *_: self.steps[-1].update(stepped=True))

        def on_before_backward(self, trainer, pl_module, loss):
            self._loss += float(loss.detach().double()) / self._scale(trainer)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads = [p.grad.double() for p in pl_module.parameters() if p.grad is not None]
            norm = float(torch.stack([g.norm() for g in grads]).norm()) if grads else None
            self.steps.append({"global_step": trainer.global_step, "lr": optimizer.param_groups[0]["lr"],
                               "loss": self._loss, "grad_norm": norm, "scale": self._scale(trainer), "stepped": False})
            self._loss = 0.0

    return LightningSteps()


@pytest.mark.parametrize("precision, accumulate, skip, max_steps", [
    ("32-true", 1, {3, 7}, 10), ("bf16-mixed", 1, {3, 7}, 10), ("cpu-fp16", 1, {3, 7}, 10),
    ("32-true", 2, {3, 8, 9}, 6), ("cpu-fp16", 2, {3, 8, 9}, 6)],
    ids=["32", "bf16-mixed", "16-mixed-scaled", "32-accumulate", "16-mixed-scaled-accumulate"])
def test_lightning_callback_when_training_step_returns_none(store_path, precision, accumulate, skip, max_steps):
    """A batch whose training_step returns None back-propagates nothing: Lightning counts an optimizer step for it
    in global_step and steps the per-step scheduler after it, but the weights take no gradient from it. The steps
    recorded are Lightning's optimizer steps that applied gradients, each with its own loss, rate, norm and scale,
    none stored as skipped; the note counts the others. Where a None batch ends an accumulation window, Lightning
    steps on the window's earlier micro-batch in FP32 (batch 3: a step, with batch 2's loss), and under its
    GradScaler plugin neither steps nor keeps those gradients (no step, and their loss is no later step's)."""
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.plugins import MixedPrecision
    from torch.utils.data import DataLoader, TensorDataset

    from mpdiag.integrations.lightning import MpdiagCallback

    pl.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(160, 8, generator=generator)
    data = DataLoader(TensorDataset(x, x[:, :1] * 3 + 0.1 * torch.randn(160, 1, generator=generator)), batch_size=8)
    truth = _lightning_steps_truth()
    settings = {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10))]} \
        if precision == "cpu-fp16" else {"precision": precision}
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=accumulate,
                         callbacks=[truth, MpdiagCallback(store=store_path, name="skips")], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **settings)
    trainer.fit(_module_skipping_batches(skip), data)

    assert [step["global_step"] for step in truth.steps] == list(range(max_steps))
    applied = [step for step in truth.steps if step["stepped"] and step["grad_norm"] is not None]
    store = Store(store_path)
    run_id = int(store.runs()["run_id"].max())
    steps = store.steps(run_id)
    assert steps["step"].tolist() == list(range(len(applied)))
    assert len(applied) < max_steps
    assert steps["loss"].tolist() == pytest.approx([step["loss"] for step in applied], rel=1e-6)
    assert steps["lr"].tolist() == [step["lr"] for step in applied]
    assert steps["grad_norm"].tolist() == pytest.approx([step["grad_norm"] for step in applied], rel=1e-6)
    assert steps["loss_scale"].tolist() == [step["scale"] for step in applied]
    assert steps["skipped"].tolist() == [0.0] * len(applied)
    assert store.run(run_id)["note"].startswith(f"{max_steps - len(applied)} of Lightning's optimizer steps "
                                                f"(global_step {max_steps}) back-propagated nothing")


@pytest.mark.parametrize("precision", ["32-true", "cpu-fp16"], ids=["32", "16-mixed-scaled"])
def test_lightning_callback_reads_manual_optimization_gradients_before_its_clip(store_path, precision):
    """Manual optimization clips with ``self.clip_gradients`` inside ``training_step``, before ``opt.step()`` calls
    ``on_before_optimizer_step``: the step's gradients are stored as they were before the clip (the callback stored
    the clipped ones), unscaled (under 16-mixed Lightning clips them still scaled: unscale_ runs in the step). Truth:
    torch's norms of the gradients the module saw before its clip, divided by GradScaler's scale then."""
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.plugins import MixedPrecision
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from mpdiag.integrations.lightning import MpdiagCallback

    class ClipsByHand(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            self.automatic_optimization = False
            self.truth = []  # per step: each parameter's gradient as it was before the clip, unscaled

        def training_step(self, batch, batch_idx):
            x, y = batch
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(nn.functional.mse_loss(self.body(x).float(), y))
            scaler = getattr(self.trainer.precision_plugin, "scaler", None)
            inv = torch.tensor(1.0 if scaler is None else scaler.get_scale(), dtype=torch.float64).reciprocal().float()
            self.truth.append({n: p.grad * inv for n, p in self.named_parameters()})
            self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="norm")
            optimizer.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    pl.seed_everything(0, verbose=False)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    settings = {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10))]} \
        if precision == "cpu-fp16" else {"precision": precision}
    module, callback = ClipsByHand(), MpdiagCallback(store=store_path, name="clips")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **settings)
    trainer.fit(module, DataLoader(TensorDataset(x, 3 * x[:, :1]), batch_size=8))

    store = Store(store_path)
    norms = [float(torch.nn.utils.get_total_norm(list(grads.values()))) for grads in module.truth]
    assert min(norms) > 0.1  # far above the clip: a clipped gradient's norm would be 0.01
    assert store.steps(callback.run_id)["grad_norm"].tolist() == pytest.approx(norms, rel=1e-6)
    stats = store.tensor_stats(callback.run_id)
    for step, grads in enumerate(module.truth):
        l2 = stats[stats["step"] == step].set_index("tensor")["l2"].to_dict()
        assert l2 == pytest.approx({n: float(g.double().norm()) for n, g in grads.items()}, rel=1e-6)
    assert "clip_gradients" not in vars(trainer.precision_plugin)  # Lightning's own method again after the fit
