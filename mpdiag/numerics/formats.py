"""The registry of floating-point formats mpdiag reasons about: one typed-in entry per format.

This module owns each format's name, torch dtype name and limits, and the exponent-bin range of an fp32
histogram. It must not import torch: the dashboard reads formats and never imports torch. The limits are typed
in here and a test checks every entry against ``torch.finfo`` of its dtype (the ground truth); numerics code that
needs the dtype itself asks :attr:`Format.dtype`, which imports torch only when called.
Exponents are base-2: a value x lies in exponent bin e when 2**e <= |x| < 2**(e+1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    """A floating-point format: the name of its torch dtype and its representable range (all magnitudes)."""

    name: str
    dtype_name: str  # attribute of the torch module, e.g. "float16"
    max_finite: float
    min_normal: float
    min_subnormal: float
    mantissa_bits: int  # stored fraction bits (without the implicit leading one)
    #: a format whose cast saturates at max_finite instead of giving inf (E4M3) overflows for |x| above this
    #: (the midpoint past max_finite, which ties to the even max_finite); None: overflow is the cast's inf
    overflow_above: float | None = None

    @property
    def dtype(self):
        """The torch dtype, imported on demand so that reading the registry never loads torch."""
        import torch

        return getattr(torch, self.dtype_name)

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


FP32 = Format("fp32", "float32", max_finite=(2 - 2**-23) * 2.0**127, min_normal=2.0**-126, min_subnormal=2.0**-149,
              mantissa_bits=23)
FP16 = Format("fp16", "float16", max_finite=65504.0, min_normal=2.0**-14, min_subnormal=2.0**-24, mantissa_bits=10)
BF16 = Format("bf16", "bfloat16", max_finite=(2 - 2**-7) * 2.0**127, min_normal=2.0**-126, min_subnormal=2.0**-133,
              mantissa_bits=7)

FP8_E4M3 = Format("fp8_e4m3", "float8_e4m3fn", max_finite=448.0, min_normal=2.0**-6, min_subnormal=2.0**-9,
                  mantissa_bits=3, overflow_above=464.0)
FP8_E5M2 = Format("fp8_e5m2", "float8_e5m2", max_finite=57344.0, min_normal=2.0**-14, min_subnormal=2.0**-16,
                  mantissa_bits=2)

#: The registry: the low-precision formats whose representability mpdiag counts, by name. The store keys its
#: representability rows by these names, so a format added here needs no new column anywhere. The FP8 entries
#: count gradients as a plain cast would (no per-tensor scale); what an FP8 recipe's scaled casts would do to a
#: Linear's tensors is mpdiag.numerics.fp8.
LOW_PRECISION = {fmt.name: fmt for fmt in (FP16, BF16, FP8_E4M3, FP8_E5M2)}

#: The per-step signals: the formats whose at-scale underflow and overflow are counted at every step, kept or not
#: (what anomaly retention watches, mpdiag.recording.retention), and the count names, in the order the light pass
#: (mpdiag.numerics.gradstats) counts them and the store keeps them (step_signals); each equals the full statistics'
#: count of the same name (StepGradStats.counts).
SIGNAL_FORMATS = ("fp16", "bf16")
SIGNAL_COUNTS = ("nan", "posinf", "neginf", *(f"{fmt}_{kind}_at_scale" for fmt in SIGNAL_FORMATS
                                              for kind in ("underflow", "overflow")))

#: Exponent bins of an fp32 histogram: every finite non-zero fp32 value falls in one of these.
EXP_MIN = FP32.min_subnormal_exponent  # -149
EXP_MAX = FP32.max_exponent  # 127
N_EXP_BINS = EXP_MAX - EXP_MIN + 1  # 277


def resolution_log2(format_name: str) -> int:
    """log2 of the relative update below which ``format_name`` weights lose it: -(mantissa bits + 1)."""
    if format_name not in ("fp16", "bf16"):
        raise ValueError(f"update_format must be 'fp16' or 'bf16', got {format_name!r}")
    return -(LOW_PRECISION[format_name].mantissa_bits + 1)
