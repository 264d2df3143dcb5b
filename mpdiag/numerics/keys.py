"""The key layout shared by the statistics' two backends and the numba kernel: an fp32 value's bits split
into sign, exponent field and *mantissa region* (how many format rounding edges its mantissa reaches).

It owns only the layout and the edges; counting lives in :mod:`mpdiag.numerics.gradstats` and
:mod:`mpdiag.numerics.cpu_kernel`, which both import this module (and not each other at import time).
"""

from __future__ import annotations

import struct

from mpdiag.numerics.formats import FP32, LOW_PRECISION, Format

MANTISSA_BITS = 23
MANTISSA_MASK = (1 << MANTISSA_BITS) - 1
FIELDS = 256  # biased exponent field values of fp32


def _rounding_edges(fmt: Format) -> dict[int, int]:
    """fp32 exponent field -> mantissa threshold at which a cast into ``fmt`` changes category.

    Only edges that lie among fp32 normal numbers are listed; edges inside fp32's subnormal range are
    resolved by casting (see :mod:`mpdiag.numerics.gradstats`).
    """
    m = fmt.mantissa_bits
    bias = 127
    edges = {}
    # |x| == min_subnormal / 2 ties to zero (even); anything above it rounds up to min_subnormal.
    tie_to_zero = fmt.min_subnormal_exponent - 1
    if tie_to_zero >= FP32.min_normal_exponent:
        edges[tie_to_zero + bias] = 1
    # Midpoint between the largest subnormal and min_normal rounds up to min_normal (even mantissa).
    below_normal = fmt.min_normal_exponent - 1
    if below_normal >= FP32.min_normal_exponent:
        edges[below_normal + bias] = ((1 << m) - 1) << (MANTISSA_BITS - m)
    if fmt.overflow_above is None:
        # Midpoint between max_finite and the next power of two rounds up to inf (even mantissa).
        edges[fmt.max_exponent + bias] = ((1 << (m + 1)) - 1) << (MANTISSA_BITS - m - 1)
    else:  # a saturating cast: overflow starts just above the threshold (which ties to the even max_finite)
        field, mantissa = divmod(struct.unpack("<I", struct.pack("<f", fmt.overflow_above))[0], 1 << MANTISSA_BITS)
        edges[field] = mantissa + 1
    return edges


#: Mantissa values at which some format's category changes (1 also separates zero from fp32 subnormals and
#: inf from NaN); a value's region is how many of them its mantissa reaches.
REGION_BOUNDS = tuple(sorted({1} | {t for fmt in LOW_PRECISION.values() for t in _rounding_edges(fmt).values()}))
REGIONS = len(REGION_BOUNDS) + 1
#: FP16's and BF16's edges lie in the top 2^-8 of a field: the numba kernel keys values there (and mantissa 0)
#: one by one, as rare; the bounds below it (FP8's: mantissas 0.75, 0.8125 + 2^-23, 0.875) it counts for every
#: value with a few comparisons, beside the field
RARE_FROM = 0x7F8000
COMMON_BOUNDS = tuple(b for b in REGION_BOUNDS if 1 < b < RARE_FROM)
assert REGION_BOUNDS == (1, *COMMON_BOUNDS, *(b for b in REGION_BOUNDS if b >= RARE_FROM))
assert len(COMMON_BOUNDS) == 3 and len(REGION_BOUNDS) == 7, \
    "the numba kernel compares against exactly three common and three rare bounds"
