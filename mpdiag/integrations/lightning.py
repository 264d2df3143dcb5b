"""``Trainer(callbacks=[MpdiagCallback()])``: a Lightning fit recorded as one mpdiag run, over the Recorder.

Owns the mapping from Lightning's hooks to the Recorder's contract: the run starts when training starts (the
LightningModule's parameters, Lightning's optimizers and its precision plugin's GradScaler, if any); the loss of a
step is the sum of the values Lightning hands ``on_before_backward`` since the previous step (divided by the loss
scale under ``16-mixed``, where Lightning hands the scaled loss; with ``accumulate_grad_batches`` k, each is the
micro-batch loss / k, so the sum is their mean); the gradients are read at ``on_before_optimizer_step``, which
Lightning calls once they are final for the step, unscaled and before it clips them; in manual optimization, which
clips (``self.clip_gradients``) inside ``training_step`` before the step calls that hook, at the first clip after a
backward instead (as ``mpdiag watch`` reads them; a later backward reads them again). Optimizer steps after the same
backward passes are one step, as in ``mpdiag watch``. The run ends at ``on_train_end`` (finished) or
``on_exception`` (failed, with the traceback).

A batch whose ``training_step`` returns None (automatic optimization) back-propagates nothing, so it is no step
(its row would hold no loss and no gradient), though Lightning counts it in ``global_step`` and steps an
``interval="step"`` scheduler after it; the run's note says how many there were. Where it ends an accumulation
window, Lightning's optimizer step depends on the precision plugin: without a GradScaler it steps on the window's
earlier micro-batches, recorded as the step; with one it neither unscales nor steps, and the next window's
``zero_grad`` discards those gradients, so no step is recorded (not a skipped one: GradScaler skipped nothing) and
their loss is no later step's.
"""

from __future__ import annotations

import os
import traceback

import pytorch_lightning as pl
import torch

from mpdiag.numerics.fp8_recipes import Fp8Settings
from mpdiag.options import OPTIONS
from mpdiag.recording.recorder import Recorder, torch_optimizer
from mpdiag.training.watch import WatchSession


class MpdiagCallback(pl.Callback):
    """Records the fit into ``store`` (default ``MPDIAG_STORE`` or ``mpdiag_runs.db``) as run ``name`` (default:
    the LightningModule's class name); ``every``, ``trace_modules`` and ``fp8`` as the Recorder takes them."""

    def __init__(self, store: str | os.PathLike | None = None, name: str | None = None,
                 every: int | None = OPTIONS["every"].default, *,
                 trace_modules: bool = OPTIONS["trace_modules"].default,
                 fp8: Fp8Settings | None = None):
        self.store, self.name, self.every, self.trace_modules, self.fp8 = store, name, every, trace_modules, fp8
        self.recorder: Recorder | None = None
        self._loss: torch.Tensor | None = None  # the unscaled loss back-propagated since the previous step
        self._backward_in_batch = False  # False at the optimizer step: this batch's training_step returned None
        self._steps_without_backward = 0  # Lightning's optimizer steps (in global_step) that record no step here
        self._read = None  # manual optimization: the step's gradients as read before its clip (GradientRead)
        self._clipping = None  # manual optimization: the precision plugin whose clip_gradients reads them first

    @property
    def run_id(self) -> int | None:
        return None if self.recorder is None else self.recorder.run_id

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if WatchSession.active is not None:
            return  # `mpdiag watch` records this script already
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        settings = {"precision": str(trainer.precision), "accumulate_grad_batches": trainer.accumulate_grad_batches,
                    "gradient_clip_val": trainer.gradient_clip_val, "max_steps": trainer.max_steps}
        self.recorder = Recorder(pl_module, store=self.store, name=self.name or type(pl_module).__name__,
                                 scaler=scaler, optimizer=list(trainer.optimizers), every=self.every,
                                 config={"lightning": settings}, trace_modules=self.trace_modules, fp8=self.fp8)
        if not pl_module.automatic_optimization:
            self._read_before_clips(trainer.precision_plugin)

    def _read_before_clips(self, plugin) -> None:
        """Wrap ``plugin.clip_gradients`` (``LightningModule.clip_gradients`` calls it) on the instance, until the
        fit ends, to read the step's gradients before the first clip after a backward: read at the step's
        ``on_before_optimizer_step``, they were the clipped ones."""
        clip = plugin.clip_gradients

        def clip_gradients(*args, **kwargs):
            if self._loss is not None and self._read is None:
                self._read = self.recorder.read_gradients()
            return clip(*args, **kwargs)

        plugin.clip_gradients, self._clipping = clip_gradients, plugin

    def _restore_clips(self) -> None:
        if self._clipping is not None:
            del self._clipping.clip_gradients  # the instance's: the class's own method is the plugin's again
            self._clipping = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        self._backward_in_batch = False

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.recorder is None:
            return
        self._backward_in_batch = True
        self._read = None  # gradients read before a clip are not the step's once another backward adds to them
        value = loss.detach().reshape(()).double()
        scaler = self.recorder.scaler
        if scaler is not None:  # Lightning scaled it before the hook; the scale is a power of 2: exact
            value = value / scaler._get_scale_async().double().reshape(())
        self._loss = value if self._loss is None else self._loss + value

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if self.recorder is None:
            return
        if pl_module.automatic_optimization and not self._backward_in_batch:  # training_step returned None
            if self.recorder.scaler is not None:
                # Lightning's GradScaler plugin then calls neither unscale_ nor scaler.step, and the next window's
                # zero_grad drops the gradients of its earlier micro-batches, with their loss
                self._loss = None
            if self._loss is None:
                self._steps_without_backward += 1
                return
        if self._loss is not None:  # else no backward since the step recorded last: another optimizer of that step
            self.recorder.record(self._loss, gradients=self._read)
            self._loss = self._read = None
        # Lightning calls this hook from inside ``optimizer.step(closure)``, after the optimizer's own step
        # pre-hook (and GradScaler's unscale_): in automatic optimization, whose closure runs the backward after
        # that hook, they counted it for the step recorded before; it steps in this one
        self.recorder.asked_to_step(torch_optimizer(optimizer))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_clips()
        if self.recorder is None:
            return
        note = None
        if self._steps_without_backward:  # the step numbers then run behind global_step: the run says why
            note = (f"{self._steps_without_backward} of Lightning's optimizer steps (global_step {trainer.global_step}) "
                    "back-propagated nothing: their training_step returned None, so no step was recorded for them "
                    "and each step here is Lightning's global_step less the number of those before it.")
        self.recorder.close(note=note)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_clips()
        if self.recorder is not None:
            self.recorder.fail("".join(traceback.format_exception(exception)))
