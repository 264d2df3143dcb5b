"""Floating-point formats mpdiag reasons about, with their limits taken from torch itself.

The limits come from ``torch.finfo`` so they are torch's ground truth, not constants typed in by hand.
Exponents are base-2: a value x lies in exponent bin e when 2**e <= |x| < 2**(e+1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    """A floating-point format: its torch dtype and its representable range (all magnitudes)."""

    name: str
    dtype: torch.dtype
    max_finite: float
    min_normal: float
    min_subnormal: float
    mantissa_bits: int

    @property
    def max_exponent(self) -> int:
        """Exponent bin of the largest finite value."""
        return math.frexp(self.max_finite)[1] - 1

    @property
    def min_normal_exponent(self) -> int:
        return math.frexp(self.min_normal)[1] - 1

    @property
    def min_subnormal_exponent(self) -> int:
        return math.frexp(self.min_subnormal)[1] - 1


def _format(name: str, dtype: torch.dtype) -> Format:
    info = torch.finfo(dtype)
    return Format(
        name=name,
        dtype=dtype,
        max_finite=float(info.max),
        min_normal=float(info.smallest_normal),
        min_subnormal=float(info.smallest_normal) * float(info.eps),
        mantissa_bits=round(-math.log2(float(info.eps))),
    )


FP32 = _format("fp32", torch.float32)
FP16 = _format("fp16", torch.float16)
BF16 = _format("bf16", torch.bfloat16)

#: The low-precision formats whose representability mpdiag counts, by name.
LOW_PRECISION = {"fp16": FP16, "bf16": BF16}

#: Exponent bins of an fp32 histogram: every finite non-zero fp32 value falls in one of these.
EXP_MIN = FP32.min_subnormal_exponent  # -149
EXP_MAX = FP32.max_exponent  # 127
N_EXP_BINS = EXP_MAX - EXP_MIN + 1  # 277
