"""MXFP8 and NVFP4 block-scaled casts and counts (mpdiag.numerics.block_scaled) against torchao 0.18.0's emulated
reference casts, value by value: the dequantised values bit for bit, and the counts as computed from torchao's
elements and scales (never from mpdiag's)."""

from __future__ import annotations

import math

import pytest
import torch

from mpdiag.numerics import block_scaled as bs

pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
from conftest import DEVICES  # noqa: E402
from ground_truth import reference_counts, reference_mxfp8, reference_nvfp4  # noqa: E402


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.cpu().reshape(-1), want.cpu().reshape(-1)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    mismatch = (_bits(got) != _bits(want)) & ~nan
    assert not mismatch.any(), f"{int(mismatch.sum())} values differ, first at {got[mismatch][:4]} vs {want[mismatch][:4]}"


def _wide_random(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Values spanning many orders of magnitude: each value and each row at its own power of two."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x = x * torch.exp2(torch.randint(-30, 31, (rows, cols), generator=g).float())
    return x * torch.exp2(torch.randint(-60, 61, (rows, 1), generator=g).float())


def _edges(recipe: str) -> torch.Tensor:
    """Rows of one block each: the element format's max, the overflow edges and their neighbours, halfway
    points, exact powers of two, tiny values near the smallest subnormal, zeros and all-zero blocks."""
    block = bs.BLOCK_SIZE[recipe]
    top = 448.0 if recipe == "mxfp8" else 6.0
    nxt = lambda v, d: math.nextafter(v, d)  # noqa: E731
    rows = []
    if recipe == "mxfp8":
        # with amax 256 the divisor is 1: elements are the values themselves
        specials = [448.0, 464.0, nxt(464.0, 1e9), 480.0, 500.0, 2.0**-9, 2.0**-10, nxt(2.0**-10, 1), 2.0**-10 * 3,
                    2.0**-6, 2.0**-6 - 2.0**-10, nxt(2.0**-6 - 2.0**-10, 0), 1.5 * 2.0**-9, 2.0**-11, 1.0, 288.0, 304.0]
        for amax in (256.0, 511.0, 2.0**-120, 2.0**-119, 2.0**-118, 2.0**-130, 2.0**127, 3.0e38):
            row = torch.zeros(block)
            row[0] = amax
            row[1 : 1 + len(specials)] = torch.tensor(specials) * (amax / 256.0)
            rows.append(row)
    else:
        # an anchor block of amax 2688 = 448 * 6 makes the tensor scale exactly 1; a block of amax 6 * 2^j then
        # gets the block scale 2^j (clamped up to 2^-6, torchao's E4M3_EPS) and exact halfway points
        # (a block amax that is not 6 * 2^j, e.g. 7 or 6.5, rounds its scale in E4M3: the last rows)
        halfway = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, nxt(0.25, 1), nxt(0.75, 0), nxt(5.0, 0)]
        for j, top in ((-12, 6.0), (-9, 6.0), (-6, 6.0), (0, 6.0), (5, 6.0), (8, 6.0), (0, 7.0), (0, 6.5),
                       (0, nxt(7.0, 0)), (-3, 6.75)):
            row = torch.zeros(2 * block)
            row[0] = 2688.0
            row[block] = top * 2.0**j
            row[block + 1 : block + 1 + len(halfway)] = torch.tensor(halfway) * 2.0**j
            rows.append(row)
        rows.append(torch.tensor([6.0, 2.0**-9, 2.0**-10, 2.0**-11] + [0.0] * (2 * block - 4)))
        rows.append(torch.tensor([1e-30, 1e-31] + [0.0] * (2 * block - 2)))
        block = 2 * block
    rows.append(torch.zeros(block))  # an all-zero block
    rows.append(-torch.exp2(torch.arange(block, dtype=torch.float32) - block // 2))  # powers of two, negative
    x = torch.stack(rows)
    if recipe == "nvfp4":  # one tensor: the per-tensor scale is the whole tensor's, so each edge row alone
        return x
    return torch.cat([x, -x])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", bs.BLOCK_RECIPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_tensors_match_torchao_bit_for_bit(recipe, seed, device):
    """mpdiag's casts and counts on ``device`` against torchao's reference on the same device (on CUDA torch
    divides by a CPU scalar as a multiplication by its reciprocal, which can differ in the last bit from the
    CPU's division: each device's casts are their own truth)."""
    x = _wide_random(8, 128, seed).to(device)
    cast = bs.CASTS[recipe](x)
    want = (reference_mxfp8 if recipe == "mxfp8" else reference_nvfp4)(x)
    _assert_same_bits(cast.elements, want[0])
    _assert_same_bits(cast.dequantized, want[2])
    stats = bs.block_stats(x, recipe)
    ref = reference_counts(x, recipe)
    assert (stats.underflow, stats.subnormal, stats.overflow, stats.clipped_blocks) == (
        ref["underflow"], ref["subnormal"], ref["overflow"], ref["clipped_blocks"])
    assert (stats.blocks, stats.scale_exponents) == (ref["blocks"], ref["scale_exponents"])
    assert stats.underflow > 0 and stats.subnormal > 0  # the random data reach the edges the test is about


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", bs.BLOCK_RECIPES)
def test_edge_values_match_torchao(recipe, device):
    x = _edges(recipe).to(device)
    if recipe == "nvfp4":
        rows = [x[i : i + 1] for i in range(x.shape[0])]
    else:
        rows = [x]
    for t in rows:
        if recipe == "nvfp4" and not t.abs().amax() > 0:
            continue  # an all-zero tensor: torchao's per-tensor scale is 0 and its cast NaN (below)
        cast = bs.CASTS[recipe](t)
        want = (reference_mxfp8 if recipe == "mxfp8" else reference_nvfp4)(t)
        _assert_same_bits(cast.elements, want[0])
        _assert_same_bits(cast.dequantized, want[2])
        stats, ref = bs.block_stats(t, recipe), reference_counts(t, recipe)
        assert (stats.underflow, stats.subnormal, stats.overflow, stats.clipped_blocks) == (
            ref["underflow"], ref["subnormal"], ref["overflow"], ref["clipped_blocks"]), t
        assert stats.scale_exponents == ref["scale_exponents"]


@pytest.mark.parametrize("recipe", bs.BLOCK_RECIPES)
def test_partial_last_block_is_zero_padded(recipe):
    x = _wide_random(3, 50, 7).reshape(3, 1, 50)  # leading dims flatten into rows; 50 is no multiple of 32 or 16
    cast = bs.CASTS[recipe](x)
    want = (reference_mxfp8 if recipe == "mxfp8" else reference_nvfp4)(x)
    assert cast.dequantized.shape == x.shape
    block = bs.BLOCK_SIZE[recipe]
    _assert_same_bits(cast.dequantized.reshape(3, 50), want[2].reshape(3, -1)[:, :50])
    stats, ref = bs.block_stats(x, recipe), reference_counts(x, recipe)
    assert stats.blocks == 3 * math.ceil(50 / block)
    assert (stats.underflow, stats.subnormal, stats.overflow) == (ref["underflow"], ref["subnormal"], ref["overflow"])


def test_mxfp8_inf_and_nan_blocks():
    x = torch.zeros(2, 32)
    x[0, :4] = torch.tensor([float("inf"), 1.0, 2.0**-100, 0.0])
    x[1, :3] = torch.tensor([float("nan"), 1.0, 3.0])
    cast = bs.cast_mxfp8(x)
    deq = reference_mxfp8(x)[2]
    _assert_same_bits(cast.dequantized, deq)
    assert torch.isnan(cast.dequantized[1]).all()  # a NaN block dequantises to NaN throughout
    stats = bs.block_stats(x, "mxfp8")
    ref = reference_counts(x, "mxfp8")
    assert (stats.underflow, stats.subnormal, stats.overflow) == (ref["underflow"], ref["subnormal"], ref["overflow"])
    assert stats.underflow == 4  # 1 and 2^-100 next to inf (scale 2^120), 1 and 3 next to NaN


def test_nvfp4_all_zero_tensor_counts_nothing():
    stats = bs.block_stats(torch.zeros(2, 16), "nvfp4")
    assert (stats.underflow, stats.subnormal, stats.overflow, stats.zero_blocks, stats.blocks) == (0, 0, 0, 2, 2)


def test_planted_block_by_hand():
    """One MXFP8 block and one NVFP4 block worked out on paper, so the tests can fail on a shared mistake."""
    x = torch.zeros(1, 32)
    # MXFP8: amax 1000, floor(log2 1000) = 9, scale 2^(9 - 8) = 2, elements x / 2: 500 and 465 lie past 464 and
    # clip to 448; 464 ties to the even 448, not clipped; 2^-11 and 0.75 * 2^-10 are at most half of E4M3's
    # smallest subnormal 2^-9 and underflow; 2^-9 is subnormal
    x[0, :6] = torch.tensor([1000.0, 930.0, 928.0, 2.0**-10, 3 * 2.0**-11, 2.0**-8])
    s = bs.block_stats(x, "mxfp8")
    assert (s.underflow, s.subnormal, s.overflow, s.clipped_blocks, s.scale_exponents) == (2, 1, 2, 1, {1: 1})
    assert bs.cast_mxfp8(x).dequantized[0, :3].tolist() == [896.0, 896.0, 896.0]
    # NVFP4: block 0's 2688 = 448 * 6 makes the tensor scale s_t = 2688 / 2688 = 1; block 1's amax 1536 = 6 * 256
    # gives it the block scale 256 (exact in E4M3), so its elements are x / 256: 6, 0.25 (ties to 0), 0.3 (-> 0.5,
    # subnormal), 2.5 (ties to the even 2), 0.75 (ties to the even 1), 7 * 256 / 256 would clip (not planted)
    y = torch.zeros(1, 32)
    y[0, 0] = 2688.0
    y[0, 16:21] = torch.tensor([6.0, 0.25, 0.3, 2.5, 0.75]) * 256.0
    s = bs.block_stats(y, "nvfp4")
    assert bs.cast_nvfp4(y).elements[0, 1, :5].tolist() == [6.0, 0.0, 0.5, 2.0, 1.0]
    assert (s.underflow, s.subnormal, s.overflow, s.wide_blocks) == (1, 1, 0, 1)  # 1536 / 64 = 24 > 6 / 0.5
    assert s.tensor_scale == 1.0 and s.scale_exponents == {8: 2}  # 448 and 256
