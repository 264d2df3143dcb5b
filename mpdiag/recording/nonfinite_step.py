"""Whether an optimizer step itself turned weights or optimizer state non-finite.

Asked by the Recorder around an optimizer step (every step under mpdiag's runner; the logged steps in users'
loops and under ``watch``), until the first such step: before it, whether the loss, every
gradient, every weight the optimizer updates and its state are finite; after it, which of those tensors no
longer are. A step that starts from finite values and ends with inf/NaN ones broke inside the optimizer (e.g.
AdamW's eps=1e-8 is 0 in FP16, so an FP16 ``exp_avg_sq`` that underflows divides by zero).

Owns that check and the record of it (a JSON-ready dict), and the Recorder feature behind
``check_optimizer_step`` (:class:`OptimizerStepCheck`: which steps are checked, one check per optimizer). Must not
write to the store (its caller hands the record to the writer) nor judge it (that is :mod:`mpdiag.analysis.findings`'). Costs a pass over the tensors
(one launch per dtype) and one synchronisation before and after each checked step, and stops after the first
finding. Under FSDP2 each rank checks the shards it holds (no collective): the record is rank 0's, so a step that broke only another rank's shards is not reported.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import torch

from mpdiag.numerics.gradstats import NUMBA_AVAILABLE
from mpdiag.recording.distributed import local_shards
from mpdiag.recording.features import RecordedStep, RecorderFeature

#: ``check_optimizer_step``'s value for checking every optimizer step, logged or not
EVERY_STEP = "every step"


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as torch names it without the module: ``float16``."""
    return str(dtype).removeprefix("torch.")


def _dtypes(states) -> str | None:
    """The dtypes of the floating-point tensors (not the step counter) in optimizer ``states`` (dicts), joined."""
    dtypes = sorted({dtype_name(t.dtype) for state in states for key, t in state.items()
                     if torch.is_tensor(t) and t.is_floating_point() and key != "step"})
    return ", ".join(dtypes) or None


def optimizer_state_dtype(optimizer: torch.optim.Optimizer) -> str | None:
    """The dtype of an optimizer's floating-point state (None before its first step, or stateless)."""
    return _dtypes(optimizer.state.values())


def _nonfinite_on_cpu(tensors: list[torch.Tensor]) -> int | None:
    """How many values of ``tensors`` are inf or NaN, counted by one numba kernel over their bit patterns (exact,
    no sum to overflow); None where that kernel cannot read them all (numba missing, a tensor off the CPU or
    strided, a dtype it does not know), and the torch path counts instead. One torch thread on the project's
    2-core CPU, 404 tensors of 4,096 FP32 values (a 200-tensor MLP's weights and gradients): 0.7 ms, where the
    foreach norms and their ``stack`` took 3.0 ms (each tensor read through a reduction of its own)."""
    if not NUMBA_AVAILABLE or not all(t.is_cpu and t.is_contiguous() for t in tensors):
        return None
    from mpdiag.numerics.cpu_kernel import EXPONENT_BITS, nonfinite_counts, on_torch_threads

    if not all(t.dtype in EXPONENT_BITS for t in tensors):
        return None
    table = np.array([(t.data_ptr(), t.numel(), EXPONENT_BITS[t.dtype], t.element_size()) for t in tensors],
                     dtype=np.int64).reshape(len(tensors), 4)
    counts = np.zeros(len(tensors), np.int64)
    on_torch_threads(nonfinite_counts)(table, counts)  # ``tensors`` keeps the values alive while it reads them
    return int(counts.sum())


class NonfiniteStepCheck:
    """Watch one optimizer's steps. ``named`` are (name, parameter) for the parameters whose gradients it uses,
    named as ``Store.tensors`` names them; ``masters`` (O2) are the tensors it updates in their place, in the
    same order, reported under the parameters' names."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer,
                 masters: list | None = None):
        self._grads_of = [p for _, p in named]
        targets = masters if masters else self._grads_of
        self._updated = [(name, t) for (name, _), t in zip(named, targets, strict=True)]
        self.optimizer = optimizer
        self.found: dict | None = None
        self._armed = False

    def _tensors(self):
        """(tensor name, optimizer state key or None, tensor) for every weight the optimizer updates and its
        floating-point state (not the step counter)."""
        for name, weight in self._updated:
            yield name, None, weight
            for key, value in self.optimizer.state.get(weight, {}).items():
                if torch.is_tensor(value) and value.is_floating_point() and key != "step":
                    yield name, key, value

    def state_dtype(self) -> str | None:
        """The dtype of the optimizer's floating-point state (None before its first step, or stateless)."""
        return _dtypes(self.optimizer.state.get(weight, {}) for _, weight in self._updated)

    def before(self, loss: torch.Tensor | float) -> None:
        """Arm the check when the loss, gradients, weights and state are all finite (one synchronisation)."""
        self._armed = False
        if self.found is not None:
            return
        if not self._updated:
            return
        device = self._updated[0][1].device
        values = [torch.as_tensor(loss, device=device).detach()] + [p.grad for p in self._grads_of if p.grad is not None]
        values += [t for _, _, t in self._tensors()]
        self._armed = self._finite(values)

    @staticmethod
    def _finite(values) -> bool:
        """Whether every value of every tensor is finite (of this rank's shard of an FSDP2 DTensor). On the CPU,
        one numba pass counts the inf/NaN bit patterns of all of them (:func:`_nonfinite_on_cpu`). Elsewhere one
        synchronisation: one ``_foreach_norm(ord=1)`` (at least fp32) per device and dtype reads them all, since a
        sum of magnitudes is inf or NaN when a value is: a per-tensor ``isfinite().all()`` was 4 operators a tensor
        (the profiler on an H100's host: 705 isfinite calls in 3 steps of an SGD model of 78 tensors, 97 us each
        with their children). Finite values can sum past fp32's range, so a non-finite sum is confirmed tensor by
        tensor before it counts."""
        shards = local_shards(values)
        nonfinite = _nonfinite_on_cpu(shards)
        if nonfinite is not None:
            return nonfinite == 0
        groups: dict[tuple, list[torch.Tensor]] = {}
        for v in shards:
            groups.setdefault((v.device, v.dtype), []).append(v)
        device = values[0].device
        sums = [n.to(device) for (_, dtype), group in groups.items()
                for n in torch._foreach_norm(group, 1, dtype=torch.promote_types(dtype, torch.float32))]
        if bool(torch.stack(sums).isfinite().all()):
            return True
        return all(bool(torch.isfinite(v).all()) for v in shards)

    def after(self, step: int) -> dict | None:
        """The record of ``step`` when it made an armed check's tensors non-finite, else None (one
        synchronisation when nothing broke)."""
        if not self._armed:
            return None
        self._armed = False
        tensors = list(self._tensors())
        if self._finite([t for _, _, t in tensors]):
            return None
        broken = [(name, key) for (name, key, _), t in zip(tensors, local_shards([t for _, _, t in tensors]), strict=True)
                  if not bool(torch.isfinite(t).all())]
        self.found = {
            "step": int(step),
            "optimizer": type(self.optimizer).__name__,
            "state_dtype": self.state_dtype(),
            "weight_dtype": dtype_name(self._updated[0][1].dtype),
            "tensors": list(dict.fromkeys(name for name, _ in broken)),
            "values": [name if key is None else f"{name} ({key})" for name, key in broken],
        }
        return self.found


class OptimizerStepCheck(RecorderFeature):
    """``check_optimizer_step``: around each checked optimizer step (the logged steps; ``EVERY_STEP``: every one),
    until the first finding, which is handed to ``report``. ``named`` are the recorded (name, parameter) pairs;
    ``targets`` the tensors the optimizer updates in their place (FP32 masters), or None."""

    def __init__(self, steps: bool | str, named: list[tuple[str, torch.Tensor]], targets: list | None,
                 report: Callable[[dict], None]):
        self._steps, self._named, self._targets, self._report = steps, named, targets, report
        self._checks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its check
        self._checked: tuple[int, torch.Tensor | float] | None = None  # (step, loss) of the step checked next
        self.found: dict | None = None  # the first step whose update broke finite values

    def at_record(self, step: RecordedStep) -> None:
        checked = (step.logged and self._steps or self._steps == EVERY_STEP) and self.found is None
        # the loss's value, not the loss: holding it kept the step's autograd graph alive until the next record
        # (freed there, ~1 ms a step at 500 tensors, and held after the training loop let go of it)
        loss = step.loss.detach() if torch.is_tensor(step.loss) else step.loss
        self._checked = (step.step, loss) if checked else None

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._checked is not None:
            self._check_of(optimizer).before(self._checked[1])

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        check = self._checks.get(optimizer)
        found = check.after(self._checked[0]) if check is not None and self._checked is not None else None
        if found is not None:
            self.found, self._checked = found, None  # one finding per run: the first step that broke
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
