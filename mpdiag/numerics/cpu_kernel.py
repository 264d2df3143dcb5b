"""The numba CPU kernels: gradient statistics (:mod:`mpdiag.numerics.gradstats`) and update counts
(:mod:`mpdiag.numerics.updates`), in their own module so numba is imported (and the kernels loaded from numba's
on-disk cache, or compiled) only when a CPU run first needs them, not when the app starts."""

import functools

import numba
import numpy as np
import torch
from numba import types
from numba.extending import intrinsic, overload

from mpdiag.numerics.formats import EXP_MIN, FP32
from mpdiag.numerics.keys import FIELDS, MANTISSA_BITS, MANTISSA_MASK, REGIONS

LANES = 2  # interleaved histogram rows, so consecutive equal keys do not wait on each other's increment
ABS_MASK = np.int32(0x7FFFFFFF)
EXPONENT_MASK = np.int32(0x7F800000)

# "reassoc" lets LLVM vectorise the float64 sum of squares (any summation order is as exact as the loop's);
# no flag that assumes away NaN or inf, which must propagate into the result.
_FLAGS = {"reassoc", "contract"}
FIRST_NORMAL_BIN = FP32.min_normal_exponent - EXP_MIN  # the histogram bin of fp32 field 1


def on_torch_threads(kernel):
    """``kernel`` (a parallel one) launched on as many threads as torch has (no more than numba has now), and
    both thread counts left as they were. numba's OpenMP layer sets the launching thread's OpenMP thread count to
    numba's own at each parallel launch, and torch shares that runtime: without this, a training script's
    ``torch.set_num_threads(1)`` became the number of cores from mpdiag's first parallel kernel on (seen as an O1
    run taking 6x the CPU); and a script's own ``numba.set_num_threads`` is the script's to keep."""
    @functools.wraps(kernel)
    def launch(*args):
        threads, numba_threads = torch.get_num_threads(), numba.get_num_threads()
        numba.set_num_threads(max(1, min(threads, numba_threads)))
        try:
            return kernel(*args)
        finally:
            numba.set_num_threads(numba_threads)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    return launch


@intrinsic
def _pointer(typingctx, address, like):
    """The pointer at ``address`` (an int64) to values of the type of ``like`` (a scalar: float32 values, or the
    uint16 bit patterns of FP16/BF16): the kernels reach their arrays by address and length. Handed over as numba's
    typed List instead, every process compiled the List's methods at its first pass (~0.3-0.9 s of CPU, which
    numba's on-disk cache does not keep)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return types.CPointer(like)(types.int64, like), codegen


def array_table(arrays: list[np.ndarray], dtype=np.float32) -> np.ndarray:
    """(address, length) of each of ``arrays`` (contiguous, of ``dtype``), as the kernels take them; the caller
    keeps the arrays alive while a kernel reads them."""
    if not all(a.dtype == dtype and a.flags.c_contiguous for a in arrays):
        raise ValueError(f"the kernels read contiguous {np.dtype(dtype).name} arrays")
    return np.array([(a.ctypes.data, a.size) for a in arrays], dtype=np.int64).reshape(len(arrays), 2)


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
def _field_at(k, lo):
    """The k-th field a chunk's values can lie in: 0 (zeros, fp32 subnormals), then ``lo`` (at least 1) on;
    a chunk with fields up to ``hi`` has ``hi - max(lo, 1) + 2`` of them (:func:`_field_count`)."""
    return 0 if k == 0 else max(lo, 1) + k - 1


@numba.njit(nogil=True)
def _field_count(lo, hi):
    return max(hi - max(lo, 1) + 2, 1)


@numba.njit(nogil=True)
def _key_counts(bits_of, bounds, common, row, lo, hi):
    """Sets ``row`` (KEYS_PER_TENSOR counts) to the counts of each value's key (sign x field x mantissa
    region) in the fields the values can lie in, 0 and ``lo`` .. ``hi`` (the fields of the chunk's smallest
    non-zero and largest magnitude); the other fields of ``row`` are neither written nor read: a tensor of
    gradients spans tens of fields, not 256.

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
    for sign in range(2):
        for k in range(_field_count(lo, hi)):
            field = sign * FIELDS + _field_at(k, lo)
            row[field * REGIONS : (field + 1) * REGIONS] = 0
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
    for sign in range(2):
        for k in range(_field_count(lo, hi)):
            field = sign * FIELDS + _field_at(k, lo)
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
    """Sets ``cells`` to the count of each fp32 subnormal's cell (see mpdiag.numerics.gradstats.SUBNORMAL_BOUNDS);
    a second look at the values, taken only when ``key_row`` (this chunk's key counts) says there are any."""
    cells[:] = 0
    negative, positive = key_row[1:REGIONS], key_row[FIELDS * REGIONS + 1 : (FIELDS + 1) * REGIONS]  # field 0
    if negative.sum() + positive.sum() == 0:
        return
    for i in range(bits_of.shape[0]):
        bits = bits_of[i]
        mantissa = bits & MANTISSA_MASK
        if (bits & EXPONENT_MASK) == 0 and mantissa != 0:
            cells[np.searchsorted(subnormal_bounds, mantissa, side="right")] += 1


@numba.njit(nogil=True)
def _decode_chunk(row, cells, lo, hi, shifts, tables, hist, specials, categories):
    """Adds a chunk's statistics, from its key counts ``row`` (fields 0 and ``lo`` .. ``hi``) and subnormal
    ``cells``, to ``hist`` (the exponent histogram) and ``specials`` (zeros, nan, posinf, neginf) of the
    values times 2**shifts[0], and to ``categories[v]`` (CATEGORY_COLUMNS) of the values times 2**shifts[v].

    What :func:`mpdiag.numerics.gradstats._decode` does for the torch backend's counts (there with shift 0),
    one chunk at a time, over the occupied fields only. A shift moves every normal field, keeping its
    region; fields pushed past the largest finite one became inf (no category, and ±inf for the
    histogram's view); fields 0 and 255 stay. Shifted counts are only used where no value is or becomes an
    fp32 subnormal (:func:`mpdiag.numerics.gradstats._shift_is_exact`), so the subnormal cells are added
    unshifted. ``tables``: the cell columns (field x region, format) and the subnormal cells' columns
    (cell, format) - the CATEGORY_COLUMNS index of a cell's category per format, -1 for none - and the
    subnormal cells' histogram bins (mpdiag.numerics.gradstats.KERNEL_TABLES)."""
    cell_columns, subnormal_columns, subnormal_bins = tables
    for v in range(shifts.shape[0]):
        shift = shifts[v]
        low, high = max(1, 1 - shift), min(FIELDS - 1, FIELDS - 1 - shift)  # fields that stay normal
        for k in range(_field_count(lo, hi)):
            field = _field_at(k, lo)
            for region in range(REGIONS):
                negative = row[field * REGIONS + region]
                positive = row[(FIELDS + field) * REGIONS + region]
                count = negative + positive
                if count == 0:
                    continue
                normal = 0 < field < FIELDS - 1
                if not normal:
                    target = field
                elif low <= field < high:
                    target = field + shift
                else:
                    target = -1  # inf (or, for a shift that is not used, an fp32 subnormal)
                if target >= 0:
                    for f in range(cell_columns.shape[1]):
                        column = cell_columns[target * REGIONS + region, f]
                        if column >= 0:
                            categories[v, column] += count
                if v == 0:
                    if normal and low <= field < high:
                        hist[FIRST_NORMAL_BIN + field + shift - 1] += count
                    elif normal and field >= high:
                        specials[2] += positive
                        specials[3] += negative
                    elif field == 0 and region == 0:
                        specials[0] += count
                    elif field == FIELDS - 1 and region == 0:
                        specials[2] += positive
                        specials[3] += negative
                    elif field == FIELDS - 1:
                        specials[1] += count
        for cell in range(1, cells.shape[0]):
            count = cells[cell]
            if count == 0:
                continue
            if v == 0:
                hist[subnormal_bins[cell]] += count
            for f in range(subnormal_columns.shape[1]):
                column = subnormal_columns[cell, f]
                if column >= 0:
                    categories[v, column] += count


@numba.njit(nogil=True)
def _item_stats(c, arrays, items, bounds, common_bounds, subnormal_bounds, shifts, tables, item_keys, item_cells,
                item_bits, item_sumsq, item_hist, item_specials, item_categories):
    """Work item ``c`` of :func:`fused_pass`, into row ``c`` of the ``item_*`` workspaces."""
    array, start, end = items[c, 1], items[c, 2], items[c, 3]
    values = numba.carray(_pointer(arrays[array, 0], np.float32(0)), arrays[array, 1])[start:end]
    bits_of = values.view(np.int32)
    big, low, item_sumsq[c] = _reductions(values, bits_of)
    item_bits[c, 0], item_bits[c, 1] = big, low
    lo = ((low + np.int32(1)) >> MANTISSA_BITS) if low != ABS_MASK else FIELDS  # no non-zero: field 0 alone
    hi = big >> MANTISSA_BITS
    row, cell_row = item_keys[c], item_cells[c]
    _key_counts(bits_of, bounds, common_bounds, row, lo, hi)
    _subnormal_cell_counts(bits_of, row, subnormal_bounds, cell_row)
    item_hist[c, :] = 0
    item_specials[c, :] = 0
    item_categories[c, :, :] = 0
    _decode_chunk(row, cell_row, lo, hi, shifts, tables, item_hist[c], item_specials[c], item_categories[c])


@numba.njit(nogil=True)
def _add_row(target, source):
    """``target += source`` for two 1-D rows of one length, element by element. numba compiles an array
    assignment with a shape check whose error message needs its whole string formatting: ~3.5 s of the kernels'
    first compile, paid in every new install (or cache miss), where these loops cost nothing."""
    for i in range(target.shape[0]):
        target[i] += source[i]


@numba.njit(nogil=True)
def _combine(items, item_bits, item_sumsq, item_hist, item_specials, item_categories,
             hist, specials, categories, maxbits, minbits, sumsq):
    """Each tensor's statistics and reductions from its work items' rows."""
    for c in range(items.shape[0]):
        t = items[c, 0]
        if items[c, 4]:  # a tensor's first item: its rows start from it
            hist[t, :] = 0
            specials[t, :] = 0
            categories[t, :, :] = 0
            maxbits[t], minbits[t], sumsq[t] = item_bits[c, 0], item_bits[c, 1], item_sumsq[c]
        else:
            maxbits[t], minbits[t] = max(maxbits[t], item_bits[c, 0]), min(minbits[t], item_bits[c, 1])
            sumsq[t] += item_sumsq[c]
        _add_row(hist[t], item_hist[c])
        _add_row(specials[t], item_specials[c])
        for v in range(categories.shape[1]):
            _add_row(categories[t, v], item_categories[c, v])


@numba.njit(parallel=True, cache=True, nogil=True)
def fused_pass(arrays, items, bounds, common_bounds, subnormal_bounds, shifts, tables, item_keys, item_cells,
               item_bits, item_sumsq, item_hist, item_specials, item_categories,
               hist, specials, categories, maxbits, minbits, sumsq):
    """The statistics of every tensor in one pass: per tensor t, ``hist[t]``, ``specials[t]`` and
    ``categories[t]`` as :func:`_decode_chunk` defines them for the views 2**shifts[v] times the values, and the
    reductions of :func:`_reductions` (``maxbits``, ``minbits``, ``sumsq``).

    ``arrays`` (A, 2) locates the values (:func:`array_table`): the small tensors gathered in array 0, each
    large one as itself.
    ``items`` (C, 5) lists the work items: tensor, array, first element, end element, 1 for a tensor's
    first item (a tensor's items are consecutive). Items run in parallel, each into its own row of the
    ``item_*`` workspaces (key counts, subnormal cells, the bit bounds as largest and below smallest, sum of
    squares, then its decoded statistics); then each tensor combines its rows. Every value is read twice,
    the second time from cache, and nothing is written per value."""
    for c in numba.prange(items.shape[0]):
        _item_stats(c, arrays, items, bounds, common_bounds, subnormal_bounds, shifts, tables, item_keys, item_cells,
                    item_bits, item_sumsq, item_hist, item_specials, item_categories)
    _combine(items, item_bits, item_sumsq, item_hist, item_specials, item_categories,
             hist, specials, categories, maxbits, minbits, sumsq)


@numba.njit(cache=True, nogil=True)
def fused_pass_serial(arrays, items, bounds, common_bounds, subnormal_bounds, shifts, tables, item_keys, item_cells,
                      item_bits, item_sumsq, item_hist, item_specials, item_categories,
                      hist, specials, categories, maxbits, minbits, sumsq):
    """:func:`fused_pass` on the calling thread alone, for steps too small to pay for waking the others (see
    mpdiag.numerics.gradstats.PARALLEL_FROM)."""
    for c in range(items.shape[0]):
        _item_stats(c, arrays, items, bounds, common_bounds, subnormal_bounds, shifts, tables, item_keys, item_cells,
                    item_bits, item_sumsq, item_hist, item_specials, item_categories)
    _combine(items, item_bits, item_sumsq, item_hist, item_specials, item_categories,
             hist, specials, categories, maxbits, minbits, sumsq)


@numba.njit(nogil=True)
def _item_signals(values, factor, held_are_scaled, edges, out):
    """Counts of one work item's ``values`` into ``out``: nan, posinf, neginf of the unscaled g, then per format
    (``edges[f]``: the smallest magnitude that does not underflow, the smallest that overflows) the values of S*g
    that underflow and that overflow. ``held_are_scaled``: the values are S*g, and g is their product with
    ``factor`` (GradScaler's fp32 reciprocal); else they are g, and S*g is their product with ``factor`` (S)."""
    nan = posinf = neginf = 0
    for i in range(values.shape[0]):  # branch-free, so the loop vectorises
        x = values[i]
        g = x * factor if held_are_scaled else x
        nan += g != g
        posinf += g == np.inf
        neginf += g == -np.inf
    out[0], out[1], out[2] = nan, posinf, neginf
    for f in range(edges.shape[0]):
        not_under, over = edges[f, 0], edges[f, 1]
        under_count = over_count = 0
        for i in range(values.shape[0]):
            x = values[i]
            magnitude = abs(x if held_are_scaled else x * factor)
            under_count += (magnitude > 0) & (magnitude < not_under)
            over_count += (magnitude >= over) & (magnitude < np.inf)
        out[3 + 2 * f], out[4 + 2 * f] = under_count, over_count


@numba.njit(nogil=True)
def _sum_items(items, item_counts, counts):
    counts[:] = 0
    for c in range(items.shape[0]):
        _add_row(counts[items[c, 0]], item_counts[c])


@numba.njit(parallel=True, cache=True, nogil=True)
def signal_pass(values, items, factor, held_are_scaled, edges, item_counts, counts):
    """Per tensor t, into ``counts[t]``: :func:`_item_signals` of its values in ``values`` (one FP32 array;
    ``items`` as :func:`fused_pass` takes them, the array column unused), work items in parallel; ``item_counts``
    (items, columns) is a workspace."""
    for c in numba.prange(items.shape[0]):
        _item_signals(values[items[c, 2] : items[c, 3]], factor, held_are_scaled, edges, item_counts[c])
    _sum_items(items, item_counts, counts)


@numba.njit(cache=True, nogil=True)
def signal_pass_serial(values, items, factor, held_are_scaled, edges, item_counts, counts):
    """:func:`signal_pass` on the calling thread alone (see :func:`fused_pass_serial`)."""
    for c in range(items.shape[0]):
        _item_signals(values[items[c, 2] : items[c, 3]], factor, held_are_scaled, edges, item_counts[c])
    _sum_items(items, item_counts, counts)


def _as_float32(values, i, table):
    """values[i] as a float32; FP16/BF16 tensors arrive as uint16 bit patterns and go through ``table``."""


@overload(_as_float32)
def _as_float32_for(values, i, table):
    if values.dtype == numba.types.float32:
        return lambda values, i, table: values[i]
    return lambda values, i, table: table[values[i]]


@numba.njit(parallel=True, cache=True, nogil=True)
def update_counts(befores, afters, grads, weight_like, grad_like, items, weight_table, grad_table, factor,
                  item_counts, counts):
    """Per tensor t, into ``counts[t]``: among the values whose gradient is finite and non-zero, how many
    there are (updated), how many moved by less than ``factor``·|before| (below resolution) and how many
    did not move at all (unchanged). Arithmetic in float32 like the torch path: |after - before| and
    ``factor``·|before| (a power of two, exact) are float32 values.

    ``befores``/``afters`` locate the updated tensors before and after the step, ``grads`` their gradients
    (:func:`array_table`), as float32 arrays or as uint16 bit patterns decoded by the 65,536-entry float32
    ``*_table``; ``weight_like``/``grad_like`` is a scalar of the weights'/gradients' array type; ``items`` as
    from :func:`mpdiag.numerics.gradstats.work_items`; ``item_counts`` (items, 3) is a workspace."""
    for c in numba.prange(items.shape[0]):
        t, start, end = items[c, 0], items[c, 1], items[c, 2]
        before = numba.carray(_pointer(befores[t, 0], weight_like), befores[t, 1])
        after = numba.carray(_pointer(afters[t, 0], weight_like), afters[t, 1])
        grad = numba.carray(_pointer(grads[t, 0], grad_like), grads[t, 1])
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
        _add_row(counts[items[c, 0]], item_counts[c])


#: the exponent field's bits of each floating-point dtype the finiteness count reads: a value is inf or NaN exactly
#: when all of them are set
EXPONENT_BITS = {torch.float32: 0x7F800000, torch.float16: 0x7C00, torch.bfloat16: 0x7F80,
                 torch.float64: 0x7FF0000000000000}


@numba.njit(inline="always")
def _all_exponent_bits_set(bits, mask):
    count = 0
    for i in range(bits.shape[0]):  # branch-free, so the loop vectorises
        count += (bits[i] & mask) == mask
    return count


@numba.njit(parallel=True, cache=True, nogil=True)
def nonfinite_counts(table, counts):
    """Per row t of ``table`` (address, number of values, exponent bits, bytes a value: 2, 4 or 8), into
    ``counts[t]``: how many of those values are inf or NaN, read as bit patterns (any FP16/BF16/FP32/FP64
    tensor, see :data:`EXPONENT_BITS`), tensors in parallel. The caller keeps the tensors alive."""
    for t in numba.prange(table.shape[0]):
        address, n, mask, width = table[t, 0], table[t, 1], table[t, 2], table[t, 3]
        if width == 2:
            counts[t] = _all_exponent_bits_set(numba.carray(_pointer(address, np.int16(0)), n), np.int16(mask))
        elif width == 4:
            counts[t] = _all_exponent_bits_set(numba.carray(_pointer(address, np.int32(0)), n), np.int32(mask))
        else:
            counts[t] = _all_exponent_bits_set(numba.carray(_pointer(address, np.int64(0)), n), np.int64(mask))
