"""The FP32 shadow of a watched script (``mpdiag watch --shadow-every N``): FP32 gradients of a step of a loop
mpdiag does not own.

``mpdiag run`` recomputes a shadow step from the model script's ``loss_fn`` (:mod:`mpdiag.numerics.shadow`). A
watched script has no such function: its loss is whatever code runs between the model's forward and
``backward``. So the shadow replays what it can see. At a shadow step, every forward call of a *root* (an
outermost module holding the optimizers' parameters) made with gradients enabled is captured: a copy of its
inputs and the random generators' state before it; and, during the script's own backward, the gradient that
reached each of its outputs. Before the step's gradients are read, each call is replayed on an FP32 copy of
the root holding the same weights and buffers, with autocast off and the generators as they were (dropout
draws the same numbers), and its outputs are back-propagated with the captured output gradients divided by the
loss scale. The sum over the step's calls (micro-batches) is the reference handed to
:meth:`mpdiag.recording.recorder.Recorder.compare_gradients`.

What that reference is, exactly: the model's forward and backward in FP32. When the script computes its loss
inside the model's forward (nanoGPT's ``model(X, Y)``, Hugging Face models given labels), the loss is an output
whose gradient is the scale itself, so the whole step is FP32, as in ``mpdiag run``. When it computes the loss
outside (``criterion(model(x), y)``), the gradient of the loss with respect to the model's output is the
mixed-precision one (the loss head is not replayed), so the comparison measures the model's own layers and
leaves the loss head out; the run's note says which it was.

Owns the capture and the replay. Must not write to the store (the Recorder does) nor decide when a step is a
shadow step (the watcher does). Costs, at shadow steps only: copies of the roots' inputs and output gradients,
one FP32 forward and backward per captured call; and, once, an FP32 copy of each root (4 bytes per parameter
and buffer value, plus its gradients).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from mpdiag.numerics.nested import map_tensors
from mpdiag.numerics.shadow import rng_state


class ModifiedOutput(RuntimeError):
    """A step the shadow cannot replay: an output it watched through a view was changed in place."""


def _tensors(value) -> list[torch.Tensor]:
    """The tensors inside ``value`` (nested containers), in map_tensors' order."""
    found: list[torch.Tensor] = []
    map_tensors(lambda t: found.append(t) or t, value)
    return found


def _replace_tensors(fn, value):
    """map_tensors, except that a dict subclass (a Hugging Face ModelOutput, whose attributes the script reads)
    is updated in place rather than rebuilt as a plain dict."""
    if isinstance(value, dict) and type(value) is not dict:
        for key in list(value.keys()):
            value[key] = _replace_tensors(fn, value[key])
        return value
    if isinstance(value, (list, tuple)) and not torch.is_tensor(value):
        mapped = [_replace_tensors(fn, v) for v in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else type(value)(mapped)
    return map_tensors(fn, value)


def _as_fp32(value):
    """``value`` with its floating-point tensors as detached FP32 copies (FP16/BF16 -> FP32 is exact)."""
    return map_tensors(lambda t: t.detach().float() if t.is_floating_point() else t.detach().clone(), value)


@dataclass
class _Call:
    """One captured forward call of a root."""

    root: int
    args: tuple
    kwargs: dict
    rng: tuple
    output_grads: list[torch.Tensor | None] = field(default_factory=list)
    views: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # outputs given as views, their versions


class WatchShadow:
    """FP32 shadow gradients of the parameters ``named`` (as the Recorder reads them, in order), held by
    ``roots``. Call :meth:`arm` when the coming step is a shadow step, :meth:`reference` when its gradients are
    read."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], roots: list[nn.Module]):
        self._roots = roots
        where = {id(p): (r, name) for r, root in enumerate(roots) for name, p in root.named_parameters()}
        self._where = [where.get(id(p)) for _, p in named]  # (root index, name in it) per recorded parameter
        # copied before any hook of mpdiag's is on them (deepcopy copies hooks; the script's own stay, as they
        # are part of its forward)
        self._copies = [copy.deepcopy(root).float() for root in roots]
        self._calls: list[_Call] = []
        self._armed = False
        self.replaying = False  # True during a replay: the watcher keeps autocast off, captures nothing
        self.in_backward = False  # set by the watcher: a forward during backward (checkpointing) is not a call
        self.loss_outside = False  # some replayed call's output gradient came from a loss computed outside it
        self.replayed_steps = 0
        self._hooks = [h for r, root in enumerate(roots)
                       for h in (root.register_forward_pre_hook(self._pre_forward(r), with_kwargs=True),
                                 root.register_forward_hook(self._post_forward(r), with_kwargs=True))]

    def arm(self) -> None:
        self._armed, self._calls = True, []

    @property
    def armed(self) -> bool:
        return self._armed

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()

    # -- capture --------------------------------------------------------------------------------------------
    def _capturing(self, module: nn.Module, r: int) -> bool:
        # a deep copy of a root the script makes (an EMA model, its own reference) carries these hooks too
        return (self._armed and module is self._roots[r] and not self.replaying and not self.in_backward
                and torch.is_grad_enabled())

    def _pre_forward(self, r: int):
        def hook(module, args, kwargs):
            if self._capturing(module, r):
                device = next((t.device for t in _tensors((args, kwargs))), torch.device("cpu"))
                self._calls.append(_Call(r, _as_fp32(args), _as_fp32(kwargs), rng_state(device)))
        return hook

    def _post_forward(self, r: int):
        def hook(module, args, kwargs, output):
            if not self._capturing(module, r) or not self._calls or self._calls[-1].root != r or self._calls[-1].output_grads:
                return None
            call = self._calls[-1]
            count = len(_tensors(output))
            call.output_grads = [None] * count
            index = iter(range(count))

            def seen_from_outside(out: torch.Tensor) -> torch.Tensor:
                # A new node per output, so the gradient reaching it is only what the code after the forward
                # sends (a loss computed inside from the logits also reaches the logits themselves). The hook is
                # on that node: an in-place change of the output afterwards (the HF Trainer's `loss *= ...`)
                # keeps it in the graph for a copy, the cheap choice for a loss; a large output gets an identity
                # view instead (no copy), which an in-place change would cut out of the graph: checked at replay.
                i = next(index)
                if not out.requires_grad:
                    return out
                tapped = out.clone() if out.numel() == 1 else out.view_as(out)
                tapped.grad_fn.register_prehook(self._keep_grad(call, i))
                if tapped._is_view():
                    call.views.append((tapped, tapped._version))
                return tapped

            return _replace_tensors(seen_from_outside, output)
        return hook

    @staticmethod
    def _keep_grad(call: _Call, i: int):
        def keep(grad_outputs):
            if grad_outputs[0] is None:
                return None
            grad = grad_outputs[0].detach().float()
            call.output_grads[i] = grad if call.output_grads[i] is None else call.output_grads[i] + grad
            return None
        return keep

    # -- replay ---------------------------------------------------------------------------------------------
    def reference(self, scale: float) -> list[torch.Tensor | None] | None:
        """FP32 gradients of the recorded parameters for the step captured since :meth:`arm` (None where a
        parameter got none), the captured output gradients divided by ``scale`` (the loss scale the script's
        backward used); None when no captured call received a gradient."""
        self._armed = False
        calls, self._calls = [p for p in self._calls if any(g is not None for g in p.output_grads)], []
        if not calls:
            return None
        changed = [view for call in calls for view, version in call.views if view._version != version]
        if changed:
            raise ModifiedOutput(f"an output of the model ({tuple(changed[0].shape)}) was changed in place after "
                                 "the forward, so the gradient it received cannot be seen")
        for copy_ in self._copies:
            copy_.zero_grad(set_to_none=True)
        self.replaying = True
        try:
            for call in calls:
                self._replay(call, scale)
        finally:
            self.replaying = False
        self.replayed_steps += 1
        return [None if where is None else self._copies[where[0]].get_parameter(where[1]).grad
                for where in self._where]

    def _fp32_copy(self, r: int) -> nn.Module:
        """The FP32 copy of root ``r`` holding its current weights and buffers."""
        root, mine = self._roots[r], self._copies[r]
        with torch.no_grad():
            state = mine.state_dict()
            for name, value in root.state_dict().items():
                if name in state and torch.is_tensor(value):
                    state[name].copy_(value)
        mine.train(root.training)
        return mine

    def _replay(self, call: _Call, scale: float) -> None:
        model = self._fp32_copy(call.root)
        cpu, cuda = call.rng
        device = next((t.device for t in _tensors((call.args, call.kwargs))), torch.device("cpu"))
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, device)
            with torch.autocast(device.type, enabled=False):
                outputs = _tensors(model(*call.args, **call.kwargs))
        pairs = [(out, grad / scale) for out, grad in zip(outputs, call.output_grads, strict=True)
                 if grad is not None and out.requires_grad]
        # a loss returned by the forward gets the scale (or scale/k) as its gradient: a scalar output
        self.loss_outside |= not any(out.dim() == 0 for out, _ in pairs)
        torch.autograd.backward([out for out, _ in pairs], [grad.to(out.dtype) for out, grad in pairs])
