"""Exact statistics of block-scaled FP8/FP4 casts (MXFP8 and NVFP4) of 2-D tensors, vectorised, no per-block loop.

It owns the two recipes' block-scale arithmetic (written to reproduce torchao 0.18.0's emulated reference casts,
``torchao.prototype.mx_formats``, bit for bit: ``tests/numerics/test_block_scaled.py``), the element roundings and
the per-tensor and per-block counts. What the tensors are (hooks on Linear modules) is
:mod:`mpdiag.recording.fp8_capture`; the per-tensor recipes are :mod:`mpdiag.numerics.fp8`.

Blocks run along the last dimension, the reduction dimension of ``y = x W^T`` for the input x (…, in) and the
weight W (out, in), as torchao's ``MXLinear`` and ``NVFP4Tensor`` block them in the forward pass; the output
gradient (…, out) is blocked along its last dimension too (the reduction dimension of dX = dY W). Every leading
dimension is flattened into rows. A row whose length is not a multiple of the block size is padded with zeros
(torchao refuses such a tensor): a zero changes no block's amax, so the last, partial block gets the scale of
its own values, and zeros are counted in no category.

Recipes:

* **mxfp8** (OCP MX v1.0, torchao ``to_mx`` with its default ``ScaleCalculationMode.FLOOR``): blocks of 32, an
  E8M0 scale X = 2^(floor(log2 amax) - 8) per block (8: the exponent of E4M3's largest power of two, 256),
  clamped to E8M0's range; elements E4M3 = cast(clamp(x / X, ±448)). torchao divides by max(X, 2^-126) when
  the E8M0 scale is 2^-127 (biased 0, blocks with amax below 2^-118) and dequantises with 2^-127; this is
  reproduced. A block holding NaN gets the NaN scale (biased 255): every value dequantises to NaN.
* **nvfp4** (torchao ``NVFP4Tensor.to_nvfp4`` with a per-tensor scale): blocks of 16; per tensor the fp32
  scale s_t = amax / (448 * 6) (``per_tensor_amax_to_scale``); per block the E4M3 scale
  s_b = e4m3(clamp((block amax / 6) / s_t, tiny_e4m3, 448)); elements E2M1 = rne(clamp(x * ((1 / s_t) / s_b), ±6));
  dequantised as element * (s_t * s_b). Finite tensors only (torchao's FP4 rounding has no inf or NaN).

Counts, over finite non-zero x, of the element e (before its scale is applied back): **underflow** e == 0;
**subnormal** e non-zero below the element format's smallest normal (E4M3 2^-6, E2M1 1); **overflow** (clipped)
|x / scale| past the element format's overflow edge, where round to nearest even with no upper limit would give
more than its largest value (E4M3 > 464, E2M1 >= 7: both clamp to the largest value instead). Per block: the
blocks, all-zero blocks, blocks with an overflowing value, blocks whose largest |x| over smallest non-zero |x|
exceeds the element format's dynamic range (largest over smallest subnormal: E4M3 448 / 2^-9, E2M1 6 / 0.5), and
a histogram of the exponent of the blocks' dequantisation scales (floor(log2)) over blocks with a non-zero value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mpdiag.numerics.fp8_recipes import BLOCK_RECIPES
from mpdiag.numerics.gradstats import DeviceReadback

BLOCK_SIZE = {"mxfp8": 32, "nvfp4": 16}
#: the element format of each recipe, as stored in the ``fmt`` column
ELEMENT_FORMAT = {"mxfp8": "fp8_e4m3", "nvfp4": "fp4_e2m1"}

E4M3_MAX = 448.0
E4M3_MAX_POW2 = 8
E4M3_TINY = float(torch.finfo(torch.float8_e4m3fn).tiny)  # 2^-6, torchao's E4M3_EPS
E4M3_MIN_SUBNORMAL = 2.0**-9
E4M3_OVERFLOW_ABOVE = 464.0  # midpoint of 448 and 480, which ties to the even 448
E2M1_MAX = 6.0
E2M1_MIN_NORMAL = 1.0
E2M1_MIN_SUBNORMAL = 0.5
E2M1_OVERFLOW_FROM = 7.0  # midpoint of 6 and 8, which ties to the even 8
E8M0_BIAS = 127
F32_MIN_NORMAL = 2.0**-126
#: largest |x| over smallest non-zero |x| an element format represents in one block
DYNAMIC_RANGE = {"mxfp8": E4M3_MAX / E4M3_MIN_SUBNORMAL, "nvfp4": E2M1_MAX / E2M1_MIN_SUBNORMAL}

#: E2M1's magnitudes and the rounding boundaries between them: a magnitude at or past boundary i rounds to
#: value i + 1. Ties round to the even mantissa: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
#: 3.5 -> 4, 5 -> 4; a tie that goes down has its boundary one fp32 step above it.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_BOUNDARIES = tuple(float(np.nextafter(np.float32(m), np.float32(np.inf))) if m in _TIES_DOWN else m
                        for m in _MIDPOINTS)


@dataclass
class BlockCast:
    """One tensor cast by a block recipe, blocked as ``(rows, blocks, block_size)`` (zero-padded).

    ``elements``: the element values in fp32 (E4M3 or E2M1 values, before the scale is applied back);
    ``block_scale``: the per-block dequantisation scale in fp32 (NaN for an MXFP8 block holding NaN);
    ``dequantized``: elements * block_scale, trimmed to the input's shape; ``tensor_scale``: NVFP4's per-tensor
    fp32 scale, a 0-d tensor on x's device (1.0 for MXFP8); ``overflow``: per value, whether x / scale is past the element format's edge."""

    recipe: str
    elements: torch.Tensor
    block_scale: torch.Tensor
    dequantized: torch.Tensor
    tensor_scale: torch.Tensor
    overflow: torch.Tensor


@dataclass(frozen=True)
class BlockStats:
    """Counts of one tensor under one block recipe (see the module's docstring)."""

    recipe: str
    numel: int
    amax: float
    tensor_scale: float
    underflow: int
    subnormal: int
    overflow: int
    blocks: int
    zero_blocks: int
    clipped_blocks: int
    wide_blocks: int
    scale_exponents: dict[int, int]


def _blocked(x: torch.Tensor, block: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """fp32 ``(rows, blocks, block)`` view of x along its last dimension, zero-padded to whole blocks."""
    shape = tuple(x.shape)
    x = x.detach().float().reshape(-1, shape[-1] if shape else 1)
    pad = -x.shape[1] % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(x.shape[0], -1, block), shape


def _trim(blocked: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    rows = blocked.reshape(blocked.shape[0], -1)
    return rows[:, : shape[-1] if shape else 1].reshape(shape)


def cast_mxfp8(x: torch.Tensor, blocked: tuple[torch.Tensor, tuple[int, ...]] | None = None) -> BlockCast:
    """MXFP8 as torchao's ``to_mx(x, float8_e4m3fn, 32)`` (FLOOR) and ``to_dtype`` compute it (``blocked``: x's
    ``_blocked`` view, where the caller has it)."""
    xb, shape = blocked or _blocked(x, BLOCK_SIZE["mxfp8"])
    amax = xb.abs().amax(dim=-1, keepdim=True)
    pow2 = ((amax.view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS  # amax's unbiased fp32 exponent (-127 for 0)
    biased = (pow2 - E4M3_MAX_POW2).clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
    biased = torch.where(torch.isnan(amax), 255, biased)
    divisor = (biased << 23).view(torch.float32).clamp(min=F32_MIN_NORMAL)  # 255 -> inf
    y = xb / divisor
    elements = y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    # 2^(biased - 127) built from its bits (2^-127, biased 0, is the fp32 subnormal 0x00400000): exact on every
    # device, where exp2 of a subnormal result need not be
    bits = torch.where(biased == 0, 0x00400000, biased << 23)
    scale = torch.where(biased == 255, float("nan"), bits.view(torch.float32))
    overflow = torch.isfinite(xb) & (y.abs() > E4M3_OVERFLOW_ABOVE)
    return BlockCast("mxfp8", elements, scale, _trim(elements * scale, shape), torch.ones((), device=x.device), overflow)


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 magnitudes to E2M1 by round to nearest even, saturating at 6 (signs kept)."""
    bounds = torch.tensor(E2M1_BOUNDARIES, dtype=torch.float32, device=y.device)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=y.device)
    magnitude = values[torch.bucketize(y.abs(), bounds, right=True)]
    return torch.where(torch.signbit(y), -magnitude, magnitude)


def nvfp4_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor fp32 scale from the tensor's amax (torchao's ``per_tensor_amax_to_scale``)."""
    return amax.to(torch.float32) / (E4M3_MAX * E2M1_MAX)


def cast_nvfp4(x: torch.Tensor, blocked: tuple[torch.Tensor, tuple[int, ...]] | None = None) -> BlockCast:
    """NVFP4 with a per-tensor scale from the tensor's own amax, as torchao's ``NVFP4Tensor.to_nvfp4(x,
    per_tensor_scale=per_tensor_amax_to_scale(amax))`` and its ``dequantize`` compute it."""
    xb, shape = blocked or _blocked(x, BLOCK_SIZE["nvfp4"])
    tensor_scale = nvfp4_tensor_scale(xb.abs().amax())
    block_amax = xb.abs().amax(dim=-1)
    scaled = (block_amax / E2M1_MAX) / tensor_scale
    scale_e4m3 = scaled.clamp(E4M3_TINY, E4M3_MAX).to(torch.float8_e4m3fn).float()
    reciprocal = (1.0 / tensor_scale) / scale_e4m3
    y = xb * reciprocal.unsqueeze(-1)
    elements = round_e2m1(y.clamp(-E2M1_MAX, E2M1_MAX))
    scale = (tensor_scale * scale_e4m3).unsqueeze(-1)
    overflow = torch.isfinite(xb) & (y.abs() >= E2M1_OVERFLOW_FROM)
    return BlockCast("nvfp4", elements, scale, _trim(elements * scale, shape), tensor_scale, overflow)


CASTS = {"mxfp8": cast_mxfp8, "nvfp4": cast_nvfp4}
MIN_NORMAL = {"mxfp8": float(torch.finfo(torch.float8_e4m3fn).smallest_normal), "nvfp4": E2M1_MIN_NORMAL}


#: floor(log2) of a positive fp32 block scale lies in [-149, 127]: the scale-exponent histogram's fixed bins
SCALE_EXPONENT_LOW, SCALE_EXPONENT_BINS = -150, 280
_TOTALS = ("underflow", "subnormal", "overflow", "zero_blocks", "clipped_blocks", "wide_blocks", "amax",
           "tensor_scale")


def _counts_on_device(x: torch.Tensor, recipe: str) -> tuple[int, torch.Tensor]:
    """(blocks, counts): the counts of ``x`` cast by ``recipe`` as one float64 vector on x's device, _TOTALS then
    the scale-exponent histogram; nothing waits for the device (a histogram by index_add_ into fixed bins,
    where torch.unique or bincount would read back)."""
    if recipe not in CASTS:
        raise ValueError(f"unknown block recipe {recipe!r}; expected one of {BLOCK_RECIPES}")
    blocked = _blocked(x, BLOCK_SIZE[recipe])
    cast, xb = CASTS[recipe](x, blocked), blocked[0]
    magnitude = xb.abs()
    counted = torch.isfinite(xb) & (xb != 0)
    element = cast.elements.abs()
    underflow = counted & (element == 0)
    subnormal = counted & (element > 0) & (element < MIN_NORMAL[recipe])
    finite_mag = torch.where(torch.isfinite(magnitude), magnitude, 0.0)
    block_max = finite_mag.amax(dim=-1)
    block_min = torch.where(counted, magnitude, float("inf")).amin(dim=-1)
    nonzero = counted.any(dim=-1)
    wide = nonzero & (block_max > block_min * DYNAMIC_RANGE[recipe])
    scale = cast.block_scale.reshape(block_max.shape)
    used = nonzero & torch.isfinite(scale) & (scale > 0)
    _, exponent = torch.frexp(scale)  # scale = m * 2^e with 0.5 <= m < 1: floor(log2) = e - 1
    bins = (exponent.long() - 1 - SCALE_EXPONENT_LOW).clamp(0, SCALE_EXPONENT_BINS - 1).reshape(-1)
    histogram = torch.zeros(SCALE_EXPONENT_BINS, dtype=torch.float64, device=xb.device)
    histogram.index_add_(0, bins, used.reshape(-1).double())
    amax = magnitude.amax()  # inf or NaN where the tensor holds one
    totals = torch.stack([underflow.sum(), subnormal.sum(), cast.overflow.sum(), (~nonzero).sum(),
                          cast.overflow.any(dim=-1).sum(), wide.sum()]).double()
    return scale.numel(), torch.cat([totals, amax.double().reshape(1), cast.tensor_scale.double().reshape(1), histogram])


def _stats(recipe: str, numel: int, blocks: int, values: np.ndarray) -> BlockStats:
    totals = dict(zip(_TOTALS, values[: len(_TOTALS)].tolist(), strict=True))
    histogram = values[len(_TOTALS):]
    exponents = {int(SCALE_EXPONENT_LOW + b): int(histogram[b]) for b in np.flatnonzero(histogram)}
    return BlockStats(recipe, numel, totals["amax"], totals["tensor_scale"], *(int(totals[k]) for k in _TOTALS[:3]),
                      blocks, *(int(totals[k]) for k in _TOTALS[3:6]), scale_exponents=exponents)


class PendingBlockStats:
    """The block statistics of several (key, tensor, recipe) on their way to the host: one readback for all,
    non-blocking on the GPU; :meth:`result` waits only if the copy has not completed."""

    def __init__(self, items: Sequence[tuple[object, torch.Tensor, str]]):
        self._keys, vectors = [], []
        for key, x, recipe in items:
            blocks, vector = _counts_on_device(x, recipe)
            self._keys.append((key, recipe, int(x.numel()), blocks))
            vectors.append(vector)
        self._readback = DeviceReadback(torch.cat(vectors)) if vectors else None

    def ready(self) -> bool:
        return self._readback is None or self._readback.ready()

    def result(self) -> list[tuple[object, BlockStats]]:
        """(key, stats) in the order given."""
        if self._readback is None:
            return []
        values = self._readback.numpy().reshape(len(self._keys), -1)
        return [(key, _stats(recipe, numel, blocks, row))
                for (key, recipe, numel, blocks), row in zip(self._keys, values, strict=True)]


def block_stats(x: torch.Tensor, recipe: str) -> BlockStats:
    """The counts of ``x`` cast by ``recipe`` ("mxfp8" or "nvfp4"); one readback at the end."""
    return PendingBlockStats([(None, x, recipe)]).result()[0][1]


__all__ = ["BLOCK_RECIPES", "BLOCK_SIZE", "BlockCast", "BlockStats", "CASTS", "PendingBlockStats", "ELEMENT_FORMAT", "block_stats",
           "cast_mxfp8", "cast_nvfp4", "round_e2m1"]
