"""Exact per-tensor gradient statistics, computed in one pass over the fp32 bit patterns.

Every value gets an integer *key* from its fp32 bits: the arithmetic shift ``bits >> 23`` yields sign and
biased exponent field at once, and one extra bit says whether the mantissa lies at or above a rounding edge
of FP16 or BF16 inside that exponent bin. One ``bincount`` over the keys of all tensors then gives, per
tensor, the exponent histogram and the exact FP16/BF16 underflow / subnormal / overflow counts.

Which (exponent bin, edge bit) cell falls in which category is not typed in: it is found by casting the
smallest and largest fp32 value of every cell with torch (:func:`_category_table`), so the counts equal
torch's own round-to-nearest-even casting by construction. The one place where a cell is not uniform is the
fp32 subnormal range (|x| < 2**-126) for BF16; values there are rare and are classified by casting them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mpdiag.formats import BF16, EXP_MIN, FP16, FP32, LOW_PRECISION, N_EXP_BINS, Format

MANTISSA_BITS = 23
MANTISSA_MASK = (1 << MANTISSA_BITS) - 1
NEVER = 1 << MANTISSA_BITS  # a mantissa threshold no mantissa reaches: the bin is not split
FIELDS = 256  # biased exponent field values of fp32
KEYS_PER_TENSOR = 2 * FIELDS * 2  # sign x field x edge bit

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


def _split_thresholds() -> torch.Tensor:
    """Mantissa threshold per key index (sign x field); shared by all formats."""
    per_field = torch.full((FIELDS,), NEVER, dtype=torch.int32)
    per_field[0] = 1  # zero (mantissa 0) versus fp32 subnormal
    per_field[FIELDS - 1] = 1  # inf (mantissa 0) versus NaN
    for fmt in LOW_PRECISION.values():
        for field, threshold in _rounding_edges(fmt).items():
            if int(per_field[field]) != NEVER:
                raise AssertionError(f"two rounding edges in exponent field {field}")
            per_field[field] = threshold
    return torch.cat([per_field, per_field])  # negative sign first, as bits >> 23 + 256 orders them


SPLIT = _split_thresholds()


def _classify(values: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Category of each finite non-zero fp32 value when cast to ``fmt`` (torch casting is the truth)."""
    cast = values.to(fmt.dtype).float().abs()
    category = torch.full(values.shape, NORMAL, dtype=torch.int8)
    category[cast == 0] = UNDERFLOW
    category[(cast > 0) & (cast < fmt.min_normal)] = SUBNORMAL
    category[torch.isinf(cast)] = OVERFLOW
    return category


def _category_table(fmt: Format) -> np.ndarray:
    """Category of every (field, edge bit) cell for ``fmt``, shape (256, 2); MIXED where not uniform."""
    field = torch.arange(FIELDS, dtype=torch.int32).repeat_interleave(2)
    edge = torch.arange(2, dtype=torch.int32).repeat(FIELDS)
    threshold = SPLIT[FIELDS:].repeat_interleave(2)
    lowest = torch.where(edge == 1, threshold, torch.zeros_like(threshold))
    highest = torch.where(edge == 1, torch.full_like(threshold, MANTISSA_MASK), threshold - 1)
    empty = lowest > highest
    first = _classify(((field << MANTISSA_BITS) | lowest).view(torch.float32), fmt)
    last = _classify(((field << MANTISSA_BITS) | highest.clamp(min=0)).view(torch.float32), fmt)
    table = torch.where(first == last, first, torch.full_like(first, MIXED))
    table[empty] = NORMAL  # an empty cell never holds a count
    table = table.view(FIELDS, 2).numpy().copy()
    table[0, 0] = SPECIAL  # zero
    table[FIELDS - 1, :] = SPECIAL  # inf, NaN
    if (table[1 : FIELDS - 1] == MIXED).any():
        raise AssertionError(f"{fmt.name}: a rounding edge inside an fp32 normal bin is not split")
    return table


CATEGORY_TABLES = {name: _category_table(fmt) for name, fmt in LOW_PRECISION.items()}


@dataclass
class StepGradStats:
    """Statistics of every recorded tensor at one step. Arrays are indexed by tensor position.

    ``hist[t, i]`` counts values of tensor t with 2**(EXP_MIN + i) <= |g| < 2**(EXP_MIN + i + 1), for the
    unscaled gradient g. ``counts[name]`` holds zeros, nan, posinf, neginf and, for fmt in fp16/bf16 and
    category in underflow/subnormal/overflow, ``{fmt}_{category}`` (for g) and ``{fmt}_{category}_at_scale``
    (for S*g, the gradient as it was in the backward pass). absmax, min_nonzero and l2 are of g; absmax and
    l2 are NaN when g holds a NaN; min_nonzero is NaN when g holds no non-zero value.
    """

    hist: np.ndarray
    counts: dict[str, np.ndarray]
    absmax: np.ndarray
    min_nonzero: np.ndarray
    l2: np.ndarray


def _count_keys(keys: torch.Tensor, n: int) -> torch.Tensor:
    """Histogram of integer keys in [0, n) without a host synchronisation on CUDA."""
    if keys.device.type == "cpu":
        return torch.bincount(keys, minlength=n)
    counts = torch.zeros(n, dtype=torch.int64, device=keys.device)
    return counts.index_add_(0, keys.long(), torch.ones_like(keys, dtype=torch.int64))


class GradStatsComputer:
    """Computes :class:`StepGradStats` for a fixed list of tensor sizes, reusing its workspaces.

    Workspaces are allocated once (keys for every element, unscaled values when a scale is applied,
    scratch sized to the largest tensor), so a step allocates no full-size temporaries of its own.
    """

    def __init__(self, numels: list[int], device: torch.device | str = "cpu"):
        self.numels = list(numels)
        self.device = torch.device(device)
        self.offsets = np.concatenate([[0], np.cumsum(self.numels)]).astype(np.int64)
        total, largest = int(self.offsets[-1]), max(self.numels, default=0)
        self._keys = torch.empty(total, dtype=torch.int32, device=self.device)
        self._unscaled: torch.Tensor | None = None
        self._threshold = torch.empty(largest, dtype=torch.int32, device=self.device)
        self._mantissa = torch.empty(largest, dtype=torch.int32, device=self.device)
        self._edge = torch.empty(largest, dtype=torch.bool, device=self.device)
        self._split = SPLIT.to(self.device)

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the reusable workspaces allocated so far."""
        spaces = [self._keys, self._unscaled, self._threshold, self._mantissa, self._edge]
        return sum(t.numel() * t.element_size() for t in spaces if t is not None)

    def compute(self, grads: list[torch.Tensor], scale: float, grads_are_scaled: bool = True) -> StepGradStats:
        """Statistics of ``grads`` produced at loss scale ``scale``.

        ``grads_are_scaled``: the tensors hold S*g (as after ``scaler.scale(loss).backward()``); the unscaled
        g is then computed as GradScaler does (multiply by the fp32 reciprocal computed in fp64). If False
        they hold g already (after ``scaler.unscale_``) and S*g is computed by multiplying in fp32.
        """
        if [g.numel() for g in grads] != self.numels:
            raise ValueError("gradient sizes differ from the sizes this computer was built for")
        flat = [g.detach().reshape(-1).float() for g in grads]
        if scale == 1.0:
            unscaled = at_scale = flat
        else:
            other = self._unscaled_workspace()
            factor = float(torch.tensor(scale, dtype=torch.float64).reciprocal().float()) if grads_are_scaled else scale
            derived = [torch.mul(x, factor, out=other[s:e]) for x, s, e in self._slices(flat)]
            unscaled, at_scale = (derived, flat) if grads_are_scaled else (flat, derived)

        key_counts = self._key_counts(unscaled).numpy()
        hist, counts = self._decode(key_counts, unscaled, suffix="")
        if at_scale is unscaled:
            counts.update({f"{k}_at_scale": v for k, v in counts.items() if k.startswith(("fp16", "bf16"))})
        else:
            _, scaled_counts = self._decode(self._key_counts(at_scale).numpy(), at_scale, suffix="_at_scale")
            counts.update({k: v for k, v in scaled_counts.items() if k.startswith(("fp16", "bf16"))})

        absmax, l2, min_nonzero = self._reductions(unscaled, counts["zeros"])
        return StepGradStats(hist=hist, counts=counts, absmax=absmax, min_nonzero=min_nonzero, l2=l2)

    def _unscaled_workspace(self) -> torch.Tensor:
        if self._unscaled is None:
            self._unscaled = torch.empty(int(self.offsets[-1]), dtype=torch.float32, device=self.device)
        return self._unscaled

    def _slices(self, flat: list[torch.Tensor]):
        for t, x in enumerate(flat):
            yield x, int(self.offsets[t]), int(self.offsets[t + 1])

    def _key_counts(self, flat: list[torch.Tensor]) -> torch.Tensor:
        """Counts per (tensor, sign, field, edge bit), shape (T, 2, 256, 2), on the host."""
        for t, (x, start, end) in enumerate(self._slices(flat)):
            n = end - start
            bits, keys = x.view(torch.int32), self._keys[start:end]
            threshold, mantissa, edge = self._threshold[:n], self._mantissa[:n], self._edge[:n]
            torch.bitwise_right_shift(bits, MANTISSA_BITS, out=keys)
            keys.add_(FIELDS)  # sign and field as one index in [0, 512)
            torch.index_select(self._split, 0, keys, out=threshold)
            torch.bitwise_and(bits, MANTISSA_MASK, out=mantissa)
            torch.ge(mantissa, threshold, out=edge)
            keys.add_(2 * FIELDS * t).mul_(2).add_(edge)
        n_keys = KEYS_PER_TENSOR * len(flat)
        return _count_keys(self._keys, n_keys).cpu().view(len(flat), 2, FIELDS, 2)

    def _decode(self, key_counts: np.ndarray, flat: list[torch.Tensor], suffix: str):
        """Histogram and named counts from key counts; fp32 subnormals are resolved from the values."""
        key_counts = key_counts.astype(np.int64)
        magnitude = key_counts.sum(axis=1)  # (T, field, edge bit)
        n = key_counts.shape[0]
        hist = np.zeros((n, N_EXP_BINS), dtype=np.int64)
        first_normal_bin = FP32.min_normal_exponent - EXP_MIN
        hist[:, first_normal_bin:] = magnitude[:, 1 : FIELDS - 1, :].sum(axis=2)
        counts = {
            "zeros": magnitude[:, 0, 0],
            "nan": magnitude[:, FIELDS - 1, 1],
            "posinf": key_counts[:, 1, FIELDS - 1, 0],
            "neginf": key_counts[:, 0, FIELDS - 1, 0],
        }
        for name, table in CATEGORY_TABLES.items():
            for category, label in zip((UNDERFLOW, SUBNORMAL, OVERFLOW), CATEGORY_NAMES, strict=True):
                counts[f"{name}_{label}{suffix}"] = (magnitude * (table == category)).sum(axis=(1, 2))
        for t in np.nonzero(magnitude[:, 0, 1])[0]:
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
            if not (CATEGORY_TABLES[name][0, 1] == MIXED):
                continue  # uniform cell: already counted from the table
            category = _classify(values, fmt)
            for code, label in zip((UNDERFLOW, SUBNORMAL, OVERFLOW), CATEGORY_NAMES, strict=True):
                counts[f"{name}_{label}{suffix}"][t] += int((category == code).sum())

    def _reductions(self, flat: list[torch.Tensor], zeros: np.ndarray):
        """absmax, L2 norm and smallest non-zero |g| per tensor, copied to the host together.

        absmax is max(-min, max) of one fused aminmax (NaN when a NaN is present, like torch's max); the
        smallest non-zero magnitude comes from the bit pattern, masking zeros only in tensors that have any
        (``zeros`` from the key counts): (|bits| - 1) & 0x7FFFFFFF wraps zero to the largest key.
        """
        if not flat:
            empty = np.zeros(0)
            return empty, empty, empty
        l2 = torch.stack(torch._foreach_norm(flat, 2))
        absmax, smallest = [], []
        for x, has_zeros in zip(flat, zeros > 0, strict=True):
            if x.numel() == 0:
                absmax.append(torch.zeros((), device=x.device))
                smallest.append(torch.tensor(0x7FFFFFFF, dtype=torch.int32, device=x.device))
                continue
            low, high = torch.aminmax(x)
            absmax.append(torch.maximum(-low, high))
            magnitude = self._mantissa[: x.numel()]
            torch.bitwise_and(x.view(torch.int32), 0x7FFFFFFF, out=magnitude)
            if has_zeros:
                magnitude.sub_(1).bitwise_and_(0x7FFFFFFF)
                smallest.append(magnitude.min())
            else:
                smallest.append(magnitude.min() - 1)
        smallest_bits = torch.stack(smallest)
        nothing = smallest_bits == 0x7FFFFFFF
        min_nonzero = (smallest_bits + 1).view(torch.float32)
        min_nonzero = torch.where(nothing, torch.full_like(min_nonzero, float("nan")), min_nonzero)
        host = torch.stack([torch.stack(absmax).float(), l2, min_nonzero]).double().cpu().numpy()
        return host[0], host[1], host[2]


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
