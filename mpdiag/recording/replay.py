"""Replay to localise: the step that turned non-finite, or whose loss spiked, run again on a copy of the model with
a hook on every module.

This module owns :class:`StepReplay`: what the Recorder keeps of every training forward so a step can be replayed
(the kept references, the random state, the autocast state, the output's gradient), the rule that decides when a
step is replayed (:meth:`StepReplay.triggered`), the replay itself and the rules naming its first offender
(:class:`ReplayResult`), the Recorder feature behind ``replay`` (:class:`ReplayFeature`: asks at every ``record``,
gives the replay up for the run when asking fails, hands each result to the writer), and how ``watch`` keeps its
hooks out of the script's pickles and copies (:func:`reduce_ex_without_replay_hooks`). Must not write to the store
itself (the Recorder submits its feature's writer jobs) nor change the user's training in any way.

**What is kept, at every training forward** (a forward of the model's root module with gradients enabled; a
forward under ``no_grad`` - an evaluation - keeps nothing and leaves the kept one alone): a *reference* to the
positional and keyword arguments of the step's last forward call (not a copy: no memory and no time beyond
holding the batch a little longer, until the step's ``record``), the CPU random state (and every CUDA device's,
once CUDA is initialised) at the start of that forward, the autocast state (device types, dtype), and, from a
tensor hook on the root's output tensors, the gradient that flowed into them in the real backward (the loss is
computed outside the model, so this is what drives the replayed backward). Everything kept is dropped at each
``record``, except the step's inputs and random state, kept one step longer as the *previous* step's (its output
gradient dropped) for a loss spike's comparison. Limits: an input the script modifies in place after the forward
(or the model modifies in place inside it, or a script refilling one batch buffer every step) is replayed as it is
then, not as the forward saw it; with gradient accumulation only the step's last
micro-batch is replayed; a model whose forward draws random numbers on another generator (a ``torch.Generator``
of its own) is not replayed with the same draws.

**When**: at ``record``, the step's loss and global gradient norm are read back until both replays have run (on a
GPU a synchronisation, so there the Recorder asks only when a GradScaler is in use, whose ``step`` synchronises
anyway, unless ``Recorder(replay=True)``). The step is replayed when the loss is non-finite, or the gradients are and either no
loss scaler is used or an optimizer step has already been taken (a dynamic scaler's first steps overflow on
purpose while it finds its scale: those are not what the replay is for). And at the first loss spike: the
loss-spike event's own rule (:class:`mpdiag.recording.events.SpikeRule`, fed the loss read at ``record``; the
event itself is raised a step later, when the step's row completes, after its optimizer update), when the previous
step's inputs are kept. Once per run each: the hooks are removed after both.

**How**: ``copy.deepcopy`` of the eager module (``model._orig_mod`` for a ``torch.compile``'d model, so the
replay runs eagerly with hooks that compilation would not see), its gradients cleared, a forward hook and a full
backward hook on every module of the copy (its modules' ``inplace`` switches turned off: an in-place op on a
module's output refuses full backward hooks; an in-place op in the model's own code makes the replay run again,
forward only, and say so in its note), and a tensor hook on every parameter; the kept arguments cloned (so
the replay cannot change the user's batch), the kept random state set, the forward run under the kept autocast
state, then - unless the forward already produced a non-finite or overflowing value - the backward driven from
the copy's output with the kept output gradient. The random state of the process is restored afterwards and the
copy dropped; the user's model, optimizer and gradients are never touched.

**The first offender**: each module's forward output and backward gradient (what its backward produced: the
gradient of its inputs and of its own parameters) is *bad* when it holds inf/NaN or, under FP16 (autocast or
FP16 weights), a magnitude above the format's largest finite value (65504). In execution order - every forward
call in the order the calls completed (a module completes after the modules it calls), then the backward in the
order autograd reached the modules - the first offender is the first module whose result is bad while what it
received (its forward inputs; its output gradient in backward) was not: where the bad value was born, not where
it was passed on. Inputs already bad name ``(inputs)``; an output gradient bad as it arrived from the loss
outside the model names ``(loss)``. The replay *reproduced* the event when it met a non-finite value: then the
fault is numerics, deterministic given the weights, batch and random state; when it met none, the event came
from something the replay does not repeat (non-determinism, a kernel's race, hardware) or from outside the model.

**A loss spike** is finite, so it has no bad value to find: the forwards of the previous step's batch and of the
spike step's run, forward only and without gradients, on the same copy (the spike step's weights, each batch with
its own random state), and each module call's output absmax is compared with the same call's on the previous batch
(calls matched by module and the how-manieth call of it). The first offender (:func:`mpdiag.recording.spike_rule.spike_offender`) is
``(inputs)`` when the batch's floating-point tensors' absmax is at least ``SPIKE_FACTOR`` times the previous
batch's; else the first module call, in completion order, whose output absmax is at least that many times its
previous one while its inputs' absmax rose less (a batch of integer ids has no magnitude to compare: there the
embedding is the first module whose inputs did not rise); else none, said with the largest rise seen. Its note says
what was found in numbers ("the batch at step N was already X× larger than the step before (absmax a against b)");
*reproduced* means an offender was found. Both forwards' rows are stored, the previous one's under step N-1.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from mpdiag.recording.events import LOSS_SPIKE, SpikeRule
from mpdiag.recording.features import RecordedStep, RecorderFeature, WriterJob
from mpdiag.recording.spike_rule import INPUTS, LOSS, spike_offender

FORWARD, BACKWARD = "forward", "backward"
NONFINITE_LOSS, NONFINITE_GRADIENTS, LOSS_SPIKE_TRIGGER = "nonfinite loss", "nonfinite gradients", "loss spike"
_DEVICE_TYPES = ("cpu", "cuda")
#: under a dynamic loss scaler, gradient overflows replayed at most this many times when they turn out to be the
#: scale's (finite at scale 1); then the replay is given up for the run
SCALER_TRIES = 8
#: torch's own backward, taken at import: ``watch`` wraps ``torch.autograd.backward`` to see the script's, and the
#: replay's backward is not the script's
_BACKWARD = torch.autograd.backward


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if torch.is_tensor(t) and t.is_floating_point() and t.numel()]


def _stats(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[absmax of the finite values, count of non-finite values] over ``tensors``, as a float64 device vector."""
    if not tensors:
        return torch.tensor([math.nan, 0.0], dtype=torch.float64)
    parts = []
    for t in tensors:
        t = t.detach()
        finite = torch.isfinite(t)
        absmax = torch.where(finite, t.abs(), torch.zeros((), dtype=t.dtype, device=t.device)).max()
        parts.append(torch.stack([absmax.double(), (~finite).sum().double()]).cpu())
    stacked = torch.stack(parts)
    return torch.stack([stacked[:, 0].max(), stacked[:, 1].sum()])


@dataclass
class _Kept:
    args: tuple
    kwargs: dict
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    autocast: list[tuple[str, torch.dtype]]
    out_grads: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class ReplayResult:
    """A replayed step: ``modules`` rows (phase, order, module name, type, absmax, nonfinite, in_absmax,
    in_nonfinite) in execution order; the first offender (``first_module``, ``first_phase``; None when nothing was
    bad); ``reproduced``; the FP16 bound checked (``format_max``, None without one); ``note``: why the replay
    could not run or what it could not do, and for a loss spike what it found, in numbers; ``previous``: a loss
    spike's replay of the previous step's batch, the same rows, stored under step ``step - 1``."""

    step: int
    trigger: str
    modules: list[tuple] = field(default_factory=list)
    first_module: str | None = None
    first_phase: str | None = None
    reproduced: bool = False
    low_format: str | None = None
    format_max: float | None = None
    note: str | None = None
    previous: list[tuple] = field(default_factory=list)

    def summary_row(self) -> tuple:
        """(step, trigger, reproduced, first_module, first_phase, low_format, format_max, note) for the writer."""
        return (self.step, self.trigger, int(self.reproduced), self.first_module, self.first_phase,
                self.low_format, self.format_max, self.note)

    def module_rows(self) -> list[tuple]:
        """(step, phase, order, module, type, absmax, nonfinite, in_absmax, in_nonfinite) for the writer."""
        return [(self.step, *row) for row in self.modules] + [(self.step - 1, *row) for row in self.previous]

    def line(self) -> str:
        if self.trigger == LOSS_SPIKE_TRIGGER:
            return f"mpdiag: replay of the loss spike at step {self.step}: {self.note}"
        if self.first_module is None:
            return f"mpdiag: replay of step {self.step}: no non-finite value reproduced" + (
                f" ({self.note})" if self.note else "")
        return (f"mpdiag: replay of step {self.step}: first offender {self.first_module} ({self.first_phase}); "
                f"{'reproduced (numerics)' if self.reproduced else 'not reproduced'}")


class StepReplay:
    """Keeps what a step's replay needs at every training forward of ``model``; :meth:`replay` runs it, at most
    once for a non-finite step and once for a loss spike."""

    def __init__(self, model: torch.nn.Module):
        self.root = model
        self.eager = getattr(model, "_orig_mod", model)
        self._kept: _Kept | None = None
        #: the previous step's (its output gradient dropped): what a loss spike's step is compared with
        self._previous: _Kept | None = None
        self.stepped = False  # an optimizer step was taken (a dynamic scaler has found its scale)
        self.nonfinite_done = self.spike_done = False
        self.scaler_tries = 0  # steps replayed whose overflow was the loss scale's
        #: the events' loss-spike rule, fed the loss read at ``record``: the event is raised from the same values
        #: a step later (its row completes then), when the step's optimizer update is already applied
        self._spikes = SpikeRule(LOSS_SPIKE, 1, "loss")
        self._handles = [model.register_forward_pre_hook(self._before, with_kwargs=True),
                         model.register_forward_hook(self._after)]

    # -- kept at every training forward ---------------------------------------------------------------------
    def _before(self, module, args, kwargs):
        if module is not self.root or not torch.is_grad_enabled():
            return  # a deep copy of the model carries this hook too; an evaluation forward keeps nothing
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        autocast = [(d, torch.get_autocast_dtype(d)) for d in _DEVICE_TYPES if torch.is_autocast_enabled(d)]
        self._kept = _Kept(args, dict(kwargs), torch.get_rng_state(), cuda, autocast)

    def _after(self, module, args, output):
        kept = self._kept
        if module is not self.root or not torch.is_grad_enabled() or kept is None:
            return
        for i, t in enumerate(tree_leaves(output)):
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(lambda g, i=i: kept.out_grads.__setitem__(i, g))

    def forget(self) -> None:
        """The step was recorded and not replayed: what was kept of it becomes the previous step's, without its
        output gradient (a spike's replay runs the forward only)."""
        kept, self._kept = self._kept, None
        if kept is not None:
            kept.out_grads.clear()
        self._previous = None if self.spike_done else kept

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._kept = self._previous = None

    # -- when -----------------------------------------------------------------------------------------------
    def triggered(self, step: int, loss: torch.Tensor | float, grad_norm: torch.Tensor | None,
                  scaled: bool) -> str | None:
        """Why step ``step`` is replayed (:data:`NONFINITE_LOSS`, :data:`NONFINITE_GRADIENTS`,
        :data:`LOSS_SPIKE_TRIGGER`) or None; ``scaled``: a loss scaler is in use. Reads the loss and the norm back
        (a synchronisation on a GPU); the loss of every step feeds the spike rule."""
        # a float NaN is "no loss known" (``watch`` before it saw a backward), not an event
        value = float(loss.detach().reshape(-1)[0]) if torch.is_tensor(loss) and loss.numel() == 1 else None
        spiked = value is not None and not self.spike_done and self._spikes.see((step, value)) is not None
        if self._kept is None:
            return None
        if not self.nonfinite_done:
            if torch.is_tensor(loss) and loss.numel() and not (
                    math.isfinite(value) if value is not None else bool(torch.isfinite(loss.detach()).all())):
                return NONFINITE_LOSS
            if grad_norm is not None and not math.isfinite(float(grad_norm)) and (not scaled or self.stepped):
                return NONFINITE_GRADIENTS
        if spiked and self._previous is not None:
            return LOSS_SPIKE_TRIGGER
        return None

    # -- the replay -----------------------------------------------------------------------------------------
    def replay(self, step: int, trigger: str, scale: float = 1.0) -> ReplayResult | None:
        """Replay the kept forward (and backward) on a copy; never raises (a failure is the result's note).

        ``scale``: under a dynamic loss scaler, a step whose gradients alone overflowed (``trigger`` "nonfinite
        gradients") is replayed with the output gradient divided by the scale it carries: if nothing overflows
        at scale 1 (or the kept output gradient had itself overflowed at the scale: a finite loss's), the
        overflow was the scale's (the scaler skips the step and lowers it, its job), the result is None and the
        replay stays armed for a later step, at most :data:`SCALER_TRIES` times. A loss spike replays the
        forwards of this step's and the previous step's batches (:meth:`_spike`)."""
        kept = self._kept
        result = ReplayResult(step, trigger)
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if kept.cuda_rng is not None else None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the full backward hooks' notes about inputs without gradients
                if trigger == LOSS_SPIKE_TRIGGER:
                    self._spike(self._previous, kept, result)
                else:
                    result = self._nonfinite(kept, result, scale)
        except Exception as exc:  # noqa: BLE001 - the user's training goes on whatever the replay meets
            result.note = f"the replay failed: {type(exc).__name__}: {exc}"
        finally:
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        self._kept = self._previous = None  # the next step's previous is not this replayed one
        failed = result.note is not None and result.note.startswith("the replay failed")
        if trigger == LOSS_SPIKE_TRIGGER:
            self.spike_done = True
        elif scale != 1.0 and result.first_module is None and not failed:
            self.scaler_tries += 1
            if self.scaler_tries >= SCALER_TRIES:
                self.nonfinite_done = True
            result = None
        else:
            self.nonfinite_done = True
        if self.nonfinite_done and self.spike_done:
            self.remove()
        return result

    def _nonfinite(self, kept: _Kept, result: ReplayResult, scale: float) -> ReplayResult:
        try:
            self._run(kept, result, scale, backward=True)
        except RuntimeError as exc:  # an in-place op on a module's output refuses full backward hooks
            if isinstance(exc, torch.OutOfMemoryError):
                raise  # no room for a copy of the model: a second try would not find more
            result = ReplayResult(result.step, result.trigger)
            self._run(kept, result, scale, backward=False)
            result.note = (f"the forward only: the backward with hooks failed ({exc}"[:300] + ")")
        return result

    def _format(self, kept: _Kept, result: ReplayResult) -> None:
        low = next((dtype for _, dtype in kept.autocast if dtype in (torch.float16, torch.bfloat16)), None)
        if low is None:
            low = next((p.dtype for p in self.eager.parameters() if p.dtype in (torch.float16, torch.bfloat16)), None)
        result.low_format = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(low)
        result.format_max = torch.finfo(torch.float16).max if low is torch.float16 else None

    def _copy(self) -> torch.nn.Module:
        model = copy.deepcopy(self.eager)
        for p in model.parameters():
            p.grad = None
        for module in model.modules():  # the copy's own: ReLU(inplace=True) on an output refuses backward hooks
            if isinstance(getattr(module, "inplace", None), bool):
                module.inplace = False
        return model

    @staticmethod
    def _forward(model: torch.nn.Module, kept: _Kept, grad: bool = True):
        """``model`` called on clones of the kept arguments (the replay cannot change the user's batch) with the
        kept random and autocast state."""
        def clone(t):
            return t.detach().clone().requires_grad_(t.requires_grad and grad) if torch.is_tensor(t) else t

        args, kwargs = tree_map(clone, kept.args), tree_map(clone, kept.kwargs)
        torch.set_rng_state(kept.cpu_rng)
        if kept.cuda_rng is not None:
            torch.cuda.set_rng_state_all(kept.cuda_rng)
        with contextlib.ExitStack() as stack:
            for device_type, dtype in kept.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            stack.enter_context(torch.enable_grad() if grad else torch.no_grad())
            return model(*args, **kwargs)

    def _spike(self, previous: _Kept, kept: _Kept, result: ReplayResult) -> None:
        """A loss spike: the previous step's batch and this step's, forward only, on the same copy (this step's
        weights), and the first offender by :func:`spike_offender`."""
        self._format(kept, result)
        model = self._copy()
        probe = _Probe(model, backward=False)
        rows = []
        try:
            for one in (previous, kept):
                probe.reset()
                self._forward(model, one, grad=False)
                rows.append(probe.rows(FORWARD))
        finally:
            probe.remove()
        result.previous = [(FORWARD, i, *row) for i, row in enumerate(rows[0])]
        result.modules = [(FORWARD, i, *row) for i, row in enumerate(rows[1])]
        batches = [_stats(_tensors((one.args, one.kwargs))).tolist()[0] for one in (previous, kept)]
        offender, result.note = spike_offender(result.step, *rows, *batches)
        if offender is not None:
            result.first_module, result.first_phase, result.reproduced = offender, FORWARD, True

    def _run(self, kept: _Kept, result: ReplayResult, scale: float, backward: bool) -> None:
        self._format(kept, result)
        model = self._copy()
        probe = _Probe(model, backward)
        try:
            output = self._forward(model, kept)
            forward = probe.rows(FORWARD)
            offender = _first_offender(forward, FORWARD, result.format_max)
            if offender is None and backward:
                outs = tree_leaves(output)
                pairs = [(o, kept.out_grads[i]) for i, o in enumerate(outs)
                         if i in kept.out_grads and torch.is_tensor(o) and o.requires_grad]
                grads = [g / scale if scale != 1.0 else g for _, g in pairs]
                if scale != 1.0:
                    result.note = f"backward replayed at loss scale 1 (the step's was {scale:g})"
                if grads and _bad(_stats(_tensors(grads)).tolist(), result.format_max):
                    if scale == 1.0:
                        offender = (LOSS, BACKWARD)
                    # else: the output gradient overflowed as the loss scale carried it (a finite loss): a
                    # division cannot bring back what overflowed, and the overflow is the scale's to handle
                elif not pairs:
                    result.note = "no gradient of the model's output was kept: the backward was not replayed"
                else:
                    _BACKWARD([o for o, _ in pairs], grads)
            backward = probe.rows(BACKWARD)
            if offender is None:
                offender = _first_offender(backward, BACKWARD, result.format_max)
        finally:
            probe.remove()
        result.modules = [(FORWARD, i, *row) for i, row in enumerate(forward)] + \
                         [(BACKWARD, i, *row) for i, row in enumerate(backward)]
        if offender is not None:
            result.first_module, result.first_phase = offender
            broken = [name for name, p in model.named_parameters()
                      if name.startswith(f"{offender[0]}.") or offender[0] == type(model).__name__ and "." not in name
                      if not bool(torch.isfinite(p.detach()).all())]
            if broken:  # the step's weights were already bad: an earlier optimizer step broke them
                result.note = f"its weights already held inf/NaN before the step: {', '.join(broken[:5])}"
        result.reproduced = offender == (LOSS, BACKWARD) or any(row[3] or row[5] for row in forward + backward)


class ReplayFeature(RecorderFeature):
    """``replay``: at every ``record`` until both replays ran, whether the step is replayed, and the replay before its
    optimizer step (the weights are still those it used); ``on_result`` is told each result, the writer gets it at
    the next flush (``Store.replays``). Off for the rest of the run once asking failed (said on stderr): the replay
    never ends the training."""

    def __init__(self, model: torch.nn.Module, run_id: int, on_result: Callable[[ReplayResult], None]):
        self._replay: StepReplay | None = StepReplay(model)
        self._run_id, self._on_result = run_id, on_result
        self._results: list[ReplayResult] = []

    def at_record(self, step: RecordedStep) -> None:
        if self._replay is None:
            return
        try:
            trigger = self._replay.triggered(step.step, step.loss, step.norm, scaled=step.scaled)
        except Exception as exc:  # noqa: BLE001 - the replay never ends the training: it is given up instead
            print(f"mpdiag: the replay is off for this run: {type(exc).__name__}: {exc}", file=sys.stderr)
            self.remove()
            return
        if trigger is None:  # what was kept of this step becomes the previous step's
            self._replay.forget()
            return
        # a gradient overflow is replayed at the step's loss scale, as its backward ran
        scale = step.scale if step.scaled and trigger == NONFINITE_GRADIENTS else 1.0
        result = self._replay.replay(step.step, trigger, scale=float(scale))
        if not self._replay.armed:  # both replays done, or the loss scale's overflows tried enough
            self._replay = None
        if result is not None:  # None: the loss scale's overflow, nothing to store
            self._results.append(result)
            self._on_result(result)

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._replay is not None:
            self._replay.stepped = True

    def drain(self, wait: bool) -> list[WriterJob]:
        results, self._results = self._results, []
        return [lambda w, r=r: w.add_replay(self._run_id, r.summary_row(), r.module_rows()) for r in results]

    def remove(self) -> None:
        if self._replay is not None:
            self._replay.remove()
            self._replay = None


#: a module's forward-hook tables (and their companions keyed by the same handle ids, which are unique per process)
_FORWARD_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                        "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _replay_hook_ids(state: dict) -> set[int]:
    return {key for name in ("_forward_pre_hooks", "_forward_hooks") for key, hook in (state.get(name) or {}).items()
            if isinstance(getattr(hook, "__self__", None), StepReplay)}


def reduce_ex_without_replay_hooks(module: torch.nn.Module, protocol: int):
    """``torch.nn.Module.__reduce_ex__`` while ``watch`` runs a script: ``object.__reduce_ex__`` (which honours a
    class's own ``__reduce__`` and ``__getstate__``), with the forward hooks of a :class:`StepReplay` left out of
    the state it returns. Pickling (``torch.save(model)``) and ``copy.deepcopy`` both take a module's state from
    here, so a script's checkpoint or EMA copy of its model carries nothing of mpdiag's, and
    ``torch.load(weights_only=True)`` meets only the script's own classes. The module itself keeps its hooks; a
    module without them (every module but the watched model's root) returns its state untouched, uncopied."""
    reduced = object.__reduce_ex__(module, protocol)
    state = reduced[2] if isinstance(reduced, tuple) and len(reduced) > 2 else None
    ours = _replay_hook_ids(state) if isinstance(state, dict) else None
    if not ours:
        return reduced
    state = {name: (type(table)((k, v) for k, v in table.items() if k not in ours)
                    if name in _FORWARD_HOOK_TABLES and isinstance(table, dict) else table)
             for name, table in state.items()}
    return (*reduced[:2], state, *reduced[3:])


def _bad(values, limit: float | None) -> bool:
    absmax, nonfinite = values
    return nonfinite > 0 or (limit is not None and not math.isnan(absmax) and absmax > limit)


def _first_offender(rows: list[tuple], phase: str, limit: float | None) -> tuple[str, str] | None:
    """The first row whose result is bad while what it received was not; when every bad result was fed bad
    values, where they came from: the inputs (forward) or the loss (backward)."""
    for name, _, absmax, nonfinite, in_absmax, in_nonfinite in rows:
        if _bad((absmax, nonfinite), limit) and not _bad((in_absmax, in_nonfinite), limit):
            return name, phase
    if any(_bad((r[2], r[3]), limit) for r in rows):
        return (INPUTS if phase == FORWARD else LOSS), phase
    return None


class _Probe:
    """Hooks on every module of the copy: per forward call (completion order) and per module reached in
    backward, the absmax and non-finite count of what it produced and of what it received."""

    def __init__(self, model: torch.nn.Module, backward: bool = True):
        self.names = {id(m): (name or type(m).__name__) for name, m in model.named_modules()}
        self._forward: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = []
        self._backward: dict[int, list] = {}  # id(module) -> [order, module, produced tensors, received tensors]
        self._handles = []
        for _, m in model.named_modules():
            self._handles.append(m.register_forward_hook(self._on_forward, with_kwargs=True))
            if not backward:
                continue
            self._handles.append(m.register_full_backward_hook(self._on_backward))
            for p in m.parameters(recurse=False):
                if p.requires_grad:
                    self._handles.append(p.register_hook(self._on_param(m)))

    def reset(self) -> None:
        """Forget the forward calls seen (a spike's replay runs two forwards on the same copy)."""
        self._forward.clear()

    def _on_forward(self, module, args, kwargs, output):
        self._forward.append((module, _stats(_tensors(output)), _stats(_tensors((args, kwargs)))))

    def _entry(self, module) -> list:
        return self._backward.setdefault(id(module), [len(self._backward), module, [], []])

    def _on_backward(self, module, grad_input, grad_output):
        entry = self._entry(module)
        entry[2] += _tensors(grad_input)
        entry[3] += _tensors(grad_output)

    def _on_param(self, module):
        def hook(grad):
            self._entry(module)[2].append(grad.detach())

        return hook

    def rows(self, phase: str) -> list[tuple]:
        """(module, type, absmax, nonfinite, in_absmax, in_nonfinite) in execution order, as Python values."""
        if phase == FORWARD:
            items = [(m, out, inp) for m, out, inp in self._forward]
        else:
            items = [(m, _stats(prod), _stats(recv)) for _, m, prod, recv in sorted(self._backward.values(),
                                                                                   key=lambda e: e[0])]
        return [(self.names[id(m)], type(m).__name__, *out.tolist(), *inp.tolist()) for m, out, inp in items]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
