"""``mpdiag watch``: record an unmodified training script, run in this process as ``python SCRIPT ARGS`` would.

This module owns the interception: for the watch's lifetime it hooks torch's global optimizer step hooks and
patches GradScaler (``__init__``, ``scale``, ``step``; whether ``unscale_`` ran the Recorder reads from its state), autocast's
``__init__``, ``torch.autograd.backward``, the gradient-clipping functions, the optimizers' ``__init__``,
``add_param_group`` and ``zero_grad`` and modules' ``zero_grad`` (gradients dropped without a step drop their loss),
and ``nn.Module.__reduce_ex__`` (so the
replay's two hooks on the script's model stay out of its ``torch.save(model)`` and ``copy.deepcopy(model)``), and
restores every one of them afterwards. It must not compute statistics itself: every number goes through the
:class:`mpdiag.recording.recorder.Recorder`, fed at the moment a step's gradients are complete.

A step is one ``scaler.step(optimizer)`` call, or one ``optimizer.step()`` where no scaler steps it; several
optimizer steps after the same backward passes are one step. Its gradients are read once they are final and
before anything changes them:

* at a clip call (``clip_grad_norm_``/``clip_grad_value_``), read then and recorded at the step that follows -
  unless another backward comes first (a script that clips every micro-batch of an accumulation window): then
  that read is dropped, and the gradients are read again at the next clip call or step;
* else at the scaler's or optimizer's step;
* for ``optimizer.step(closure)`` (LBFGS, Lightning's automatic optimization), after the closure's first
  evaluation, which runs the forward and backward of the step; later evaluations (LBFGS's iterations and line
  search, at other weights) are not part of the recorded step, and their backward values are no step's loss.

So the gradients are unclipped, and unscaled by the Recorder whether or not the script called ``unscale_``. Of
them, the step keeps those of the parameters the optimizers stepping in it hold, written since the previous step
(:mod:`mpdiag.recording.step_gradients`). Its loss is the sum of the (unscaled) values ``backward`` was called on
since the previous step: with accumulation over k micro-batches of ``loss / k``, their mean.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import runpy
import signal
import sys
import threading
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator

import psutil
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from mpdiag.options import WATCH_LEVEL_NAMES
from mpdiag.recording.background import BackgroundWriter, StoreWriteFailed
from mpdiag.recording.console import OutputKeeper
from mpdiag.recording.distributed import DiscardingWriter, RankContext
from mpdiag.recording.recorder import GradientRead, Recorder, gpu_name, scaler_run_fields
from mpdiag.recording.replay import reduce_ex_without_replay_hooks
from mpdiag.recording.run import MpdiagConfig, Run
from mpdiag.training.watch_config import WatchConfig
from mpdiag.training.watch_shadow import WatchShadow

#: what each of WATCH_LEVEL_NAMES does to the script's own autocast regions (dtype, or False to disable) and
#: GradScalers (enabled or not)
WATCH_LEVELS = dict(zip(WATCH_LEVEL_NAMES, [(False, False), (torch.float16, True), (torch.bfloat16, False)], strict=True))
class WatchStopped(BaseException):
    """The watched process got SIGTERM. A BaseException, so the script's ``except Exception`` lets it through."""


class StoppedAtEvent(WatchStopped):
    """``--stop-on``: an event asked to end the training. Raised, as SIGTERM's WatchStopped is, from inside the
    script's step (the capture before its optimizer step), so the script's ``finally`` blocks and context managers
    run and that step's update is not applied; ``watch`` ends the run ``stopped`` with the reason."""


def _wrapped_attributes() -> dict[type, str]:
    """Modules that only wrap another one, holding its parameters under a prefix of their own (``_orig_mod.``,
    ``module.``), and the attribute holding the module inside, which is named instead: the names are the ones
    the user's code uses."""
    from torch._dynamo.eval_frame import OptimizedModule

    wrappers = {OptimizedModule: "_orig_mod", nn.DataParallel: "module", nn.parallel.DistributedDataParallel: "module"}
    for name, wrapper in (("pytorch_lightning.overrides.base", "_LightningModuleWrapperBase"),
                          ("lightning.pytorch.overrides.base", "_LightningModuleWrapperBase"),
                          ("lightning_fabric.wrappers", "_FabricModule"),  # fabric.setup(model)'s
                          ("lightning.fabric.wrappers", "_FabricModule")):
        module = sys.modules.get(name)  # only when the script imported Lightning (or Fabric)
        if module is not None:
            wrappers[getattr(module, wrapper)] = "_forward_module"
    return wrappers


def _unwrapped(module: nn.Module, wrappers: dict[type, str]) -> nn.Module:
    while type(module) in wrappers:
        module = getattr(module, wrappers[type(module)])
    return module


def _live_modules(wrappers: dict[type, str]) -> list[nn.Module]:
    """Every module alive in this process but wrappers (DDP's excepted: the Recorder reads the job's shape from it).
    By ``type()``, never ``isinstance()``: the heap holds objects whose ``__class__`` raises (a dead
    ``weakref.proxy``, which torch.compile leaves behind)."""
    skipped = tuple(t for t in wrappers if t is not nn.parallel.DistributedDataParallel)
    return [m for m in gc.get_objects() if issubclass(type(m), nn.Module) and not issubclass(type(m), skipped)]


def _held_parameters(module: nn.Module) -> list[nn.Parameter]:
    try:
        return list(module.parameters())
    except Exception:  # noqa: BLE001 - a module of the script in an odd state holds nothing watch can name
        return []


class OptimizedParameters(nn.Module):
    """The parameters the script's optimizers hold, each once, named by its path in the module owning it:
    what the Recorder reads. It registers nothing, so it changes no module of the script."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], roots: list[tuple[str, nn.Module]],
                 wrappers: list[nn.Module] = ()):
        super().__init__()
        self._named_params = named
        self.roots = roots  # (name prefix, outermost module holding some of the parameters, wrappers undone)
        self._wrappers = list(wrappers)  # DDP around a root: how the Recorder knows the job is DDP

    def called(self) -> nn.Module | None:
        """The module the script calls for its forward, whose steps the replay keeps and repeats: the one root,
        or the ``torch.compile`` wrapper around it where the script made one (hooks on the module inside would be
        traced into the compiled graph); None when the optimizers' parameters sit in several models (a GAN's:
        which forward made the loss is not known)."""
        if len(self.roots) != 1:
            return None
        from torch._dynamo.eval_frame import OptimizedModule

        root = self.roots[0][1]
        return next((m for m in gc.get_objects() if type(m) is OptimizedModule and m._orig_mod is root), root)

    def named_parameters(self, *args, **kwargs) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self._named_params)

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        yield from (("", wrapper) for wrapper in self._wrappers)
        for root_prefix, root in self.roots:
            yield from root.named_modules(prefix=root_prefix)


#: the weight formats whose updates an optimizer writing them directly rounds away (the update tracker's names)
_LOW_PRECISION_WEIGHTS = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def weight_update_format(params: list[torch.Tensor]) -> str | None:
    """The format every trainable parameter is kept in when it is FP16 or BF16 throughout (a model cast by
    ``.half()`` or ``.bfloat16()`` and updated with no FP32 copy): watch then counts the updates that format cannot
    hold, as ``mpdiag run`` does at O3 and bf16-pure (finding ``update-swamping``). None for FP32 or mixed
    weights, and for tensor subclasses (FSDP2's DTensors, which the tracker does not read, as under mpdiag run)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable or not {type(p) for p in trainable} <= {torch.Tensor, nn.Parameter}:
        return None
    formats = {_LOW_PRECISION_WEIGHTS.get(p.dtype) for p in trainable}
    return formats.pop() if len(formats) == 1 and None not in formats else None


#: the share of the memory free on the weights' device that the update tracker's snapshot of them may take
SNAPSHOT_SHARE = 0.5


def snapshot_refused(params: list[torch.Tensor]) -> str | None:
    """Why the update tracker's copy of the trainable weights (as many bytes as they hold, allocated once) is not
    taken, or None when it fits in SNAPSHOT_SHARE of the memory free where they are: a script whose half model
    fills its GPU must not run out of memory because watch looks at it."""
    trainable = [p for p in params if p.requires_grad]
    needed = sum(p.numel() * p.element_size() for p in trainable)
    device = trainable[0].device
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    elif device.type == "cpu":
        free = psutil.virtual_memory().available
    else:  # no way to read what is free there: not taken
        return f"the memory free on {device.type} cannot be read"
    if needed <= SNAPSHOT_SHARE * free:
        return None
    return f"a copy of the weights would take {needed / 2**30:.1f} GiB of the {free / 2**30:.1f} GiB free"


def optimized_parameters(optimizers) -> OptimizedParameters:
    """Name every distinct parameter of ``optimizers`` (in the order they were created) by its path in the
    outermost module holding it (found among the live modules, wrappers excepted); modules in the order their
    first parameter appears in the optimizers, each prefixed by its class name when there are several (numbered
    only when two share one), so identical runs name their tensors identically."""
    held = list({id(p): p for opt in optimizers for g in opt.param_groups for p in g["params"]}.values())
    position = {id(p): i for i, p in enumerate(held)}
    wrappers = _wrapped_attributes()
    with warnings.catch_warnings():  # some deprecated torch objects warn when looked at
        warnings.simplefilter("ignore")
        owned = ((m, _held_parameters(m)) for m in _live_modules(wrappers))
        holding = {id(m): (m, params) for m, params in owned if any(id(p) in position for p in params)}
    inner = {id(c) for m, _ in holding.values() for c in list(m.modules())[1:]}
    roots = [(m, params) for key, (m, params) in holding.items() if key not in inner]
    roots.sort(key=lambda root: min(position[id(p)] for p in root[1] if id(p) in position))
    outer = [m for m, _ in roots if type(m) in wrappers]
    roots = [(_unwrapped(m, wrappers), params) for m, params in roots]
    classes = [type(m).__name__ for m, _ in roots]
    named, seen, prefixed = [], set(), []
    for k, (root, _) in enumerate(roots):
        cls = classes[k]
        prefix = "" if len(roots) == 1 else cls if classes.count(cls) == 1 else f"{cls}{classes[:k].count(cls)}"
        prefixed.append((prefix, root))
        for name, p in root.named_parameters(prefix=prefix):
            if id(p) in position and id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
    named += [(f"param{position[id(p)]}", p) for p in held if id(p) not in seen]  # held by no module
    return OptimizedParameters(named, prefixed, outer)


class _Patches:
    """Attribute replacements undone in reverse order by :meth:`restore`."""

    def __init__(self):
        self._undo: list[Callable[[], None]] = []

    def set(self, owner, name: str, value) -> None:
        """Replace ``owner.name``; a class's attribute it only inherits (``nn.Module.__reduce_ex__``, object's) is
        deleted again on restore."""
        if isinstance(owner, type) and name not in owner.__dict__:
            setattr(owner, name, value)
            self._undo.append(lambda: delattr(owner, name))
            return
        old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old))

    def hook(self, handle) -> None:
        self._undo.append(handle.remove)

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


def _closure(args, kwargs):
    """The closure given to an optimizer's (or scaler's) ``step`` (``args``: its positional arguments after the
    optimizer), or None."""
    closure = kwargs["closure"] if "closure" in kwargs else args[0] if args else None
    return closure if callable(closure) else None


def _bound(fn, args, kwargs) -> inspect.BoundArguments:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


class Watcher:
    """Installs the interception, feeds the Recorder and ends the run. One per watched process."""

    def __init__(self, config: WatchConfig, run: Run):
        self.config, self.run, self.writer, self.run_id = config, run, run.writer, run.run_id
        self.recorder: Recorder | None = None
        self.steps = 0
        self._optimizers: list[weakref.ref] = []  # the script's optimizers, in the order it created them
        self._scalers: list = []  # GradScalers the script created, newest last (weak references)
        self._scaled: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # scaler.scale() output -> unscaled loss
        self._loss: torch.Tensor | None = None
        self.backward_calls = 0
        self.autocast_regions = 0  # autocast regions the script created while watched (a level changes only these)
        self._recorded = False  # this step's gradients have been given to the Recorder
        self._stepped = False  # an optimizer or scaler step has run since they were
        #: this step's gradients as read at a clip call, with the FP32 shadow's rows for them; recorded at the
        #: step unless a backward comes first
        self._read_at_clip: tuple[GradientRead, list] | None = None
        self._reevaluating = 0  # inside a closure's evaluation after its first (LBFGS): not the recorded step
        self._closure_scaler = None  # a (disabled) scaler stepping an optimizer with a closure
        self._closures: dict[int, list[int]] = {}  # optimizer -> evaluations of the closure its running step got
        self.closures_never_called = 0  # optimizer steps whose closure never ran: those steps are not recorded
        #: parameter tensors an optimizer took after recording began (add_param_group, a new optimizer), unrecorded,
        #: and the step of the first: the Recorder's tensors are those the optimizers held at the first step
        self.added_later: dict[int, int] = {}
        self._patches = _Patches()
        self.shadow: WatchShadow | None = None  # --shadow-every: replays the coming step in FP32 when armed
        self._shadow_error: str | None = None  # why the shadow stopped, for the run's note
        self._snapshot_refused: str | None = None  # why a half model's lost updates were not counted, for the note

    # -- interception --------------------------------------------------------------------------------------
    def install(self) -> None:
        """Patch what a training loop touches, one step each: optimizers (found as they are made, their steps
        seen), GradScaler (the level's enabled/scale, every scaled loss and step), backward, gradient clipping,
        and autocast (the level's dtype; the FP32 shadow's replay turning it off)."""
        level = WATCH_LEVELS.get(self.config.opt_level)
        self._watch_optimizers()
        self._watch_grad_scalers(level)
        self._watch_backward()
        self._watch_gradient_clipping()
        # the replay's hooks sit on the script's model from the first step: out of its pickles and deep copies
        self._patches.set(nn.Module, "__reduce_ex__", reduce_ex_without_replay_hooks)
        if level is not None:
            self._set_autocast_level(level)
        if self.config.shadow_every:
            self._let_the_shadow_turn_autocast_off()

    def _watch_optimizers(self) -> None:
        p, watcher = self._patches, self
        opt_init = torch.optim.Optimizer.__init__

        def optimizer_init(opt, *args, **kwargs):
            opt_init(opt, *args, **kwargs)
            if all(ref() is not opt for ref in watcher._optimizers):
                watcher._optimizers.append(weakref.ref(opt))

        p.set(torch.optim.Optimizer, "__init__", optimizer_init)
        add_param_group = torch.optim.Optimizer.add_param_group

        def add_group(opt, param_group):
            add_param_group(opt, param_group)
            if watcher.recorder is not None:
                recorded = watcher.recorder.recorded_parameter_ids()
                for param in opt.param_groups[-1]["params"]:
                    if id(param) not in recorded:
                        watcher.added_later.setdefault(id(param), watcher.steps)

        p.set(torch.optim.Optimizer, "add_param_group", add_group)
        for owner in (torch.optim.Optimizer, nn.Module):
            p.set(owner, "zero_grad", self._dropping_the_loss_with_the_gradients(owner.zero_grad))
        # a compiled optimizer step traces its hooks: they record (and may run a closure) eagerly, at a graph break
        p.hook(register_optimizer_step_pre_hook(torch.compiler.disable(self._before_optimizer_step)))
        p.hook(register_optimizer_step_post_hook(
            torch.compiler.disable(lambda opt, args, kwargs: watcher._after_optimizer_step(opt))))

    def _watch_grad_scalers(self, level: tuple | None) -> None:
        p, watcher = self._patches, self
        scaler_cls = torch.amp.GradScaler
        scaler_init, scaler_scale, scaler_step = scaler_cls.__init__, scaler_cls.scale, scaler_cls.step

        def init(scaler, *args, **kwargs):
            bound = _bound(scaler_init, (scaler, *args), kwargs)
            if level is not None:
                bound.arguments["enabled"] = level[1]
                if level[1] and bound.arguments["device"] == "cuda" and not torch.cuda.is_available():
                    bound.arguments["device"] = "cpu"  # O1 on a CPU-only machine: a CUDA scaler would disable itself
            if watcher.config.init_scale is not None:
                bound.arguments["init_scale"] = watcher.config.init_scale
            scaler_init(*bound.args, **bound.kwargs)
            watcher._scalers.append(weakref.ref(scaler))
            watch_own_scale(type(scaler))

        def watched_scale(own_scale):
            def scale(scaler, outputs):
                scaled = own_scale(scaler, outputs)
                if torch.is_tensor(outputs) and torch.is_tensor(scaled):
                    watcher._scaled[id(scaled)] = (weakref.ref(scaled), outputs.detach())
                return scaled

            return scale

        own_scales_watched = {scaler_cls}

        def watch_own_scale(cls):
            # a subclass with a scale of its own (FSDP's ShardedGradScaler) never calls GradScaler's: unwatched,
            # its scaled loss was recorded as the loss (1,024 times the script's, ranks' losses included)
            for klass in cls.__mro__[:cls.__mro__.index(scaler_cls)]:
                if "scale" in klass.__dict__ and klass not in own_scales_watched:
                    own_scales_watched.add(klass)
                    p.set(klass, "scale", watched_scale(klass.__dict__["scale"]))

        def step(scaler, optimizer, *args, **kwargs):
            if _closure(args, kwargs) is None:
                watcher._capture(scaler, optimizer)
            else:  # the optimizer's step (a disabled scaler's) captures after the closure ran
                watcher._closure_scaler = scaler
            try:
                return scaler_step(scaler, optimizer, *args, **kwargs)
            finally:
                watcher._mark_stepped()  # also when GradScaler skipped the optimizer's step

        p.set(scaler_cls, "__init__", init)
        p.set(scaler_cls, "scale", watched_scale(scaler_scale))
        p.set(scaler_cls, "step", step)

    def _watch_backward(self) -> None:
        watcher, backward = self, torch.autograd.backward

        def watched_backward(tensors, *args, **kwargs):
            watcher._on_backward(tensors, args[0] if args else kwargs.get("grad_tensors"))
            if watcher.shadow is None:
                return backward(tensors, *args, **kwargs)
            watcher.shadow.in_backward = True  # a forward now (activation checkpointing) is not a call to replay
            try:
                return backward(tensors, *args, **kwargs)
            finally:
                watcher.shadow.in_backward = False

        self._patches.set(torch.autograd, "backward", watched_backward)

    def _watch_gradient_clipping(self) -> None:
        # Each name is wrapped as it is found, so a wrapper installed before watch (a profiler's, a test's) still
        # runs; the capture happens before it.
        for module, names in ((torch.nn.utils, ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")),
                              (torch.nn.utils.clip_grad, ("clip_grad_norm_", "clip_grad_value_"))):
            for name in names:  # clip_grads_with_norm_: the second half of get_total_norm + clip, as HF calls it
                self._patches.set(module, name, self._before(getattr(module, name)))

    def _set_autocast_level(self, level: tuple) -> None:
        watcher, autocast_cls = self, torch.amp.autocast_mode.autocast
        autocast_init = autocast_cls.__init__

        def autocast(region, *args, **kwargs):
            watcher.autocast_regions += 1
            bound = _bound(autocast_init, (region, *args), kwargs)
            if level[0] is False:
                bound.arguments["enabled"] = False
            else:
                bound.arguments["dtype"] = level[0]
            autocast_init(*bound.args, **bound.kwargs)

        self._patches.set(autocast_cls, "__init__", autocast)

    def _let_the_shadow_turn_autocast_off(self) -> None:
        watcher, autocast_cls = self, torch.amp.autocast_mode.autocast
        autocast_enter = autocast_cls.__enter__

        def enter(region):
            # The FP32 replay turns every region off as it is entered, also those made before it: a
            # decorator's (Accelerate wraps the model's forward in one autocast object, made once).
            entered = autocast_enter(region)
            if watcher.shadow is not None and watcher.shadow.replaying:
                torch.set_autocast_enabled(region.device, False)
            return entered

        self._patches.set(autocast_cls, "__enter__", enter)

    def _before(self, clip):
        def clipped(*args, **kwargs):
            self._read_before_clip()
            return clip(*args, **kwargs)

        clipped.__wrapped__ = clip
        return clipped

    def restore(self) -> None:
        self._patches.restore()
        if self.shadow is not None:
            self.shadow.remove()

    # -- step boundaries -----------------------------------------------------------------------------------
    def _on_backward(self, tensors, grad_tensors=None) -> None:
        if self._reevaluating:
            return
        self.backward_calls += 1
        if self._recorded and self._stepped:  # the first backward of a new step
            self._recorded = self._stepped = False
        self._read_at_clip = None  # a clip call before this backward clipped an earlier micro-batch
        # ``torch.autograd.backward([l1, l2])`` back-propagates several losses at once, their sum as one backward
        # each would (its step's loss was NaN, and a false non-finite event followed); tensors given with their
        # gradients (the FP32 shadow's replay of the outputs) are no losses: counted, they doubled the loss
        several = isinstance(tensors, (list, tuple)) and grad_tensors is None
        losses = (tensors,) if torch.is_tensor(tensors) else tuple(tensors) if several else ()
        if not losses or not all(torch.is_tensor(t) and t.numel() == 1 for t in losses):
            return
        for loss in losses:
            ref, unscaled = self._scaled.get(id(loss), (None, None))
            value = unscaled if ref is not None and ref() is loss else loss.detach()
            value = value.reshape(()).double()
            self._loss = value if self._loss is None else self._loss + value

    def _dropping_the_loss_with_the_gradients(self, zero_grad):
        """``zero_grad`` (an optimizer's or a module's), after which a loss back-propagated since the last recorded
        step is dropped when no parameter of the script's optimizers holds a gradient any more: those backward
        passes' gradients were discarded without a step (a Lightning batch returning None at the end of an
        accumulation window under its GradScaler plugin), so their loss is no step's; watch added it to the next
        step's loss. A zero_grad of another model's gradients alone (a GAN's) leaves it."""
        watcher = self

        def watched_zero_grad(owner, *args, **kwargs):
            result = zero_grad(owner, *args, **kwargs)
            if watcher._loss is not None and not watcher._reevaluating:
                optimizers = [opt for opt in (ref() for ref in watcher._optimizers) if opt is not None]
                if all(p.grad is None for opt in optimizers for group in opt.param_groups for p in group["params"]):
                    watcher._loss, watcher._scaled = None, {}
            return result

        return watched_zero_grad

    def _mark_stepped(self) -> None:
        if self._recorded:
            self._stepped = True

    def _after_optimizer_step(self, optimizer) -> None:
        evaluations = self._closures.pop(id(optimizer), None)
        if evaluations is not None and evaluations[0] == 0:
            self.closures_never_called += 1  # its forward and backward never ran where watch could see them
        self._mark_stepped()

    def _before_optimizer_step(self, optimizer, args, kwargs):
        """An optimizer's step is entered: capture now, or, given a closure, once its first evaluation has run
        the step's forward and backward (returned in its place, as torch's step pre-hooks may)."""
        closure = _closure(args[1:], kwargs)  # args[0] is the optimizer itself
        if closure is None:
            self._capture(optimizer=optimizer)
            return None
        evaluated = self._capturing_closure(closure, optimizer)
        return (args, {**kwargs, "closure": evaluated}) if "closure" in kwargs else \
            ((args[0], evaluated, *args[2:]), kwargs)

    def _capturing_closure(self, closure, optimizer):
        evaluations = self._closures[id(optimizer)] = [0]

        def evaluate():
            evaluations[0] += 1
            if evaluations[0] > 1:
                self._reevaluating += 1
                try:
                    return closure()
                finally:
                    self._reevaluating -= 1
            result = closure()
            self._capture(self._closure_scaler, optimizer)
            return result

        return evaluate

    def _read_before_clip(self) -> None:
        if self._recorded or self._read_at_clip is not None or not self._ensure_recorder(None):
            return
        self._read_at_clip = self._read()

    def _read(self) -> tuple[GradientRead, list]:
        """This step's gradients as they are now, and the FP32 shadow's rows for them at a shadow step."""
        read = self.recorder.read_gradients()
        return read, (self._shadow_rows(read) if self.shadow is not None and self.shadow.armed else [])

    def _ensure_recorder(self, scaler) -> bool:
        if self.recorder is None:
            self.recorder = self._start_recorder(scaler)
            if self.recorder is not None:  # --stop-on, and one stderr line per event
                # rank 0's lines only: under torchrun every rank saw the same event (a line per rank repeated it)
                self.recorder.events.configure(self.config.stop_on, announce=not RankContext.launched_as_other_rank())
        return self.recorder is not None

    def _capture(self, scaler=None, optimizer=None) -> None:
        """Record this step's gradients, once per step, before anything changes them; ``optimizer``: one that
        steps in it."""
        if self.recorder is not None and self.recorder.stopped_recording is not None:
            return  # writing to the store failed: the script trains on unrecorded
        if self._recorded:
            if optimizer is not None:
                self.recorder.asked_to_step(optimizer)
            return
        if not self._ensure_recorder(scaler):
            return
        (read, shadow_rows), self._read_at_clip = self._read_at_clip or self._read(), None
        loss = self._loss if self._loss is not None else float("nan")
        self.recorder.record(loss, gradients=read)
        if self.recorder.events.stop_reason is not None:  # --stop-on: before this step's update is applied
            raise StoppedAtEvent(self.recorder.events.stop_reason)
        self.recorder.add_shadow_rows(shadow_rows)
        if optimizer is not None:
            self.recorder.asked_to_step(optimizer)
        self.steps += 1
        if self.shadow is not None and self.steps % self.config.shadow_every == 0:
            self.shadow.arm()
        self._loss, self._scaled = None, {}
        self._recorded = True

    def _shadow_rows(self, read: GradientRead) -> list:
        """The comparison of this step's gradients with their FP32 replay; a replay that fails stops the shadow,
        never the script."""
        scale = float(self.recorder.scaler.get_scale()) if self.recorder.scaler is not None else 1.0
        try:
            reference = self.shadow.reference(scale)
            return [] if reference is None else self.recorder.shadow_rows(reference, read)
        except Exception as exc:  # noqa: BLE001 - the script's training goes on without the shadow
            self._shadow_error = f"The FP32 shadow stopped at step {self.steps}: {type(exc).__name__}: {exc}"
            self.shadow.remove()
            self.shadow = None
            return []

    def _start_recorder(self, scaler) -> Recorder | None:
        """The Recorder over every parameter the script's optimizers hold, with the scaler that steps them
        (the newest enabled GradScaler when the first capture is a clip call)."""
        live = [s for s in (ref() for ref in self._scalers) if s is not None]
        if scaler is None:
            scaler = next((s for s in reversed(live) if s.is_enabled()), None)
        optimizers = [opt for opt in (ref() for ref in self._optimizers) if opt is not None]
        if not optimizers:
            return None
        params = optimized_parameters(optimizers)
        enabled = scaler is not None and scaler.is_enabled()
        device = next((p.device for _, p in params.named_parameters() if p.requires_grad), torch.device("cpu"))
        fields = {"scaling": "dynamic" if enabled else "none", **(scaler_run_fields(scaler) if enabled else {}),
                  "device": str(device), "gpu_name": gpu_name(device)}  # the Recorder's: its first parameter's
        try:
            self.run.describe(**fields)
        except StoreWriteFailed as exc:  # the Recorder would stop at its first write: say it once, never start
            print(f"mpdiag: recording stopped before the first step: {exc}. The training itself goes on.",
                  file=sys.stderr)
            self._optimizers.clear()
            return None
        if self.config.shadow_every:  # before the Recorder's hooks, which the FP32 copies must not carry
            try:
                self.shadow = WatchShadow(list(params.named_parameters()), [root for _, root in params.roots])
            except Exception as exc:  # noqa: BLE001 - e.g. a module deepcopy cannot copy: recorded, not raised
                self._shadow_error = f"The FP32 shadow could not copy the model: {type(exc).__name__}: {exc}"
        called = params.called()
        # the replay as under mpdiag run (on a GPU only with a GradScaler), on the model the script calls; its
        # hooks on that model are kept out of the script's torch.save(model) and deepcopy(model) by install's
        # nn.Module.__reduce_ex__ (word_language_model's torch.load(weights_only=True) refused them once)
        weights = [p for _, p in params.named_parameters()]
        update_format = weight_update_format(weights)
        self._snapshot_refused = None if update_format is None else snapshot_refused(weights)
        return Recorder(params, run=self.run, scaler=scaler if enabled else None, optimizer=optimizers,
                        every=self.config.every, trace_modules=self.config.trace_modules, fp8=self.config.fp8,
                        update_format=None if self._snapshot_refused else update_format,
                        check_optimizer_step=True, replay=None if called is not None else False, replay_model=called)

    # -- the script ----------------------------------------------------------------------------------------
    def run_script(self) -> None:
        """Run the target as ``python [-m] TARGET ARGS`` would, in this process."""
        saved_argv, saved_path = sys.argv, list(sys.path)
        try:
            if self.config.module:
                sys.argv = [self.config.target, *self.config.args]  # runpy puts the module's file in argv[0]
                sys.path[0:0] = [self.config.cwd]
                runpy.run_module(self.config.target, run_name="__main__", alter_sys=True)
            else:
                path = os.path.abspath(self.config.target)
                sys.argv = [self.config.target, *self.config.args]
                sys.path[0:0] = [os.path.dirname(path)]
                runpy.run_path(path, run_name="__main__")
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path

    def end(self, status: str, error: str | None) -> None:
        note = " ".join(self._notes(status)) or None
        if self.recorder is not None:
            if status == "finished":
                self.recorder.close(note=note)
            else:
                self.recorder.fail(error, status=status)
            return
        self.run.end(status, error=error, note=note)

    def _notes(self, status: str) -> list[str]:
        """What the user must know to read this run ending with ``status``: a level that changed nothing, steps that
        could not be seen."""
        notes = []
        level = self.config.opt_level
        if level in ("O1", "bf16") and self.autocast_regions == 0:
            dtype = "FP16" if level == "O1" else "BF16"
            scalers = " Only its GradScaler was switched on." if level == "O1" and self._scalers else ""
            notes.append(f"--opt-level {level} changed nothing in the forward pass: the script entered no autocast "
                         f"region (watch sets the dtype of the script's own regions), so it computed in FP32, not "
                         f"{dtype}.{scalers}")
        if self.closures_never_called:
            notes.append(f"{self.closures_never_called} optimizer step(s) were given a closure they never called: "
                         "watch records a step's gradients once its closure has run the step's forward and backward, "
                         "so those steps are not recorded.")
        if self.added_later:
            notes.append(f"{len(self.added_later)} parameter tensor(s) joined an optimizer after recording began "
                         f"(add_param_group or a new optimizer, first at step {min(self.added_later.values())}): watch "
                         "records the parameters the optimizers held at the first step, so their gradients are in "
                         "no tensor statistics and outside the stored gradient norm. Put every parameter in the "
                         "optimizer from the start (frozen ones included: a layer unfrozen later is recorded).")
        if self.config.shadow_every:
            notes.extend(self._shadow_notes())
        if self._snapshot_refused:
            notes.append(f"The weights are FP16/BF16 throughout, but the updates they lose were not counted: "
                         f"{self._snapshot_refused} (the count compares each weight before and after its step).")
        if not self.steps and status != "finished":  # its error says why: a guess at the loop would mislead
            notes.append("The script stopped before its first optimizer step: nothing was recorded.")
        elif not self.steps:
            why = (f" {self.backward_calls} backward pass(es) ran, so the script likely updates its parameters without "
                   "a torch.optim optimizer (e.g. p.data.add_): use one, or call Recorder.record in the loop."
                   if self.backward_calls else "")
            notes.append(f"No optimizer step was observed: nothing to record.{why}")
        return notes


    def _shadow_notes(self) -> list[str]:
        if self._shadow_error is not None:
            return [self._shadow_error + "."]
        if self.shadow is None or not self.shadow.replayed_steps:
            return ["No step was compared with FP32: the modules holding the optimizers' parameters were not called "
                    "with gradients after step 0 at a shadow step (step 0 runs before watch knows the model)."]
        if self.shadow.loss_outside:
            return ["The FP32 shadow replayed the model's forward and backward in FP32 from the gradient that reached "
                    "its outputs in the mixed-precision step: the loss is computed outside the model's forward, so "
                    "the loss head itself is not part of the comparison."]
        return []


#: the exit status of ``mpdiag run`` and ``mpdiag watch`` when --stop-on ended the training at an event
STOPPED_EXIT_CODE = 3


def _stop(signum, frame):
    raise WatchStopped(f"stopped by signal {signal.Signals(signum).name}")


def _exit_code(code) -> int:
    """``sys.exit(code)``'s process exit status, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


class WatchSession:
    """One watched run: its store writer, run row and the interception, from construction to :meth:`end`.
    ``watch`` wraps a script in one; the framework callbacks (:mod:`mpdiag.integrations`) wrap a training call
    in one, handing over the ``optimizers`` made before it started. One at a time in a process. ``console``: a
    capture of this process's output (``mpdiag watch`` in a terminal tees it), kept with the run."""

    active: WatchSession | None = None

    def __init__(self, config: WatchConfig, store: str | os.PathLike | Callable[[], object], optimizers=(),
                 console=None):
        config.validate()
        if WatchSession.active is not None:
            raise RuntimeError("mpdiag is already watching this process: one watched run at a time")
        # under torchrun, rank 0 records the job; the other ranks run the script with watch's hooks (their
        # collectives must match rank 0's) and write nothing
        self.writer = DiscardingWriter() if RankContext.launched_as_other_rank() else BackgroundWriter(store)
        try:
            settings = config.settings()
            # the level and every are the settings'; the scaling and device are the script's, known once its
            # first optimizer step is (Watcher._start_recorder)
            self.run = Run.create(
                self.writer, config=MpdiagConfig({"watch": settings}), name=config.name or os.path.basename(config.target),
                script_path=None if config.module or config.bundle else os.path.abspath(config.target),
                scaling="none", device="cpu", torch_version=torch.__version__, parent_run_id=config.parent_run_id)
            self.run_id = self.run.run_id
            self.watcher = Watcher(config, self.run)
            self.watcher._optimizers.extend(weakref.ref(opt) for opt in optimizers)
            self.watcher.install()
            self.output = None if console is None else OutputKeeper(self.writer, [self.run_id], console)
        except BaseException:
            self.writer.close()
            raise
        WatchSession.active = self

    def end(self, status: str, error: str | None) -> None:
        """Undo the interception and end the run (``finished``, ``failed`` or ``crashed``); idempotent."""
        if WatchSession.active is not self:
            return
        WatchSession.active = None
        self.watcher.restore()
        try:
            try:
                self.watcher.end(status, error)  # first: the Recorder meets a failed write itself and says so
                if self.output is not None:
                    self.output.finish()
            finally:
                self.writer.close()
        except StoreWriteFailed as exc:  # the script has run; what could not be stored is said, not raised
            stopped = self.watcher.recorder is not None and self.watcher.recorder.stopped_recording is not None
            if not stopped:
                print(f"mpdiag: the run could not be stored in full: {exc}", file=sys.stderr)


@contextlib.contextmanager
def _run_ended_at_os_exit(session: WatchSession) -> Iterator[None]:
    """While the script runs, its own ``os._exit(code)`` ends the run before the process: finished for 0, failed
    otherwise, as returning or ``sys.exit(code)`` would. ``os._exit`` ends a process without unwinding (no
    ``finally``, no atexit), so the run was left open and read crashed, its last rows uncommitted; it is how
    torchrun scripts avoid the finalization hangs of docs/distributed.md (a DDP job's run had none of its steps).
    Only in this process: a forked child (a DataLoader worker, a ``multiprocessing`` process) ends by ``os._exit``
    too, and its exit is not the script's."""
    real, watching = os._exit, os.getpid()

    def exit_after_ending_the_run(code: int) -> None:
        if os.getpid() == watching:
            os._exit = real
            session.end("finished" if code == 0 else "failed",
                        None if code == 0 else f"the script called os._exit({code!r})")
        real(code)

    os._exit = exit_after_ending_the_run
    try:
        yield
    finally:
        if os._exit is exit_after_ending_the_run:
            os._exit = real


def watch(config: WatchConfig, store: str | os.PathLike | Callable[[], object], console=None) -> tuple[int, int]:
    """Run the script under ``config``, record it as one run into ``store`` (a store path, or a callable
    returning a writer-like sink, as a supervised child's forwarder is) and return (run id, the script's exit
    code); the run id is None on a torchrun rank other than 0, which records nothing. ``console``: a
    :class:`~mpdiag.store.console.ConsoleCapture` of this process's output, kept with the run (refreshed while it
    runs); never given in a supervised child, whose supervisor keeps its output.

    Raises ConfigError before anything runs or is stored when an option is refused."""
    session = WatchSession(config, store, console=console)
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop) if on_main else None
    try:
        with _run_ended_at_os_exit(session):
            session.watcher.run_script()
        status, error, code = "finished", None, 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
        status, error = ("finished", None) if code == 0 else ("failed", f"the script called sys.exit({exc.code!r})")
    except StoppedAtEvent as exc:
        status, error, code = "stopped", str(exc), STOPPED_EXIT_CODE
    except WatchStopped as exc:  # asked to end (the dashboard's Stop, a kill): stopped, as python's exit code says
        status, error, code = "stopped", str(exc), 128 + signal.SIGTERM
    except KeyboardInterrupt:
        status, error, code = "stopped", "stopped by keyboard interrupt (SIGINT)", 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 - the script's own error: recorded, printed, exit 1 as python would
        error = traceback.format_exc()
        print(error, file=sys.stderr, end="")
        status, code = "failed", 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    session.end(status, error)
    return session.run_id, code
