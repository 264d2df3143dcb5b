"""The numba CPU kernels: gradient statistics (:mod:`mpdiag.numerics.gradstats`) and update counts
(:mod:`mpdiag.numerics.updates`), in their own module so numba is imported (and the kernels loaded from numba's
on-disk cache, or compiled) only when a CPU run first needs them, not when the app starts."""

import numba
import numpy as np
from numba.extending import overload

from mpdiag.numerics.keys import FIELDS, MANTISSA_BITS, MANTISSA_MASK, REGIONS

LANES = 2  # interleaved histogram rows, so consecutive equal keys do not wait on each other's increment
ABS_MASK = np.int32(0x7FFFFFFF)
EXPONENT_MASK = np.int32(0x7F800000)

# "reassoc" lets LLVM vectorise the float64 sum of squares (any summation order is as exact as the loop's);
# no flag that assumes away NaN or inf, which must propagate into the result.
_FLAGS = {"reassoc", "contract"}


@numba.njit(nogil=True, fastmath=_FLAGS)
def _reductions(values, bits_of):
    """The largest magnitude bit pattern, the smallest non-zero one minus 1 and the float64 sum of squares.
    As int32, magnitude bit patterns order like the magnitudes (NaN above inf); minus 1 wraps zero to the
    top, so zero never is the minimum. Two plain loops so both vectorise."""
    big, low = np.int32(0), ABS_MASK
    for i in range(bits_of.shape[0]):
        magnitude = bits_of[i] & ABS_MASK
        big = max(big, magnitude)
        low = min(low, (magnitude - np.int32(1)) & ABS_MASK)
    sumsq = 0.0
    for i in range(values.shape[0]):
        x = np.float64(values[i])
        sumsq += x * x
    return big, low, sumsq


@numba.njit(nogil=True)
def _key_counts(bits_of, bounds, common, row):
    """Adds each value's key (sign x field x mantissa region) to ``row`` (KEYS_PER_TENSOR counts).

    ``bounds`` are the region bounds: 1, then ``common`` (FP8's edges, mid-field), then the rare ones (FP16's
    and BF16's, in the top 2^-8 of a field; see mpdiag.numerics.keys). Every value is counted by sign, field
    and how many common bounds its mantissa reaches, in a histogram small enough to stay in L1 (2 lanes x 512
    fields x 4 int32 = 16 KB); only the rare values (mantissa 0, or at the top of its field, near an FP16/BF16
    rounding edge) are keyed in full. Each region's count is then what the histogram holds for it, less the
    rare values keyed apart."""
    groups = common.shape[0] + 1  # regions 0-1, 2, ..., 1 + len(common) and the rare ones above it
    c0, c1, c2 = common[0], common[1], common[2]  # scalars: compares the loop keeps in registers
    r0, r1, r2 = bounds[groups], bounds[groups + 1], bounds[groups + 2]  # the rare bounds
    fields = np.zeros((LANES, 2 * FIELDS * groups), np.int32)
    for i in range(bits_of.shape[0]):
        bits = bits_of[i]
        mantissa = bits & MANTISSA_MASK
        group = (mantissa >= c0) + (mantissa >= c1) + (mantissa >= c2)
        fields[i & (LANES - 1), ((bits >> MANTISSA_BITS) + FIELDS) * groups + group] += 1
        if np.uint32(mantissa - 1) >= np.uint32(r0 - 1):  # mantissa 0 (wraps around) or >= the first rare bound
            # region 0 for mantissa 0 (zeros are common: embedding rows a batch did not touch), else past
            # every common bound and as many rare ones as it reaches
            region = 0 if mantissa == 0 else groups + (mantissa >= r0) + (mantissa >= r1) + (mantissa >= r2)
            row[((bits >> MANTISSA_BITS) + FIELDS) * REGIONS + region] += 1
    for field in range(2 * FIELDS):
        cells = row[field * REGIONS : (field + 1) * REGIONS]
        for group in range(groups):
            total = 0
            for lane in range(LANES):
                total += fields[lane, field * groups + group]
            if group == 0:
                cells[1] = total - cells[0]  # mantissa 0 is region 0, keyed apart
            else:
                cells[1 + group] = total
        cells[groups] -= cells[groups + 1 :].sum()  # the rare values keyed apart sit in the top group


@numba.njit(nogil=True)
def _subnormal_cell_counts(bits_of, key_row, subnormal_bounds, cells):
    """Adds each fp32 subnormal's cell (see mpdiag.numerics.gradstats.SUBNORMAL_BOUNDS) to ``cells``; a second look
    at the values, taken only when ``key_row`` (this chunk's key counts) says there are any."""
    negative, positive = key_row[1:REGIONS], key_row[FIELDS * REGIONS + 1 : (FIELDS + 1) * REGIONS]  # field 0
    if negative.sum() + positive.sum() == 0:
        return
    for i in range(bits_of.shape[0]):
        bits = bits_of[i]
        mantissa = bits & MANTISSA_MASK
        if (bits & EXPONENT_MASK) == 0 and mantissa != 0:
            cells[np.searchsorted(subnormal_bounds, mantissa, side="right")] += 1


@numba.njit(parallel=True, cache=True, nogil=True)
def fused_pass(arrays, chunks, bounds, common_bounds, subnormal_bounds, chunk_keys, chunk_cells, chunk_bits, chunk_sumsq,
               keys, cells, maxbits, minbits, sumsq):
    """Key counts, fp32-subnormal cell counts and the reductions of :func:`_reductions` of every tensor in
    ``arrays``, written per tensor into ``keys`` (T, KEYS_PER_TENSOR), ``cells`` (T, SUBNORMAL_CELLS),
    ``maxbits``, ``minbits`` and ``sumsq``.

    ``chunks`` (C, 4) lists the work items (:func:`mpdiag.numerics.gradstats.work_items`). Items run in parallel,
    each into its own row of ``chunk_keys``, ``chunk_cells``, ``chunk_bits`` (C, 2: largest, below
    smallest) and ``chunk_sumsq``; then each tensor combines its rows. Every value is read twice, the
    second time from cache, and nothing is written per value."""
    for c in numba.prange(chunks.shape[0]):
        tensor, start, end = chunks[c, 0], chunks[c, 1], chunks[c, 2]
        values = arrays[tensor][start:end]
        bits_of = values.view(np.int32)
        chunk_bits[c, 0], chunk_bits[c, 1], chunk_sumsq[c] = _reductions(values, bits_of)
        row, cell_row = chunk_keys[c], chunk_cells[c]
        row[:] = 0
        cell_row[:] = 0
        _key_counts(bits_of, bounds, common_bounds, row)
        _subnormal_cell_counts(bits_of, row, subnormal_bounds, cell_row)
    for c in range(chunks.shape[0]):
        t = chunks[c, 0]
        if chunks[c, 3]:
            keys[t], cells[t] = chunk_keys[c], chunk_cells[c]
            maxbits[t], minbits[t], sumsq[t] = chunk_bits[c, 0], chunk_bits[c, 1], chunk_sumsq[c]
        else:
            keys[t] += chunk_keys[c]
            cells[t] += chunk_cells[c]
            maxbits[t], minbits[t] = max(maxbits[t], chunk_bits[c, 0]), min(minbits[t], chunk_bits[c, 1])
            sumsq[t] += chunk_sumsq[c]

def _as_float32(values, i, table):
    """values[i] as a float32; FP16/BF16 tensors arrive as uint16 bit patterns and go through ``table``."""


@overload(_as_float32)
def _as_float32_for(values, i, table):
    if values.dtype == numba.types.float32:
        return lambda values, i, table: values[i]
    return lambda values, i, table: table[values[i]]


@numba.njit(parallel=True, cache=True, nogil=True)
def update_counts(befores, afters, grads, items, weight_table, grad_table, factor, item_counts, counts):
    """Per tensor t, into ``counts[t]``: among the values whose gradient is finite and non-zero, how many
    there are (updated), how many moved by less than ``factor``·|before| (below resolution) and how many
    did not move at all (unchanged). Arithmetic in float32 like the torch path: |after - before| and
    ``factor``·|before| (a power of two, exact) are float32 values.

    ``befores``/``afters`` hold the updated tensors before and after the step, ``grads`` their gradients,
    as float32 arrays or as uint16 bit patterns decoded by the 65,536-entry float32 ``*_table``; ``items``
    as from :func:`mpdiag.numerics.gradstats.work_items`; ``item_counts`` (items, 3) is a workspace."""
    for c in numba.prange(items.shape[0]):
        t, start, end = items[c, 0], items[c, 1], items[c, 2]
        before, after, grad = befores[t], afters[t], grads[t]
        updated = below = unchanged = 0
        for i in range(start, end):  # branch-free, so the loop vectorises
            g = _as_float32(grad, i, grad_table)
            old, new = _as_float32(before, i, weight_table), _as_float32(after, i, weight_table)
            moved = np.isfinite(g) & (g != 0)
            updated += moved
            unchanged += moved & (new == old)
            below += moved & (abs(new - old) < factor * abs(old))
        item_counts[c, 0], item_counts[c, 1], item_counts[c, 2] = updated, below, unchanged
    counts[:] = 0
    for c in range(items.shape[0]):
        counts[items[c, 0]] += item_counts[c]
