"""Which parameters' ``.grad`` belong to the step being recorded, and which optimizers that step fed.

A ``.grad`` that is not None is not always this step's gradient. A GAN's loop (pytorch/examples' DCGAN, with
AMP as torch's AMP examples add it) steps the discriminator, then the generator, each with its own optimizer:
at the discriminator's step the generator still holds the gradient of its previous step (already unscaled in
place by ``scaler.step``, so dividing it by the scale again made it 65,536 times too small, and a skipped step's
NaNs leaked into the next step's row); at the generator's step the discriminator's ``.grad`` holds its consumed
gradient plus the generator loss's, at two different scales - a number no optimizer uses.

Two rules, each exact where it applies:

* **Fresh.** A gradient is this step's when autograd accumulated into it since the previous step began (a
  post-accumulate-grad hook, which DDP and FSDP2 also run) or the parameter holds a different ``.grad``
  object than it did then (one assigned by hand). A gradient left over from an earlier step is neither. A
  parameter frozen when recording starts cannot carry the hook (torch refuses it without ``requires_grad``): its
  first gradient, once it is unfrozen, is fresh by the second rule, and the hook is added at that step's end.
* **Fed.** Of the fresh gradients, those of the parameters held by the optimizers asked to step in that step
  (between its ``record`` and the next one, so a second optimizer stepping after the same backward passes
  counts too, unless a backward ran in between: then the optimizer steps on that backward's gradients, which
  the next ``record`` reads - Lightning asks an optimizer to step before it records the step; an optimizer the
  Recorder's GradScaler unscaled was asked, also when the scaler then skipped its step, which fires no optimizer
  hook: :class:`UnscaleWatch`). A step in which no optimizer holding a recorded parameter was seen keeps every
  fresh gradient (weights updated by hand, FP32 master weights held by the optimizer instead, a run stopped inside
  the step), so a step's evidence is never dropped for lack of an owner.

The hooks never copy or change a gradient; they only mark a parameter.
"""

from __future__ import annotations

import itertools
import operator
import threading
import weakref
from collections.abc import Callable, Sequence

import torch

_GRAD = operator.attrgetter("grad")


class StepGradients:
    """Bookkeeping over ``params`` (the recorded parameters, in the Recorder's order)."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self._params = list(params)
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._previous: list[weakref.ref | None] = [None] * len(self._params)  # each .grad when the step began
        self._asked: dict[int, torch.optim.Optimizer] = {}  # optimizers asked to step in the open step
        #: optimizers asked after a backward that no record has read yet: they step in the step that record opens
        self._asked_next: dict[int, torch.optim.Optimizer] = {}
        self._backward_since_read = False  # autograd wrote a recorded parameter's .grad since the last record
        #: per optimizer seen: (a weak reference to it, its parameter groups' lists and lengths, the indices of ours
        #: it holds)
        self._held: dict[int, tuple[weakref.ref, tuple, frozenset[int]]] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._marker(i))
                         for i, p in enumerate(self._params) if p.requires_grad]
        #: the parameters frozen when recording started, not hooked until they are unfrozen (see the module)
        self._unhooked = [i for i, p in enumerate(self._params) if not p.requires_grad]
        self._accumulated = self._unmarked()

    def _marker(self, index: int):
        def mark(param: torch.Tensor) -> None:
            self._accumulated[index] = True
            self._backward_since_read = True

        return mark

    def grads(self) -> list[torch.Tensor | None]:
        """Every recorded parameter's ``.grad`` now, in order (one list for :meth:`fresh` and :meth:`next_step`)."""
        return list(map(_GRAD, self._params))

    def fresh(self, grads: list[torch.Tensor | None]) -> tuple[int, ...]:
        """The indices of the parameters whose ``.grad`` is this step's now; ``grads``: :meth:`grads`."""
        if all(self._accumulated):  # the usual step: autograd wrote every gradient, no earlier .grad to compare
            # map and compress run in C: a Python loop here cost ~0.3 us a parameter on every recorded step
            return tuple(itertools.compress(range(len(grads)), map(operator.is_not, grads, itertools.repeat(None))))
        fresh = []
        for i, grad in enumerate(grads):
            previous = self._previous[i]
            if grad is not None and (self._accumulated[i] or previous is None or previous() is not grad):
                fresh.append(i)
        return tuple(fresh)

    def next_step(self, grads: list[torch.Tensor | None] | None = None) -> None:
        """The step's gradients have been read: what is in ``.grad`` now is stale from here on. ``grads``: the
        :meth:`grads` read in the same ``record`` call (no user code ran since), else they are read again."""
        grads = self.grads() if grads is None else grads
        if type(None) in map(type, grads):  # a missing .grad, tested in C (a tensor is never of NoneType)
            self._previous = [grad if grad is None else weakref.ref(grad) for grad in grads]
        else:
            self._previous = list(map(weakref.ref, grads))
        if self._unhooked:
            self._hook_unfrozen()
        self._accumulated = self._unmarked(grads)
        self._backward_since_read = False

    def _unmarked(self, grads: list[torch.Tensor | None] | None = None) -> list[bool]:
        """``_accumulated`` as a step begins: False for every hooked parameter; for a parameter without the hook,
        True while it has no gradient (no hook will mark it, and it has nothing to read, so the usual step's
        shortcut in :meth:`fresh` stands), False once it has one (then the ``.grad`` object's identity decides)."""
        accumulated = [False] * len(self._params)
        for i in self._unhooked:
            accumulated[i] = grads is None or grads[i] is None
        return accumulated

    def _hook_unfrozen(self) -> None:
        """Hook the parameters frozen when recording started that have been unfrozen since (gradual unfreezing)."""
        for i in [i for i in self._unhooked if self._params[i].requires_grad]:
            self._handles.append(self._params[i].register_post_accumulate_grad_hook(self._marker(i)))
            self._unhooked.remove(i)

    def asked_to_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` was asked to step (whether or not the step then ran): in the open step; or, when a backward
        ran since that step was recorded, in the step the next record opens. Lightning asks before it records:
        an optimizer's step pre-hook fires before the closure that runs ``on_before_optimizer_step``, and its
        GradScaler plugin unscales before that hook. Counted in the open step, each of two optimizers stepping in
        turn after its own backward (manual optimization) was taken as stepping in the other's step too, which
        then kept both models' gradients."""
        (self._asked_next if self._backward_since_read else self._asked)[id(optimizer)] = optimizer

    def fed(self) -> frozenset[int] | None:
        """Close the open step: the indices of the recorded parameters the optimizers asked to step in it hold;
        None when none holds any (the step's owner is unknown: keep every fresh gradient)."""
        asked, self._asked, self._asked_next = self._asked, self._asked_next, {}
        helds = [self.held_by(opt) for opt in asked.values()]
        held = helds[0] if len(helds) == 1 else frozenset().union(*helds)  # one optimizer: its set, not a copy
        return held or None

    def held_by(self, optimizer: torch.optim.Optimizer) -> frozenset[int]:
        """The indices of the recorded parameters ``optimizer`` holds, looked up again only when its parameter
        groups changed (a group added, or a group's list of parameters replaced or resized)."""
        groups = tuple((id(group["params"]), len(group["params"])) for group in optimizer.param_groups)
        cached = self._held.get(id(optimizer))
        if cached is None or cached[0]() is not optimizer or cached[1] != groups:
            held = frozenset(self._index[id(p)] for group in optimizer.param_groups for p in group["params"]
                             if id(p) in self._index)
            cached = self._held[id(optimizer)] = (weakref.ref(optimizer), groups, held)
        return cached[2]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class UnscaleWatch:
    """Calls ``seen(optimizer)`` whenever ``scaler`` unscales an optimizer's gradients: ``GradScaler.step`` does
    before it steps the optimizer or skips it, and a loop that clips first does itself. A skipped step fires no
    optimizer hook, so without this a GAN's skipped generator step kept the discriminator's fresh gradients too.
    ``unscale_`` is wrapped on the scaler's class, acting for the watched scalers alone, and restored when the
    last watch of that class is removed: an attribute on the instance would travel into ``torch.save(scaler)``
    (GradScaler pickles its ``__dict__``) and a ``deepcopy``."""

    _lock = threading.Lock()
    #: per patched class: (its own ``unscale_``, or None where it inherited it; how many watches use it)
    _patched: dict[type, list] = {}
    #: per watched scaler's id: (a weak reference to it, the callbacks)
    _watchers: dict[int, tuple[weakref.ref, list[Callable]]] = {}

    def __init__(self, scaler, seen: Callable[[torch.optim.Optimizer], None]):
        self._cls, self._id, self._seen = type(scaler), id(scaler), seen
        with self._lock:
            ref, callbacks = self._watchers.get(self._id, (None, []))
            if ref is None or ref() is not scaler:  # a scaler since collected had this id
                ref, callbacks = weakref.ref(scaler), []
                self._watchers[self._id] = (ref, callbacks)
            callbacks.append(seen)
            if self._cls not in self._patched:
                self._patched[self._cls] = [self._cls.__dict__.get("unscale_"), 0]
                self._cls.unscale_ = self._wrapped(self._cls.unscale_)
            self._patched[self._cls][1] += 1

    @classmethod
    def _wrapped(cls, unscale):
        def unscale_(scaler, optimizer):
            ref, callbacks = cls._watchers.get(id(scaler), (None, ()))
            if ref is not None and ref() is scaler:
                for seen in tuple(callbacks):
                    seen(optimizer)
            return unscale(scaler, optimizer)

        return unscale_

    def remove(self) -> None:
        with self._lock:
            ref, callbacks = self._watchers.get(self._id, (None, []))
            if self._seen in callbacks:
                callbacks.remove(self._seen)
                if not callbacks:
                    del self._watchers[self._id]
            patch = self._patched.get(self._cls)
            if patch is None:
                return
            patch[1] -= 1
            if patch[1] == 0:
                del self._patched[self._cls]
                if patch[0] is None:
                    del self._cls.unscale_
                else:
                    self._cls.unscale_ = patch[0]
