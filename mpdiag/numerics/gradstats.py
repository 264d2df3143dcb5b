"""Exact per-tensor gradient statistics, computed in one pass over the fp32 bit patterns.

Every value gets an integer *key* from its fp32 bits: sign, exponent field and a *mantissa region*, the
number of FP16/BF16 rounding edges its mantissa lies at or above. The edges of every format sit at the same
few mantissa values in whichever exponent field they occur (:data:`REGION_BOUNDS`), so one key serves all
formats. Per tensor, the key counts give the exponent histogram and the exact FP16/BF16 underflow /
subnormal / overflow counts.

Which (field, region) cell falls in which category is not typed in: it is found by casting the smallest and
largest fp32 value of every cell with torch (:func:`_category_table`), so the counts equal torch's own
round-to-nearest-even casting by construction, and a cell that is not uniform fails at import. fp32
subnormals (|x| < 2**-126) are the one non-uniform range (for BF16, and for the histogram's binades): they
are counted again by *subnormal cell* (:data:`SUBNORMAL_BOUNDS`, edges found by bisecting with casts), so
no count ever needs the values themselves after the pass.

One pass serves both views the Recorder stores, g and S*g: multiplying by a power of two 2^k moves every
normal value k fields and leaves its mantissa alone, so the other view's counts are the same counts shifted
k fields - exactly, as long as no value leaves fp32's normal range (then, or for a scale that is not a
power of two, the other view is computed and counted explicitly, as GradScaler computes it).

Two backends compute the counts and reductions: a fused numba kernel on the CPU (see mpdiag.numerics.cpu_kernel),
which decodes each work item's key counts into the statistics as it goes, over the few fields its values
occupy (a tensor costs its values and a few microseconds, not KEYS_PER_TENSOR counts to decode), and torch
ops elsewhere (CUDA): a fixed number of launches over all gradients gathered into workspaces
allocated once, no host synchronisation, one non-blocking copy to the host (:class:`PendingStats`). On CUDA
those launches (~35) are captured once in a CUDA graph and replayed, one launch a step, since each costs the
host tens of microseconds. The torch backend always computes the second view by GradScaler's multiply, since
choosing to shift would mean reading counts back first.

float64 gradients are read as torch casts them to FP32 (its casts of float64 to FP16, BF16 and FP8 go through
FP32, so the counts are torch's), except a finite value the cast would make infinite or zero: it is read as
FP32's largest value or smallest subnormal, with its sign (:class:`_Float64Read`), so it counts as overflowing or
underflowing every narrower format, not as inf or zero; the histogram counts it in FP32's top or bottom bin. Their
absmax, min_nonzero and l2 are taken from the float64 values themselves.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import operator
import warnings
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from mpdiag.numerics.formats import (
    BF16,
    EXP_MIN,
    FP16,
    FP32,
    LOW_PRECISION,
    N_EXP_BINS,
    SIGNAL_COUNTS,
    SIGNAL_FORMATS,
    Format,
)
from mpdiag.numerics.keys import COMMON_BOUNDS, FIELDS, MANTISSA_BITS, MANTISSA_MASK, REGION_BOUNDS, REGIONS

#: whether the fused CPU kernel (mpdiag.numerics.cpu_kernel) can be used; numba itself is imported on first use
NUMBA_AVAILABLE = importlib.util.find_spec("numba") is not None

# Categories of a value's cast into a low-precision format.
NORMAL, UNDERFLOW, SUBNORMAL, OVERFLOW, SPECIAL, MIXED = range(6)
CATEGORY_NAMES = ("underflow", "subnormal", "overflow")


KEYS_PER_TENSOR = 2 * FIELDS * REGIONS  # sign x field x region


def _classify(values: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Category of each finite non-zero fp32 value when cast to ``fmt`` (torch casting is the truth)."""
    cast = values.to(fmt.dtype).float().abs()
    category = torch.full(values.shape, NORMAL, dtype=torch.int8)
    category[cast == 0] = UNDERFLOW
    category[(cast > 0) & (cast < fmt.min_normal)] = SUBNORMAL
    category[torch.isinf(cast)] = OVERFLOW
    if fmt.overflow_above is not None:  # a saturating cast (E4M3) shows no inf: overflow is past its threshold
        category[values.abs() > fmt.overflow_above] = OVERFLOW
    return category


def _category_table(fmt: Format) -> np.ndarray:
    """Category of every (field, region) cell for ``fmt``, shape (256, REGIONS); MIXED where a cell holds
    values of two categories (only among fp32 subnormals, which are then all classified by casting)."""
    bounds = torch.tensor((0, *REGION_BOUNDS, MANTISSA_MASK + 1), dtype=torch.int32)
    field = torch.arange(FIELDS, dtype=torch.int32).repeat_interleave(REGIONS)
    lowest, highest = bounds[:-1].repeat(FIELDS), (bounds[1:] - 1).repeat(FIELDS)
    first = _classify(((field << MANTISSA_BITS) | lowest).view(torch.float32), fmt)
    last = _classify(((field << MANTISSA_BITS) | highest).view(torch.float32), fmt)
    table = torch.where(first == last, first, torch.full_like(first, MIXED)).view(FIELDS, REGIONS).numpy().copy()
    if (table[1 : FIELDS - 1] == MIXED).any():
        raise AssertionError(f"{fmt.name}: a rounding edge inside an fp32 normal exponent field is not a region bound")
    if (table[0, 1:] == MIXED).any():
        table[0, 1:] = MIXED  # all fp32 subnormals then count by subnormal cell, none from the table
    table[0, 0] = SPECIAL  # zero
    table[FIELDS - 1, :] = SPECIAL  # inf, NaN
    return table


CATEGORY_TABLES = {name: _category_table(fmt) for name, fmt in LOW_PRECISION.items()}
#: "{format}_{category}" names, and a 0/1 matrix (field x region, name) summing each name's cells at once (as
#: float64: a BLAS product, exact below 2**53)
CATEGORY_COLUMNS = [f"{name}_{label}" for name in CATEGORY_TABLES for label in CATEGORY_NAMES]
CATEGORY_MATRIX = np.stack([(table == category).reshape(-1) for table in CATEGORY_TABLES.values()
                            for category in (UNDERFLOW, SUBNORMAL, OVERFLOW)], axis=1).astype(np.float64)


def _subnormal_category(mantissa: int, fmt: Format) -> int:
    """Category in ``fmt`` of the fp32 subnormal mantissa * 2**-149, by casting it."""
    return int(_classify(torch.tensor([mantissa], dtype=torch.int32).view(torch.float32), fmt)[0])


def _subnormal_bounds() -> tuple[int, ...]:
    """Mantissas at which an fp32 subnormal (mantissa * 2**-149) changes binade or changes category in some
    format, plus the region bounds so cells nest in regions. A cast's category only grows with magnitude,
    so each change is found by bisecting between casts (torch's casting is the truth, not a formula)."""
    bounds = {1 << k for k in range(MANTISSA_BITS)} | set(REGION_BOUNDS)
    for fmt in LOW_PRECISION.values():
        low, top = 1, _subnormal_category(MANTISSA_MASK, fmt)
        while (category := _subnormal_category(low, fmt)) != top:
            lo, hi = low, MANTISSA_MASK  # category(lo) < category(hi): find the first mantissa above lo's
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if _subnormal_category(mid, fmt) == category else (lo, mid)
            bounds.add(hi)
            low = hi
    return tuple(sorted(bounds))


#: fp32 subnormals are keyed by *cell*: cell 0 is mantissa 0 (zero), cell i >= 1 holds the mantissas in
#: [SUBNORMAL_BOUNDS[i-1], SUBNORMAL_BOUNDS[i]) (the last ends at 2**23). Within a cell the binade and every
#: format's category are the same (checked below by casting both ends; categories only grow with magnitude).
SUBNORMAL_BOUNDS = _subnormal_bounds()
SUBNORMAL_CELLS = len(SUBNORMAL_BOUNDS) + 1


def _subnormal_cell_tables() -> tuple[np.ndarray, np.ndarray]:
    """Per cell (>= 1): its histogram bin, and a 0/1 matrix (cell, CATEGORY_COLUMNS) of its category in each
    format whose field-0 cells are MIXED (formats with uniform field-0 cells are counted by CATEGORY_MATRIX)."""
    first = np.array(SUBNORMAL_BOUNDS, dtype=np.int64)
    last = np.array((*SUBNORMAL_BOUNDS[1:], MANTISSA_MASK + 1), dtype=np.int64) - 1
    bins = np.zeros(SUBNORMAL_CELLS, dtype=np.int64)
    bins[1:] = np.floor(np.log2(first)).astype(np.int64)  # exponent -149 + floor(log2 m) is bin floor(log2 m)
    if (np.floor(np.log2(last)).astype(np.int64) != bins[1:]).any():
        raise AssertionError("a subnormal cell spans two binades")
    matrix = np.zeros((SUBNORMAL_CELLS, len(CATEGORY_COLUMNS)), dtype=np.float64)
    for f, (name, fmt) in enumerate(LOW_PRECISION.items()):
        low, high = (_classify(torch.from_numpy(m.astype(np.int32)).view(torch.float32), fmt).numpy() for m in (first, last))
        if (low != high).any():
            raise AssertionError(f"{name}: a subnormal cell holds two categories")
        if (CATEGORY_TABLES[name][0, 1:] == MIXED).all():
            for column, category in enumerate((UNDERFLOW, SUBNORMAL, OVERFLOW)):
                matrix[1:, f * len(CATEGORY_NAMES) + column] = low == category
    return bins, matrix


SUBNORMAL_BINS, SUBNORMAL_MATRIX = _subnormal_cell_tables()
#: 0/1 (cell, region): the mantissa region each subnormal cell lies in (cell 0, zero, is region 0)
SUBNORMAL_CELL_REGIONS = np.zeros((SUBNORMAL_CELLS, REGIONS), dtype=np.int64)
SUBNORMAL_CELL_REGIONS[0, 0] = 1
SUBNORMAL_CELL_REGIONS[np.arange(1, SUBNORMAL_CELLS), np.searchsorted(REGION_BOUNDS, SUBNORMAL_BOUNDS, side="right")] = 1

#: The torch backend keys each value by one search of its magnitude bits among these bounds: bucket 0 is
#: zero, buckets 1 .. SUBNORMAL_CELLS - 1 the subnormal cells, then REGIONS buckets per field 1..255.
BUCKET_BOUNDS = (*SUBNORMAL_BOUNDS, *((field << MANTISSA_BITS) | bound for field in range(1, FIELDS)
                                      for bound in (0, *REGION_BOUNDS)))
BUCKETS = len(BUCKET_BOUNDS) + 1


@dataclass
class StepGradStats:
    """Statistics of every recorded tensor at one step. Arrays are indexed by tensor position.

    ``hist[t, i]`` counts values of tensor t with 2**(EXP_MIN + i) <= |g| < 2**(EXP_MIN + i + 1), for the
    unscaled gradient g. ``counts[name]`` holds zeros, nan, posinf, neginf and, for fmt in the registry (LOW_PRECISION) and
    category in underflow/subnormal/overflow, ``{fmt}_{category}`` (for g) and ``{fmt}_{category}_at_scale``
    (for S*g, the gradient as it was in the backward pass). absmax, min_nonzero and l2 are of g; absmax and
    l2 are NaN when g holds a NaN; min_nonzero is NaN when g holds no non-zero value. ``other_view`` says how
    the second view was obtained: "same" (scale 1), "shifted" (power-of-two scale) or "recomputed".
    """

    hist: np.ndarray
    counts: dict[str, np.ndarray]
    absmax: np.ndarray
    min_nonzero: np.ndarray
    l2: np.ndarray
    other_view: str


SPECIAL_COUNTS = ("zeros", "nan", "posinf", "neginf")


@dataclass
class _Pass:
    """One pass over a step's values: the exponent histogram (T, N_EXP_BINS) and SPECIAL_COUNTS (T, 4) of
    the values times 2**shift for the pass's first shift, the CATEGORY_COLUMNS counts (T, shifts, columns)
    of the values times 2**shift for each of its shifts, and the values' own reductions (float64, per
    tensor; ``below_smallest`` as from :func:`_reductions_from_bits`)."""

    hist: np.ndarray
    specials: np.ndarray
    categories: np.ndarray
    absmax: np.ndarray
    min_nonzero: np.ndarray
    l2: np.ndarray
    below_smallest: np.ndarray


def power_of_two_exponent(scale: float) -> int | None:
    """k when ``scale`` is exactly 2**k (with 2**-k also a normal fp32), else None."""
    mantissa, exponent = math.frexp(scale)
    return exponent - 1 if mantissa == 0.5 and -126 <= exponent - 1 <= 126 else None


def _shift_is_exact(below_smallest: np.ndarray, shift: int) -> bool:
    """Whether the counts of every value times 2**shift follow from the key counts alone: no value is an fp32
    subnormal or would become one (their products depend on digits the counts do not hold). Read from each
    tensor's smallest non-zero magnitude (``below_smallest`` + 1), whose field is the lowest it occupies.
    Values pushed past the largest finite field become inf, which is exact."""
    lowest = (below_smallest[below_smallest != 0x7FFFFFFF].astype(np.int64) + 1) >> MANTISSA_BITS
    if (lowest == 0).any():
        return False
    normal = lowest[lowest < FIELDS - 1]  # a tensor whose non-zero values are all inf/NaN occupies no normal field
    return not (normal.size and normal.min() + shift < 1)


def _format_columns(matrix: np.ndarray) -> np.ndarray:
    """A 0/1 (cell, CATEGORY_COLUMNS) matrix as (cell, format): the column of the cell's category in each
    format, -1 for none."""
    per_format = matrix.reshape(len(matrix), len(LOW_PRECISION), len(CATEGORY_NAMES))
    if (per_format.sum(axis=2) > 1).any():
        raise AssertionError("a cell in two categories of one format")
    base = np.arange(len(LOW_PRECISION)) * len(CATEGORY_NAMES)
    return np.where(per_format.any(axis=2), base + per_format.argmax(axis=2), -1).astype(np.int64)


#: what the numba kernel decodes a chunk's keys with (mpdiag.numerics.cpu_kernel._decode_chunk): the category
#: columns of every (field, region) cell and of every subnormal cell, and the subnormal cells' histogram bins
KERNEL_TABLES = (_format_columns(CATEGORY_MATRIX), _format_columns(SUBNORMAL_MATRIX), SUBNORMAL_BINS)


def _cast_edges(fmt: Format) -> tuple[float, float]:
    """The smallest fp32 magnitude that does not underflow ``fmt`` and the smallest that overflows it, found by
    bisecting over the magnitude bit patterns with torch's casts (a cast's category only grows with magnitude)."""

    def first(predicate) -> int:  # the first finite magnitude bit pattern where predicate holds
        lo, hi = 0, 0x7F800000  # predicate(lo) is False, predicate(hi) True (inf overflows, is not underflow)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if predicate(mid) else (mid, hi)
        return hi

    def category(bits: int) -> int:
        return int(_classify(torch.tensor([bits], dtype=torch.int32).view(torch.float32), fmt)[0])

    edges = first(lambda bits: category(bits) != UNDERFLOW), first(lambda bits: category(bits) == OVERFLOW)
    return tuple(float(torch.tensor([bits], dtype=torch.int32).view(torch.float32)) for bits in edges)


# :meth:`GradStatsComputer.hold` counts SIGNAL_COUNTS (mpdiag.numerics.formats): a subset of StepGradStats.counts,
# equal to them
SIGNAL_EDGES = np.array([_cast_edges(LOW_PRECISION[fmt]) for fmt in SIGNAL_FORMATS], dtype=np.float32)


#: elements per work item of the numba kernels: big tensors are split so both cores share them
CHUNK = 1 << 17
#: values from which the statistics kernel runs its work items in parallel. Below, one thread does all: at
#: 500 small tensors (1M values, ~4 ms on one core) on a busy 2-core machine, two threads took 18-23 ms and
#: one took 10 ms (wall), since a parallel step waits for its slowest thread to be scheduled
PARALLEL_FROM = 1 << 22


def work_items(numels: list[int]) -> np.ndarray:
    """The numba kernels' work items over tensors of sizes ``numels``, shape (items, 4), int64: tensor,
    first element, end element, 1 for a tensor's first item. A tensor's items are consecutive; an empty
    tensor gets one empty item."""
    per_tensor = [max(1, -(-size // CHUNK)) for size in numels]
    tensor = np.repeat(np.arange(len(numels)), per_tensor)
    first_item = np.concatenate([[0], np.cumsum(per_tensor)[:-1]]).astype(np.int64)
    start = (np.arange(len(tensor)) - first_item[tensor]) * CHUNK
    end = np.minimum(start + CHUNK, np.asarray(numels, dtype=np.int64)[tensor])
    return np.stack([tensor, start, end, start == 0], axis=1).astype(np.int64).reshape(-1, 4)


class DeviceReadback:
    """A small device tensor on its way to the host without a synchronisation: one non-blocking copy into
    pinned memory, readable once the copy's event has completed. On the CPU it is a plain copy, ready at once."""

    def __init__(self, values: torch.Tensor):
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = values.clone(), None

    def ready(self) -> bool:
        """Whether :meth:`numpy` would return without waiting for the device."""
        return self._event is None or self._event.query()

    def numpy(self) -> np.ndarray:
        """The values, waiting for the copy if it has not completed."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy()


class PendingStats:
    """The statistics of one step, computed or still on the device. :meth:`result` decodes them, waiting for
    the device copy only if it has not completed; :meth:`ready` says whether it would wait."""

    def __init__(self, finish, readback: DeviceReadback | None = None):
        self._finish, self._readback, self._result = finish, readback, None

    def ready(self) -> bool:
        return self._readback is None or self._readback.ready()

    def result(self) -> StepGradStats:
        if self._result is None:
            self._result = self._finish(None if self._readback is None else self._readback.numpy())
        return self._result

    def then(self, patch) -> PendingStats:
        """These statistics as ``patch`` leaves them (called once, on the decoded result)."""
        return PendingStats(lambda host: patch(self._finish(host)), self._readback)


FP32_MAX = float(torch.finfo(torch.float32).max)
_FLOAT64 = frozenset((torch.float64,))
_DTYPE = operator.attrgetter("dtype")
FP32_SMALLEST = 2.0**-149  # FP32's smallest subnormal


class _Float64Read:
    """The float64 tensors among a step's gradients, read for the FP32 pass and for their exact reductions.

    :meth:`values` gives each tensor as the pass reads it (see the module's docstring): a float64 value whose
    FP32 cast is inf or zero while it is finite or non-zero would otherwise be counted as a non-finite value or
    a zero that the gradient does not hold (a 1e39 or a 1e-50, beyond FP32's range). :meth:`_reduce` takes
    absmax, min_nonzero and l2 of the unscaled float64 values (the gradient times GradScaler's FP32 reciprocal,
    multiplied in float64 as GradScaler does), on the tensors' device, read by :meth:`patch` once the step's
    statistics are decoded (a device's results are ready by then)."""

    def __init__(self, grads: list[torch.Tensor], factor: float | torch.Tensor | None):
        self.indices = [t for t, g in enumerate(grads) if g.dtype == torch.float64 and g.numel()]
        self._reductions = self._reduce([grads[t].detach() for t in self.indices], factor) if self.indices else None

    @classmethod
    def of(cls, grads: list[torch.Tensor], scale: float | torch.Tensor, grads_are_scaled: bool) -> _Float64Read | None:
        """None when no gradient is float64 (the usual case: one test in C)."""
        if _FLOAT64.isdisjoint(map(_DTYPE, grads)):
            return None
        if not grads_are_scaled or (not torch.is_tensor(scale) and scale == 1.0):
            return cls(grads, None)
        return cls(grads, unscale_factor(scale))

    @staticmethod
    def values(grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return [_within_fp32(g) if g.dtype == torch.float64 else g for g in grads]

    @staticmethod
    def _reduce(grads: list[torch.Tensor], factor: float | torch.Tensor | None) -> torch.Tensor:
        unscaled = grads if factor is None else [g * factor for g in grads]
        magnitudes = [u.abs() for u in unscaled]
        absmax = torch.stack([m.amax() for m in magnitudes])  # NaN when the tensor holds one, as the pass says
        l2 = torch.stack(torch._foreach_norm(unscaled, 2))
        # the smallest magnitude that is neither zero nor NaN; inf if the tensor holds inf and nothing smaller,
        # NaN if it holds no such value (as the pass: a NaN is never the smallest non-zero value)
        counted = [torch.where((m == 0) | m.isnan(), math.inf, m).amin() for m in magnitudes]
        has_inf = torch.stack([m.isinf().any() for m in magnitudes])
        smallest = torch.stack(counted)
        min_nonzero = torch.where(smallest.isinf() & ~has_inf, math.nan, smallest)
        return torch.stack([absmax, min_nonzero, l2])

    def patch(self, stats: StepGradStats) -> StepGradStats:
        if self._reductions is not None:
            absmax, min_nonzero, l2 = self._reductions.cpu().numpy()
            stats.absmax[self.indices], stats.min_nonzero[self.indices], stats.l2[self.indices] = absmax, min_nonzero, l2
        return stats


def _within_fp32(g: torch.Tensor) -> torch.Tensor:
    """float64 ``g`` cast to FP32, a finite value the cast made infinite read as FP32's largest and a non-zero one
    it made zero as FP32's smallest subnormal, each with its sign (see :class:`_Float64Read`)."""
    g = g.detach()
    cast = g.float()
    cast = torch.where(cast.isinf() & g.isfinite(), torch.copysign(torch.full_like(cast, FP32_MAX), cast), cast)
    return torch.where((cast == 0) & (g != 0), torch.copysign(torch.full_like(cast, FP32_SMALLEST), cast), cast)


class HeldStep:
    """A step's gradients held aside by :meth:`GradStatsComputer.hold`: ``counts`` holds :data:`SIGNAL_COUNTS`
    (per tensor, as StepGradStats.counts names them); :meth:`stats` computes the full statistics from the copy
    (once). The copy goes back to its computer once this object is gone."""

    def __init__(self, counts: dict[str, np.ndarray], compute):
        self.counts, self._compute, self._stats = counts, compute, None

    def stats(self) -> StepGradStats:
        if self._stats is None:
            self._stats = self._compute()
        return self._stats


class _Gather:
    """Copies tensors into given consecutive pieces of a buffer with one ``torch._foreach_copy_``: one launch
    whatever their number (a per-tensor flatten was two operators a tensor), FP16/BF16 widened exactly. The
    copy goes into views of the pieces shaped like the tensors, made on first use (again if shapes change)."""

    def __init__(self, pieces: list[torch.Tensor]):
        self._pieces, self._shapes, self._views = pieces, [], []

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        shapes = [t.shape for t in tensors]
        if shapes != self._shapes:
            self._views = [piece.view(shape) for piece, shape in zip(self._pieces, shapes, strict=True)]
            self._shapes = shapes
        if tensors:
            with torch.no_grad():  # a gradient that requires grad (create_graph) is read, not differentiated
                torch._foreach_copy_(self._views, tensors)


#: values the torch backend gathers at once, so its workspaces (16 bytes a value) stay under 256 MB, unless a
#: single tensor is larger: it is gathered alone
SEGMENT = 1 << 24


#: values a first-level reduction of the torch backend takes at most (see :class:`_SegmentIndex`): CUDA's
#: segment_reduce over a 1-D input is one CUB segmented reduce, one thread block per segment, so a 16M-value
#: tensor as one segment would be read by one of the GPU's ~130 multiprocessors. In chunks of 2**16 values
#: (512 KB of float64, a few microseconds for one block) a full SEGMENT is 256 blocks, enough to fill the GPU;
#: a tensor of at most one chunk (most of them) is reduced by one block.
REDUCE_CHUNK = 1 << 16


@dataclass
class _SegmentIndex:
    """What the torch backend's pass over one segment reads besides its values, made once on the device, a
    few numbers per tensor (no per-value buffer): ``block_starts`` (int64), the position of each non-empty
    tensor's first value, and ``block_steps`` (int32), the step from the previous tensor's block of counts
    (2 x BUCKETS per tensor) to its own, so that putting the steps there and summing up gives every value its
    tensor's block; ``chunk_offsets`` (int64), where the segment's chunks of at most REDUCE_CHUNK values start
    (each within one tensor) and, last, its end, and ``tensor_chunks`` (int64), where each tensor's chunks start
    among them and, last, their number: per-tensor reductions are a reduction per chunk, then per tensor."""

    block_starts: torch.Tensor
    block_steps: torch.Tensor
    chunk_offsets: torch.Tensor
    tensor_chunks: torch.Tensor


@dataclass
class _Segment:
    """Consecutive tensors the torch backend processes together: their indices, the non-empty ones, each
    non-empty one's (start, end) within the gathered segment, and the segment's length. ``gather`` copies
    the non-empty tensors into the values workspace and ``index`` is what its pass reads (both made once,
    see :meth:`GradStatsComputer._init_torch`)."""

    tensors: list[int]
    nonempty: list[int]
    bounds: list[tuple[int, int]]
    total: int
    gather: _Gather | None = None
    index: _SegmentIndex | None = None


def _segments(numels: list[int], offsets: np.ndarray) -> list[_Segment]:
    """Consecutive runs of tensors holding at most SEGMENT values (a larger tensor alone in its own)."""
    segments, first = [], 0
    for t in range(len(numels) + 1):
        if t == len(numels) or (t > first and offsets[t + 1] - offsets[first] > SEGMENT):
            if t > first:
                base = int(offsets[first])
                nonempty = [u for u in range(first, t) if numels[u]]
                segments.append(_Segment(list(range(first, t)), nonempty,
                                         [(int(offsets[u]) - base, int(offsets[u + 1]) - base) for u in nonempty],
                                         int(offsets[t]) - base))
            first = t
    return segments


def _segment_index(segment: _Segment, device: torch.device) -> _SegmentIndex:
    """The device tensors the pass over ``segment`` reads (see :class:`_SegmentIndex`)."""
    starts = np.array([start for start, _ in segment.bounds], dtype=np.int64)
    blocks = 2 * BUCKETS * np.array(segment.nonempty, dtype=np.int64)
    chunks = [np.arange(start, end, REDUCE_CHUNK, dtype=np.int64) for start, end in segment.bounds]
    tensor_chunks = np.cumsum([0, *(len(c) for c in chunks)])
    chunk_offsets = np.append(np.concatenate(chunks), segment.total)
    as_tensor = functools.partial(torch.as_tensor, device=device)
    return _SegmentIndex(as_tensor(starts), as_tensor(np.diff(blocks, prepend=0).astype(np.int32)),
                         as_tensor(chunk_offsets), as_tensor(tensor_chunks.astype(np.int64)))


def _per_tensor(data: torch.Tensor, how: str, index: _SegmentIndex) -> torch.Tensor:
    """``how`` ("max", "min" or "sum") of each non-empty tensor's values in ``data`` (float64, a segment's
    values in order): per chunk, then over each tensor's chunks. Whole-segment ops with no atomics, so the
    same values give the same bits every run. ``unsafe``: the offsets are right by construction, and torch's
    checks of segments read them back to the host (a synchronisation; today only for ``lengths``)."""
    per_chunk = torch.segment_reduce(data, how, offsets=index.chunk_offsets, unsafe=True)
    return torch.segment_reduce(per_chunk, how, offsets=index.tensor_chunks, unsafe=True)


class GradStatsComputer:
    """Computes :class:`StepGradStats` for a fixed list of tensor sizes, reusing its workspaces.

    ``backend``: "numba" (CPU, the default there when numba is installed) or "torch" (any device; CUDA's).
    Workspaces are allocated once. numba: the tensors smaller than a work item gathered into one FP32 buffer,
    key counts and decoded statistics per work item, the statistics per tensor, plus an FP32 buffer for the
    other view, only when a scale is not a power of two or values leave fp32's normal range. torch: the
    gradients gathered, one segment of at most SEGMENT values at a time, into one FP32 buffer, one int32
    buffer of their magnitudes and one float64 buffer of the same length, whose halves serve as two int32
    buffers until the per-tensor reductions read it (16 bytes a value), so a step is a fixed number of kernel
    launches per segment whatever the number of tensors, with no host synchronisation and no per-tensor
    Python objects; its counts reach the host in one non-blocking copy (see :meth:`start`). On CUDA, when the
    gradients fit one segment, the pass after the gather reads and writes only those fixed workspaces, so it is
    captured in a CUDA graph at its first step (which runs it op by op) and replayed after: one launch instead
    of ~35, each of which costs the host 20-40 us on a GPU machine (see :meth:`_replayed`).
    """

    def __init__(self, numels: list[int], device: torch.device | str = "cpu", backend: str | None = None):
        self.numels = list(numels)
        self.device = torch.device(device)
        self.backend = backend or ("numba" if self.device.type == "cpu" and NUMBA_AVAILABLE else "torch")
        if self.backend == "numba" and (not NUMBA_AVAILABLE or self.device.type != "cpu"):
            raise ValueError("the numba backend needs numba installed and tensors on the CPU")
        self.offsets = np.concatenate([[0], np.cumsum(self.numels)]).astype(np.int64)
        self._unscaled: torch.Tensor | None = None
        self._spaces: list = []
        if self.backend == "numba":
            self._init_numba(len(self.numels))
        else:
            self._init_torch(len(self.numels))

    def _init_numba(self, n: int) -> None:
        """The fused CPU kernel's work items and workspaces, allocated once for these tensor sizes."""
        from mpdiag.numerics import cpu_kernel as kernels  # here, not at module import: the app never loads numba

        parallel = sum(self.numels) >= PARALLEL_FROM
        self._kernel = kernels.on_torch_threads(kernels.fused_pass) if parallel else kernels.fused_pass_serial
        self._signal_kernel = kernels.on_torch_threads(kernels.signal_pass) if parallel else kernels.signal_pass_serial
        self._array_table = kernels.array_table
        # Tensors smaller than a work item are gathered into one buffer by one foreach copy (2 us a tensor
        # at 500 tensors, where handing each to numba as its own array cost 12 us); larger ones are read
        # in place, where a copy would cost more than the hand-over.
        sizes = np.asarray(self.numels, dtype=np.int64)
        gathered = sizes < CHUNK
        self._gathered = np.flatnonzero(gathered).tolist()
        self._large = np.flatnonzero(~gathered).tolist()
        self._gathered_values = torch.empty(int(sizes[gathered].sum()), dtype=torch.float32)
        ends = np.cumsum([0, *sizes[gathered]]).tolist()
        self._gather = _Gather([self._gathered_values[start:end] for start, end in zip(ends[:-1], ends[1:], strict=True)])
        array = np.zeros(n, np.int64)
        array[self._large] = np.arange(1, len(self._large) + 1)
        base = np.zeros(n, np.int64)  # where each gathered tensor starts in the buffer
        base[gathered] = ends[:-1]
        items = work_items(self.numels)
        tensor = items[:, 0]
        self._items = np.stack([tensor, array[tensor], items[:, 1] + base[tensor], items[:, 2] + base[tensor],
                                items[:, 3]], axis=1)
        # every tensor gathered into one buffer of its own: the layout of the copies hold() keeps
        self._held_items = np.stack([tensor, np.zeros_like(tensor), items[:, 1] + self.offsets[tensor],
                                     items[:, 2] + self.offsets[tensor], items[:, 3]], axis=1)
        self._held_pool: list[tuple[torch.Tensor, _Gather]] = []  # copies no held step uses any more
        self._signal_spaces = (np.empty((len(items), len(SIGNAL_COUNTS)), np.int64),
                               np.empty((n, len(SIGNAL_COUNTS)), np.int64))
        self._bounds = np.array(REGION_BOUNDS, dtype=np.int32)
        self._common_bounds = np.array(COMMON_BOUNDS, dtype=np.int32)
        self._subnormal_bounds = np.array(SUBNORMAL_BOUNDS, dtype=np.int32)
        columns, count = len(CATEGORY_COLUMNS), len(items)
        self._spaces = [  # per work item: key counts, subnormal cells, bit bounds, sum of squares, statistics
            np.empty((count, KEYS_PER_TENSOR), np.int64), np.empty((count, SUBNORMAL_CELLS), np.int64),
            np.empty((count, 2), np.int32), np.empty(count, np.float64), np.empty((count, N_EXP_BINS), np.int64),
            np.empty((count, len(SPECIAL_COUNTS)), np.int64), np.empty((count, 2, columns), np.int64),
            # per tensor: the statistics and reductions, combined (the bit bounds as largest and below smallest)
            np.empty((n, N_EXP_BINS), np.int64), np.empty((n, len(SPECIAL_COUNTS)), np.int64),
            np.empty((n, 2, columns), np.int64), np.empty(n, np.int32), np.empty(n, np.int32),
            np.empty(n, np.float64), self._gathered_values,
        ]

    def _init_torch(self, n: int) -> None:
        """The torch backend's segments and device workspaces, allocated once for these tensor sizes."""
        self._segments = [segment for segment in _segments(self.numels, self.offsets) if segment.nonempty]
        room = max((segment.total for segment in self._segments), default=0)
        self._values = torch.empty(room, dtype=torch.float32, device=self.device)
        self._magnitudes = torch.empty(room, dtype=torch.int32, device=self.device)
        # the keys and a scratch buffer (int32) are its two halves until the counts are added; then it holds
        # the float64 values the per-tensor reductions read
        self._wide = torch.empty(room, dtype=torch.float64, device=self.device)
        halves = self._wide.view(torch.int32)
        self._keys, self._scratch = halves[:room], halves[room:]
        self._one = torch.ones(1, dtype=torch.int32, device=self.device)  # index_add_ reads it expanded
        self._counts = torch.empty((2, n * 2 * BUCKETS), dtype=torch.int32, device=self.device)
        self._decoded = torch.empty((2 * n, DECODED_COLUMNS + 1), dtype=torch.int32, device=self.device)
        self._decoding = [torch.from_numpy(index).to(self.device) for index in bucket_decoding()]
        self._bucket_bounds = torch.tensor(BUCKET_BOUNDS, dtype=torch.int32, device=self.device)
        self._nonempty = [t for t, size in enumerate(self.numels) if size]
        self._spaces = [self._values, self._magnitudes, self._wide, self._counts, self._decoded]
        # the captured pass's input beside the gathered values: the factor of the second view, set each step
        self._factor = torch.empty((), dtype=torch.float32, device=self.device)
        # views (1 or 2) -> (graph, its output); None: op by op (not CUDA, several segments, or a capture failed)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] | None = (
            {} if self.device.type == "cuda" and len(self._segments) == 1 else None)
        for segment in self._segments:
            segment.gather = _Gather([self._values[start:end] for start, end in segment.bounds])
            segment.index = _segment_index(segment, self.device)

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the reusable workspaces allocated so far."""
        spaces = [*self._spaces, self._unscaled]
        return sum(int(t.nbytes) for t in spaces if t is not None)

    def compute(self, grads: list[torch.Tensor], scale: float | torch.Tensor, grads_are_scaled: bool = True) -> StepGradStats:
        """Statistics of ``grads`` produced at loss scale ``scale`` (a number, or a one-element tensor such as
        GradScaler's own scale, read without a synchronisation by the torch backend).

        ``grads_are_scaled``: the tensors hold S*g (as after ``scaler.scale(loss).backward()``); the unscaled
        g is then what GradScaler computes (a multiply by the fp32 reciprocal computed in fp64). If False
        they hold g already (after ``scaler.unscale_``) and S*g is their product with S in fp32.
        """
        return self.start(grads, scale, grads_are_scaled).result()

    def start(self, grads: list[torch.Tensor], scale: float | torch.Tensor, grads_are_scaled: bool = True) -> PendingStats:
        """:meth:`compute`, returning before the host has the counts. The torch backend only enqueues
        device work and one non-blocking copy, so the gradients may change once the call returns, and the
        result is best read a step later (after GradScaler's own synchronisation); numba computes at once."""
        if [g.numel() for g in grads] != self.numels:
            raise ValueError("gradient sizes differ from the sizes this computer was built for")
        float64 = _Float64Read.of(grads, scale, grads_are_scaled)
        if float64 is not None:
            grads = float64.values(grads)
        if self.backend == "numba":
            stats = self._numba_stats(self._numba_sources(grads), self._items, float(scale), grads_are_scaled)
            pending = PendingStats(lambda _: stats)
        else:
            pending = self._torch_start(grads, scale, grads_are_scaled)
        return pending if float64 is None else pending.then(float64.patch)

    def hold(self, grads: list[torch.Tensor], scale: float, grads_are_scaled: bool = True) -> PendingStats:
        """numba only: copy ``grads`` aside (one FP32 buffer, reused once no held step needs it) and count only
        :data:`SIGNAL_COUNTS`; the result is a :class:`HeldStep`, whose full statistics are computed from the copy
        if they are asked for (they equal :meth:`compute`'s). A copy and one light pass instead of the full one:
        for a caller that needs the full statistics of a step only if something happens at it or next to it."""
        if self.backend != "numba":
            raise ValueError("hold() is the numba backend's")
        if [g.numel() for g in grads] != self.numels:
            raise ValueError("gradient sizes differ from the sizes this computer was built for")
        scale = float(scale)
        float64 = _Float64Read.of(grads, scale, grads_are_scaled)
        if float64 is not None:
            grads = float64.values(grads)
        buffer, gather = self._held_pool.pop() if self._held_pool else self._new_held_buffer()
        gather(grads)
        factor = unscale_factor(scale) if grads_are_scaled else scale
        item_counts, counts = self._signal_spaces
        self._signal_kernel(buffer.numpy(), self._held_items, np.float32(factor), grads_are_scaled, SIGNAL_EDGES,
                            item_counts, counts)
        finish = float64.patch if float64 is not None else (lambda stats: stats)
        held = HeldStep(dict(zip(SIGNAL_COUNTS, counts.T.copy(), strict=True)),
                        lambda: finish(self._numba_stats([buffer], self._held_items, scale, grads_are_scaled)))
        weakref.finalize(held, self._held_pool.append, (buffer, gather))
        return PendingStats(lambda _: held)

    def _new_held_buffer(self) -> tuple[torch.Tensor, _Gather]:
        buffer = torch.empty(int(self.offsets[-1]), dtype=torch.float32)
        return buffer, _Gather([buffer[start:end] for start, end in zip(self.offsets[:-1].tolist(),
                                                                        self.offsets[1:].tolist(), strict=True)])

    # -- numba ----------------------------------------------------------------------------------------------
    def _numba_stats(self, sources: list[torch.Tensor], items: np.ndarray, scale: float,
                     grads_are_scaled: bool) -> StepGradStats:
        """The statistics of the values in ``sources`` (the arrays ``items`` index) at loss scale ``scale``."""
        k = power_of_two_exponent(scale)
        # (g, S*g) as the tensors times 2**shift: one pass counts both views, if the shift is exact
        shifts = (0, 0) if scale == 1.0 else None if k is None else (-k, 0) if grads_are_scaled else (0, k)
        raw = self._numba_pass(sources, items, shifts or (0, 0))
        if scale == 1.0:
            return _stats(raw, raw.categories[:, 0], raw.categories[:, 0], 0, "same")
        if shifts is not None and _shift_is_exact(raw.below_smallest, shifts[0] + shifts[1]):
            return _stats(raw, raw.categories[:, 0], raw.categories[:, 1], shifts[0], "shifted")
        factor = unscale_factor(scale) if grads_are_scaled else scale
        workspace = self._unscaled_workspace()
        starts = np.cumsum([0, *(x.numel() for x in sources)]).tolist()
        derived = self._numba_pass([torch.mul(x, factor, out=workspace[start:end])
                                    for x, start, end in zip(sources, starts[:-1], starts[1:], strict=True)],
                                   items, (0, 0))
        # raw's histogram is of its first view: shifted when the tensors hold S*g, unshifted when they hold g
        unshifted = raw.categories[:, (shifts or (0, 0)).index(0)]
        if grads_are_scaled:
            return _stats(derived, derived.categories[:, 0], unshifted, 0, "recomputed")
        return _stats(raw, unshifted, derived.categories[:, 0], 0, "recomputed")

    def _numba_sources(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The arrays the kernel reads (as float32): the gathered buffer, then each large tensor flattened."""
        self._gather([grads[t] for t in self._gathered])
        return [self._gathered_values, *(grads[t].detach().reshape(-1).float() for t in self._large)]

    def _unscaled_workspace(self) -> torch.Tensor:
        if self._unscaled is None:
            self._unscaled = torch.empty(int(self.offsets[-1]), dtype=torch.float32, device=self.device)
        return self._unscaled

    def _numba_pass(self, sources: list[torch.Tensor], items: np.ndarray, shifts: tuple[int, int]) -> _Pass:
        arrays = [x.numpy() for x in sources]  # alive while the kernel reads them by address
        self._kernel(self._array_table(arrays), items, self._bounds, self._common_bounds, self._subnormal_bounds,
                     np.array(shifts, dtype=np.int64), KERNEL_TABLES, *self._spaces[:-1])
        hist, specials, categories, largest, below_smallest, sumsq = (a.copy() for a in self._spaces[7:-1])  # reused next pass
        return _Pass(hist, specials, categories, *_reductions_from_bits(largest, below_smallest), np.sqrt(sumsq),
                     below_smallest)

    # -- torch ----------------------------------------------------------------------------------------------
    def _torch_start(self, grads: list[torch.Tensor], scale: float | torch.Tensor, grads_are_scaled: bool) -> PendingStats:
        """Both views on the device (the other one by GradScaler's own multiply, in place), segment by
        segment, packed into one int32 tensor and copied to the host without waiting."""
        same = not torch.is_tensor(scale) and scale == 1.0
        if same:
            factor = None
        elif grads_are_scaled:
            factor = unscale_factor(scale)
        else:
            factor = scale.float() if torch.is_tensor(scale) else scale
        views = 1 if same else 2
        if self._graphs is None:
            packed = self._device_pass(views, factor, grads)
        else:
            segment = self._segments[0]
            segment.gather([grads[t] for t in segment.nonempty])
            if views == 2:  # into the graph's input: one launch, no synchronisation
                self._factor.copy_(factor.reshape(())) if torch.is_tensor(factor) else self._factor.fill_(factor)
            packed = self._replayed(views)
        return PendingStats(lambda host: self._torch_finish(host, views, grads_are_scaled), DeviceReadback(packed))

    def _device_pass(self, views: int, factor: float | torch.Tensor | None,
                     grads: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Both views' statistics, packed into one int32 tensor on the device, segment by segment: each gathered
        from ``grads``, or, for ``grads`` None, the one segment gathered already (what a CUDA graph captures).
        ``factor``: what the gathered values are multiplied by for the second view."""
        self._counts.zero_()
        reductions = [[] for _ in range(views)]  # per view, per segment: largest, below smallest, l2
        for segment in self._segments:
            if grads is not None:
                segment.gather([grads[t] for t in segment.nonempty])
            reductions[0].append(self._torch_pass(segment, self._counts[0]))
            if views == 2:
                self._values[: segment.total].mul_(factor)
                reductions[1].append(self._torch_pass(segment, self._counts[1]))
        parts = [self._decode_on_device(views)]
        # per view, per kind, per segment: float64 (bit patterns are exact in it), sent as its int32 halves
        per_kind = [part for per_view in reductions for kind in zip(*per_view, strict=True) for part in kind]
        if per_kind:
            parts.append(torch.cat(per_kind).view(torch.int32))
        return torch.cat(parts)

    def _replayed(self, views: int) -> torch.Tensor:
        """The pass over the one segment, gathered already, with its factor in ``self._factor``: the CUDA graph's
        replay, whose output tensor is the same every step (its copy to the host is queued behind the replay,
        and the next replay behind that copy). The first step of each view count runs op by op, then captures.
        A failed capture (an op that would synchronise, in some torch version) leaves every later step op by
        op, said once: the same numbers, more host time."""
        captured = self._graphs.get(views)
        if captured is not None:
            graph, packed = captured
            with torch.cuda.device(self.device):  # on its device's current stream, whichever device is current
                graph.replay()
            return packed
        packed = self._device_pass(views, self._factor)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's CUDA calls (a DataLoader pinning memory) are not the capture's
            with torch.cuda.device(self.device), torch.cuda.graph(graph, stream=torch.cuda.Stream(self.device),
                                                                  capture_error_mode="thread_local"):
                output = self._device_pass(views, self._factor)
        except RuntimeError as error:
            self._graphs = None
            warnings.warn(f"mpdiag: the gradient statistics' CUDA graph could not be captured ({error}); they "
                          "are computed op by op (the same numbers, more host time a step)", stacklevel=2)
            return packed
        self._graphs[views] = graph, output
        return packed

    def _decode_on_device(self, views: int) -> torch.Tensor:
        """The views' bucket counts decoded on the device into DECODED_COLUMNS per tensor (see
        :func:`bucket_decoding`): a fixed number of index_add_ launches, and a copy to the host of 293 counts a
        tensor instead of 2 x BUCKETS (decoding those on the host cost ~100 us a tensor, more than the pass)."""
        n = len(self.numels)
        counts, decoded = self._counts[:views].view(views * n, 2 * BUCKETS), self._decoded[: views * n]
        decoded.zero_()
        for index in self._decoding:
            decoded.index_add_(1, index, counts)
        return decoded[:, :DECODED_COLUMNS].reshape(-1)

    def _torch_pass(self, segment: _Segment, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Adds the bucket counts of ``segment``'s values (gathered at the start of the workspaces) into
        ``counts`` (T x sign x bucket); returns its non-empty tensors' largest and below-smallest magnitude
        bit patterns and L2 norms, as float64. A fixed number of ops over the whole segment, none per tensor
        and none returning a tensor per tensor (see :class:`_SegmentIndex`)."""
        total, index = segment.total, segment.index
        bits = self._values[:total].view(torch.int32)
        magnitudes, keys, scratch = self._magnitudes[:total], self._keys[:total], self._scratch[:total]
        torch.bitwise_and(bits, 0x7FFFFFFF, out=magnitudes)
        torch.bucketize(magnitudes, self._bucket_bounds, out_int32=True, right=True, out=keys)
        torch.bitwise_right_shift(bits, 31, out=scratch).mul_(-BUCKETS)  # BUCKETS for a negative value
        keys.add_(scratch)
        scratch.zero_().index_copy_(0, index.block_starts, index.block_steps).cumsum_(0)  # each value's block
        keys.add_(scratch)
        counts.index_add_(0, keys, self._one.expand(total))
        wide = self._wide[:total]  # the keys and scratch are done with
        largest = _per_tensor(wide.copy_(magnitudes), "max", index)  # int32 bit patterns are exact in float64
        # (|bits| - 1) & 0x7FFFFFFF wraps zero to the top: a min finds the smallest non-zero - 1
        below_smallest = _per_tensor(wide.copy_(magnitudes.sub_(1).bitwise_and_(0x7FFFFFFF)), "min", index)
        # fp32 squares are exact in float64, and the sums are in a fixed order (index_add_ would use atomics)
        l2 = _per_tensor(wide.copy_(self._values[:total]).square_(), "sum", index).sqrt_()
        return largest, below_smallest, l2

    def _torch_finish(self, host: np.ndarray, views: int, grads_are_scaled: bool) -> StepGradStats:
        n, present = len(self.numels), len(self._nonempty)
        decoded = host[: views * n * DECODED_COLUMNS].reshape(views, n, DECODED_COLUMNS).astype(np.int64)
        rest = host[views * n * DECODED_COLUMNS :].view(np.float64).reshape(views, 3, present)
        passes = []
        for v in range(views):
            largest = np.zeros(n, np.int32)
            below_smallest = np.full(n, 0x7FFFFFFF, np.int32)  # empty tensors: no non-zero value
            l2 = np.zeros(n, np.float64)
            largest[self._nonempty] = rest[v, 0].astype(np.int32)
            below_smallest[self._nonempty] = rest[v, 1].astype(np.int32)
            l2[self._nonempty] = rest[v, 2]
            hist, specials, categories = np.split(decoded[v], [N_EXP_BINS, N_EXP_BINS + len(SPECIAL_COUNTS)], axis=1)
            passes.append(_Pass(hist, specials, categories[:, None], *_reductions_from_bits(largest, below_smallest),
                                l2, below_smallest))
        if views == 1:
            return _stats(passes[0], passes[0].categories[:, 0], passes[0].categories[:, 0], 0, "same")
        raw, derived = passes
        g, at_scale = (derived, raw) if grads_are_scaled else (raw, derived)
        return _stats(g, g.categories[:, 0], at_scale.categories[:, 0], 0, "recomputed")


def unscale_factor(scale: float | torch.Tensor) -> float | torch.Tensor:
    """What GradScaler multiplies by to unscale: the fp32 reciprocal of the scale, computed in fp64; of a scale
    held as a tensor (GradScaler's own), a one-element tensor on its device, not read back."""
    if torch.is_tensor(scale):
        return scale.reshape(()).double().reciprocal().float()
    return float(torch.tensor(scale, dtype=torch.float64).reciprocal().float())


def _reductions_from_bits(largest: np.ndarray, below_smallest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """absmax and min_nonzero (float64) from the largest magnitude bit pattern and the smallest non-zero one
    minus 1 (0x7FFFFFFF when there is none: min_nonzero is then NaN)."""
    smallest = (below_smallest.astype(np.int64) + 1).astype(np.uint32).view(np.float32).astype(np.float64)
    return largest.view(np.float32).astype(np.float64), np.where(below_smallest == 0x7FFFFFFF, np.nan, smallest)


def _keys_from_buckets(buckets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The torch backend's (T, sign, bucket) counts as the numba kernel's key counts (T, sign, field, region)
    and subnormal cell counts (T, cell)."""
    n = buckets.shape[0]
    keys = np.zeros((n, 2, FIELDS, REGIONS), np.int64)
    keys[:, :, 1:] = buckets[:, :, SUBNORMAL_CELLS:].reshape(n, 2, FIELDS - 1, REGIONS)
    keys[:, :, 0] = buckets[:, :, :SUBNORMAL_CELLS] @ SUBNORMAL_CELL_REGIONS
    # the bucket's sign comes from the sign bit, so bucket counts of sign 1 are negative values: key sign 0
    return keys[:, ::-1].copy(), buckets.sum(axis=1)[:, :SUBNORMAL_CELLS]


def _stats(g: _Pass, g_categories: np.ndarray, at_scale_categories: np.ndarray, g_shift: int, how: str) -> StepGradStats:
    """StepGradStats from the pass whose values times 2**g_shift are g (its histogram and special counts are
    g's) and the category counts of g and of S*g."""
    counts = dict(zip(SPECIAL_COUNTS, np.ascontiguousarray(g.specials.T), strict=True))
    counts.update(zip(CATEGORY_COLUMNS, np.ascontiguousarray(g_categories.T), strict=True))
    counts.update(zip((f"{name}_at_scale" for name in CATEGORY_COLUMNS), np.ascontiguousarray(at_scale_categories.T),
                      strict=True))
    absmax, min_nonzero, l2 = g.absmax, g.min_nonzero, g.l2
    if g_shift:
        with np.errstate(over="ignore"):  # a product past fp32's range is inf, as in fp32
            factor = 2.0**g_shift
            absmax = (absmax * factor).astype(np.float32).astype(np.float64)
            min_nonzero, l2 = min_nonzero * factor, l2 * factor
    return StepGradStats(hist=g.hist, counts=counts, absmax=absmax, min_nonzero=min_nonzero, l2=l2, other_view=how)


def _decode(key_counts: np.ndarray, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The histogram, SPECIAL_COUNTS (T, 4) and CATEGORY_COLUMNS counts (T, columns) of values from their key
    counts (T, sign, field, region) and fp32-subnormal cell counts (T, cell): the torch backend's decoding
    (the numba kernel decodes each chunk as it goes, see mpdiag.numerics.cpu_kernel._decode_chunk)."""
    magnitude = key_counts[:, 0] + key_counts[:, 1]  # (T, field, region)
    n = key_counts.shape[0]
    per_field = sum(magnitude[:, :, r] for r in range(REGIONS))  # (T, field): five adds beat .sum(axis=2)
    hist = np.zeros((n, N_EXP_BINS), dtype=np.int64)
    first_normal_bin = FP32.min_normal_exponent - EXP_MIN  # the bin of field 1
    hist[:, first_normal_bin : first_normal_bin + FIELDS - 2] = per_field[:, 1 : FIELDS - 1]
    if cells[:, 1:].any():  # fp32 subnormals, by cell (rare)
        np.add.at(hist, (slice(None), SUBNORMAL_BINS[1:]), cells[:, 1:])
    specials = np.stack([magnitude[:, 0, 0], magnitude[:, FIELDS - 1, 1:].sum(axis=1),
                         key_counts[:, 1, FIELDS - 1, 0], key_counts[:, 0, FIELDS - 1, 0]], axis=1)
    per_category = magnitude.reshape(n, -1) @ CATEGORY_MATRIX + cells @ SUBNORMAL_MATRIX
    return hist, specials, np.rint(per_category).astype(np.int64)


#: what the torch backend decodes each tensor's bucket counts into on the device: the histogram (N_EXP_BINS),
#: SPECIAL_COUNTS and CATEGORY_COLUMNS, as :func:`_decode` gives them
DECODED_COLUMNS = N_EXP_BINS + len(SPECIAL_COUNTS) + len(CATEGORY_COLUMNS)


@functools.cache
def bucket_decoding() -> tuple[np.ndarray, ...]:
    """The torch backend's decoding as index_add_ indices: per group of output columns in which no (sign,
    bucket) counts twice (the histogram with SPECIAL_COUNTS: a value is in one bin or special; each format's
    CATEGORY_COLUMNS), the column each of the 2 x BUCKETS counts adds to, DECODED_COLUMNS for none.

    Found by decoding every (sign, bucket) alone with :func:`_keys_from_buckets` and :func:`_decode` (the host
    decoding, which stays the definition): the decoding is a sum over buckets, so adding each bucket's count
    into the columns its unit count lands in gives the same numbers. Fails if a unit count lands anywhere
    twice or with a weight other than 1."""
    columns = np.concatenate([np.concatenate(_decode(*_keys_from_buckets(units)), axis=1)
                              for units in _unit_counts(chunk=128)])  # (sign x bucket, DECODED_COLUMNS)
    groups = [np.arange(N_EXP_BINS + len(SPECIAL_COUNTS))]
    first = N_EXP_BINS + len(SPECIAL_COUNTS)
    groups += [first + np.arange(f, f + len(CATEGORY_NAMES)) for f in range(0, len(CATEGORY_COLUMNS), len(CATEGORY_NAMES))]
    indices = []
    for group in groups:
        part = columns[:, group]
        if not np.isin(part, (0, 1)).all() or (part.sum(axis=1) > 1).any():
            raise AssertionError("a bucket's count decodes into one group's columns more than once")
        indices.append(np.where(part.any(axis=1), group[part.argmax(axis=1)], DECODED_COLUMNS).astype(np.int64))
    if (columns.sum(axis=1) != sum((index != DECODED_COLUMNS) for index in indices)).any():
        raise AssertionError("a bucket's count decodes into a column no group holds")
    return tuple(indices)


def _unit_counts(chunk: int):
    """Every (sign, bucket) count of 1 alone, as (T, sign, bucket) count arrays of ``chunk`` rows at a time."""
    for first in range(0, 2 * BUCKETS, chunk):
        rows = np.arange(first, min(first + chunk, 2 * BUCKETS))
        units = np.zeros((len(rows), 2 * BUCKETS), np.int64)
        units[np.arange(len(rows)), rows] = 1
        yield units.reshape(len(rows), 2, BUCKETS)


def category_counts_by_casting(values: torch.Tensor, fmt: Format) -> dict[str, int]:
    """Reference counts by plain casting: the definition the fast path must equal (used by tests). A cast that
    saturates (E4M3: every finite value, even inf, becomes at most 448) cannot show overflow: there it is
    |x| above the format's threshold."""
    x = values.float().reshape(-1)
    finite_nonzero = torch.isfinite(x) & (x != 0)
    cast = x.to(fmt.dtype).float()
    over = torch.isinf(cast) if fmt.overflow_above is None else x.abs() > fmt.overflow_above
    return {
        "underflow": int((finite_nonzero & (cast == 0)).sum()),
        "subnormal": int((finite_nonzero & (cast != 0) & (cast.abs() < fmt.min_normal)).sum()),
        "overflow": int((finite_nonzero & over).sum()),
    }


__all__ = ["GradStatsComputer", "StepGradStats", "category_counts_by_casting", "BF16", "FP16"]
