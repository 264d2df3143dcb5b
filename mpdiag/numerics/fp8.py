"""Exact FP8 statistics of many tensors at once: exponent histogram, amax, and per recipe the scale and the
underflow / subnormal / overflow counts of the scaled tensor, on any device with a fixed number of torch ops
per segment and one non-blocking readback per step.

It owns the FP8 rounding edges and the batched counting; the recipes' scale arithmetic and the formats'
limits are :mod:`mpdiag.numerics.fp8_recipes`, what the tensors are (hooks on Linear modules) is
:mod:`mpdiag.recording.fp8_capture`.

Categories of a value y = fp32(x * scale) about to be cast to an FP8 format, by round-to-nearest-even:
underflow (x non-zero and finite, the cast is 0), subnormal (the cast is non-zero and below min normal),
overflow (x finite and |y| past the format's overflow rule: > 464 for E4M3, >= 61440 for E5M2). The first two
edges are found by bisecting torch's own casts over the fp32 bit patterns (:func:`_category_edges`), so the
counts equal torch's casting value by value; so is the overflow edge where the cast shows it (NaN or inf),
else (a saturating E4M3 cast) it is the 464 threshold, checked against the cast. As in :mod:`mpdiag.numerics.gradstats`' torch backend, the tensors are
gathered into fp32 workspaces, each value keyed by one ``bucketize`` of its magnitude bits, and counted by
one ``index_add_``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mpdiag.numerics.formats import EXP_MIN, N_EXP_BINS
from mpdiag.numerics.fp8_recipes import (
    FP8_E4M3,
    FP8_E5M2,
    FP8_FORMATS,
    NORMAL,
    OVERFLOW,
    SUBNORMAL,
    Fp8Format,
    Fp8Settings,
    scale_from_reference,
)
from mpdiag.numerics.gradstats import SEGMENT, DeviceReadback, _segments

MAGNITUDE = 0x7FFFFFFF
INF_BITS = 0x7F800000


def torch_dtype(fmt: Fp8Format) -> torch.dtype:
    return getattr(torch, fmt.torch_dtype)


def _check_limits(fmt: Fp8Format) -> None:
    """The typed-in limits must be torch's (torch.finfo is the ground truth)."""
    info = torch.finfo(torch_dtype(fmt))
    got = (float(info.max), float(info.smallest_normal), float(info.smallest_normal) * float(info.eps))
    if got != (fmt.max_finite, fmt.min_normal, fmt.min_subnormal):
        raise AssertionError(f"{fmt.name}: limits {got} from torch.finfo differ from {fmt}")


def _cast_magnitude(bits: int, fmt: Fp8Format) -> float:
    value = torch.tensor([bits], dtype=torch.int32).view(torch.float32)
    return float(value.to(torch_dtype(fmt)).float().abs()[0])


def _first_bits(predicate) -> int:
    """Smallest non-negative fp32 magnitude bit pattern (below inf) for which ``predicate`` holds; the
    predicate must be monotone in the magnitude."""
    lo, hi = -1, INF_BITS  # predicate(lo) False, predicate(hi) True
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if predicate(mid) else (mid, hi)
    return hi


def _category_edges(fmt: Fp8Format) -> tuple[int, int, int]:
    """fp32 magnitude bit patterns where a cast to ``fmt`` stops being 0, stops being subnormal, and starts
    overflowing, all found by casting. Where the cast cannot show overflow (torch 2.13 saturates E4M3 casts at
    448; 2.11 gives NaN past 464) the edge is the format's typed threshold, checked to be where saturation
    starts."""
    _check_limits(fmt)
    nonzero = _first_bits(lambda b: _cast_magnitude(b, fmt) > 0)
    normal = _first_bits(lambda b: _cast_magnitude(b, fmt) >= fmt.min_normal)
    overflow = _first_bits(lambda b: not math.isfinite(_cast_magnitude(b, fmt)))
    if overflow == INF_BITS and fmt.overflow_above is not None:
        threshold = int(torch.tensor([fmt.overflow_above]).view(torch.int32)[0])
        if _cast_magnitude(threshold, fmt) != fmt.max_finite or _cast_magnitude(threshold + 1, fmt) != fmt.max_finite:
            raise AssertionError(f"{fmt.name}: the cast neither saturates past {fmt.overflow_above} nor shows overflow")
        overflow = threshold + 1
    for edge, category in ((nonzero, SUBNORMAL), (normal, NORMAL), (overflow, OVERFLOW)):
        below, at = (float(torch.tensor([b], dtype=torch.int32).view(torch.float32)[0]) for b in (edge - 1, edge))
        if fmt.category(below) != category - 1 or fmt.category(at) != category:
            raise AssertionError(f"{fmt.name}: the torch-free category rule disagrees with torch's casts at {at}")
    return nonzero, normal, overflow


CATEGORY_EDGES = {name: _category_edges(fmt) for name, fmt in FP8_FORMATS.items()}
#: histogram buckets of a magnitude: 0 zero, 1 .. N_EXP_BINS the fp32 binades from 2^EXP_MIN, then inf/NaN
HIST_BOUNDS = (*(1 << k for k in range(23)), *(field << 23 for field in range(1, 256)))
HIST_BUCKETS = len(HIST_BOUNDS) + 1
assert HIST_BUCKETS == N_EXP_BINS + 2
CATEGORIES = 4  # buckets of a scaled magnitude: zero or underflow, subnormal, normal, overflow (or inf/NaN)


@dataclass
class Fp8Stats:
    """One step's statistics of T tensors (index = tensor position), all numpy.

    ``numel``, ``zeros``, ``nonfinite``; ``amax`` (float64 of the fp32 amax, NaN when a NaN is present);
    ``hist[t, i]`` counts 2**(EXP_MIN + i) <= |x| < 2**(EXP_MIN + i + 1); per recipe name, ``scale[r]``
    (the fp32 scale) and ``counts[r]``, shape (T, 3): underflow, subnormal, overflow of x * scale.
    A tensor with no values has numel 0, amax 0 and no counts."""

    numel: np.ndarray
    zeros: np.ndarray
    nonfinite: np.ndarray
    amax: np.ndarray
    hist: np.ndarray
    scale: dict[str, np.ndarray]
    counts: dict[str, np.ndarray]


class PendingFp8Stats:
    """A step's statistics on their way to the host; :meth:`result` waits only if the copy is not done."""

    def __init__(self, finish, readback: DeviceReadback):
        self._finish, self._readback, self._result = finish, readback, None

    def ready(self) -> bool:
        return self._readback.ready()

    def result(self) -> Fp8Stats:
        if self._result is None:
            self._result = self._finish(self._readback.numpy())
        return self._result


class Fp8StatsComputer:
    """Computes :class:`Fp8Stats` for T tensors whose formats are fixed (``formats``, registry names), under
    ``settings``' recipes, keeping each tensor's delayed amax history on the device.

    A non-finite amax (an output gradient at a step GradScaler skips, or a forward that overflowed) is
    counted at its step but never enters the history: it would hold the delayed scale at 1 for the next H
    steps, as no real recipe does (Transformer Engine keeps its previous scale when the amax is not finite).
    The history and its per-tensor counts stay on the device, so leaving one out reads nothing back.

    ``divide_by_loss_scale[t]``: tensor t arrives multiplied by the loss scale (an output gradient at a
    loss-scaled level) and is unscaled as GradScaler does (times the fp32 reciprocal of S, computed in fp64).
    The workspaces (20 bytes a value) grow to the largest segment seen; a segment holds tensors of one
    format and at most SEGMENT values (a larger tensor alone)."""

    def __init__(self, formats: Sequence[str], settings: Fp8Settings, device: torch.device | str = "cpu",
                 divide_by_loss_scale: Sequence[bool] | None = None):
        settings.validate()
        self.formats = [FP8_FORMATS[name] for name in formats]
        self.settings = settings
        self.device = torch.device(device)
        n = len(self.formats)
        self._divide = list(divide_by_loss_scale or [False] * n)
        self._divide_mask = torch.tensor(self._divide, dtype=torch.bool, device=self.device)
        self._is_e5m2 = torch.tensor([fmt.name == "fp8_e5m2" for fmt in self.formats], dtype=torch.bool, device=self.device)
        self._history = torch.zeros((n, settings.history), dtype=torch.float32, device=self.device)
        self._kept = torch.zeros(n, dtype=torch.int64, device=self.device)  # finite amaxes in each history, so far
        self._edges = {name: torch.tensor(edges, dtype=torch.int32, device=self.device)
                       for name, edges in CATEGORY_EDGES.items()}
        self._hist_bounds = torch.tensor(HIST_BOUNDS, dtype=torch.int32, device=self.device)
        self._room = 0
        self._layout: tuple | None = None  # (sizes, segments with their owner index tensors)

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the reusable workspaces allocated so far (the delayed history besides)."""
        return 20 * self._room

    def _workspaces(self, room: int) -> None:
        if room > self._room:
            self._room = room
            self._values = torch.empty(room, dtype=torch.float32, device=self.device)
            self._magnitude = torch.empty(room, dtype=torch.int32, device=self.device)
            self._buckets = torch.empty(room, dtype=torch.int32, device=self.device)
            self._ones = torch.ones(room, dtype=torch.int32, device=self.device)

    def _segment_layout(self, sizes: tuple[int, ...]):
        """Per format, segments of consecutive tensors of that format, each with its global tensor ids and
        a per-value owner index (int32, global id), rebuilt only when the sizes change."""
        if self._layout is not None and self._layout[0] == sizes:
            return self._layout[1]
        layout = []
        for name in dict.fromkeys(fmt.name for fmt in self.formats):
            ids = [t for t, fmt in enumerate(self.formats) if fmt.name == name]
            numels = [sizes[t] for t in ids]
            for segment in _segments(numels, np.concatenate([[0], np.cumsum(numels)]).astype(np.int64)):
                present = [ids[u] for u in segment.nonempty]
                if not present:
                    continue
                counts = torch.tensor([sizes[t] for t in present], device=self.device)
                owner = torch.repeat_interleave(torch.tensor(present, dtype=torch.int32, device=self.device), counts,
                                                output_size=segment.total)
                layout.append((name, present, torch.tensor(present, device=self.device), segment.bounds,
                               segment.total, owner))
        self._workspaces(max((entry[4] for entry in layout), default=0))
        self._layout = (sizes, layout)
        return layout

    def start(self, tensors: Sequence[Sequence[torch.Tensor]], loss_scale: float | torch.Tensor = 1.0) -> PendingFp8Stats:
        """Enqueue one recorded step: ``tensors[t]`` holds tensor t's pieces (several calls of one module;
        empty when it did not run), all counted as one tensor. ``loss_scale`` may be GradScaler's scale
        tensor, read without a synchronisation. Nothing here reads a value back to the host."""
        if len(tensors) != len(self.formats):
            raise ValueError(f"expected {len(self.formats)} tensors, got {len(tensors)}")
        sizes = tuple(sum(p.numel() for p in pieces) for pieces in tensors)
        n, dev = len(self.formats), self.device
        present = np.array(sizes) > 0
        amax_bits = torch.zeros(n, dtype=torch.int32, device=dev)
        hist = torch.zeros(n * HIST_BUCKETS, dtype=torch.int32, device=dev)
        recipes = self.settings.recipes
        counts = {r: torch.zeros(n * CATEGORIES, dtype=torch.int32, device=dev) for r in recipes}
        factors = self._unscale_factors(loss_scale)
        first = self._kept == 0
        history_max = self._history.max(dim=1).values
        for name, ids, id_tensor, bounds, total, owner in self._segment_layout(sizes):
            values, magnitude = self._values[:total], self._magnitude[:total]
            buckets, ones = self._buckets[:total], self._ones[:total]
            torch.cat([p.detach().reshape(-1) for t in ids for p in tensors[t]], out=values)  # widen exactly
            if factors is not None and any(self._divide[t] for t in ids):
                values.mul_(torch.index_select(factors, 0, owner))  # 1 for tensors not loss-scaled
            torch.bitwise_and(values.view(torch.int32), MAGNITUDE, out=magnitude)
            pieces = [magnitude[start:end] for start, end in bounds]
            amax_bits[id_tensor] = torch.stack(torch._foreach_max(pieces))
            torch.bucketize(magnitude, self._hist_bounds, out_int32=True, right=True, out=buckets)
            hist.index_add_(0, buckets.add_(owner, alpha=HIST_BUCKETS), ones)
            amax = amax_bits.view(torch.float32)
            for recipe in recipes:
                scale = self._scales(recipe, self.formats[ids[0]], amax, first, history_max)
                torch.index_select(scale, 0, owner, out=values).mul_(magnitude.view(torch.float32))
                torch.bucketize(values.view(torch.int32), self._edges[name], out_int32=True, right=True, out=buckets)
                counts[recipe].index_add_(0, buckets.add_(owner, alpha=CATEGORIES), ones)
        amax = amax_bits.view(torch.float32)
        scales = [self._scale_vector(recipe, amax, first, history_max) for recipe in recipes]
        packed = torch.cat([amax_bits, hist, *(s.view(torch.int32) for s in scales), *counts.values()])
        self._push_history(amax, present)
        return PendingFp8Stats(lambda host: self._finish(host, np.array(sizes, dtype=np.int64)), DeviceReadback(packed))

    def _unscale_factors(self, loss_scale) -> torch.Tensor | None:
        """Per tensor, what its values are multiplied by: GradScaler's unscale factor or 1; None if all 1."""
        if not any(self._divide) or (not torch.is_tensor(loss_scale) and loss_scale == 1.0):
            return None
        if torch.is_tensor(loss_scale):
            factor = loss_scale.reshape(()).to(self.device).double().reciprocal().float()
        else:
            factor = torch.tensor(1.0 / float(loss_scale), dtype=torch.float64).float().to(self.device)
        return torch.where(self._divide_mask, factor, torch.ones((), device=self.device))

    def _scales(self, recipe: str, fmt: Fp8Format, amax, first, history_max) -> torch.Tensor:
        """fp32 scales of every tensor for ``recipe`` in ``fmt`` (only the entries of ``fmt``'s tensors are used)."""
        if recipe == "current":
            return scale_from_reference(amax, fmt, 0, self.settings.pow2, xp=torch)
        reference = torch.where(first, amax, history_max)
        return scale_from_reference(reference, fmt, self.settings.margin, self.settings.pow2, xp=torch)

    def _scale_vector(self, recipe: str, amax, first, history_max) -> torch.Tensor:
        """Every tensor's scale for ``recipe`` in its own format."""
        e4m3, e5m2 = (self._scales(recipe, fmt, amax, first, history_max) for fmt in (FP8_E4M3, FP8_E5M2))
        return torch.where(self._is_e5m2, e5m2, e4m3)

    def _push_history(self, amax: torch.Tensor, present: np.ndarray) -> None:
        """Append this step's amax to the history (a ring of H entries) of each tensor that had values and
        whose amax is finite; the others' histories are written back unchanged."""
        ids = torch.from_numpy(np.flatnonzero(present)).to(self.device)
        if ids.numel():
            slots = self._kept[ids] % self.settings.history
            keep = torch.isfinite(amax[ids])
            self._history[ids, slots] = torch.where(keep, amax[ids], self._history[ids, slots])
            self._kept[ids] += keep

    def _finish(self, host: np.ndarray, numel: np.ndarray) -> Fp8Stats:
        n, recipes = len(self.formats), self.settings.recipes
        amax = host[:n].view(np.float32).astype(np.float64)
        at = n + n * HIST_BUCKETS
        buckets = host[n:at].reshape(n, HIST_BUCKETS).astype(np.int64)
        scale, counts = {}, {}
        for recipe in recipes:
            scale[recipe] = host[at : at + n].view(np.float32).astype(np.float64)
            at += n
        zeros, nonfinite = buckets[:, 0], buckets[:, -1]
        for recipe in recipes:
            c = host[at : at + n * CATEGORIES].reshape(n, CATEGORIES).astype(np.int64)
            at += n * CATEGORIES
            counts[recipe] = np.stack([c[:, 0] - zeros, c[:, 1], c[:, 3] - nonfinite], axis=1)
        return Fp8Stats(numel=numel, zeros=zeros, nonfinite=nonfinite, amax=amax, hist=buckets[:, 1:-1],
                        scale=scale, counts=counts)


__all__ = ["CATEGORY_EDGES", "EXP_MIN", "Fp8Stats", "Fp8StatsComputer", "PendingFp8Stats", "SEGMENT"]
