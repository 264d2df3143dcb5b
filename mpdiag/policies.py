"""Precision policies: one small class per opt level, all behind :class:`PrecisionPolicy`.

A policy decides how weights are stored, which ops run in low precision, and how the loss is scaled. The
training loop calls, per step::

    with policy.autocast():
        loss = loss_fn(model, batch)
    policy.backward(loss)          # gradients now hold S * g
    recorder.record(loss)
    policy.step(optimizer)         # unscale, skip on inf/NaN, update the scale

See ``shared/reference/mixed-precision.md`` section 5 for the opt-level table these follow.
"""

from __future__ import annotations

import contextlib
from abc import ABC
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


class ConfigError(ValueError):
    """A run option is invalid; raised before any training starts. The message names the option."""


@dataclass(frozen=True)
class ScalingConfig:
    """Dynamic loss-scale settings, as ``torch.amp.GradScaler`` takes them."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def validate(self) -> None:
        if not self.init_scale > 0 or self.init_scale == float("inf"):
            raise ConfigError(f"--init-scale must be a finite number > 0, got {self.init_scale}")
        if not self.growth_factor > 1:
            raise ConfigError(f"--growth-factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ConfigError(f"--backoff-factor must be between 0 and 1 (exclusive), got {self.backoff_factor}")
        if self.growth_interval < 1:
            raise ConfigError(f"--growth-interval must be >= 1, got {self.growth_interval}")


class PrecisionPolicy(ABC):
    """How one opt level trains. Subclasses set ``name`` and ``summary`` and implement the hooks."""

    name: ClassVar[str]
    summary: ClassVar[str]
    #: whether the loss is scaled (scaling options apply)
    scales_loss: ClassVar[bool] = False

    def __init__(self, device: torch.device, scaling: ScalingConfig | None = None):
        self.device = device
        self.scaling = scaling or ScalingConfig()
        self.scaler = None  # an object the Recorder reads the scale from, or None

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        """Raise ConfigError when this level cannot run on ``device``."""

    def prepare(self, model: torch.nn.Module, make_optimizer: OptimizerFactory):
        """Return (model, optimizer) ready for this level; the default keeps FP32 weights."""
        return model, make_optimizer(model.parameters())

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


class O0(PrecisionPolicy):
    name = "O0"
    summary = "pure FP32: no casting, no loss scaling (the reference)"


class _GradScalerPolicy(PrecisionPolicy):
    """Dynamic loss scaling with torch.amp.GradScaler (parameters, hence gradients, are FP32)."""

    scales_loss = True

    def __init__(self, device: torch.device, scaling: ScalingConfig | None = None):
        super().__init__(device, scaling)
        self.scaler = torch.amp.GradScaler(
            device.type,
            init_scale=self.scaling.init_scale,
            growth_factor=self.scaling.growth_factor,
            backoff_factor=self.scaling.backoff_factor,
            growth_interval=self.scaling.growth_interval,
        )

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)
        self.scaler.update()


class O1(_GradScalerPolicy):
    name = "O1"
    summary = "autocast FP16 (per-op casting), FP32 weights, dynamic loss scaling"

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.float16)


class BF16Mixed(PrecisionPolicy):
    name = "bf16"
    summary = "autocast BF16 (per-op casting), FP32 weights, no loss scaling"

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError(
                f"--opt-level bf16: {torch.cuda.get_device_name(device)} has no BF16 support; use O1 (FP16 with loss scaling)."
            )

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


POLICIES: dict[str, type[PrecisionPolicy]] = {cls.name: cls for cls in (O0, O1, BF16Mixed)}


def make_policy(opt_level: str, device: torch.device, scaling: ScalingConfig | None = None) -> PrecisionPolicy:
    """The policy for ``opt_level``, after checking the level, the device and the scale settings."""
    cls = POLICIES.get(opt_level)
    if cls is None:
        raise ConfigError(f"unknown opt level {opt_level!r}; choose one of: {', '.join(POLICIES)}")
    scaling = scaling or ScalingConfig()
    scaling.validate()
    cls.check_device(device)
    return cls(device, scaling)
