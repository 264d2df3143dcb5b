"""Ground truth the numerics tests compare against, computed with torch's own casting and Python's frexp,
never with mpdiag's code: FP8 underflow/subnormal/overflow counts by casting, and exact exponent histograms; the
block-scaled recipes' (MXFP8, NVFP4) by torchao 0.18.0's emulated reference casts (imported when used)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import torch

from mpdiag.numerics.fp8 import EXP_MIN
from mpdiag.numerics.fp8_recipes import FP8_FORMATS

DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def by_casting(x: torch.Tensor, scale: float, name: str) -> tuple[int, int, int]:
    """underflow, subnormal, overflow of fp32(x * scale) cast to ``name``: the definition, with torch's cast."""
    fmt = FP8_FORMATS[name]
    x = x.float().reshape(-1)
    y = x * torch.tensor(scale, dtype=torch.float32)
    cast = y.to(DTYPES[name]).float().abs()
    finite_nonzero = torch.isfinite(x) & (x != 0)
    # past 464 E4M3's cast saturates to 448 (torch 2.13) or gives NaN (2.11): its overflow is the 464 threshold;
    # E5M2's cast gives inf
    over = y.abs() > 464 if name == "fp8_e4m3" else torch.isinf(cast)
    return (int((finite_nonzero & (cast == 0)).sum()),
            int((finite_nonzero & (cast > 0) & (cast < fmt.min_normal)).sum()),
            int((torch.isfinite(x) & over).sum()))


def exponent_histogram(x: torch.Tensor) -> np.ndarray:
    hist = np.zeros(277, dtype=np.int64)
    for v in x.double().reshape(-1).tolist():
        if v != 0 and math.isfinite(v):
            hist[math.frexp(abs(v))[1] - 1 - EXP_MIN] += 1
    return hist


def _torchao(module: str):
    import importlib

    return importlib.import_module(f"torchao.prototype.mx_formats.{module}")


def _pad(x: torch.Tensor, block: int) -> torch.Tensor:
    """torchao refuses rows that are not whole blocks: the reference sees x zero-padded, as mpdiag pads it."""
    x = x.float().reshape(-1, x.shape[-1])
    return torch.nn.functional.pad(x, (0, -x.shape[1] % block)).contiguous()


def reference_mxfp8(x: torch.Tensor):
    """torchao's to_mx (default FLOOR scaling) and to_dtype: (elements, divisor, dequantised, block scales),
    blocked."""
    mx = _torchao("mx_tensor")
    xp = _pad(x, 32)
    scale_e8m0, data_lp = mx.to_mx(xp, torch.float8_e4m3fn, 32)
    deq = mx.to_dtype(data_lp, scale_e8m0, torch.float8_e4m3fn, 32, torch.float32)
    scale = mx.get_fp_scale(scale_e8m0).reshape(xp.shape[0], -1, 1)
    # the spec's divisor is the E8M0 scale; torchao divides by it, raised to fp32's smallest normal
    divisor = scale.clamp(min=2.0**-126)
    return data_lp.float().reshape(xp.shape[0], -1, 32), divisor, deq, scale


def reference_nvfp4(x: torch.Tensor):
    """torchao's NVFP4Tensor with the per-tensor scale from the tensor's amax: (elements, what x is multiplied
    by, dequantised, block scales in fp32), blocked."""
    nv, kernels = _torchao("nvfp4_tensor"), _torchao("kernels")
    xp = _pad(x, 16)
    per_tensor = nv.per_tensor_amax_to_scale(xp.abs().amax())
    t = nv.NVFP4Tensor.to_nvfp4(xp, per_tensor_scale=per_tensor)
    deq = t.dequantize(torch.float32)
    elements = kernels.f4_unpacked_to_f32(kernels.unpack_uint4(t.qdata.view(torch.uint8)))
    elements = elements.reshape(xp.shape[0], -1, 16)
    block_e4m3 = t.scale.to(torch.float32).reshape(xp.shape[0], -1, 1)
    multiplier = (1.0 / per_tensor) / block_e4m3  # what x is multiplied by before the FP4 rounding
    return elements, multiplier, deq, t.get_hp_scales().reshape(xp.shape[0], -1, 1)


def reference_counts(x: torch.Tensor, recipe: str) -> dict:
    """Counts from torchao's output: a finite non-zero input whose element is 0 underflowed, one whose element
    is non-zero below the element format's min normal is subnormal, one whose scaled value lies past the
    element format's overflow edge (the spec's constants) was clipped; blocks, and the exponents (Python's
    frexp) of torchao's block scales of the blocks with a finite non-zero value."""
    block = {"mxfp8": 32, "nvfp4": 16}[recipe]
    xb = _pad(x, block).reshape(-1, _pad(x, block).shape[1] // block, block)
    if recipe == "mxfp8":
        elements, divisor, _, scales = reference_mxfp8(x)
        y = xb / divisor
        min_normal, past = 2.0**-6, y.abs() > 464.0
    else:
        elements, multiplier, _, scales = reference_nvfp4(x)
        y = xb * multiplier
        min_normal, past = 1.0, y.abs() >= 7.0
    counted = torch.isfinite(xb) & (xb != 0)
    used = [s for s in scales.reshape(-1)[counted.any(dim=-1).reshape(-1)].double().tolist()
            if math.isfinite(s) and s > 0]
    return {
        "underflow": int((counted & (elements == 0)).sum()),
        "subnormal": int((counted & (elements != 0) & (elements.abs() < min_normal)).sum()),
        "overflow": int((counted & past).sum()),
        "clipped_blocks": int((counted & past).any(dim=-1).sum()),
        "blocks": int(xb.shape[0] * xb.shape[1]),
        "scale_exponents": dict(sorted(Counter(math.frexp(s)[1] - 1 for s in used).items())),
    }


def reference_mx_linear(x: torch.Tensor, w: torch.Tensor, grad_output: torch.Tensor):
    """torchao's MXFP8 training GEMMs (``mx_mm`` of ``torchao.prototype.moe_training.mxfp8_linear``, emulated, torch
    casts, FLOOR scales, weight gradient in MXFP8): (output, input gradient, weight gradient) of ``x @ w.T`` with
    ``grad_output`` flowing back. Rows and columns must be whole blocks of 32 (torchao refuses the rest)."""
    from torchao.prototype.moe_training.mxfp8_linear import mx_mm
    from torchao.prototype.mx_formats.config import (
        MXFP8Dim0CastKernelChoice,
        MXFP8Dim1CastKernelChoice,
        ScaleCalculationMode,
    )
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = mx_mm.apply(x, w, torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e4m3fn, 32,
                      KernelPreference.EMULATED, MXFP8Dim0CastKernelChoice.TORCH, MXFP8Dim1CastKernelChoice.TORCH,
                      ScaleCalculationMode.FLOOR, False)
    out.backward(grad_output)
    return out.detach(), x.grad, w.grad
