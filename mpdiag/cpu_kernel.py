"""The fused CPU kernel of :mod:`mpdiag.gradstats`, in its own module so numba is imported (and the kernel
loaded from numba's on-disk cache, or compiled) only when a CPU statistics computer is first built, not
when the app starts."""

import numba
import numpy as np

from mpdiag.gradstats import FIELDS, MANTISSA_BITS, MANTISSA_MASK, REGIONS


@numba.njit(parallel=True, cache=True, nogil=True)
def fused_pass(arrays, chunk_tensor, chunk_start, chunk_end, bounds, keys, maxbits, minbits, sumsq):
    """Per chunk of a tensor: key counts into its rows of ``keys``, the largest magnitude bit pattern and
    the smallest non-zero one minus 1 (as int32 they order like the magnitudes, NaN above inf; zero wraps
    to the top) and the float64 sum of squares. Reads each value once and writes nothing per value.
    Four interleaved lanes (histogram rows and accumulators) keep consecutive equal keys and the sum's
    additions from waiting on each other."""
    b0, b1, b2, b3 = bounds[0], bounds[1], bounds[2], bounds[3]
    for c in numba.prange(chunk_tensor.shape[0]):
        values = arrays[chunk_tensor[c]]
        bits_of = values.view(np.int32)
        rows = keys[c]
        rows[:] = 0
        start, end = chunk_start[c], chunk_end[c]
        whole = start + (end - start) // 4 * 4
        big0 = big1 = big2 = big3 = 0
        low0 = low1 = low2 = low3 = 0x7FFFFFFF
        sq0 = sq1 = sq2 = sq3 = 0.0
        for i in range(start, whole, 4):
            for lane in range(4):
                bits = bits_of[i + lane]
                mantissa = bits & MANTISSA_MASK
                region = (mantissa >= b0) + (mantissa >= b1) + (mantissa >= b2) + (mantissa >= b3)
                rows[lane, ((bits >> MANTISSA_BITS) + FIELDS) * REGIONS + region] += 1
            m0, m1 = bits_of[i] & 0x7FFFFFFF, bits_of[i + 1] & 0x7FFFFFFF
            m2, m3 = bits_of[i + 2] & 0x7FFFFFFF, bits_of[i + 3] & 0x7FFFFFFF
            big0, big1, big2, big3 = max(big0, m0), max(big1, m1), max(big2, m2), max(big3, m3)
            low0, low1 = min(low0, (m0 - 1) & 0x7FFFFFFF), min(low1, (m1 - 1) & 0x7FFFFFFF)
            low2, low3 = min(low2, (m2 - 1) & 0x7FFFFFFF), min(low3, (m3 - 1) & 0x7FFFFFFF)
            x0, x1, x2, x3 = (np.float64(values[i]), np.float64(values[i + 1]),
                              np.float64(values[i + 2]), np.float64(values[i + 3]))
            sq0, sq1, sq2, sq3 = sq0 + x0 * x0, sq1 + x1 * x1, sq2 + x2 * x2, sq3 + x3 * x3
        for i in range(whole, end):
            bits = bits_of[i]
            mantissa = bits & MANTISSA_MASK
            region = (mantissa >= b0) + (mantissa >= b1) + (mantissa >= b2) + (mantissa >= b3)
            rows[0, ((bits >> MANTISSA_BITS) + FIELDS) * REGIONS + region] += 1
            m0 = bits & 0x7FFFFFFF
            big0, low0 = max(big0, m0), min(low0, (m0 - 1) & 0x7FFFFFFF)
            x0 = np.float64(values[i])
            sq0 += x0 * x0
        rows[0] += rows[1] + rows[2] + rows[3]  # the lanes' histograms, summed once per chunk
        maxbits[c] = max(max(big0, big1), max(big2, big3))
        minbits[c] = min(min(low0, low1), min(low2, low3))
        sumsq[c] = (sq0 + sq1) + (sq2 + sq3)
