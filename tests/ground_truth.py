"""Ground truth the numerics tests compare against, computed with torch's own casting and Python's frexp,
never with mpdiag's code: FP8 underflow/subnormal/overflow counts by casting, and exact exponent histograms."""

from __future__ import annotations

import math

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
    # E4M3's cast saturates (448 even for inf), so its overflow is the 464 threshold; E5M2's cast gives inf
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
