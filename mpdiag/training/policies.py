"""Precision policies: one small class per opt level, all behind :class:`PrecisionPolicy`.

A policy decides how weights are stored, which ops run in low precision, and how the loss is scaled. The
training loop calls, per step::

    policy.zero_grad(optimizer)
    with policy.autocast():
        loss = loss_fn(model, batch)
    policy.backward(loss)          # gradients now hold S * g
    recorder.record(loss)
    policy.step(optimizer)         # unscale, skip on inf/NaN, update the scale

The opt levels follow apex's table (docs/cli.md: Opt levels, and docs/background.md), built on native torch:

======== ============= ============== ==================== ============== ==================
level    weights       per-op casting norm layers          master weights loss scale
======== ============= ============== ==================== ============== ==================
O0       fp32          no             fp32                 no             none
O1       fp32          autocast fp16  (autocast lists)     no             dynamic
O2       fp16          no             fp32 (see below)     fp32           dynamic
O3       fp16          no             fp16                 no             static 1.0
bf16     fp32          autocast bf16  (autocast lists)     no             none
bf16-pure bf16         no             bf16                 no             none
fp8-sim  fp32          as bf16; every (autocast lists)     no             none
                       Linear via FP8
fp8-sim- fp32          as O1; every   (autocast lists)     no             dynamic
fp16                   Linear via FP8
======== ============= ============== ==================== ============== ==================

``--moment-format bf16|fp8`` holds the optimizer's state in that format at any level: after every optimizer step
each floating state tensor but the step count is rounded through it with torch's own cast (FP8: E4M3 at the
tensor's current per-tensor scale, saturating), :func:`hold_optimizer_state`. A simulation: the tensors stay in
their dtype, holding only values the format can.

At O2 a normalization module keeps FP32 parameters and computes in FP32 (:func:`is_norm_module`: torch's
norm layers, a class name ending in ``Norm``, or a forward calling a functional norm on its own parameters);
blocks it wraps stay FP16.

Every FP16 level scales through :class:`LossScaler` (a ``torch.amp.GradScaler``), so "skipped" and the scale
trajectory mean the same at every level: a step whose gradients hold inf/NaN is skipped, and a dynamic
scale is multiplied by ``backoff_factor``.

Owns the torch side of each level. Must not define or validate options: the options, their bounds, the level
names, summaries and default scaling are :mod:`mpdiag.options`'s (importable without torch).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from mpdiag.numerics.fp8_recipes import FP8_E4M3, Fp8Settings
from mpdiag.numerics.nested import map_tensors
from mpdiag.options import ConfigError, RunConfig
from mpdiag.training.fp8_sim import AmaxHistory, quantize_dequantize, simulate_fp8

#: ``factory(params, originals=None)``: see :attr:`mpdiag.training.script.BuiltModel.make_optimizer`
OptimizerFactory = Callable[..., torch.optim.Optimizer]
NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
#: functional normalizations whose call in a module's own forward makes it a normalization module at O2
NORM_FUNCTIONS = frozenset({"layer_norm", "group_norm", "batch_norm", "rms_norm"})


def _forward_calls_norm(module: nn.Module) -> bool:
    """Whether the source of ``module``'s forward calls a function named layer_norm, group_norm, batch_norm or
    rms_norm (``F.layer_norm(...)``, ``torch.nn.functional.rms_norm(...)``, ``layer_norm(...)``)."""
    try:
        source = textwrap.dedent(inspect.getsource(type(module).forward))
    except (OSError, TypeError):  # no source (built in, or generated): only the class name can tell
        return False
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in NORM_FUNCTIONS:
                return True
    return False


def is_norm_module(module: nn.Module) -> bool:
    """A normalization module O2 keeps in FP32: torch's own, one whose class name ends in ``Norm``, or one with
    parameters of its own whose forward calls a functional normalization (a GPT-style LayerNorm)."""
    if isinstance(module, NORM_LAYERS) or type(module).__name__.endswith("Norm"):
        return True
    return any(True for _ in module.parameters(recurse=False)) and _forward_calls_norm(module)


class LossScaler(torch.amp.GradScaler):
    """GradScaler with the three things the opt levels need beyond it.

    * ``static``: the scale never changes (steps with inf/NaN gradients are still skipped);
    * ``min_scale`` / ``max_scale``: bounds on a dynamic scale, applied on the device after each update;
    * ``allow_fp16_grads``: unscale FP16 gradients in place (pure-FP16 O3), through GradScaler's own
      ``allow_fp16`` path (the one FSDP's ShardedGradScaler uses). GradScaler refuses them otherwise.
    """

    def __init__(self, device_type: str, scaling: RunConfig, static: float | None, allow_fp16_grads: bool):
        super().__init__(
            device_type,
            init_scale=static if static is not None else scaling.init_scale,
            growth_factor=scaling.growth_factor,
            backoff_factor=scaling.backoff_factor,
            growth_interval=scaling.growth_interval,
        )
        self.static = static
        self.min_scale, self.max_scale = scaling.min_scale, scaling.max_scale
        self.allow_fp16_grads = allow_fp16_grads

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16 or self.allow_fp16_grads)

    def update(self, new_scale=None) -> None:
        if self.static is not None:
            super().update(new_scale=float(self.static))  # clears per-step state, keeps the scale
            return
        super().update(new_scale)
        if self._scale is not None and (self.min_scale is not None or self.max_scale is not None):
            self._scale.clamp_(min=self.min_scale, max=self.max_scale)


#: a state tensor the moments' format leaves alone: Adam's step count (a float tensor) is a count, not a moment
STATE_COUNTS = frozenset({"step"})


def hold_optimizer_state(optimizer: torch.optim.Optimizer, fmt: str) -> None:
    """Round every floating tensor of ``optimizer``'s state (but STATE_COUNTS) through ``fmt`` in place: "bf16" by
    torch's cast to bfloat16 and back; "fp8" by a saturating cast to E4M3 at the tensor's own current scale
    (fp8_sim.quantize_dequantize, the current recipe's scale) and back."""
    current = Fp8Settings(recipe="current", history=1)
    with torch.no_grad():
        for state in optimizer.state.values():
            for key, tensor in state.items():
                if key in STATE_COUNTS or not torch.is_tensor(tensor) or not tensor.is_floating_point():
                    continue
                if fmt == "bf16":
                    held = tensor.to(torch.bfloat16)
                else:
                    held = quantize_dequantize(tensor, AmaxHistory(FP8_E4M3, current, tensor.device))
                tensor.copy_(held)


def _cast_floats(value, dtype: torch.dtype):
    """``value`` with every floating-point tensor inside (nested lists, tuples, dicts) cast to ``dtype``."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, value)


def _cast_io(module: nn.Module, inputs_to: torch.dtype, outputs_to: torch.dtype) -> None:
    """Cast a module's floating inputs to ``inputs_to`` and its floating outputs to ``outputs_to``."""
    module.register_forward_pre_hook(
        lambda m, args, kwargs: (_cast_floats(args, inputs_to), _cast_floats(kwargs, inputs_to)), with_kwargs=True
    )
    module.register_forward_hook(lambda m, args, output: _cast_floats(output, outputs_to))


class PrecisionPolicy:
    """How one opt level trains. Subclasses set the class attributes and override what differs; the level's
    summary and default loss scaling are in :data:`mpdiag.options.LEVELS` under ``name``."""

    name: ClassVar[str]
    #: weights (and so gradients) of non-norm layers are stored in this dtype
    weight_dtype: ClassVar[torch.dtype] = torch.float32
    #: the low-precision format the model's weights are stored in, whose resolution the Recorder checks
    #: optimizer updates against (mpdiag.numerics.updates): updates are lost in it (O3) or kept by masters (O2)
    update_format: ClassVar[str | None] = None

    def __init__(self, device: torch.device, config: RunConfig):
        self.device = device
        self.config = config
        mode = config.scaling
        self.scaler: LossScaler | None = None
        if mode is not None:
            static = None if mode == "dynamic" else float(mode)
            self.scaler = LossScaler(device.type, config, static, allow_fp16_grads=self.weight_dtype != torch.float32)
        self.model: nn.Module | None = None

    @classmethod
    def check(cls, device: torch.device) -> None:
        """Raise ConfigError when this level cannot run on ``device`` (the options were validated before)."""

    @property
    def scaling_mode(self) -> str:
        """'none', 'dynamic' or 'static'."""
        if self.scaler is None:
            return "none"
        return "static" if self.scaler.static is not None else "dynamic"

    def prepare(self, model: nn.Module, make_optimizer: OptimizerFactory):
        """Return (model, optimizer) ready for this level; the default keeps FP32 weights."""
        self.model = model
        return model, make_optimizer(model.parameters())

    def master_params(self) -> list[torch.Tensor]:
        """FP32 master copies of the weights, when this level keeps them."""
        return []

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, clip_grad_norm: float | None = None) -> None:
        """Unscale, clip the 2-norm of every gradient the optimizer uses to ``clip_grad_norm`` when given (after
        unscaling, so the bound is on the true gradients), step (skipped on inf/NaN) and update the scale."""
        if self.scaler is not None and clip_grad_norm is not None:
            self.scaler.unscale_(optimizer)  # GradScaler.step then reuses this unscale and its inf check
        if clip_grad_norm is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, clip_grad_norm, norm_type=2.0)
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()
        if self.config.moment_format:
            hold_optimizer_state(optimizer, self.config.moment_format)


class O0(PrecisionPolicy):
    name = "O0"


class O1(PrecisionPolicy):
    name = "O1"

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.float16)


class O2(PrecisionPolicy):
    name = "O2"
    weight_dtype = torch.float16
    update_format = "fp16"

    def prepare(self, model, make_optimizer):
        self.model = model
        norms = {id(m) for m in model.modules() if is_norm_module(m)}
        for module in model.modules():
            if id(module) in norms:
                _cast_io(module, torch.float32, torch.float16)  # norm math in FP32, hand back FP16
                for child in module.children():
                    if id(child) not in norms:  # a wrapped block (PreNorm's attention) stays FP16
                        _cast_io(child, torch.float16, torch.float32)
            else:
                for p in module.parameters(recurse=False):
                    p.data = p.data.half()
                for name, buf in module.named_buffers(recurse=False):
                    if buf.is_floating_point():
                        setattr(module, name, buf.half())
        _cast_io(model, torch.float16, torch.float32)
        self._pairs = [(p, p.detach().clone().float().requires_grad_(True)) for p in model.parameters() if p.requires_grad]
        return model, make_optimizer([master for _, master in self._pairs], originals=[p for p, _ in self._pairs])

    def master_params(self):
        return [master for _, master in self._pairs]

    def zero_grad(self, optimizer):
        self.model.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)

    def step(self, optimizer, clip_grad_norm=None):
        for param, master in self._pairs:
            master.grad = None if param.grad is None else param.grad.float()  # still scaled: S * g
        super().step(optimizer, clip_grad_norm)  # unscales (and clips) the FP32 master grads, skips on inf/NaN
        with torch.no_grad():
            for param, master in self._pairs:
                param.copy_(master)  # FP32 master -> FP16 model weight (rounds to nearest)


class _PureLowPrecision(PrecisionPolicy):
    """Every weight, buffer and activation in ``weight_dtype``; the optimizer updates those weights directly."""

    def prepare(self, model, make_optimizer):
        self.model = model.to(self.weight_dtype)
        _cast_io(model, self.weight_dtype, torch.float32)
        return model, make_optimizer(model.parameters())


class O3(_PureLowPrecision):
    name = "O3"
    weight_dtype = torch.float16
    update_format = "fp16"


def _require_bf16(name: str, device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"--opt-level {name}: {torch.cuda.get_device_name(device)} has no BF16 support; use O1 or O2 (FP16 with loss scaling)."
        )


class BF16Mixed(PrecisionPolicy):
    name = "bf16"

    @classmethod
    def check(cls, device):
        _require_bf16(cls.name, device)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


class BF16Pure(_PureLowPrecision):
    name = "bf16-pure"
    weight_dtype = torch.bfloat16
    update_format = "bf16"

    @classmethod
    def check(cls, device):
        _require_bf16(cls.name, device)


class _SimulatedFP8(PrecisionPolicy):
    """A mixed level with every Linear computing through simulated FP8 (mpdiag.training.fp8_sim) under its
    autocast of ``autocast_dtype``."""

    autocast_dtype: ClassVar[torch.dtype]

    def __init__(self, device: torch.device, config: RunConfig):
        super().__init__(device, config)
        self.fp8 = config.fp8_settings()  # validated with the rest of the configuration

    def prepare(self, model, make_optimizer):
        simulate_fp8(model, self.fp8, self.device, self.autocast_dtype)
        return super().prepare(model, make_optimizer)


class FP8Sim(_SimulatedFP8, BF16Mixed):
    """The bf16 level with every Linear computing through simulated FP8."""

    name = "fp8-sim"
    autocast_dtype = torch.bfloat16


class FP8SimFP16(_SimulatedFP8, O1):
    """O1 (FP16 autocast, a GradScaler) with every Linear computing through simulated FP8: a precision plan whose
    run is FP16."""

    name = "fp8-sim-fp16"
    autocast_dtype = torch.float16


POLICIES: dict[str, type[PrecisionPolicy]] = {cls.name: cls for cls in (O0, O1, O2, O3, BF16Mixed, BF16Pure, FP8Sim,
                                                                        FP8SimFP16)}


def make_policy(config: RunConfig, device: torch.device) -> PrecisionPolicy:
    """The policy for ``config.opt_level`` on ``device``, after validating every option."""
    config.validate()
    cls = POLICIES[config.opt_level]
    cls.check(device)
    return cls(device, config)
