"""FP8 simulation for the ``fp8-sim`` opt level: every ``nn.Linear`` computes with its input, its weight and
its output gradient quantized to FP8 and dequantized, at the recipe's per-tensor scales.

It owns the quantize-dequantize arithmetic and the per-tensor amax history; the policy class that uses it is
in :mod:`mpdiag.training.policies`, the scale rules in :mod:`mpdiag.numerics.fp8_recipes` (the same function
the capture and the what-if use). As an FP8 GEMM does, the matmul multiplies the dequantized values in FP32
(products of FP8 values are exact in FP32) and hands back autocast's dtype (BF16, or FP16 at fp8-sim-fp16); the
weight gradient and the input gradient are computed from the quantized output gradient and the quantized input and weight (what TE
keeps for backward). Casts saturate at the format's largest value, as Transformer Engine's do (torch's E5M2
cast would give inf). Everything stays on the device: no value is read back.

The delayed history of a tensor advances at each call of its module (each forward for input and weight, each
backward for the output gradient), as TE's does; the capture's history advances per recorded step.

Block-scaled recipes (``recipe`` "mxfp8" or "nvfp4"): each GEMM's two operands are quantize-dequantized with
:mod:`mpdiag.numerics.block_scaled`'s casts (``cast_mxfp8`` / ``cast_nvfp4``, bit for bit torchao 0.18.0's emulated
reference casts), blocked along that GEMM's reduction dimension, as torchao's ``MXFP8Linear`` (``mx_mm``,
``torchao.prototype.moe_training.mxfp8_linear``, ``wgrad_with_hp=False``) blocks them:

* forward ``y = x W^T``: x (..., in) and W (out, in) blocked along ``in``;
* input gradient ``dX = dY W``: dY (..., out) blocked along ``out``, and W re-blocked along ``out`` (W^T's last
  dimension);
* weight gradient ``dW = dY^T x``: dY^T (out, rows) and x^T (in, rows) blocked along the rows (every leading
  dimension of x flattened), each re-cast from the high-precision tensor.

So the weight is cast twice a step and the input and the output gradient twice each, as torchao's MXFP8 training
does; what each GEMM sees is exact against ``F.linear`` / ``mm`` of the reference casts' dequantized values, and
the output and both gradients equal torchao's ``mx_mm`` (emulated, FLOOR scales) bit for bit on the CPU
(``tests/numerics/test_fp8_sim_blocks.py``). The products are summed in FP32 as the per-tensor path does (a real MX GEMM
accumulates in FP32 too, in its own order: sums need not match a GPU's bit for bit). The bias is added in FP32
after the GEMM and its gradient is the high-precision dY's sum (torchao adds the bias outside ``mx_mm``). A
dimension that is not a multiple of the block size is zero-padded per row (torchao refuses such a tensor): a zero
changes no block's scale. An all-zero tensor is zeros under NVFP4 (torchao's cast gives NaN: its tensor scale
is 0). NVFP4 follows the same scheme with ``cast_nvfp4`` (1x16 blocks, a per-tensor scale from
each cast tensor's own amax); torchao 0.18.0 has no NVFP4 training linear to compare with, and what NVIDIA's NVFP4
training recipe adds (16x16 weight blocks, random Hadamard transforms on the weight-gradient operands,
stochastic rounding of gradients) is not simulated: round to nearest even everywhere. Nothing has state: no amax
history, the ``--fp8-history``/``--fp8-margin``/``--fp8-grad-format``/``--fp8-pow2`` settings are not used.

A recipe per Linear (``--fp8-modules``, a precision plan's rerun): each Linear takes its own recipe among the four,
or stays in BF16 (as ``--fp8-bf16-modules``), or computes in FP32 with autocast off inside it. The ``fp8-sim-fp16``
level runs the same simulation under FP16 autocast with a GradScaler (a plan whose run is FP16): a simulated
Linear hands its output back in FP16 there, and a Linear left in BF16 computes under a BF16 autocast of its own.
"""

from __future__ import annotations

import dataclasses
import types

import torch
from torch import nn
from torch.nn import functional as F

from mpdiag.numerics.block_scaled import CASTS
from mpdiag.numerics.fp8 import torch_dtype
from mpdiag.numerics.fp8_recipes import BLOCK_RECIPES, ROLES, Fp8Format, Fp8Settings, scale_from_reference


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


def _handed_back(out: torch.Tensor, input: torch.Tensor, device_type: str) -> torch.Tensor:
    """A simulated Linear's output as autocast would hand back a Linear's (in its dtype, BF16 or FP16), else in
    its input's dtype."""
    enabled = torch.is_autocast_enabled(device_type)
    return out.to(torch.get_autocast_dtype(device_type) if enabled else input.dtype)


def _fp8_forward(module: nn.Linear, states: dict[str, AmaxHistory], device_type: str):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = _QuantizeInput.apply(input, states["input"])
        w = _QuantizeInput.apply(self.weight, states["weight"])
        with torch.autocast(device_type, enabled=False):
            out = F.linear(x, w, None if self.bias is None else self.bias.float())
        out = _QuantizeGradient.apply(out, states["grad_output"])
        return _handed_back(out, input, device_type)

    return types.MethodType(forward, module)


def block_dequantized(x: torch.Tensor, recipe: str) -> torch.Tensor:
    """``x`` in fp32 after ``recipe``'s block cast along its last dimension and back (block_scaled's arithmetic).
    An NVFP4 tensor scale of 0 (an all-zero tensor: a zero-initialised weight, a zero gradient) gives zeros, where
    torchao's reference (and the cast it is reproduced from) gives NaN everywhere (0 / 0); a NaN stays NaN."""
    cast = CASTS[recipe](x.detach())
    if recipe != "nvfp4":
        return cast.dequantized
    return torch.where(cast.tensor_scale == 0, torch.zeros((), device=x.device), cast.dequantized)


class _BlockLinear(torch.autograd.Function):
    """``y = x W^T + b`` with each GEMM's operands block-quantized along its reduction dimension (module docstring);
    x and W kept in high precision for the backward casts."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        ctx.recipe, ctx.has_bias, ctx.x_dtype = recipe, bias is not None, x.dtype
        ctx.save_for_backward(x, weight)
        out = F.linear(block_dequantized(x, recipe), block_dequantized(weight, recipe))
        return out if bias is None else out + bias.float()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        recipe = ctx.recipe
        rows = grad.detach().float().reshape(-1, grad.shape[-1])  # (rows, out)
        x_rows = x.detach().float().reshape(-1, x.shape[-1])  # (rows, in)
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            w_by_out = block_dequantized(weight.float().t().contiguous(), recipe)  # (in, out), blocked along out
            grad_input = (block_dequantized(rows, recipe) @ w_by_out.t()).reshape(*x.shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            g_by_rows = block_dequantized(rows.t().contiguous(), recipe)  # (out, rows), blocked along rows
            x_by_rows = block_dequantized(x_rows.t().contiguous(), recipe)  # (in, rows), blocked along rows
            grad_weight = (g_by_rows @ x_by_rows.t()).to(weight.dtype)
        grad_bias = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None


def _block_forward(module: nn.Linear, recipe: str, device_type: str):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type, enabled=False):
            out = _BlockLinear.apply(input, self.weight, self.bias, recipe)
        return _handed_back(out, input, device_type)

    return types.MethodType(forward, module)


def _fp32_forward(module: nn.Linear, device_type: str):
    """The Linear in FP32 under the run's BF16 autocast (a plan's "fp32" recipe): its input cast up, autocast
    off inside it, its output handed back as autocast would hand a Linear's."""
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type, enabled=False):
            out = F.linear(input.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        return _handed_back(out, input, device_type)

    return types.MethodType(forward, module)


def _bf16_forward(module: nn.Linear, device_type: str):
    """The Linear under BF16 autocast inside a run's FP16 autocast (a plan's "bf16" recipe at fp8-sim-fp16)."""
    plain = module.forward

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return plain(input)

    return types.MethodType(forward, module)


def simulate_fp8(model: nn.Module, settings: Fp8Settings, device: torch.device,
                 autocast_dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Make every Linear of ``model`` compute through its recipe (``settings.module_recipe``: "current",
    "delayed", "mxfp8" or "nvfp4"; "bf16" computes it in BF16, as the run's BF16 autocast does or, when the run's
    ``autocast_dtype`` is FP16, under a BF16 autocast of its own; "fp32" computes it in FP32); returns the names
    of the Linears cast to FP8 or FP4. ``settings.recipe`` must not be "both"."""
    settings.validate()
    if settings.recipe == "both":
        raise ValueError("--fp8-recipe both records two recipes; a simulated run uses one: current, delayed, mxfp8 "
                         "or nvfp4")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    unknown = sorted(set(settings.bf16_modules) - set(linears))
    if unknown:
        raise ValueError(f"--fp8-bf16-modules names no Linear module: {', '.join(unknown)}")
    unknown = sorted({name for name, _ in settings.module_recipes} - set(linears))
    if unknown:
        raise ValueError(f"--fp8-modules names no Linear module: {', '.join(unknown)}")
    changed = []
    for name, module in linears.items():
        recipe = settings.module_recipe(name)
        if recipe == "bf16":
            if autocast_dtype != torch.bfloat16:
                module.forward = _bf16_forward(module, device.type)
            continue
        if recipe == "fp32":
            module.forward = _fp32_forward(module, device.type)
            continue
        if recipe in BLOCK_RECIPES:
            module.forward = _block_forward(module, recipe, device.type)
        else:
            own = dataclasses.replace(settings, recipe=recipe)
            states = {role: AmaxHistory(own.role_format(role), own, device) for role in ROLES}
            module.forward = _fp8_forward(module, states, device.type)
        changed.append(name)
    return changed
