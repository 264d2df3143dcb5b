"""Model scripts: loading one and checking it keeps the contract.

A model script is a Python file defining ``build(device)`` that returns a dict with keys

* ``model``: a ``torch.nn.Module``;
* ``optimizer``: a ``torch.optim.Optimizer`` over ``model.parameters()``, or a callable ``params -> Optimizer``;
* ``batches``: an iterable of batches, or a callable ``step -> batch``;
* ``loss_fn``: a callable ``(model, batch) -> scalar loss tensor``;
* optionally ``name`` and ``description`` (strings);
* optionally ``clip_grad_norm`` (a number > 0: the gradients' 2-norm is clipped to it before every optimizer
  step, after unscaling), ``scheduler`` (a callable ``optimizer -> LRScheduler``, stepped once after every
  optimizer step, skipped ones included) and ``accumulate`` (an integer k >= 1: k micro-batches per optimizer
  step).

Every problem is reported as a :class:`ScriptError` whose message names the file and what to change; an
exception raised by the script's own code carries the script's traceback lines. Reading the script and running
its code as a module is :mod:`mpdiag.training.script_source`'s (torch-free); building and checking it is here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mpdiag.options import ScriptError
from mpdiag.training.script_source import ModelScript, script_errors

REQUIRED_KEYS = ("model", "optimizer", "batches", "loss_fn")


@dataclass
class BuiltModel:
    """What ``build(device)`` returned, checked and normalised."""

    model: torch.nn.Module
    #: ``make_optimizer(params, originals=None)``: an optimizer over ``params``; ``originals``, when given, are
    #: the model parameters that ``params`` stand in for, in the same order (O2's FP32 masters)
    make_optimizer: Callable[..., torch.optim.Optimizer]
    batches: Callable[[], Iterator[Any]]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    name: str
    description: str
    optimizer_rebuildable: bool
    #: the max 2-norm gradients are clipped to before each optimizer step, or None
    clip_grad_norm: float | None = None
    #: ``make_scheduler(optimizer)`` -> the LRScheduler over the optimizer that steps, or None
    make_scheduler: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler] | None = None
    #: micro-batches per optimizer step
    accumulate: int = 1


def _rebuild_optimizer(optimizer: torch.optim.Optimizer, filename: str):
    """A factory that returns ``optimizer`` itself for the model's own parameters, and over stand-ins for them
    (``params[i]`` replacing ``originals[i]``, e.g. FP32 master weights) a new optimizer of the same class with
    every parameter group and its hyper-parameters, each parameter mapped by identity. Parameters without a
    stand-in (frozen ones) are left out of the new groups: nothing would update them."""

    def make(params, originals=None):
        if originals is None:
            return optimizer
        stand_in = {id(original): param for original, param in zip(originals, params, strict=True)}
        groups = [
            {**{k: v for k, v in group.items() if k != "params"},
             "params": [stand_in[id(p)] for p in group["params"] if id(p) in stand_in]}
            for group in optimizer.param_groups
        ]
        try:
            return type(optimizer)(groups)
        except Exception as exc:  # noqa: BLE001 - reported to the user with the fix
            raise ScriptError(
                f"{filename}: cannot rebuild {type(optimizer).__name__} from its parameter groups over the FP32 "
                f"master weights ({exc}). Return 'optimizer' as a callable, e.g. "
                "lambda params: torch.optim.Adam(params, lr=1e-3)."
            ) from exc

    return make


def build_model(script: ModelScript, device: torch.device) -> BuiltModel:
    """Load the script, call ``build(device)`` and check the result against the contract, key by key."""
    spec = _called_build(script, device)
    model = _checked_model(spec["model"], script.filename)
    make_optimizer, rebuildable = _optimizer_factory(spec["optimizer"], model, script)
    batches = _batch_source(spec["batches"], script)
    loss_fn = spec["loss_fn"]
    if not callable(loss_fn):
        raise ScriptError(f"{script.filename}: 'loss_fn' is a {type(loss_fn).__name__}; it must be a callable "
                          "(model, batch) -> loss.")
    for key in ("name", "description"):
        if key in spec and not isinstance(spec[key], str):
            raise ScriptError(f"{script.filename}: '{key}' must be a string, got {type(spec[key]).__name__}.")
    return BuiltModel(
        model=model,
        make_optimizer=make_optimizer,
        batches=batches,
        loss_fn=_checked_loss(loss_fn, script),
        name=spec.get("name") or Path(script.filename).stem,
        description=spec.get("description", ""),
        optimizer_rebuildable=rebuildable,
        **_optional_training_keys(spec, script),
    )


def _called_build(script: ModelScript, device: torch.device) -> dict:
    """What the script's ``build(device)`` returned: a dict holding every required key."""
    module = script.load_module()
    fname = script.filename
    build = getattr(module, "build", None)
    if not callable(build):
        raise ScriptError(f"{fname}: defines no function build(device). A model script must define it.")
    with script_errors(script, "in build(device)"):
        spec = build(device)
    if not isinstance(spec, dict):
        raise ScriptError(f"{fname}: build(device) returned {type(spec).__name__}; it must return a dict.")
    missing = [k for k in REQUIRED_KEYS if k not in spec]
    if missing:
        raise ScriptError(
            f"{fname}: build(device) returned a dict without {', '.join(repr(k) for k in missing)} "
            f"(required keys: {', '.join(REQUIRED_KEYS)})."
        )
    return spec


def _checked_model(model, fname: str) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise ScriptError(f"{fname}: 'model' is a {type(model).__name__}; it must be a torch.nn.Module.")
    if not any(p.requires_grad for p in model.parameters()):
        raise ScriptError(f"{fname}: the model has no trainable parameters.")
    return model


def _optimizer_factory(optimizer, model: torch.nn.Module, script: ModelScript) -> tuple[Callable, bool]:
    """(params -> optimizer, whether the script's own factory builds it) from the ``optimizer`` key: an
    instance over the model's parameters (rebuilt alike over the parameters a level trains) or a factory."""
    fname = script.filename
    if isinstance(optimizer, torch.optim.Optimizer):
        mine = {id(p) for p in model.parameters()}
        if not all(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
            raise ScriptError(f"{fname}: 'optimizer' holds parameters that are not the model's.")
        return _rebuild_optimizer(optimizer, fname), False
    if callable(optimizer):
        return _checked_factory(optimizer, script), True
    raise ScriptError(
        f"{fname}: 'optimizer' is a {type(optimizer).__name__}; it must be a torch.optim.Optimizer "
        "or a callable params -> Optimizer."
    )


def _batch_source(batches, script: ModelScript) -> Callable[[], Iterator]:
    """A function starting the ``batches`` key's stream (a callable step -> batch, or an iterable), each batch
    made inside :func:`script_errors` so a failing data loader is named as the script's error."""
    if callable(batches):
        def batch_iter(fn=batches):
            step = 0
            while True:
                with script_errors(script, f"in batches({step})"):
                    batch = fn(step)
                yield batch
                step += 1
        return batch_iter
    if isinstance(batches, Iterable) and not isinstance(batches, (str, bytes)):
        def batch_iter(it=batches):
            iterator = iter(it)
            while True:
                with script_errors(script, "while producing a batch"):
                    try:
                        batch = next(iterator)
                    except StopIteration:
                        return
                yield batch
        return batch_iter
    raise ScriptError(
        f"{script.filename}: 'batches' is a {type(batches).__name__}; it must be an iterable of batches or a "
        "callable step -> batch."
    )


def _optional_training_keys(spec: dict, script: ModelScript) -> dict:
    """The checked ``clip_grad_norm``, ``scheduler`` and ``accumulate`` keys as BuiltModel fields."""
    fname, fields = script.filename, {}
    clip = spec.get("clip_grad_norm")
    if clip is not None:
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip <= 0:
            raise ScriptError(f"{fname}: 'clip_grad_norm' is {clip!r}; it must be a finite number > 0 (the max 2-norm).")
        fields["clip_grad_norm"] = float(clip)
    scheduler = spec.get("scheduler")
    if scheduler is not None:
        if not callable(scheduler) or isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise ScriptError(
                f"{fname}: 'scheduler' is a {type(scheduler).__name__}; it must be a callable optimizer -> LRScheduler "
                "(the runner builds it over the optimizer that actually steps), e.g. "
                "lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=10)."
            )
        fields["make_scheduler"] = _checked_scheduler(scheduler, script)
    accumulate = spec.get("accumulate", 1)
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ScriptError(f"{fname}: 'accumulate' is {accumulate!r}; it must be an integer >= 1 (micro-batches per optimizer step).")
    fields["accumulate"] = accumulate
    return fields


def _checked_scheduler(factory, script: ModelScript):
    def make(optimizer):
        with script_errors(script, "in the scheduler callable"):
            scheduler = factory(optimizer)
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise ScriptError(
                f"{script.filename}: the 'scheduler' callable returned {type(scheduler).__name__}; it must return "
                "a torch.optim.lr_scheduler.LRScheduler."
            )
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ScriptError(
                f"{script.filename}: the 'scheduler' callable returned ReduceLROnPlateau, whose step() needs a "
                "metric; the runner calls step() with no arguments after every optimizer step."
            )
        if scheduler.optimizer is not optimizer:
            raise ScriptError(
                f"{script.filename}: the 'scheduler' callable returned a scheduler over another optimizer; build "
                "it over the optimizer it is given."
            )
        return scheduler

    return make


def _checked_factory(factory, script: ModelScript):
    def make(params, originals=None):  # noqa: ARG001 - a callable builds over whatever it is given
        with script_errors(script, "in the optimizer factory"):
            opt = factory(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ScriptError(
                f"{script.filename}: the 'optimizer' callable returned {type(opt).__name__}; "
                "it must return a torch.optim.Optimizer."
            )
        return opt

    return make


def _checked_loss(loss_fn, script: ModelScript):
    def compute(model, batch):
        with script_errors(script, "in loss_fn"):
            loss = loss_fn(model, batch)
        if not torch.is_tensor(loss):
            raise ScriptError(
                f"{script.filename}: loss_fn returned {type(loss).__name__}; it must return a scalar tensor."
            )
        if loss.numel() != 1:
            raise ScriptError(
                f"{script.filename}: loss_fn returned a tensor of shape {list(loss.shape)}; it must return a "
                "scalar (reduce it, e.g. with .mean())."
            )
        if not loss.requires_grad:
            raise ScriptError(
                f"{script.filename}: the loss does not require grad (was it computed under torch.no_grad() "
                "or from detached tensors?)."
            )
        return loss.reshape(())

    return compute
