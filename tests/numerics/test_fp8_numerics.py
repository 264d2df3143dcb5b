"""FP8 statistics against torch's own casting, value by value, over the whole fp32 range and every edge;
the recipes' scales against fp32 arithmetic done here; the delayed history against the stored-series form."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import DEVICES
from ground_truth import by_casting, exponent_histogram

from mpdiag.numerics.fp8 import CATEGORY_EDGES, EXP_MIN, Fp8StatsComputer
from mpdiag.numerics.fp8_recipes import (
    FP8_E4M3,
    FP8_E5M2,
    FP8_FORMATS,
    FP32_MAX,
    Fp8Settings,
    delayed_reference,
    recipe_scales,
    scale_from_reference,
    whatif_counts,
)


def bits(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


def edge_values() -> torch.Tensor:
    """Every category edge of both formats and every binade bound, one fp32 step either side, both signs,
    plus zeros, infinities and NaN."""
    centres = [e for edges in CATEGORY_EDGES.values() for e in edges] + [1 << k for k in range(23)] + \
              [f << 23 for f in range(1, 255)]
    # the FP8 formats' own limits and half-steps, to catch a wrong edge even if bisection were wrong
    centres += [int(torch.tensor([v], dtype=torch.float32).view(torch.int32)) for fmt in FP8_FORMATS.values()
                for v in (fmt.max_finite, fmt.min_normal, fmt.min_subnormal, fmt.min_subnormal / 2, 464.0, 61440.0)]
    magnitudes = sorted({c + d for c in centres for d in (-1, 0, 1) if 0 < c + d < 0x7F800000})
    x = bits(magnitudes)
    return torch.cat([x, -x, torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])])


def whole_range(seed: int, n: int = 40000) -> torch.Tensor:
    """Random fp32 values over every exponent field (subnormals included), both signs."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 0x7F800000, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32) * \
        (torch.randint(0, 2, (n,), generator=g) * 2 - 1)


def test_edges_are_where_torch_casts_change_category():
    for name, edges in CATEGORY_EDGES.items():
        for edge in edges:
            below, at = bits([edge - 1]), bits([edge])
            assert by_casting(below, 1.0, name) != by_casting(at, 1.0, name), (name, hex(edge))
    assert float(bits([CATEGORY_EDGES["fp8_e4m3"][2] - 1])) == 464.0  # 464 ties to 448: not an overflow
    assert float(bits([CATEGORY_EDGES["fp8_e5m2"][2]])) == 61440.0


@pytest.mark.parametrize("grad_format", ["e5m2", "e4m3"])
def test_each_value_counted_as_its_cast_at_scale_one(grad_format):
    """Every value in its own tensor: step 0 holds fmt_max, so the delayed scale (H=1) of step 1 is exactly 1."""
    values = edge_values()
    settings = Fp8Settings(recipe="delayed", history=1, grad_format=grad_format)
    roles = ["input", "grad_output"]
    formats = [settings.role_format(role).name for role in roles for _ in values]
    computer = Fp8StatsComputer(formats, settings)
    computer.start([[torch.tensor([FP8_FORMATS[f].max_finite])] for f in formats]).result()
    stats = computer.start([[v.reshape(1)] for _ in roles for v in values]).result()
    assert (stats.scale["delayed"] == 1.0).all()
    for t, (fmt, v) in enumerate(zip(formats, [*values, *values], strict=True)):
        assert tuple(stats.counts["delayed"][t]) == by_casting(v, 1.0, fmt), (fmt, float(v))
        assert (stats.hist[t] == exponent_histogram(v)).all()


@pytest.mark.parametrize("device", DEVICES)
def test_whole_range_at_random_scales_and_current_scaling(device):
    """64 tensors of random fp32 values over the whole range; delayed scales fmt_max / A with random A from
    the previous step, current scales from each tensor's own amax (computed on ``device``, checked against
    casting on the CPU)."""
    g = torch.Generator().manual_seed(1)
    tensors = [whole_range(seed).reshape(200, 200)[: 1 + t] for t, seed in enumerate(range(64))]
    tensors = [t[torch.isfinite(t).all(dim=1)] if i % 2 else t for i, t in enumerate(tensors)]  # some without inf/NaN
    formats = ["fp8_e4m3" if t % 3 else "fp8_e5m2" for t in range(64)]
    previous = (torch.rand(64, generator=g) * 60 - 30).exp2() * torch.rand(64, generator=g)
    computer = Fp8StatsComputer(formats, Fp8Settings(recipe="both", history=1), device=device)
    computer.start([[a.reshape(1).to(device)] for a in previous]).result()
    stats = computer.start([[x.to(device)] for x in tensors]).result()
    for t, (x, fmt) in enumerate(zip(tensors, formats, strict=True)):
        delayed = np.float32(FP8_FORMATS[fmt].max_finite) / np.float32(previous[t])
        assert stats.scale["delayed"][t] == delayed
        assert tuple(stats.counts["delayed"][t]) == by_casting(x, float(delayed), fmt)
        amax = x.abs().max()
        assert (math.isnan(stats.amax[t]) and amax.isnan()) or stats.amax[t] == float(amax)
        current = np.float32(FP8_FORMATS[fmt].max_finite) / np.float32(amax) if torch.isfinite(amax) and amax > 0 else 1.0
        assert stats.scale["current"][t] == np.float32(current)
        assert tuple(stats.counts["current"][t]) == by_casting(x, float(current), fmt)
        assert (stats.hist[t] == exponent_histogram(x)).all()
        assert stats.numel[t] == x.numel() and stats.zeros[t] == int((x == 0).sum())
        assert stats.nonfinite[t] == int((~torch.isfinite(x)).sum())


def test_output_gradients_are_unscaled_as_gradscaler_does_and_pieces_count_as_one_tensor():
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(300, generator=g) * 2.0**-20, torch.randn(50, generator=g) * 2.0**-24]
    scale = 3.0 * 2**14  # not a power of two: the reciprocal rounds
    computer = Fp8StatsComputer(["fp8_e4m3", "fp8_e5m2"], Fp8Settings(recipe="current"), divide_by_loss_scale=[False, True])
    x = torch.randn(40, generator=g)
    stats = computer.start([[x], [grads[0] * scale, grads[1] * scale]], loss_scale=torch.tensor(scale)).result()
    unscaled = torch.cat(grads) * scale * torch.tensor(scale, dtype=torch.float64).reciprocal().float()
    assert stats.amax[1] == float(unscaled.abs().max()) and stats.numel[1] == 350
    assert tuple(stats.counts["current"][1]) == by_casting(unscaled, float(stats.scale["current"][1]), "fp8_e5m2")
    assert tuple(stats.counts["current"][0]) == by_casting(x, float(stats.scale["current"][0]), "fp8_e4m3")
    assert (stats.hist[1] == exponent_histogram(unscaled)).all()


def test_scale_arithmetic_is_one_fp32_division_the_same_in_numpy_and_torch():
    rng = np.random.default_rng(3)
    amax = np.concatenate([np.exp2(rng.uniform(-140, 127, 5000)).astype(np.float32),
                           np.float32([0.0, np.inf, np.nan, 1e-45, 448.0, 3.0])])
    for fmt in (FP8_E4M3, FP8_E5M2):
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            direct = np.float32(fmt.max_finite) / amax
        usable = np.isfinite(amax) & (amax > 0)
        for margin, pow2 in ((0, False), (3, False), (0, True), (2, True)):
            got_np = scale_from_reference(amax, fmt, margin, pow2)
            got_torch = scale_from_reference(torch.from_numpy(amax), fmt, margin, pow2, xp=torch).numpy()
            assert got_np.dtype == np.float32 and (got_np.view(np.int32) == got_torch.view(np.int32)).all()
            divided = direct.astype(np.float64) / 2.0**margin
            want = np.where(usable, np.where(np.isfinite(divided), divided, FP32_MAX), 1.0)
            if pow2:
                want = np.where(usable, np.exp2(np.floor(np.log2(want))), 1.0)
            assert (got_np.astype(np.float64) == want.astype(np.float32).astype(np.float64)).all()


def test_delayed_history_on_the_device_equals_the_stored_series_form():
    """H=3 over 9 recorded steps, a tensor absent at two steps, a NaN amax (left out of the history), margin
    and pow2."""
    settings = Fp8Settings(recipe="delayed", history=3, margin=1, pow2=True)
    g = torch.Generator().manual_seed(4)
    computer = Fp8StatsComputer(["fp8_e4m3", "fp8_e5m2"], settings)
    series = ([], [])
    for step in range(9):
        x = torch.randn(20, generator=g) * 2.0 ** (step % 4 * 3)
        if step == 5:
            x[3] = math.nan
        y = torch.randn(10, generator=g) * 2.0 ** -step
        present_y = step not in (2, 3)
        stats = computer.start([[x], [y] if present_y else []]).result()
        series[0].append((x.abs().max().item(), stats.scale["delayed"][0]))
        if present_y:
            series[1].append((y.abs().max().item(), stats.scale["delayed"][1]))
        else:
            assert stats.numel[1] == 0
    for t, fmt in enumerate((FP8_E4M3, FP8_E5M2)):
        amax = np.array([a for a, _ in series[t]], dtype=np.float32)
        scales = np.array([s for _, s in series[t]])
        expected = recipe_scales(amax, "delayed", fmt, settings)
        assert (scales == expected.astype(np.float64)).all(), (t, scales, expected)
    # the window holds the last H finite amaxes: a NaN or inf is its own step's reference only when no finite
    # amax came before it, and never anyone else's
    assert delayed_reference(np.float32([1, np.nan, 2, 3, 4]), 2).tolist() == [1, 1, 1, 2, 3]
    reference = delayed_reference(np.float32([np.inf, np.nan, 5, np.inf, 1, 2]), 2)
    assert np.isinf(reference[0]) and np.isnan(reference[1]) and reference[2:].tolist() == [5, 5, 5, 5]
    assert delayed_reference(np.float32([5, 1, 2]), 4).tolist() == [5, 5, 5]


def test_start_reads_nothing_back(monkeypatch):
    """No per-tensor .item()/float(): the host gets the counts in one copy, at result()."""
    computer = Fp8StatsComputer(["fp8_e4m3"] * 3, Fp8Settings(recipe="both", history=2))
    xs = [[torch.randn(30)], [torch.randn(7), torch.randn(5)], [torch.randn(11)]]
    computer.start(xs).result()

    def refuse(*args):
        raise AssertionError("a value was read back")

    for name in ("item", "__float__", "__int__", "__bool__", "tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    pending = computer.start(xs, loss_scale=torch.tensor(8.0))
    monkeypatch.undo()
    assert pending.result().numel.tolist() == [30, 12, 11]


def test_settings_refuse_bad_options():
    for bad in (dict(recipe="dynamic"), dict(history=0), dict(margin=-1), dict(grad_format="e3m4")):
        with pytest.raises(ValueError, match="--fp8-"):
            Fp8Settings(**bad).validate()


def test_whatif_bounds_from_the_histogram_hold_the_exact_counts():
    """For other scales (another history, margin or format), the stored histogram bounds the counts; a
    binade that no edge crosses after scaling is exact."""
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(3000, generator=g) * 2.0 ** float(torch.randint(-30, 30, (), generator=g)) for _ in range(12)]
    computer = Fp8StatsComputer(["fp8_e4m3"] * 6 + ["fp8_e5m2"] * 6, Fp8Settings(recipe="current"))
    stats = computer.start([[x] for x in tensors]).result()
    for t, x in enumerate(tensors):
        fmt = FP8_E4M3 if t < 6 else FP8_E5M2
        for scale in (float(stats.scale["current"][t]), 2.0 ** (t - 6), 3.0e4, 1e-3):
            bounds = whatif_counts(stats.hist[t], EXP_MIN, scale, fmt)
            exact = by_casting(x, scale, fmt.name)
            for (low, high), count in zip(bounds.values(), exact, strict=True):
                assert low <= count <= high, (t, scale, bounds, exact)
    # 1.5 * 2^j for j = -24 .. 8 after a power-of-two scale: exact counts (14, 4, 0); the binades holding an
    # E4M3 edge (2^-10 itself ties to 0; 2^-6 - 2^-10; 464) stay uncertain, every other one is exact
    x = torch.tensor([1.5 * 2.0**k for k in range(-20, 13)])
    bounds = whatif_counts(exponent_histogram(x), EXP_MIN, 2.0**-4, FP8_E4M3)
    assert by_casting(x, 2.0**-4, "fp8_e4m3") == (14, 4, 0)
    assert bounds == {"underflow": (14, 15), "subnormal": (2, 4), "overflow": (0, 1)}
