"""Precision policies: one small class per opt level, all behind :class:`PrecisionPolicy`.

A policy decides how weights are stored, which ops run in low precision, and how the loss is scaled. The
training loop calls, per step::

    policy.zero_grad(optimizer)
    with policy.autocast():
        loss = loss_fn(model, batch)
    policy.backward(loss)          # gradients now hold S * g
    recorder.record(loss)
    policy.step(optimizer)         # unscale, skip on inf/NaN, update the scale

The opt levels follow apex's table (``shared/reference/mixed-precision.md`` section 5), built on native torch:

======== ============= ============== ==================== ============== ==================
level    weights       per-op casting norm layers          master weights loss scale
======== ============= ============== ==================== ============== ==================
O0       fp32          no             fp32                 no             none
O1       fp32          autocast fp16  (autocast lists)     no             dynamic
O2       fp16          no             fp32                 fp32           dynamic
O3       fp16          no             fp16                 no             static 1.0
bf16     fp32          autocast bf16  (autocast lists)     no             none
bf16-pure bf16         no             bf16                 no             none
fp8-sim  fp32          as bf16; every (autocast lists)     no             none
                       Linear via FP8
======== ============= ============== ==================== ============== ==================

Every FP16 level scales through :class:`LossScaler` (a ``torch.amp.GradScaler``), so "skipped" and the scale
trajectory mean the same at every level: a step whose gradients hold inf/NaN is skipped, and a dynamic
scale is multiplied by ``backoff_factor``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from torch import nn

from mpdiag.numerics.fp8_recipes import Fp8Settings
from mpdiag.numerics.nested import map_tensors
from mpdiag.training.fp8_sim import simulate_fp8

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)


class ConfigError(ValueError):
    """A run option is invalid; raised before any training starts. The message names the option."""


@dataclass(frozen=True)
class ScalingConfig:
    """Loss-scale settings.

    ``loss_scale``: None for the opt level's default, ``"dynamic"``, or a number for a static scale.
    The dynamic settings are ``torch.amp.GradScaler``'s; ``min_scale`` / ``max_scale`` bound a dynamic scale
    (apex's dynamic scaler stops at 2**24; GradScaler has no bound unless one is given here).
    """

    loss_scale: str | float | None = None
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = None
    max_scale: float | None = None

    def validate(self) -> None:
        def positive(name: str, value) -> None:
            if value is not None and not (0 < value < float("inf")):
                raise ConfigError(f"--{name} must be a finite number > 0, got {value}")

        if isinstance(self.loss_scale, str) and self.loss_scale != "dynamic":
            raise ConfigError(f"--loss-scale must be 'dynamic' or a number > 0, got {self.loss_scale!r}")
        if not isinstance(self.loss_scale, str):
            positive("loss-scale", self.loss_scale)
        positive("init-scale", self.init_scale)
        positive("min-scale", self.min_scale)
        positive("max-scale", self.max_scale)
        if not self.growth_factor > 1:
            raise ConfigError(f"--growth-factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ConfigError(f"--backoff-factor must be between 0 and 1 (exclusive), got {self.backoff_factor}")
        if self.growth_interval < 1:
            raise ConfigError(f"--growth-interval must be >= 1, got {self.growth_interval}")
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ConfigError(f"--min-scale {self.min_scale} is above --max-scale {self.max_scale}")

    def to_dict(self) -> dict:
        return asdict(self)


class LossScaler(torch.amp.GradScaler):
    """GradScaler with the three things the opt levels need beyond it.

    * ``static``: the scale never changes (steps with inf/NaN gradients are still skipped);
    * ``min_scale`` / ``max_scale``: bounds on a dynamic scale, applied on the device after each update;
    * ``allow_fp16_grads``: unscale FP16 gradients in place (pure-FP16 O3), through GradScaler's own
      ``allow_fp16`` path (the one FSDP's ShardedGradScaler uses). GradScaler refuses them otherwise.
    """

    def __init__(self, device_type: str, scaling: ScalingConfig, static: float | None, allow_fp16_grads: bool):
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
    """How one opt level trains. Subclasses set the class attributes and override what differs."""

    name: ClassVar[str]
    summary: ClassVar[str]
    #: the default loss scaling: None (no scaling), "dynamic", or a static number
    default_scaling: ClassVar[str | float | None] = None
    #: weights (and so gradients) of non-norm layers are stored in this dtype
    weight_dtype: ClassVar[torch.dtype] = torch.float32
    #: the low-precision format the model's weights are stored in, whose resolution the Recorder checks
    #: optimizer updates against (mpdiag.numerics.updates): updates are lost in it (O3) or kept by masters (O2)
    update_format: ClassVar[str | None] = None

    def __init__(self, device: torch.device, scaling: ScalingConfig | None = None):
        self.device = device
        self.scaling = scaling or ScalingConfig()
        mode = self.scaling.loss_scale if self.scaling.loss_scale is not None else self.default_scaling
        self.scaler: LossScaler | None = None
        if mode is not None:
            static = None if mode == "dynamic" else float(mode)
            self.scaler = LossScaler(device.type, self.scaling, static, allow_fp16_grads=self.weight_dtype != torch.float32)
        self.model: nn.Module | None = None

    @classmethod
    def check(cls, device: torch.device, scaling: ScalingConfig) -> None:
        """Raise ConfigError when this level cannot run on ``device`` or with ``scaling``."""
        if cls.default_scaling is None and scaling.loss_scale is not None:
            raise ConfigError(f"--opt-level {cls.name} does not scale the loss; drop --loss-scale")

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

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()


class O0(PrecisionPolicy):
    name = "O0"
    summary = "pure FP32: no casting, no loss scaling (the reference)"


class O1(PrecisionPolicy):
    name = "O1"
    summary = "autocast FP16 (per-op casting), FP32 weights, dynamic loss scaling"
    default_scaling = "dynamic"

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.float16)


class O2(PrecisionPolicy):
    name = "O2"
    summary = "FP16 weights except norm layers, FP32 master weights in the optimizer, dynamic loss scaling"
    default_scaling = "dynamic"
    weight_dtype = torch.float16
    update_format = "fp16"

    def prepare(self, model, make_optimizer):
        self.model = model
        for module in model.modules():
            if isinstance(module, NORM_LAYERS):
                _cast_io(module, torch.float32, torch.float16)  # norm math in FP32, hand back FP16
            else:
                for p in module.parameters(recurse=False):
                    p.data = p.data.half()
                for name, buf in module.named_buffers(recurse=False):
                    if buf.is_floating_point():
                        setattr(module, name, buf.half())
        _cast_io(model, torch.float16, torch.float32)
        self._pairs = [(p, p.detach().clone().float().requires_grad_(True)) for p in model.parameters() if p.requires_grad]
        return model, make_optimizer([master for _, master in self._pairs])

    def master_params(self):
        return [master for _, master in self._pairs]

    def zero_grad(self, optimizer):
        self.model.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)

    def step(self, optimizer):
        for param, master in self._pairs:
            master.grad = None if param.grad is None else param.grad.float()  # still scaled: S * g
        self.scaler.step(optimizer)  # unscales the FP32 master grads, skips the step on inf/NaN
        self.scaler.update()
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
    summary = "pure FP16: weights, BatchNorm and optimizer in FP16, no master weights, static scale 1.0"
    default_scaling = 1.0
    weight_dtype = torch.float16
    update_format = "fp16"


def _require_bf16(name: str, device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"--opt-level {name}: {torch.cuda.get_device_name(device)} has no BF16 support; use O1 or O2 (FP16 with loss scaling)."
        )


class BF16Mixed(PrecisionPolicy):
    name = "bf16"
    summary = "autocast BF16 (per-op casting), FP32 weights, no loss scaling"

    @classmethod
    def check(cls, device, scaling):
        super().check(device, scaling)
        _require_bf16(cls.name, device)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


class BF16Pure(_PureLowPrecision):
    name = "bf16-pure"
    summary = "pure BF16: weights, activations and optimizer in BF16, no loss scaling"
    weight_dtype = torch.bfloat16
    update_format = "bf16"

    @classmethod
    def check(cls, device, scaling):
        super().check(device, scaling)
        _require_bf16(cls.name, device)


class FP8Sim(BF16Mixed):
    """The bf16 level with every Linear computing through simulated FP8 (mpdiag.training.fp8_sim)."""

    name = "fp8-sim"
    summary = "as bf16, with every Linear's input, weight and output gradient quantized through FP8 (simulated)"

    def __init__(self, device, scaling=None, fp8: Fp8Settings | None = None):
        super().__init__(device, scaling)
        self.fp8 = fp8 or Fp8Settings()
        try:
            self.fp8.validate()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.fp8.recipe == "both":
            raise ConfigError("--opt-level fp8-sim runs one recipe: --fp8-recipe current or delayed, not both")

    def prepare(self, model, make_optimizer):
        simulate_fp8(model, self.fp8, self.device)
        return super().prepare(model, make_optimizer)


POLICIES: dict[str, type[PrecisionPolicy]] = {cls.name: cls for cls in (O0, O1, O2, O3, BF16Mixed, BF16Pure, FP8Sim)}


def make_policy(opt_level: str, device: torch.device, scaling: ScalingConfig | None = None,
                fp8: Fp8Settings | None = None) -> PrecisionPolicy:
    """The policy for ``opt_level``, after checking the level, the device and the scale settings
    (``fp8``: the recipe of the fp8-sim level)."""
    cls = POLICIES.get(opt_level)
    if cls is None:
        raise ConfigError(f"unknown opt level {opt_level!r}; choose one of: {', '.join(POLICIES)}")
    scaling = scaling or ScalingConfig()
    scaling.validate()
    cls.check(device, scaling)
    return cls(device, scaling, fp8) if cls is FP8Sim else cls(device, scaling)
