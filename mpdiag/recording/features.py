"""The Recorder's optional parts as features behind one small protocol, and the two that wrap numerics code.

The Recorder's core reads a step's gradients and the scaler's state, builds the step rows, keeps what retention
keeps and flushes it to the background writer. Everything a run may add to that - the module trace
(:class:`mpdiag.recording.tracing.ModuleTraceFeature`), the FP8 capture
(:class:`mpdiag.recording.fp8_capture.Fp8Feature`), the update counts (:class:`UpdateCounts`), the optimizer-step
check (:class:`mpdiag.recording.nonfinite_step.OptimizerStepCheck`), the non-finite and loss-spike replay
(:class:`mpdiag.recording.replay.ReplayFeature`) and the FP32 shadow comparison (:class:`ShadowComparison`) - is a
:class:`RecorderFeature`: one class per part, the same hooks for all, each a no-op unless the part needs it. The
Recorder builds the list of enabled features once, after its writer exists (a store that cannot be opened leaves
no hook behind), and calls each hook on every feature in that list's order.

The call order, per recorded step (one step: from one ``record`` to the next)::

    at_record(step)                 in Recorder.record, after the step's gradients were read and before the
                                    optimizer step: the weights and the .grad are the ones the step used
    before_optimizer_step(opt)      in each optimizer step pre-hook of that step (none when GradScaler skips a
                                    non-fused optimizer's step)
    after_optimizer_step(opt)       in each optimizer step post-hook (not under the Recorder's lock, which a
                                    timer flush may hold: what it leaves for drain, it only appends); also
                                    when GradScaler had a fused optimizer skip inside its step
                                    (:func:`found_inf_of` is then not None)
    drain(wait)                     at every flush (the training thread's, or the writer thread's timer): the
                                    writer jobs for the rows that have reached the host; ``wait``: the run is
                                    ending, wait for all of them
    remove()                        once, when the run ends or recording stops: take every hook out

``drain`` may also be called between ``at_record`` and the optimizer hooks (a timer flush) and after ``remove``
(the flush that ends the run). A feature never writes to the store itself: it returns jobs, each a function of the
writer (a :class:`mpdiag.store.StoreWriter`), which the Recorder submits in order after the step rows of the same
flush; what the Recorder must know at once (the optimizer-step check's finding, a replay's result) a feature hands
to the callback it was built with. Owns that protocol, :class:`RecordedStep` and the update-count and
shadow-comparison features; must not know the Recorder (a feature is given what it needs when built).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mpdiag.numerics.updates import UpdateTracker

#: a write the Recorder submits to its background writer: called there with the store writer
WriterJob = Callable[[Any], None]


def found_inf_of(optimizer) -> torch.Tensor | None:
    """The ``found_inf`` GradScaler handed ``optimizer`` for the step running now, or None. An optimizer with
    ``_step_supports_amp_scaling`` (torch's ``fused=True`` Adam, AdamW, SGD, Adagrad) is stepped by
    ``GradScaler.step`` even when the gradients overflowed: the scaler sets ``found_inf`` and ``grad_scale`` on it
    for the length of its ``step``, and the fused kernel leaves the weights and state unchanged where ``found_inf``
    is non-zero. So its step hooks fire on a skipped step too: read as applied, a skipped step was stored as run
    (and its overflowed gradients raised a false ``nonfinite`` event)."""
    found_inf = getattr(optimizer, "found_inf", None)
    return found_inf if torch.is_tensor(found_inf) else None


@dataclass(frozen=True)
class RecordedStep:
    """What ``at_record`` is told of the step being recorded.

    step: its index; loss: the unscaled loss as ``record`` was given it; scale: the loss scale the gradients were
    computed at (GradScaler's scale tensor on a GPU, else a float; 1.0 without a scaler); scaled: a loss scaler is
    in use; norm: the global gradient norm, unscaled, as a 0-dim device tensor (None where this process reads no
    statistics); at_multiple: a regular step (a multiple of ``every``, or one of the default's first 1,000 steps:
    Retention.regular); logged: at a regular step and its statistics were
    started (the steps where the update counts and the optimizer-step check run)."""

    step: int
    loss: torch.Tensor | float
    scale: float | torch.Tensor
    scaled: bool
    norm: torch.Tensor | None
    at_multiple: bool
    logged: bool


class RecorderFeature:
    """One optional part of the Recorder; every hook does nothing unless overridden (the call order is in the
    module's docstring)."""

    def at_record(self, step: RecordedStep) -> None:
        """The step is recorded (before its optimizer step)."""

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` is about to step over the model's parameters."""

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` has stepped."""

    def drain(self, wait: bool) -> list[WriterJob]:
        """The writer jobs for what has reached the host since the last drain; ``wait``: all of it."""
        return []

    def remove(self) -> None:
        """The run ended: take every hook out."""


class UpdateCounts(RecorderFeature):
    """``update_format``: at every logged step, the optimizer updates below that format's resolution, counted by
    :class:`mpdiag.numerics.updates.UpdateTracker` around the step (``Store.updates``)."""

    def __init__(self, tracker: UpdateTracker, run_id: int):
        self._tracker, self._run_id = tracker, run_id
        self._step: int | None = None  # the logged step whose optimizer update is tracked next
        self._rows: list[tuple] = []

    def at_record(self, step: RecordedStep) -> None:
        self._step = step.step if step.logged else None
        self._take(wait=False)

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._step is not None:
            self._tracker.before(self._step)
            self._step = None

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._tracker.after(found_inf_of(optimizer))

    def _take(self, wait: bool) -> None:
        self._rows += [(step, i, *counts) for step, per_tensor in self._tracker.take(wait)
                       for i, counts in enumerate(per_tensor)]

    def drain(self, wait: bool) -> list[WriterJob]:
        self._take(wait)
        rows, self._rows = self._rows, []
        return [lambda w: w.add_update_steps(self._run_id, rows)] if rows else []


class ShadowComparison(RecorderFeature):
    """The FP32 shadow comparison (``Recorder.compare_gradients``): per tensor, how far a step's gradients are from
    FP32 reference gradients of the same weights and batch (``Store.shadow``). Always on: a caller decides when
    to compare (the runner's ``--shadow-every``, ``watch``'s shadow)."""

    def __init__(self, params: Sequence[tuple[int, torch.Tensor]], run_id: int):
        """``params``: (tensor id, parameter) of the parameters trainable when recording started, the ones a
        reference's gradients are given for, in order."""
        self._params, self._run_id = list(params), run_id
        self._rows: list[tuple] = []

    def rows(self, reference: Sequence[torch.Tensor | None], step: int, unscale_by: float | torch.Tensor) -> list[tuple]:
        """(step, tensor, relative error, cosine, reference norm) per tensor with both gradients, in float64, of
        the gradients in ``.grad`` now divided by ``unscale_by``; a non-finite value is None."""
        if len(reference) != len(self._params):
            raise ValueError(f"reference has {len(reference)} gradients; the model has {len(self._params)} trainable parameters")
        present, stats = [], []
        for (i, p), ref in zip(self._params, reference, strict=True):
            if p.grad is None or ref is None:
                continue
            g, r = p.grad.detach().double() / unscale_by, ref.detach().double()
            ref_norm = torch.linalg.vector_norm(r)
            stats.append(torch.stack([torch.linalg.vector_norm(g - r) / ref_norm,
                                      (g * r).sum() / (torch.linalg.vector_norm(g) * ref_norm), ref_norm]))
            present.append(i)
        if not present:
            return []
        values = torch.stack(stats).tolist()
        return [(step, i, *(v if math.isfinite(v) else None for v in vals))
                for i, vals in zip(present, values, strict=True)]

    def add(self, rows: list[tuple]) -> None:
        self._rows += rows

    def drain(self, wait: bool) -> list[WriterJob]:
        rows, self._rows = self._rows, []
        return [lambda w: w.add_shadow_steps(self._run_id, rows)] if rows else []
