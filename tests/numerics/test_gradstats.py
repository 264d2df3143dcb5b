"""Exact gradient statistics against torch casting (the ground truth), not against mpdiag's own output."""

import collections
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import ROOT
from torch.utils._python_dispatch import TorchDispatchMode

from mpdiag.numerics import gradstats
from mpdiag.numerics.formats import EXP_MIN, FP16, LOW_PRECISION, N_EXP_BINS
from mpdiag.numerics.gradstats import NUMBA_AVAILABLE, GradStatsComputer, category_counts_by_casting

BACKENDS = ["torch"] + (["numba"] if NUMBA_AVAILABLE else []) + (["cuda"] if torch.cuda.is_available() else [])


class OnDevice:
    """A GradStatsComputer on the GPU, fed the same CPU test tensors (copied over) and returning host results."""

    def __init__(self, numels):
        self.inner = GradStatsComputer(numels, device="cuda")
        self.backend = self.inner.backend

    def start(self, grads, scale, grads_are_scaled=True):
        scale = scale.cuda() if torch.is_tensor(scale) else scale
        return self.inner.start([g.cuda() for g in grads], scale, grads_are_scaled)

    def compute(self, grads, scale, grads_are_scaled=True):
        return self.start(grads, scale, grads_are_scaled).result()

    @property
    def workspace_bytes(self):
        return self.inner.workspace_bytes


@pytest.fixture(params=BACKENDS)
def computer(request):
    """GradStatsComputer factory for each backend (and the GPU, where there is one): every test below runs
    against each."""
    if request.param == "cuda":
        return OnDevice
    return lambda numels: GradStatsComputer(numels, backend=request.param)


def up(x):
    """The next fp32 value above x."""
    return float(np.nextafter(np.float32(x), np.float32(np.inf)))


def down(x):
    """The next fp32 value below x."""
    return float(np.nextafter(np.float32(x), np.float32(0)))


BF16_OVERFLOW_EDGE = 2.0**127 * (2 - 2**-8)
EDGES = [
    2**-25, up(2**-25), down(2**-25),  # fp16 tie-to-zero edge
    2**-24, 2**-14, 2**-14 * (2047 / 2048), down(2**-14 * (2047 / 2048)),  # fp16 subnormal / normal edge
    65504.0, 65519.99, down(65520.0), 65520.0, 65536.0,  # fp16 overflow edge
    2**-134, up(2**-134), 2**-133, 2**-126 * (255 / 256), down(2**-126 * (255 / 256)), 2**-149, 2**-127,
    2**-126,  # bf16 edges inside fp32's subnormal range
    down(BF16_OVERFLOW_EDGE), BF16_OVERFLOW_EDGE, 3.4e38,  # bf16 overflow edge
    2**-10, up(2**-10), 2**-6 - 2**-10, down(2**-6 - 2**-10), 2**-6,  # fp8_e4m3 underflow and subnormal edges
    448.0, 464.0, up(464.0), 480.0,  # fp8_e4m3 overflow: above 464, where its saturating cast shows nothing
    2**-17, up(2**-17), 2**-14 - 2**-17, down(2**-14 - 2**-17),  # fp8_e5m2 underflow and subnormal edges
    57344.0, down(61440.0), 61440.0,  # fp8_e5m2 overflow edge (the cast gives inf)
    0.0, -0.0, float("inf"), -float("inf"), float("nan"),
]


def sweep(n=100_000, seed=0):
    """Edge values (both signs) plus log-uniform magnitudes over 2^-150 .. 2^128."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.exp2(torch.empty(n, dtype=torch.float64).uniform_(-150, 128, generator=g))
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    edges = torch.tensor(EDGES, dtype=torch.float64)
    return torch.cat([edges, -edges, mags * signs]).float()


def clip_grad_norms_reading(g):
    """``g``'s L2 norm as ``clip_grad_norm_`` reads it (torch's ``get_total_norm``): the recorded per-tensor L2's
    definition. On CUDA a float64 ``linalg.vector_norm`` can differ from it in the last place."""
    return torch.nn.utils.get_total_norm([g])


def reference_hist(x):
    a = x.abs()
    a = a[torch.isfinite(a) & (a > 0)]
    exponents = torch.frexp(a).exponent.numpy() - 1
    return np.bincount(exponents - EXP_MIN, minlength=N_EXP_BINS)


def gradscaler_unscale(x, scale):
    """What GradScaler.unscale_ computes: multiply by the fp32 reciprocal computed in fp64."""
    return x * torch.tensor(scale, dtype=torch.float64).reciprocal().float()


def test_edges_cast_as_reference_says():
    # The reference's rounding edges, checked once so a torch change cannot slip through silently.
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    assert torch.tensor([464.0, up(464.0), 1e30]).to(e4m3).float().tolist() == [448.0] * 3  # saturates
    assert math.isinf(torch.tensor(61440.0).to(e5m2).float().item())
    assert not math.isinf(torch.tensor(down(61440.0)).to(e5m2).float().item())
    assert torch.tensor([2**-10, up(2**-10)]).to(e4m3).float().tolist() == [0.0, 2**-9]
    assert torch.tensor([2**-17, up(2**-17)]).to(e5m2).float().tolist() == [0.0, 2**-16]
    assert torch.tensor(2**-25).half().item() == 0
    assert torch.tensor(up(2**-25)).half().item() == 2**-24
    assert math.isinf(torch.tensor(BF16_OVERFLOW_EDGE).bfloat16().item())
    assert not math.isinf(torch.tensor(down(BF16_OVERFLOW_EDGE)).bfloat16().item())
    assert torch.tensor(65519.99).half().item() == 65504
    assert math.isinf(torch.tensor(65520.0).half().item())
    assert torch.tensor(2**-134).bfloat16().item() == 0


def assert_counts_equal_casting(stats, g, scaled, t=0):
    """Tensor ``t``'s counts in ``stats`` equal casting ``g`` (unscaled) and ``scaled`` (S*g)."""
    for fmt in LOW_PRECISION.values():
        for values, suffix in ((g, ""), (scaled, "_at_scale")):
            expected = category_counts_by_casting(values, fmt)
            got = {k: int(stats.counts[f"{fmt.name}_{k}{suffix}"][t]) for k in expected}
            assert got == expected, (fmt.name, suffix)
    assert (stats.hist[t] == reference_hist(g)).all()
    assert stats.counts["zeros"][t] == int((g == 0).sum())
    assert stats.counts["nan"][t] == int(g.isnan().sum())
    assert stats.counts["posinf"][t] == int((g == float("inf")).sum())
    assert stats.counts["neginf"][t] == int((g == -float("inf")).sum())


@pytest.mark.parametrize("scale", [1.0, 2.0**16, 2.0**-3, 1000.0, 3.0e9])
def test_counts_equal_casting(scale, computer):
    x = sweep()
    stats = computer([x.numel()]).compute([x], scale, grads_are_scaled=True)
    g = gradscaler_unscale(x, scale) if scale != 1.0 else x
    assert_counts_equal_casting(stats, g, x)
    assert stats.other_view == ("same" if scale == 1.0 else "recomputed")  # the sweep reaches fp32 subnormals


@pytest.mark.parametrize("scale", [2.0**16, 2.0**-3, 2.0**100])
@pytest.mark.parametrize("already_unscaled", [False, True])
def test_power_of_two_scales_shift_one_pass_exactly(scale, already_unscaled, computer):
    """Values that stay fp32-normal under the scale: the other view is the same counts shifted, and still
    equals casting; values pushed past fp32's range become inf in both."""
    x = sweep(50_000, seed=3)
    x = x[~((x.abs() < 2.0**-126 * max(scale, 1 / scale)) & (x != 0))]  # nothing becomes an fp32 subnormal
    comp = computer([x.numel()])
    stats = comp.compute([x], scale, grads_are_scaled=not already_unscaled)
    # torch never reads counts back to choose (that would synchronise with the device): it multiplies
    assert stats.other_view == {"numba": "shifted", "torch": "recomputed"}[comp.backend]
    g, scaled = (x, x * scale) if already_unscaled else (gradscaler_unscale(x, scale), x)
    assert_counts_equal_casting(stats, g, scaled)
    finite = g[torch.isfinite(g)]
    np.testing.assert_equal(stats.absmax[0], g.abs().max().item())  # NaN when g holds one, like torch's max
    assert stats.min_nonzero[0] == finite[finite != 0].abs().min().item()


def test_every_edge_value_alone_matches_casting(computer):
    # One tensor per edge value makes an off-by-one at any single edge visible as a count of exactly 1.
    values = [torch.tensor([v], dtype=torch.float32) for v in EDGES]
    stats = computer([1] * len(values)).compute(values, 1.0)
    for t, v in enumerate(values):
        for fmt in LOW_PRECISION.values():
            expected = category_counts_by_casting(v, fmt)
            got = {k: int(stats.counts[f"{fmt.name}_{k}"][t]) for k in expected}
            assert got == expected, (EDGES[t], fmt.name)


def test_already_unscaled_grads_give_scaled_counts_by_multiplying(computer):
    g = sweep(20_000, seed=1)
    stats = computer([g.numel()]).compute([g], 2.0**10, grads_are_scaled=False)
    scaled = g * 2.0**10
    for fmt in LOW_PRECISION.values():
        expected = category_counts_by_casting(scaled, fmt)
        assert {k: int(stats.counts[f"{fmt.name}_{k}_at_scale"][0]) for k in expected} == expected
        expected = category_counts_by_casting(g, fmt)
        assert {k: int(stats.counts[f"{fmt.name}_{k}"][0]) for k in expected} == expected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_grads_are_counted_exactly(dtype, computer):
    g = (torch.randn(5000, generator=torch.Generator().manual_seed(2)) * 1e-3).to(dtype)
    stats = computer([g.numel()]).compute([g], 1.0)
    assert (stats.hist[0] == reference_hist(g.float())).all()
    assert stats.counts["fp16_underflow"][0] == category_counts_by_casting(g.float(), FP16)["underflow"]


def test_reductions_and_multiple_tensors(computer):
    a = torch.tensor([0.0, -3.0, 2.0**-140, 5.0])
    b = torch.zeros(7)
    c = torch.tensor([1.0, float("nan")])
    big = torch.randn(3 * 2**17 + 5, generator=torch.Generator().manual_seed(4))  # several numba chunks
    stats = computer([4, 7, 2, big.numel()]).compute([a, b, c, big], 1.0)
    assert stats.absmax[0] == 5.0 and stats.min_nonzero[0] == 2.0**-140
    assert stats.l2[0] == pytest.approx(float(torch.linalg.vector_norm(a)))
    assert math.isnan(stats.min_nonzero[1]) and stats.absmax[1] == 0 and stats.counts["zeros"][1] == 7
    assert math.isnan(stats.absmax[2]) and stats.min_nonzero[2] == 1.0 and stats.counts["nan"][2] == 1
    assert stats.hist[0][-140 - EXP_MIN] == 1  # an fp32 subnormal lands in its exact bin
    assert stats.absmax[3] == big.abs().max().item() and stats.min_nonzero[3] == big.abs().min().item()
    assert stats.l2[3] == pytest.approx(float(torch.linalg.vector_norm(big.double())), rel=1e-6)
    assert (stats.hist[3] == reference_hist(big)).all()


@pytest.mark.parametrize("parallel", [False, True])
def test_tensors_split_into_work_items_still_equal_casting(computer, parallel, monkeypatch):
    """Tensors larger than one numba work item (2**17 values), with odd lengths and edge values in every
    item: the per-item counts and reductions must combine to the whole tensor's, whether numba runs the
    items on one thread (as at this size) or in parallel."""
    if parallel:
        monkeypatch.setattr(gradstats, "PARALLEL_FROM", 0)
    x = sweep(3 * 2**17, seed=5)
    x[-2] = float("nan")  # in the last work item, after the others' absmax
    y = sweep(2**17 + 1, seed=6)
    tensors = [x[:7], x, y]
    stats = computer([v.numel() for v in tensors]).compute(tensors, 2.0**16, grads_are_scaled=True)
    for t, scaled in enumerate(tensors):
        g = gradscaler_unscale(scaled, 2.0**16)
        assert_counts_equal_casting(stats, g, scaled, t)
        np.testing.assert_equal(stats.absmax[t], g.abs().max().item())  # NaN in x's last item wins
        assert stats.min_nonzero[t] == g[g != 0].abs().nan_to_num(nan=float("inf")).min().item()
        np.testing.assert_allclose(stats.l2[t], torch.linalg.vector_norm(g.double()).item(), rtol=1e-12)


def test_scale_as_a_tensor_and_gradients_changed_after_start(computer):
    """GradScaler's own scale tensor works as the scale, and what start() returns does not depend on the
    gradients after it returned (the torch backend has already gathered them on the device)."""
    x = sweep(30_000, seed=8)
    scale = torch.tensor(1000.0)  # not a power of two: GradScaler's fp32 reciprocal decides the roundings
    empty = torch.zeros(0)
    pending = computer([0, x.numel()]).start([empty, x], scale, grads_are_scaled=True)
    original = x.clone()
    x.fill_(1.0)
    stats = pending.result()
    assert_counts_equal_casting(stats, gradscaler_unscale(original, 1000.0), original, t=1)
    assert stats.absmax[0] == 0 and math.isnan(stats.min_nonzero[0]) and stats.l2[0] == 0
    assert stats.hist[0].sum() == 0 and stats.counts["zeros"][0] == 0


def test_torch_backend_segments_equal_casting(monkeypatch):
    """The torch backend gathers at most SEGMENT values at once; tensors spread over several segments
    (one larger than a segment, empty ones between) still equal casting, and its workspaces stay bounded."""
    monkeypatch.setattr(gradstats, "SEGMENT", 5000)
    tensors = [sweep(3000, seed=9)[:3000], torch.zeros(0), sweep(1500, seed=10)[:1500], sweep(12_000, seed=11),
               torch.zeros(0), sweep(10, seed=12)[:10]]
    comp = GradStatsComputer([t.numel() for t in tensors], backend="torch")
    stats = comp.compute(tensors, 2.0**12)
    for t, scaled in enumerate(tensors):
        g = gradscaler_unscale(scaled, 2.0**12)
        assert_counts_equal_casting(stats, g, scaled, t)
        if scaled.numel():
            np.testing.assert_equal(stats.absmax[t], g.abs().max().item())
    largest_segment = tensors[3].numel()  # alone: larger than a segment
    counts = 4 * 2 * len(tensors) * 2 * gradstats.BUCKETS  # per view, tensor, sign and bucket
    decoded = 4 * 2 * len(tensors) * (gradstats.DECODED_COLUMNS + 1)  # per view and tensor, decoded on the device
    assert comp.workspace_bytes == 16 * largest_segment + counts + decoded


def test_torch_backend_work_does_not_grow_with_tensors_and_never_reads_a_scalar():
    """The GPU design, checked on its CPU twin: the torch ops start() issues (metadata ops aside) are the
    same for 3 tensors and for 78, and none reads a value back to the host (.item() is _local_scalar_dense)."""
    metadata = {"detach", "view", "slice", "select", "lift_fresh", "alias", "_reshape_alias"}

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    issued = []
    for n in (3, 78):
        grads = [torch.randn(100, generator=torch.Generator().manual_seed(t)) for t in range(n)]
        comp = GradStatsComputer([100] * n, backend="torch")
        with Ops() as ops:
            comp.start(grads, torch.tensor(2.0**10))  # GradScaler's scale as a tensor, as on a GPU
        issued.append({name: k for name, k in ops.seen.items() if name not in metadata})
    assert issued[0] == issued[1]
    assert "_local_scalar_dense" not in issued[1] and "index_add_" in issued[1]


def test_workspace_is_reused_across_steps(computer):
    comp = computer([1000])
    before = comp.workspace_bytes
    for seed in range(3):
        x = torch.randn(1000, generator=torch.Generator().manual_seed(seed))
        stats = comp.compute([x], 2.0**8)
        assert (stats.hist[0] == reference_hist(gradscaler_unscale(x, 2.0**8))).all()
    assert comp.workspace_bytes == before  # a power-of-two scale needs no buffer for the other view


def test_wrong_sizes_are_refused(computer):
    with pytest.raises(ValueError, match="sizes"):
        computer([3]).compute([torch.zeros(4)], 1.0)


def test_torch_backend_launches_do_not_grow_with_tensors():
    """Every top-level operator the torch backend dispatches is a launch on a GPU (a per-tensor flatten too):
    their number is the same for 3 tensors and for 200."""
    launches = []
    for n in (3, 200):
        grads = [torch.randn(8, 4, generator=torch.Generator().manual_seed(t)) for t in range(n)]
        comp = GradStatsComputer([32] * n, backend="torch")
        comp.compute(grads, 2.0**10)  # the first call makes the workspaces' views
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            comp.compute(grads, 2.0**10)
        launches.append(sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None))
    assert launches[0] == launches[1]


@pytest.mark.skipif(not NUMBA_AVAILABLE, reason="compares the numba backend with the torch one")
@pytest.mark.parametrize("scale", [1.0, 2.0**16, 1000.0])
def test_many_small_tensors_equal_across_backends_and_casting(scale):
    """Hundreds of small tensors of mixed shapes and dtypes (gathered by one copy into shaped views; one
    non-contiguous, one empty, one large enough to be read in place): both backends give the same
    statistics, and they equal casting. At 2**16 no value is near fp32's subnormals, so numba shifts."""
    values = sweep(200_000, seed=13)
    if scale == 2.0**16:
        values = values[~((values.abs() < 2.0**-100) & (values != 0))]
    shapes = [(64, 64), (64,), (3, 5, 7), (1,), (0,), (2**17 + 3,)] * 4 + [(17, 9)] * 300
    grads, at = [], 0
    for shape in shapes:  # consecutive slices of the sweep, wrapping around
        size = math.prod(shape)
        start = at % (values.numel() - size)
        grads.append(values[start : start + size].reshape(shape).clone())
        at += size
    grads[5] = grads[5].half().float()  # an FP16-representable tensor kept as FP32
    grads[1] = grads[1].half()
    grads[0] = grads[0].t()  # non-contiguous
    numels = [g.numel() for g in grads]
    stats = {backend: GradStatsComputer(numels, backend=backend).compute(grads, scale) for backend in ("torch", "numba")}
    for name in stats["torch"].counts:
        np.testing.assert_array_equal(stats["numba"].counts[name], stats["torch"].counts[name], err_msg=name)
    for field in ("hist", "absmax", "min_nonzero"):
        np.testing.assert_array_equal(getattr(stats["numba"], field), getattr(stats["torch"], field), err_msg=field)
    np.testing.assert_allclose(stats["numba"].l2, stats["torch"].l2, rtol=1e-12)
    assert stats["numba"].other_view == {1.0: "same", 2.0**16: "shifted", 1000.0: "recomputed"}[scale]
    for t in (0, 1, 2, 4, 5, len(grads) - 1):
        scaled = grads[t].float().reshape(-1)
        g = gradscaler_unscale(scaled, scale) if scale != 1.0 else scaled
        assert_counts_equal_casting(stats["numba"], g, scaled, t)


def small_and_large_tensors(small: int, seed: int = 14) -> list[torch.Tensor]:
    """``small`` tensors of 1-400 values (slices of the sweep, one holding a NaN, every 37th empty), then an
    all-zero, a NaN-only, an inf-only and an fp32-subnormal-only one, and tensors of exactly one chunk of the
    torch backend's per-tensor reductions, one value more, several chunks (its smallest value and a NaN in
    different chunks) and an all-zero one of several chunks."""
    values = sweep(100_000, seed=seed)
    sizes = torch.randint(1, 401, (small,), generator=torch.Generator().manual_seed(seed)).tolist()
    starts = torch.cumsum(torch.tensor([0, *sizes[:-1]]), 0) % (values.numel() - 400)
    tensors = [values[start : start + size].clone() for start, size in zip(starts.tolist(), sizes, strict=True)]
    tensors[3][-1] = float("nan")
    tensors[1::37] = [torch.zeros(0)] * len(tensors[1::37])
    chunk = gradstats.REDUCE_CHUNK
    several = sweep(3 * chunk + 5, seed=seed + 1)[: 3 * chunk + 5]
    several[several.abs() < 2.0**-120] = 1.0
    several[chunk + 7] = 2.0**-140  # its smallest non-zero magnitude, in the second chunk
    several[-2] = float("nan")
    return [*tensors, torch.zeros(50), torch.full((9,), float("nan")), torch.tensor([float("inf"), -float("inf")]),
            torch.tensor([2.0**-149, -(2.0**-130), 0.0]), sweep(chunk, seed=seed + 2)[:chunk],
            sweep(chunk + 1, seed=seed + 3)[: chunk + 1], several, torch.zeros(2 * chunk + 3)]


def reference_min_nonzero(g: torch.Tensor) -> float:
    """The smallest non-zero magnitude by torch's own comparisons: NaN only when there is none but NaN."""
    magnitudes = g[g != 0].abs()
    ordered = magnitudes[~magnitudes.isnan()]
    return ordered.min().item() if ordered.numel() else math.nan


TORCH_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.skipif(not NUMBA_AVAILABLE, reason="compares the numba backend with the torch one")
@pytest.mark.parametrize("scale", [1.0, 2.0**16, 1000.0])
@pytest.mark.parametrize("device", TORCH_DEVICES)
def test_torch_backend_reductions_per_segment_equal_numba_and_casting(scale, device):
    """The torch backend's whole-segment reductions (per chunk, then per tensor) on many small tensors and a
    few large ones, special values and empty tensors included: the same statistics as the numba backend, the
    counts equal to casting, absmax, min_nonzero and l2 equal to torch's own reductions of the unscaled g, and
    the same bits when run twice (on the GPU too, where atomics would break that)."""
    grads = small_and_large_tensors(150)
    numels = [g.numel() for g in grads]
    torch_backend = OnDevice(numels) if device == "cuda" else GradStatsComputer(numels, backend="torch")
    stats = {"torch": torch_backend.compute(grads, scale),
             "numba": GradStatsComputer(numels, backend="numba").compute(grads, scale)}
    for name in stats["torch"].counts:
        np.testing.assert_array_equal(stats["numba"].counts[name], stats["torch"].counts[name], err_msg=name)
    for field in ("hist", "absmax", "min_nonzero"):
        np.testing.assert_array_equal(getattr(stats["numba"], field), getattr(stats["torch"], field), err_msg=field)
    np.testing.assert_allclose(stats["numba"].l2, stats["torch"].l2, rtol=1e-12)
    again = torch_backend.compute(grads, scale)
    for field in ("absmax", "min_nonzero", "l2"):
        assert getattr(again, field).tobytes() == getattr(stats["torch"], field).tobytes(), field
    for t, scaled in enumerate(grads):
        g = gradscaler_unscale(scaled, scale) if scale != 1.0 else scaled
        assert_counts_equal_casting(stats["torch"], g, scaled, t)
        np.testing.assert_equal(stats["torch"].absmax[t], g.abs().max().item() if g.numel() else 0.0)
        np.testing.assert_equal(stats["torch"].min_nonzero[t], reference_min_nonzero(g))
        np.testing.assert_allclose(stats["torch"].l2[t], torch.linalg.vector_norm(g.double()).item(), rtol=1e-12)


@pytest.mark.parametrize("device", TORCH_DEVICES)
def test_torch_backend_makes_no_per_tensor_objects(device):
    """The host work of the GPU path (and of its CPU twin): at 20 and at 200 small tensors (beside a few large
    ones) start() dispatches the same operators, metadata ones included, and they return the same number of
    tensors (a per-tensor reduction returns a 0-dim tensor a tensor, each costing host time)."""

    class Dispatched(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.returned = collections.Counter(), 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops[func.overloadpacket.__name__] += 1
            self.returned += sum(1 for x in (out if isinstance(out, (list, tuple)) else [out]) if torch.is_tensor(x))
            return out

    seen = []
    for small in (20, 200):
        grads = [g.to(device) for g in small_and_large_tensors(small)]
        comp = GradStatsComputer([g.numel() for g in grads], device, backend="torch")
        comp.compute(grads, 2.0**10)  # the first call makes the workspaces' views
        with Dispatched() as dispatched:
            comp.start(grads, torch.tensor(2.0**10, device=device))
        seen.append((dispatched.ops, dispatched.returned))
    assert seen[0] == seen[1]


class DispatchedOps(TorchDispatchMode):
    """Counts the aten operators dispatched while active (a CUDA graph's replay dispatches none)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


#: (scale, grads_are_scaled) step after step: numbers and GradScaler's tensor, S*g and unscaled, scale 1 between
CUDA_GRAPH_STEPS = [(2.0**16, True), (1000.0, True), ("tensor", 2.0**15, True), (1.0, True), (2.0**16, True),
                    (3.0, False), ("tensor", 2.0**-3, False), (1.0, True), (2.0**20, True)]


def as_scale(step):
    return torch.tensor([step[1]], device="cuda") if step[0] == "tensor" else step[0]


def assert_same_stats(got, expected):
    """Every field of two StepGradStats the same, bit for bit."""
    assert got.other_view == expected.other_view
    assert got.counts.keys() == expected.counts.keys()
    for name in expected.counts:
        np.testing.assert_array_equal(got.counts[name], expected.counts[name], err_msg=name)
    for field in ("hist", "absmax", "min_nonzero", "l2"):
        assert getattr(got, field).tobytes() == getattr(expected, field).tobytes(), field


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_equal_a_first_pass_step_after_step_and_launch_almost_nothing():
    """On CUDA a computer runs its first step op by op and captures it in a CUDA graph; later steps replay it.
    Over steps whose values and scales change (a number and GradScaler's tensor, S*g and unscaled gradients,
    scale 1 between), every step equals a fresh computer's op-by-op first step bit for bit and its counts equal
    casting; a replayed step dispatches a handful of operators (the gather, the factor, the copy to the host),
    where the same pass op by op (the CPU twin) dispatches dozens."""
    base = small_and_large_tensors(150)
    numels = [g.numel() for g in base]
    generator = torch.Generator().manual_seed(3)
    computer = GradStatsComputer(numels, device="cuda")
    for k, step in enumerate(CUDA_GRAPH_STEPS):
        grads = [(g * (1 + torch.rand(g.shape, generator=generator)) * 2.0 ** (k - 4)).cuda() for g in base]
        scale, grads_are_scaled = as_scale(step), step[-1]
        got = computer.compute(grads, scale, grads_are_scaled)
        assert_same_stats(got, GradStatsComputer(numels, device="cuda").compute(grads, scale, grads_are_scaled))
        for t in (0, 3, 150, len(base) - 2):
            held = grads[t].cpu()
            value = step[1] if step[0] == "tensor" else step[0]
            g, scaled = ((gradscaler_unscale(held, value), held) if grads_are_scaled
                         else (held, held * torch.tensor(value, dtype=torch.float32)))
            assert_counts_equal_casting(got, g, g if value == 1.0 else scaled, t)
    assert computer._graphs is not None and sorted(computer._graphs) == [1, 2]  # both captured, none failed
    with DispatchedOps() as replayed:
        computer.start(grads, 2.0**16)
    twin = GradStatsComputer(numels, backend="torch")
    twin.compute([g.cpu() for g in grads], 2.0**16)
    with DispatchedOps() as op_by_op:
        twin.start([g.cpu() for g in grads], 2.0**16)
    assert replayed.count <= 10 < 30 <= op_by_op.count, (replayed.count, op_by_op.count)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_that_cannot_be_captured_is_said_once_and_the_steps_are_computed_op_by_op(monkeypatch):
    """A capture that fails (an operator that synchronises, in some torch version) is said in one warning; that
    step and the later ones are computed op by op, equal to a computer that captured."""

    def refused(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    base = small_and_large_tensors(40)
    numels = [g.numel() for g in base]
    captured = GradStatsComputer(numels, device="cuda")
    steps = [[(g * (k + 1)).cuda() for g in base] for k in range(3)]
    expected = [captured.compute(grads, 2.0**16) for grads in steps]
    monkeypatch.setattr(torch.cuda, "graph", refused)
    failing = GradStatsComputer(numels, device="cuda")
    with pytest.warns(UserWarning, match="could not be captured") as said:
        results = [failing.compute(grads, 2.0**16) for grads in steps]
    assert len(said) == 1 and failing._graphs is None
    for got, want in zip(results, expected, strict=True):
        assert_same_stats(got, want)


@pytest.mark.skipif(not NUMBA_AVAILABLE, reason="hold() is the numba backend's")
@pytest.mark.parametrize("scale", [1.0, 2.0**16, 2.0**-3, 1000.0, 3.0e9])
@pytest.mark.parametrize("already_unscaled", [False, True])
def test_a_held_step_counts_its_signals_by_casting_and_its_statistics_later_from_its_copy(scale, already_unscaled):
    """hold(): the light pass's nan/inf counts of g and FP16/BF16 underflow/overflow counts of S*g equal torch's
    casts; the full statistics computed later come from the copy, though the gradients changed since."""
    x = sweep()
    small = [torch.randn(300, generator=torch.Generator().manual_seed(1)).half(),
             (torch.randn(64, generator=torch.Generator().manual_seed(2)) * 1e-30).bfloat16()]
    grads = [x, *small]
    computer = GradStatsComputer([g.numel() for g in grads], backend="numba")
    held = computer.hold(grads, scale, grads_are_scaled=not already_unscaled).result()
    truths = []
    for t, held_values in enumerate(grads):
        values = held_values.float().clone()
        if already_unscaled:
            g, scaled = values, values * torch.tensor(scale, dtype=torch.float32)
        else:
            g, scaled = (gradscaler_unscale(values, scale) if scale != 1.0 else values), values
        truths.append((g, scaled))
        for fmt in gradstats.SIGNAL_FORMATS:
            expected = category_counts_by_casting(scaled, LOW_PRECISION[fmt])
            for kind in ("underflow", "overflow"):
                assert held.counts[f"{fmt}_{kind}_at_scale"][t] == expected[kind], (t, fmt, kind)
        assert held.counts["nan"][t] == int(g.isnan().sum())
        assert held.counts["posinf"][t] == int((g == float("inf")).sum())
        assert held.counts["neginf"][t] == int((g == -float("inf")).sum())
    for g in grads:
        g.zero_()  # the loop's next step: the held copy is what counts
    stats = held.stats()
    for t, (g, scaled) in enumerate(truths):
        assert_counts_equal_casting(stats, g, scaled, t)


@pytest.mark.skipif(not NUMBA_AVAILABLE, reason="hold() is the numba backend's")
def test_a_held_copy_is_reused_once_its_step_is_gone():
    grads = [torch.randn(10), torch.randn(20)]
    computer = GradStatsComputer([10, 20], backend="numba")
    first = computer.hold(grads, 1.0).result()
    second = computer.hold(grads, 1.0).result()
    assert computer._held_pool == []
    del first
    third = computer.hold(grads, 1.0).result()  # the first step's copy, not a new one
    assert computer._held_pool == [] and second.stats().l2.tolist() == third.stats().l2.tolist()
    del second, third
    assert len(computer._held_pool) == 2


def test_the_kernels_leave_torch_on_the_threads_the_script_gave_it():
    """numba's OpenMP layer sets the launching thread's OpenMP thread count to numba's own at each parallel launch,
    and torch shares that runtime: a script's ``torch.set_num_threads(1)`` became 2 (numba's) after mpdiag's first
    parallel statistics pass or update count. Each parallel kernel (statistics, the light signals pass, update
    counts) must leave torch on the script's count, and numba on the script's own where it set one. In a child:
    thread counts are process state, and numba's must be 2 there (the suite runs it on 1)."""
    code = textwrap.dedent("""
        import torch
        from mpdiag.numerics.gradstats import GradStatsComputer
        from mpdiag.numerics.updates import UpdateTracker
        seen = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            grads = [torch.randn(1 << 22, generator=torch.Generator().manual_seed(threads))]  # parallel from 2**22
            computer = GradStatsComputer([grads[0].numel()])
            computer.compute(grads, 1000.0)
            after_statistics = torch.get_num_threads()
            computer.hold(grads, 1024.0)
            after_signals = torch.get_num_threads()
            weight = torch.nn.Parameter(torch.ones(1000))
            weight.grad = torch.full_like(weight, 1e-3)
            tracker = UpdateTracker([weight], "fp16")
            tracker.before(0)
            with torch.no_grad():
                weight.sub_(1e-5)
            tracker.after()
            seen.append([after_statistics, after_signals, torch.get_num_threads()])
        import numba
        numba.set_num_threads(1)  # the script's own, lower than torch's 2: kept, and a cap for mpdiag's kernels
        computer.compute(grads, 1000.0)
        computer.hold(grads, 1024.0)
        tracker.before(1)
        tracker.after()
        print(seen, numba.get_num_threads(), torch.get_num_threads())
    """)
    env = {**os.environ, "NUMBA_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[[1, 1, 1], [2, 2, 2]] 1 2"


def test_float64_values_beyond_fp32s_range_count_as_torchs_casts_of_them(computer):
    """A float64 gradient holds finite values FP32 cannot (1e39, 1e-50): torch's casts of them to FP16, BF16 and
    FP8 overflow and underflow (they go through FP32), so they are counted so, not as inf or zero, and absmax,
    min_nonzero and l2 are the float64 values' own. The casts below are of the float64 tensor itself."""
    g = torch.cat([torch.tensor([1e39, -1e39, 1e300, 1e-50, -1e-300, 0.0, float("inf"), float("nan")],
                                dtype=torch.float64), sweep(5_000, seed=5).double()])
    plain = torch.randn(7, dtype=torch.float64)  # in range: its reductions too are the float64 values' own
    stats = computer([g.numel(), plain.numel()]).compute([g, plain], 1.0)
    finite_nonzero = g.isfinite() & (g != 0)
    for fmt in LOW_PRECISION.values():
        cast = g.to(fmt.dtype).double()
        over = cast.isinf() if fmt.overflow_above is None else g.abs() > fmt.overflow_above
        expected = {"underflow": finite_nonzero & (cast == 0), "overflow": finite_nonzero & over,
                    "subnormal": finite_nonzero & (cast != 0) & (cast.abs() < fmt.min_normal)}
        got = {k: int(stats.counts[f"{fmt.name}_{k}"][0]) for k in expected}
        assert got == {k: int(v.sum()) for k, v in expected.items()}, fmt.name
    assert [int(stats.counts[k][0]) for k in ("zeros", "posinf", "neginf", "nan")] == [
        int((g == 0).sum()), int(g.isposinf().sum()), int(g.isneginf().sum()), int(g.isnan().sum())]
    assert stats.hist[0].sum() == int((finite_nonzero).sum())  # each finite non-zero value in one bin
    assert math.isnan(stats.absmax[0]) and math.isnan(stats.l2[0])  # it holds a NaN
    assert stats.min_nonzero[0] == 1e-300
    assert stats.l2[1] == float(clip_grad_norms_reading(plain)) and stats.absmax[1] == float(plain.abs().max())
    assert stats.min_nonzero[1] == float(plain.abs().min())
    finite = g[g.isfinite()]
    stats = computer([finite.numel()]).compute([finite], 1.0)
    assert stats.absmax[0] == 1e300 and stats.l2[0] == float(clip_grad_norms_reading(finite))
