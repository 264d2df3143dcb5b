"""Whether an optimizer step itself turned weights or optimizer state non-finite.

Asked by the Recorder around an optimizer step (every step under mpdiag's runner; the logged steps in users'
loops and under ``watch``), until the first such step: before it, whether the loss, every
gradient, every weight the optimizer updates and its state are finite; after it, which of those tensors no
longer are. A step that starts from finite values and ends with inf/NaN ones broke inside the optimizer (e.g.
AdamW's eps=1e-8 is 0 in FP16, so an FP16 ``exp_avg_sq`` that underflows divides by zero).

Owns that check and the record of it (a JSON-ready dict), and the Recorder feature behind
``check_optimizer_step`` (:class:`OptimizerStepCheck`: which steps are checked, one check per optimizer). Must not
write to the store (its caller hands the record to the writer) nor judge it (that is :mod:`mpdiag.analysis.findings`').
Costs a pass over the tensors before and after each checked step, each for a single flag (:class:`AnyNonfinite`: on
the CPU one numba pass; on a GPU one GradScaler multi-tensor pass per dtype), and no synchronisation of the whole
queue: on a GPU the flags come back by non-blocking copies and are read at a later record (a synchronisation
before and after each step left the GPU idle while the host caught up), so the finding is reported then; the
CPU's are reported inside the step. Only a step whose flags say it broke something is read tensor by tensor
(:class:`NonfiniteFlags`), to name what broke: its weights and state as they are before the optimizer's next
step, which waits, if they have not arrived, for that optimizer's previous flags alone (queued before the
forward and backward that precede it, so the GPU is not left idle). Per-tensor flags after every step cost
~8 us a tensor of host time on an H200's host (12 ms a step for Adam over 502 parameters). Stops after the
first finding. Under FSDP2 each rank checks the shards it holds (no collective): the record is rank 0's,
so a step that broke only another rank's shards is not reported.
"""

from __future__ import annotations

import functools
import math
import operator
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from mpdiag.numerics.gradstats import NUMBA_AVAILABLE, DeviceReadback
from mpdiag.recording.distributed import local_shards
from mpdiag.recording.features import RecordedStep, RecorderFeature

#: ``check_optimizer_step``'s value for checking every optimizer step, logged or not
EVERY_STEP = "every step"


_DTYPE = operator.attrgetter("dtype")
#: a tensor's device index (-1 on the CPU) and whether it is on a CUDA device, read in C without making a
#: ``torch.device`` (~0.1 us a tensor, 1,000 tensors a step)
_DEVICE_INDEX = torch.Tensor.get_device
_IS_CUDA = operator.attrgetter("is_cuda")
_LAYOUT = operator.attrgetter("layout")
_STRIDED = frozenset((torch.strided,))


def _sparse_values(grad: torch.Tensor) -> torch.Tensor:
    """The values of a sparse COO gradient (``nn.Embedding(sparse=True)``'s), duplicate indices summed as the
    optimizer applies them: it is finite exactly when they are, and no norm or numba pass reads the sparse tensor
    itself (NotImplementedError before SparseAdam's step)."""
    return grad.coalesce().values()


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as torch names it without the module: ``float16``."""
    return str(dtype).removeprefix("torch.")


def _dtypes(states) -> str | None:
    """The dtypes of the floating-point tensors (not the step counter) in optimizer ``states`` (dicts), joined; a
    wrapper subclass (torchao's 8-bit, 4-bit and FP8 states, which say float32) by its class: OptimState8bit."""
    tensors = [t for state in states for key, t in state.items()
               if torch.is_tensor(t) and t.is_floating_point() and key != "step"]
    dtypes = sorted({type(t).__name__ if is_traceable_wrapper_subclass(t) else dtype_name(t.dtype)
                     for t in local_shards(tensors)})
    return ", ".join(dtypes) or None


def optimizer_state_dtype(optimizer: torch.optim.Optimizer) -> str | None:
    """The dtype of an optimizer's floating-point state (None before its first step, or stateless)."""
    return _dtypes(optimizer.state.values())


def _nonfinite_on_cpu(tensors: list[torch.Tensor]) -> np.ndarray | None:
    """Per tensor, how many of its values are inf or NaN, counted by one numba kernel over their bit patterns
    (exact); None where that kernel cannot read them all (numba missing, a tensor off the CPU or strided, a dtype
    it does not know), and the torch path counts instead. One torch thread on the project's 2-core CPU, 404
    tensors of 4,096 FP32 values (a 200-tensor MLP's weights and gradients): 0.7 ms, where foreach norms and their
    ``stack`` took 3.0 ms (each tensor read through a reduction of its own)."""
    if not NUMBA_AVAILABLE or not all(t.is_cpu and t.is_contiguous() for t in tensors):
        return None
    exponent_bits, kernel = _cpu_counter()
    if not all(t.dtype in exponent_bits for t in tensors):
        return None
    table = np.array([(t.data_ptr(), t.numel(), exponent_bits[t.dtype], t.element_size()) for t in tensors],
                     dtype=np.int64).reshape(len(tensors), 4)
    counts = np.zeros(len(tensors), np.int64)
    kernel(table, counts)  # ``tensors`` keeps the values alive while it reads them
    return counts


@functools.cache
def _cpu_counter():
    """The numba finiteness kernel, wrapped once: numba is imported on the first check that needs it."""
    from mpdiag.numerics.cpu_kernel import EXPONENT_BITS, nonfinite_counts, on_torch_threads

    return EXPONENT_BITS, on_torch_threads(nonfinite_counts)


class NonfiniteFlags:
    """Per tensor of a list (of this rank's shard of an FSDP2 DTensor), whether it holds an inf or NaN, found
    without a synchronisation. On the CPU one numba pass counts them at once (:func:`_nonfinite_on_cpu`).
    Elsewhere one ``_foreach_norm(ord=inf)`` per device and dtype: a tensor's largest magnitude is inf or NaN
    exactly when the tensor holds one (the max propagates NaN, and no sum of finite values can overflow), read
    back by a non-blocking copy; a per-tensor ``isfinite().all()`` was 4 operators a tensor (the profiler on an
    H100's host: 705 isfinite calls in 3 steps of an SGD model of 78 tensors, 97 us each with their children)."""

    def __init__(self, tensors: list[torch.Tensor]):
        shards, self._owners = _values_of(local_shards(tensors))
        self._count = len(tensors)
        counts = _nonfinite_on_cpu(shards) if shards else np.zeros(0, np.int64)
        self._flags, self._readback, self._order = None, None, None
        if counts is not None:
            self._flags = self._per_tensor(counts > 0)
            return
        if len(set(map(_DTYPE, shards))) == 1 and len(set(map(_DEVICE_INDEX, shards))) == 1:
            # the usual case, told apart in C (``.device`` makes an object a tensor): one launch, no reordering
            self._readback = DeviceReadback(_finite(shards))
            return
        groups: dict[tuple, list[int]] = {}
        for i, shard in enumerate(shards):
            groups.setdefault((shard.device, shard.dtype), []).append(i)
        device = shards[0].device
        self._readback = DeviceReadback(torch.cat([_finite([shards[i] for i in indices]).to(device)
                                                   for indices in groups.values()]))
        self._order = [i for indices in groups.values() for i in indices]

    def ready(self) -> bool:
        """Whether :meth:`numpy` would return without waiting for the device."""
        return self._readback is None or self._readback.ready()

    def numpy(self) -> np.ndarray:
        """The flags (bool, in the tensors' order), waiting for the device's copy if it has not arrived."""
        if self._flags is None:
            finite = self._readback.numpy()
            if self._order is None:
                self._flags = self._per_tensor(~finite)
            else:
                flags = np.empty(len(self._order), bool)
                flags[self._order] = ~finite
                self._flags = self._per_tensor(flags)
        return self._flags

    def _per_tensor(self, read: np.ndarray) -> np.ndarray:
        """The flags of the tensors read, as flags of the tensors asked about (a subclass is any of its parts')."""
        if self._owners is None:
            return read
        flags = np.zeros(self._count, bool)
        np.logical_or.at(flags, self._owners, read)
        return flags


#: the classes whose tensors are their own values (anything else may be a wrapper subclass: see _values_of)
_PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})


def _values_of(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int] | None]:
    """The tensors to read for ``tensors``: each itself, except a wrapper subclass (torchao's 8-bit, 4-bit and FP8
    optimizer states, FP8 training's weights), read through the floating-point tensors it is made of
    (``__tensor_flatten__``, recursively): its own storage is no values (``data_ptr()`` is 0: numba read address 0
    and the process died) and its dispatch has no norm. For torchao's states (codes from a finite table, or FP8
    codes, times a per-block FP32 scale) a value is non-finite exactly when a code or scale is (an FP8 code times
    a finite scale overflows only past 7.6e35). Also the index in ``tensors`` each read tensor stands for, or None
    when every tensor is read as itself (told in C: ``map(type)``)."""
    if set(map(type, tensors)) <= _PLAIN_TYPES:
        return tensors, None
    read, owners = [], []
    for i, tensor in enumerate(tensors):
        parts = _parts(tensor)
        read += parts
        owners += [i] * len(parts)
    return read, owners


def _parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """``tensor``, or, for a wrapper subclass, the floating-point tensors it is made of."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [part for name in names for part in _parts(getattr(tensor, name)) if part.is_floating_point()]


def _finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor (one device and dtype: ``_foreach_norm``'s one-launch path), whether all its values are finite.
    FP8 tensors (no norm kernel reads them) are widened to FP32 first, which keeps inf and NaN as they are."""
    if tensors and tensors[0].element_size() == 1:
        tensors = [t.float() for t in tensors]
    return torch.stack(torch._foreach_norm(tensors, math.inf)).isfinite()


#: the dtypes GradScaler's multi-tensor finiteness kernel reads on CUDA (torch 2.11 dispatches it for FP16, FP32
#: and FP64 alone: a BF16 list raised NotImplementedError on an H200)
_ONE_PASS_DTYPES = frozenset({torch.float16, torch.float32, torch.float64})


def _on_one_cuda_device(shards: list[torch.Tensor]) -> bool:
    """Whether every tensor is a strided one (GradScaler's pass refuses a sparse gradient) on one and the same
    CUDA device, told in C."""
    return (all(map(_IS_CUDA, shards)) and len(set(map(_DEVICE_INDEX, shards))) == 1
            and set(map(_LAYOUT, shards)) == {torch.strided})


@functools.cache
def _one(device: torch.device) -> torch.Tensor:
    """The inverse scale 1 GradScaler's pass is given, made once per device (only read: not a launch a step)."""
    return torch.ones(1, dtype=torch.float32, device=device)


class AnyNonfinite:
    """Whether any value of a list of tensors (this rank's shards) is inf or NaN, found without a synchronisation:
    all the check needs to know of the values before a step. Where they are all on one CUDA device, the tensors
    of the dtypes its kernel reads go through GradScaler's own pass over the gradients,
    ``_amp_foreach_non_finite_check_and_unscale_``, with an inverse scale of 1 (one call per dtype): one flag from
    one launch per chunk of tensors and no tensor made per tensor, where per-tensor norms and their ``stack`` took
    2.1-3.5 ms of host time before an SGD step of 202 tensors on an H200's host (405 tensors: ~6 us each; 0.5-0.8
    ms this way). The pass writes each value back as it read it (x * 1 is x, a NaN stays a NaN), as GradScaler's
    unscaling does to every gradient before a step; it is not used on the CPU, where a tensor may be read-only
    memory. The other tensors (the CPU's, BF16, FP8): any of their :class:`NonfiniteFlags`."""

    def __init__(self, tensors: list[torch.Tensor]):
        shards, _ = _values_of(local_shards(tensors))
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        if shards and _on_one_cuda_device(shards):
            dtypes = set(map(_DTYPE, shards))
            if len(dtypes) == 1:
                by_dtype[dtypes.pop()] = shards
            else:
                for shard in shards:
                    by_dtype.setdefault(shard.dtype, []).append(shard)
        one_pass = [group for dtype, group in by_dtype.items() if dtype in _ONE_PASS_DTYPES]
        rest = shards if not by_dtype else [t for dtype, group in by_dtype.items() if dtype not in _ONE_PASS_DTYPES
                                            for t in group]
        self._flags = NonfiniteFlags(rest) if rest or not one_pass else None
        self._readback = None
        if one_pass:
            device = one_pass[0][0].device
            found = torch.zeros(1, dtype=torch.float32, device=device)
            with torch.no_grad():
                for group in one_pass:  # its fast path takes one dtype; others would be read one tensor at a time
                    torch._amp_foreach_non_finite_check_and_unscale_(group, found, _one(device))
            self._readback = DeviceReadback(found)

    def ready(self) -> bool:
        """Whether :meth:`any` would return without waiting for the device."""
        return all(part.ready() for part in (self._flags, self._readback) if part is not None)

    def any(self) -> bool:
        """Whether some value is inf or NaN, waiting for the device's copies if they have not arrived."""
        return ((self._readback is not None and bool(self._readback.numpy()[0]))
                or (self._flags is not None and bool(self._flags.numpy().any())))


@dataclass
class _CheckedStep:
    """One checked optimizer step whose flags may still be on their way: whether anything was non-finite before
    it (the loss, gradients, weights and state) and after it (the weights and state, ``updated``: name, state key
    or None for the weight, tensor). :meth:`broken` names the values the step made non-finite; it must first be
    asked before the optimizer's next step changes them (:meth:`OptimizerStepCheck.before_optimizer_step`)."""

    step: int
    before: AnyNonfinite
    after: AnyNonfinite
    updated: list[tuple[str, str | None, torch.Tensor]]
    _broken: list[tuple[str, str | None]] | None = None

    def ready(self) -> bool:
        return self.before.ready() and self.after.ready()

    def broken(self) -> list[tuple[str, str | None]]:
        """(name, state key or None) of each value that was finite before the step and is not after it: none if
        anything was non-finite before it. Waits for flags still on their way; read once (the tensors are read
        tensor by tensor then, only when the step's flag says it broke something)."""
        if self._broken is None:
            broke = self.after.any() and not self.before.any()
            flags = NonfiniteFlags([t for _, _, t in self.updated]).numpy() if broke else ()
            self._broken = [self.updated[i][:2] for i in np.flatnonzero(flags)]
        return self._broken


class NonfiniteStepCheck:
    """Watch one optimizer's steps. ``named`` are (name, parameter) for the parameters whose gradients it uses,
    named as ``Store.tensors`` names them; ``masters`` (O2) are the tensors it updates in their place, in the
    same order, reported under the parameters' names."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer,
                 masters: list | None = None):
        self._grads_of = [p for _, p in named]
        targets = masters if masters else self._grads_of
        self._updated = [(name, t) for (name, _), t in zip(named, targets, strict=True)]
        self._weights = [(name, None, t) for name, t in self._updated]
        self.optimizer = optimizer
        self._before: AnyNonfinite | None = None

    def _tensors(self) -> list[tuple[str, str | None, torch.Tensor]]:
        """(tensor name, optimizer state key or None, tensor) for every weight the optimizer updates and its
        floating-point state (not the step counter), each weight followed by its state. Asked twice a step: a
        stateless optimizer (plain SGD) or one before its first step gets the weights' list as it is."""
        state = self.optimizer.state
        if not state:
            return self._weights
        found = []
        for entry, (name, weight) in zip(self._weights, self._updated, strict=True):
            found.append(entry)
            held = state.get(weight)
            if held:
                found += [(name, key, value) for key, value in held.items()
                          if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point()]
        return found

    def state_dtype(self) -> str | None:
        """The dtype of the optimizer's floating-point state (None before its first step, or stateless)."""
        return _dtypes(self.optimizer.state.get(weight, {}) for _, weight in self._updated)

    def before(self, loss: torch.Tensor | float) -> None:
        """Flag the loss, gradients, weights and state before the step (no synchronisation)."""
        self._before = None
        if not self._updated:
            return
        device = self._updated[0][1].device
        grads = [p.grad for p in self._grads_of if p.grad is not None]
        if not _STRIDED.issuperset(map(_LAYOUT, grads)):  # told in C: a sparse gradient is rare
            grads = [g if g.layout is torch.strided else _sparse_values(g) for g in grads]
        values = [torch.as_tensor(loss, device=device).detach(), *grads, *(t for _, _, t in self._tensors())]
        self._before = AnyNonfinite(values)

    def after(self, step: int) -> _CheckedStep | None:
        """``step``, checked: its flags before the step and the weights' and state's after it (no
        synchronisation), for :meth:`finding` once they have arrived; None when :meth:`before` did not run."""
        before, self._before = self._before, None
        if before is None:
            return None
        tensors = self._tensors()
        return _CheckedStep(step, before, AnyNonfinite([t for _, _, t in tensors]), tensors)

    def finding(self, checked: _CheckedStep) -> dict | None:
        """The record of ``checked``'s step when it made finite values non-finite (everything was finite before
        it, some weight or state value is not after it), else None; waits for flags still on their way."""
        broken = checked.broken()
        if not broken:
            return None
        return {
            "step": int(checked.step),
            "optimizer": type(self.optimizer).__name__,
            "state_dtype": self.state_dtype(),
            "weight_dtype": dtype_name(self._updated[0][1].dtype),
            "tensors": list(dict.fromkeys(name for name, _ in broken)),
            "values": [name if key is None else f"{name} ({key})" for name, key in broken],
        }


class OptimizerStepCheck(RecorderFeature):
    """``check_optimizer_step``: around each checked optimizer step (the logged steps; ``EVERY_STEP``: every one),
    until the first finding, which is handed to ``report``. ``named`` are the recorded (name, parameter) pairs;
    ``targets`` the tensors the optimizer updates in their place (FP32 masters), or None."""

    def __init__(self, steps: bool | str, named: list[tuple[str, torch.Tensor]], targets: list | None,
                 report: Callable[[dict], None]):
        self._steps, self._named, self._targets, self._report = steps, named, targets, report
        self._checks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its check
        self._checked: tuple[int, torch.Tensor | float] | None = None  # (step, loss) of the step checked next
        self._unsettled: deque[tuple[NonfiniteStepCheck, _CheckedStep]] = deque()  # in step order
        self.found: dict | None = None  # the first step whose update broke finite values
        #: the optimizers inside their step (its pre-hook ran, its post-hook not yet)
        self._stepping: weakref.WeakSet = weakref.WeakSet()

    def at_record(self, step: RecordedStep) -> None:
        self._settle(wait=False)
        checked = (step.logged and self._steps or self._steps == EVERY_STEP) and self.found is None
        # the loss's value, not the loss: holding it kept the step's autograd graph alive until the next record
        # (freed there, ~1 ms a step at 500 tensors, and held after the training loop let go of it)
        loss = step.loss.detach() if torch.is_tensor(step.loss) else step.loss
        self._checked = (step.step, loss) if checked else None
        if checked:
            # a step given a closure (Lightning's automatic optimization, LBFGS) is recorded inside it, after its
            # pre-hook flagged the previous step's loss and gradients (at step 0 nothing: the step was unchecked)
            # and before its update: its check starts again here, with this step's
            for optimizer in list(self._stepping):
                self._check_of(optimizer).before(loss)

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._stepping.add(optimizer)
        for check, checked in self._unsettled:  # their names are read before this step changes what they name
            if check.optimizer is optimizer:
                checked.broken()
        if self._checked is not None:
            self._check_of(optimizer).before(self._checked[1])

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._stepping.discard(optimizer)
        check = self._checks.get(optimizer)
        checked = check.after(self._checked[0]) if check is not None and self._checked is not None else None
        if checked is not None:
            self._unsettled.append((check, checked))
            self._settle(wait=False)  # on the CPU the flags are there at once: a finding is reported now

    def drain(self, wait: bool) -> list:
        if wait:  # the run ends (on the training thread): the last steps' flags are waited for
            self._settle(wait=True)
        return []

    def _settle(self, wait: bool) -> None:
        """Read the checked steps whose flags have arrived (``wait``: all of them), in step order; report the
        first that broke and stop checking. On a GPU the flags arrive without a synchronisation, so a finding is
        reported at a later record (the next one, normally) rather than inside its optimizer step."""
        while self._unsettled and (wait or self._unsettled[0][1].ready()):
            check, checked = self._unsettled.popleft()
            found = check.finding(checked) if self.found is None else None
            if found is not None:
                self.found, self._checked = found, None  # one finding per run: the first step that broke
                self._unsettled.clear()
                self._report(found)

    def _check_of(self, optimizer: torch.optim.Optimizer) -> NonfiniteStepCheck:
        """The check of ``optimizer``'s steps over the recorded parameters it holds (or, given update targets, the
        targets it holds in their place, reported under the parameters' names), named as stored."""
        check = self._checks.get(optimizer)
        if check is None:
            targets = [p for _, p in self._named] if self._targets is None else self._targets
            mine = {id(t): (named, t) for named, t in zip(self._named, targets, strict=True)}
            held = [mine[id(t)] for group in optimizer.param_groups for t in group["params"] if id(t) in mine]
            check = self._checks[optimizer] = NonfiniteStepCheck([named for named, _ in held], optimizer,
                                                                 [t for _, t in held])
        return check
