"""FP8 simulation for the ``fp8-sim`` opt level: every ``nn.Linear`` computes with its input, its weight and
its output gradient quantized to FP8 and dequantized, at the recipe's per-tensor scales.

It owns the quantize-dequantize arithmetic and the per-tensor amax history; the policy class that uses it is
in :mod:`mpdiag.training.policies`, the scale rules in :mod:`mpdiag.numerics.fp8_recipes` (the same function
the capture and the what-if use). As an FP8 GEMM does, the matmul multiplies the dequantized values in FP32
(products of FP8 values are exact in FP32) and hands back BF16 under autocast; the weight gradient and the
input gradient are computed from the quantized output gradient and the quantized input and weight (what TE
keeps for backward). Casts saturate at the format's largest value, as Transformer Engine's do (torch's E5M2
cast would give inf). Everything stays on the device: no value is read back.

The delayed history of a tensor advances at each call of its module (each forward for input and weight, each
backward for the output gradient), as TE's does; the capture's history advances per recorded step.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn import functional as F

from mpdiag.numerics.fp8 import torch_dtype
from mpdiag.numerics.fp8_recipes import ROLES, Fp8Format, Fp8Settings, scale_from_reference


class AmaxHistory:
    """One tensor's scale state under a recipe: the finite amaxes of its last H quantizations, on the device
    (a non-finite amax is left out, as in the recorded statistics: see ``Fp8StatsComputer``)."""

    def __init__(self, fmt: Fp8Format, settings: Fp8Settings, device: torch.device):
        self.fmt, self.settings = fmt, settings
        self._history = torch.zeros(settings.history, dtype=torch.float32, device=device)
        self._kept = torch.zeros((), dtype=torch.int64, device=device)  # a tensor: counting reads nothing back

    def scale(self, amax: torch.Tensor) -> torch.Tensor:
        """The scale for a tensor of this ``amax`` (a 0-dim fp32 tensor); records it in the history."""
        s = self.settings
        if s.recipe == "current":
            scale = scale_from_reference(amax, self.fmt, 0, s.pow2, xp=torch)
        else:
            reference = torch.where(self._kept == 0, amax, self._history.max())
            scale = scale_from_reference(reference, self.fmt, s.margin, s.pow2, xp=torch)
            slot = (self._kept % s.history).reshape(1)
            keep = torch.isfinite(amax)
            self._history[slot] = torch.where(keep, amax, self._history[slot])
            self._kept += keep
        return scale


def quantize_dequantize(x: torch.Tensor, state: AmaxHistory) -> torch.Tensor:
    """``x`` in fp32 after a saturating cast of x * scale to the FP8 format and back, divided by the scale."""
    x = x.float()
    amax = x.detach().abs().amax() if x.numel() else torch.zeros((), device=x.device)
    scale = state.scale(amax)
    limit = state.fmt.max_finite
    return (x * scale).clamp(-limit, limit).to(torch_dtype(state.fmt)).float() / scale


class _QuantizeInput(torch.autograd.Function):
    """Forward: quantize-dequantize. Backward: the gradient passes unchanged (to the FP32 weight or the
    previous layer), as with a real FP8 cast whose gradient is taken with respect to the high-precision copy."""

    @staticmethod
    def forward(ctx, x, state):
        return quantize_dequantize(x, state)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _QuantizeGradient(torch.autograd.Function):
    """Forward: identity. Backward: the incoming (output) gradient quantized and dequantized."""

    @staticmethod
    def forward(ctx, y, state):
        ctx.state = state
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return quantize_dequantize(grad, ctx.state).to(grad.dtype), None


def _fp8_forward(module: nn.Linear, states: dict[str, AmaxHistory], device_type: str):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = _QuantizeInput.apply(input, states["input"])
        w = _QuantizeInput.apply(self.weight, states["weight"])
        with torch.autocast(device_type, enabled=False):
            out = F.linear(x, w, None if self.bias is None else self.bias.float())
        out = _QuantizeGradient.apply(out, states["grad_output"])
        return out.to(torch.bfloat16) if torch.is_autocast_enabled(device_type) else out.to(input.dtype)

    return types.MethodType(forward, module)


def simulate_fp8(model: nn.Module, settings: Fp8Settings, device: torch.device) -> list[str]:
    """Make every Linear of ``model`` not named in ``settings.bf16_modules`` compute through FP8; returns the
    names of the Linears changed. ``settings.recipe`` must be "current" or "delayed"."""
    settings.validate()
    if settings.recipe == "both":
        raise ValueError("--fp8-recipe both records two recipes; a simulated run uses one: current or delayed")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    unknown = sorted(set(settings.bf16_modules) - set(linears))
    if unknown:
        raise ValueError(f"--fp8-bf16-modules names no Linear module: {', '.join(unknown)}")
    changed = []
    for name, module in linears.items():
        if name in settings.bf16_modules:
            continue
        states = {role: AmaxHistory(settings.role_format(role), settings, device)
                  for role in ROLES}
        module.forward = _fp8_forward(module, states, device.type)
        changed.append(name)
    return changed
