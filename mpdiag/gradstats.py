"""Exact per-tensor gradient statistics, computed in one pass over the fp32 bit patterns.

Every value gets an integer *key* from its fp32 bits: sign, exponent field and a *mantissa region*, the
number of FP16/BF16 rounding edges its mantissa lies at or above. The edges of every format sit at the same
few mantissa values in whichever exponent field they occur (:data:`REGION_BOUNDS`), so one key serves all
formats. Per tensor, the key counts give the exponent histogram and the exact FP16/BF16 underflow /
subnormal / overflow counts.

Which (field, region) cell falls in which category is not typed in: it is found by casting the smallest and
largest fp32 value of every cell with torch (:func:`_category_table`), so the counts equal torch's own
round-to-nearest-even casting by construction, and a cell that is not uniform fails at import. fp32
subnormals (|x| < 2**-126) are the one non-uniform range for BF16; they are rare and classified by casting.

One pass serves both views the Recorder stores, g and S*g: multiplying by a power of two 2^k moves every
normal value k fields and leaves its mantissa alone, so the other view's counts are the same counts shifted
k fields - exactly, as long as no value leaves fp32's normal range (then, or for a scale that is not a
power of two, the other view is computed and counted explicitly, as GradScaler computes it).

Two backends compute the key counts and reductions: a fused numba kernel on the CPU (one read of each
gradient, per-thread histograms, nothing written back) and torch ops elsewhere (CUDA), which reuse
workspaces allocated once.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass

import numpy as np
import torch

from mpdiag.formats import BF16, EXP_MIN, FP16, FP32, LOW_PRECISION, N_EXP_BINS, Format

#: whether the fused CPU kernel (mpdiag.cpu_kernel) can be used; numba itself is imported on first use
NUMBA_AVAILABLE = importlib.util.find_spec("numba") is not None

MANTISSA_BITS = 23
MANTISSA_MASK = (1 << MANTISSA_BITS) - 1
FIELDS = 256  # biased exponent field values of fp32

# Categories of a value's cast into a low-precision format.
NORMAL, UNDERFLOW, SUBNORMAL, OVERFLOW, SPECIAL, MIXED = range(6)
CATEGORY_NAMES = ("underflow", "subnormal", "overflow")


def _rounding_edges(fmt: Format) -> dict[int, int]:
    """fp32 exponent field -> mantissa threshold at which a cast into ``fmt`` changes category.

    Only edges that lie among fp32 normal numbers are listed; edges inside fp32's subnormal range are
    resolved by casting (see module docstring).
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
    # Midpoint between max_finite and the next power of two rounds up to inf (even mantissa).
    edges[fmt.max_exponent + bias] = ((1 << (m + 1)) - 1) << (MANTISSA_BITS - m - 1)
    return edges


#: Mantissa values at which some format's category changes (1 also separates zero from fp32 subnormals and
#: inf from NaN); a value's region is how many of them its mantissa reaches.
REGION_BOUNDS = tuple(sorted({1} | {t for fmt in LOW_PRECISION.values() for t in _rounding_edges(fmt).values()}))
REGIONS = len(REGION_BOUNDS) + 1
assert len(REGION_BOUNDS) == 4, "the numba kernel compares against exactly four region bounds"
KEYS_PER_TENSOR = 2 * FIELDS * REGIONS  # sign x field x region


def _classify(values: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Category of each finite non-zero fp32 value when cast to ``fmt`` (torch casting is the truth)."""
    cast = values.to(fmt.dtype).float().abs()
    category = torch.full(values.shape, NORMAL, dtype=torch.int8)
    category[cast == 0] = UNDERFLOW
    category[(cast > 0) & (cast < fmt.min_normal)] = SUBNORMAL
    category[torch.isinf(cast)] = OVERFLOW
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
        table[0, 1:] = MIXED  # classify all fp32 subnormals by casting, none from the table
    table[0, 0] = SPECIAL  # zero
    table[FIELDS - 1, :] = SPECIAL  # inf, NaN
    return table


CATEGORY_TABLES = {name: _category_table(fmt) for name, fmt in LOW_PRECISION.items()}
#: "{format}_{category}" names, and a 0/1 matrix (field x region, name) summing each name's cells at once
CATEGORY_COLUMNS = [f"{name}_{label}" for name in CATEGORY_TABLES for label in CATEGORY_NAMES]
CATEGORY_MATRIX = np.stack([(table == category).reshape(-1) for table in CATEGORY_TABLES.values()
                            for category in (UNDERFLOW, SUBNORMAL, OVERFLOW)], axis=1).astype(np.int64)


@dataclass
class StepGradStats:
    """Statistics of every recorded tensor at one step. Arrays are indexed by tensor position.

    ``hist[t, i]`` counts values of tensor t with 2**(EXP_MIN + i) <= |g| < 2**(EXP_MIN + i + 1), for the
    unscaled gradient g. ``counts[name]`` holds zeros, nan, posinf, neginf and, for fmt in fp16/bf16 and
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


@dataclass
class _Pass:
    """One view's key counts, shape (T, 2, 256, REGIONS), and reductions (float64, per tensor)."""

    keys: np.ndarray
    absmax: np.ndarray
    min_nonzero: np.ndarray
    l2: np.ndarray


def power_of_two_exponent(scale: float) -> int | None:
    """k when ``scale`` is exactly 2**k (with 2**-k also a normal fp32), else None."""
    mantissa, exponent = math.frexp(scale)
    return exponent - 1 if mantissa == 0.5 and -126 <= exponent - 1 <= 126 else None


def _shift_is_exact(magnitude: np.ndarray, shift: int) -> bool:
    """Whether counts (magnitude counts, (T, field, region)) of every value times 2**shift follow from the
    counts alone: no value is an fp32 subnormal or would become one (their products depend on digits the
    counts do not hold). Values pushed past the largest finite field become inf, which is exact."""
    if magnitude[:, 0, 1:].any():
        return False
    lowest = np.flatnonzero(magnitude[:, 1 : FIELDS - 1].any(axis=(0, 2)))
    return not (lowest.size and lowest[0] + 1 + shift < 1)


@functools.cache
def _category_matrix(shift: int) -> np.ndarray:
    """CATEGORY_MATRIX for values multiplied by 2**shift, as float64 (a BLAS product; exact below 2**53):
    row (field, region) holds the categories of cell (field + shift, region). Cells pushed past the largest
    finite field are inf in fp32 and in no category."""
    table = CATEGORY_MATRIX.reshape(FIELDS, REGIONS, -1)
    shifted = np.zeros(table.shape, dtype=np.float64)
    shifted[[0, FIELDS - 1]] = table[[0, FIELDS - 1]]
    source = np.arange(1, FIELDS - 1)
    inside = (source + shift >= 1) & (source + shift < FIELDS - 1)
    shifted[source[inside]] = table[source[inside] + shift]
    return shifted.reshape(FIELDS * REGIONS, -1)


def _count_keys(keys: torch.Tensor, n: int) -> torch.Tensor:
    """Histogram of integer keys in [0, n) without a host synchronisation on CUDA."""
    if keys.device.type == "cpu":
        return torch.bincount(keys, minlength=n)
    counts = torch.zeros(n, dtype=torch.int64, device=keys.device)
    return counts.index_add_(0, keys.long(), torch.ones_like(keys, dtype=torch.int64))


#: elements per work item of the numba kernels: big tensors are split so both cores share them
CHUNK = 1 << 17


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


class GradStatsComputer:
    """Computes :class:`StepGradStats` for a fixed list of tensor sizes, reusing its workspaces.

    ``backend``: "numba" (CPU, the default there when numba is installed) or "torch" (any device). Workspaces
    are allocated once (torch: keys for every element and scratch sized to the largest tensor; numba: a
    key-count row per chunk), plus an FP32 buffer for the other view, only when a scale is not a power of
    two or values leave fp32's normal range. A step allocates no full-size temporaries of its own.
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
            import numba  # here, not at module import: the app never pays for it

            from mpdiag.cpu_kernel import fused_pass

            self._kernel, self._typed_list = fused_pass, numba.typed.List
            n = len(self.numels)
            self._chunks = work_items(self.numels)
            self._bounds = np.array(REGION_BOUNDS, dtype=np.int32)
            items = len(self._chunks)
            self._spaces = [
                np.empty((items, KEYS_PER_TENSOR), np.int64), np.empty((items, 2), np.int32),
                np.empty(items, np.float64),  # per work item: key counts, bit bounds, sum of squares
                np.empty((n, KEYS_PER_TENSOR), np.int64), np.empty(n, np.int32), np.empty(n, np.int32),
                np.empty(n, np.float64),  # per tensor: the same, combined
            ]
        else:
            total, largest = int(self.offsets[-1]), max(self.numels, default=0)
            self._keys = torch.empty(total, dtype=torch.int32, device=self.device)
            self._scratch = torch.empty(largest, dtype=torch.int32, device=self.device)
            self._bounds_t = torch.tensor(REGION_BOUNDS, dtype=torch.int32, device=self.device)
            self._spaces = [self._keys, self._scratch]

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the reusable workspaces allocated so far."""
        spaces = [*self._spaces, self._unscaled]
        return sum(int(t.nbytes) for t in spaces if t is not None)

    def compute(self, grads: list[torch.Tensor], scale: float, grads_are_scaled: bool = True) -> StepGradStats:
        """Statistics of ``grads`` produced at loss scale ``scale``.

        ``grads_are_scaled``: the tensors hold S*g (as after ``scaler.scale(loss).backward()``); the unscaled
        g is then what GradScaler computes (a multiply by the fp32 reciprocal computed in fp64). If False
        they hold g already (after ``scaler.unscale_``) and S*g is their product with S in fp32.
        """
        if [g.numel() for g in grads] != self.numels:
            raise ValueError("gradient sizes differ from the sizes this computer was built for")
        flat = [g.detach().reshape(-1).float() for g in grads]
        raw = self._pass(flat)
        k = power_of_two_exponent(scale)
        shift = None if k is None else (-k if grads_are_scaled else k)  # fields from the tensors to the other view
        if scale == 1.0:
            how, other = "same", (raw, flat, 0)
        elif shift is not None and _shift_is_exact(raw.keys.sum(axis=1), shift):
            how, other = "shifted", (raw, None, shift)  # no fp32 subnormals in either view: values not needed
        else:
            factor = float(torch.tensor(scale, dtype=torch.float64).reciprocal().float()) if grads_are_scaled else scale
            workspace = self._unscaled_workspace()
            derived_flat = [torch.mul(x, factor, out=workspace[s:e]) for x, s, e in self._slices(flat)]
            how, other = "recomputed", (self._pass(derived_flat), derived_flat, 0)
        (g, g_flat, g_shift), (at_scale, at_scale_flat, at_scale_shift) = \
            (other, (raw, flat, 0)) if grads_are_scaled else ((raw, flat, 0), other)
        hist, counts = self._decode(g.keys, g_flat, "", g_shift)
        if how == "same":
            counts.update({f"{k}_at_scale": v for k, v in counts.items() if k.startswith(("fp16", "bf16"))})
        else:
            _, scaled_counts = self._decode(at_scale.keys, at_scale_flat, "_at_scale", at_scale_shift)
            counts.update({k: v for k, v in scaled_counts.items() if k.startswith(("fp16", "bf16"))})
        absmax, min_nonzero, l2 = g.absmax, g.min_nonzero, g.l2
        if g_shift:
            with np.errstate(over="ignore"):  # a product past fp32's range is inf, as in fp32
                factor = 2.0**g_shift
                absmax = (absmax * factor).astype(np.float32).astype(np.float64)
                min_nonzero, l2 = min_nonzero * factor, l2 * factor
        return StepGradStats(hist=hist, counts=counts, absmax=absmax, min_nonzero=min_nonzero, l2=l2,
                             other_view=how)

    def _unscaled_workspace(self) -> torch.Tensor:
        if self._unscaled is None:
            self._unscaled = torch.empty(int(self.offsets[-1]), dtype=torch.float32, device=self.device)
        return self._unscaled

    def _slices(self, flat: list[torch.Tensor]):
        for t, x in enumerate(flat):
            yield x, int(self.offsets[t]), int(self.offsets[t + 1])

    def _pass(self, flat: list[torch.Tensor]) -> _Pass:
        return self._numba_pass(flat) if self.backend == "numba" else self._torch_pass(flat)

    def _numba_pass(self, flat: list[torch.Tensor]) -> _Pass:
        arrays = self._typed_list([x.numpy() for x in flat])
        self._kernel(arrays, self._chunks, self._bounds, *self._spaces)
        keys, largest, below_smallest, sumsq = (a.copy() for a in self._spaces[3:])  # the next pass reuses them
        smallest = (below_smallest.astype(np.int64) + 1).astype(np.uint32).view(np.float32).astype(np.float64)
        min_nonzero = np.where(below_smallest == 0x7FFFFFFF, np.nan, smallest)  # 0x7FFFFFFF: all zeros
        return _Pass(keys.reshape(len(flat), 2, FIELDS, REGIONS), largest.view(np.float32).astype(np.float64),
                     min_nonzero, np.sqrt(sumsq))

    def _torch_pass(self, flat: list[torch.Tensor]) -> _Pass:
        """Key counts and reductions with torch ops, copied to the host in one transfer."""
        smallest, absmax = [], []
        for t, (x, start, end) in enumerate(self._slices(flat)):
            bits, keys, scratch = x.view(torch.int32), self._keys[start:end], self._scratch[: end - start]
            torch.bitwise_right_shift(bits, MANTISSA_BITS, out=keys)
            keys.add_(FIELDS + 2 * FIELDS * t)  # sign and field as one index, then the tensor's block
            torch.bitwise_and(bits, MANTISSA_MASK, out=scratch)
            keys.mul_(REGIONS).add_(torch.bucketize(scratch, self._bounds_t, out_int32=True, right=True))
            # (|bits| - 1) & 0x7FFFFFFF wraps zero to the largest value, so the min is the smallest non-zero - 1
            torch.bitwise_and(bits, 0x7FFFFFFF, out=scratch).sub_(1).bitwise_and_(0x7FFFFFFF)
            smallest.append(scratch.min() if x.numel() else torch.tensor(0x7FFFFFFF - 1, device=x.device))
            if x.numel():
                low, high = torch.aminmax(x)  # one fused read, no |x| temporary; NaN propagates
                absmax.append(torch.maximum(-low, high))
            else:
                absmax.append(torch.zeros((), device=x.device))
        n = len(flat)
        counts = _count_keys(self._keys, KEYS_PER_TENSOR * n)
        l2 = torch.stack(torch._foreach_norm(flat, 2, dtype=torch.float64)) if n else torch.zeros(0, device=self.device)
        floats = torch.stack([torch.stack(absmax).double(), l2]) if n else torch.zeros((2, 0), device=self.device)
        packed = torch.cat([counts, torch.stack(smallest).long() if n else counts[:0],
                            floats.reshape(-1).view(torch.int64)]).cpu().numpy()  # one copy to the host
        keys = packed[: KEYS_PER_TENSOR * n].reshape(n, 2, FIELDS, REGIONS)
        below_smallest = packed[KEYS_PER_TENSOR * n : KEYS_PER_TENSOR * n + n]
        absmax_l2 = packed[KEYS_PER_TENSOR * n + n :].view(np.float64).reshape(2, n)
        smallest_bits = (below_smallest + 1).astype(np.uint32).view(np.float32).astype(np.float64)
        min_nonzero = np.where(below_smallest == 0x7FFFFFFF, np.nan, smallest_bits)  # 0x7FFFFFFF: all zeros
        return _Pass(keys, absmax_l2[0], min_nonzero, absmax_l2[1])

    def _decode(self, key_counts: np.ndarray, flat: list[torch.Tensor] | None, suffix: str, shift: int = 0):
        """Histogram and named counts of the values of ``key_counts`` times 2**shift (shift != 0 only where
        :func:`_shift_is_exact`); fp32 subnormals are resolved from the values ``flat``."""
        magnitude = key_counts[:, 0] + key_counts[:, 1]  # (T, field, region)
        n = key_counts.shape[0]
        per_field = sum(magnitude[:, :, r] for r in range(REGIONS))  # (T, field): five adds beat .sum(axis=2)
        hist = np.zeros((n, N_EXP_BINS), dtype=np.int64)
        first_normal_bin = FP32.min_normal_exponent - EXP_MIN  # the bin of field 1
        low, high = max(1, 1 - shift), min(FIELDS - 1, FIELDS - 1 - shift)  # fields that stay normal
        hist[:, first_normal_bin + low + shift - 1 : first_normal_bin + high + shift - 1] = per_field[:, low:high]
        overflowed = key_counts[:, :, high : FIELDS - 1].sum(axis=(2, 3))  # (T, sign): became ±inf
        counts = {
            "zeros": magnitude[:, 0, 0],
            "nan": magnitude[:, FIELDS - 1, 1:].sum(axis=1),
            "posinf": key_counts[:, 1, FIELDS - 1, 0] + overflowed[:, 1],
            "neginf": key_counts[:, 0, FIELDS - 1, 0] + overflowed[:, 0],
        }
        per_category = np.rint(magnitude.reshape(n, -1) @ _category_matrix(shift)).astype(np.int64)
        for column, name in enumerate(CATEGORY_COLUMNS):
            counts[f"{name}{suffix}"] = per_category[:, column]
        for t in np.nonzero(magnitude[:, 0, 1:].sum(axis=1))[0]:
            self._add_fp32_subnormals(flat[t], t, hist, counts, suffix)
        return hist, counts

    @staticmethod
    def _add_fp32_subnormals(x: torch.Tensor, t: int, hist: np.ndarray, counts: dict, suffix: str) -> None:
        """Bin and classify the (rare) fp32 subnormal values of one tensor by casting them."""
        magnitude_bits = x.view(torch.int32) & 0x7FFFFFFF
        values = x[(magnitude_bits > 0) & (magnitude_bits < (1 << MANTISSA_BITS))].abs().cpu()
        exponents = torch.frexp(values).exponent.numpy().astype(np.int64) - 1
        hist[t] += np.bincount(exponents - EXP_MIN, minlength=N_EXP_BINS)[:N_EXP_BINS]
        for name, fmt in LOW_PRECISION.items():
            if not (CATEGORY_TABLES[name][0, 1:] == MIXED).all():
                continue  # uniform cells: already counted from the table
            category = _classify(values, fmt)
            for code, label in zip((UNDERFLOW, SUBNORMAL, OVERFLOW), CATEGORY_NAMES, strict=True):
                counts[f"{name}_{label}{suffix}"][t] += int((category == code).sum())


def category_counts_by_casting(values: torch.Tensor, fmt: Format) -> dict[str, int]:
    """Reference counts by plain casting: the definition the fast path must equal (used by tests)."""
    x = values.float().reshape(-1)
    finite_nonzero = torch.isfinite(x) & (x != 0)
    cast = x.to(fmt.dtype).float()
    return {
        "underflow": int((finite_nonzero & (cast == 0)).sum()),
        "subnormal": int((finite_nonzero & (cast != 0) & (cast.abs() < fmt.min_normal)).sum()),
        "overflow": int((finite_nonzero & torch.isinf(cast)).sum()),
    }


__all__ = ["GradStatsComputer", "StepGradStats", "category_counts_by_casting", "BF16", "FP16"]
