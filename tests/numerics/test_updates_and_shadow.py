"""Weight-update swamping counts and the FP32 shadow, checked against ground truth computed here
independently: float64 arithmetic and torch's own FP16 rounding, not the code under test."""


import numpy as np
import pytest
import torch
from conftest import EXAMPLES
from torch import nn

from mpdiag import Recorder, Store
from mpdiag.analysis.summaries import shadow_ranking, update_shares
from mpdiag.numerics.updates import UpdateTracker
from mpdiag.recording.background import BackgroundWriter
from mpdiag.recording.run import Run
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript

# multiples of the FP16 resolution 2^-11·|w|, kept away from 1 so FP32 rounding of w + u cannot flip a side
MULTIPLES = [0.25, 0.5, 0.9, 1.1, 2.0, 4.0, 16.0]


def one_update(weights: torch.Tensor, update: torch.Tensor, grad_mask: torch.Tensor, store_path, fmt="fp16"):
    """Apply w += update through an optimizer step (SGD, lr 1, grad = -update) under a Recorder tracking
    updates against ``fmt``; returns the stored per-tensor counts (updated, below_resolution, unchanged)."""
    model = nn.Linear(weights.numel(), 1, bias=False).to(weights.dtype)
    with torch.no_grad():
        model.weight.copy_(weights.view(1, -1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    rec = Recorder(model, store=store_path, optimizer=optimizer, update_format=fmt)
    model.weight.grad = torch.where(grad_mask, -update, torch.zeros_like(update)).view(1, -1).to(weights.dtype)
    rec.record(0.0)
    optimizer.step()
    rec.close()
    row = Store(store_path).update_stats(rec.run_id).iloc[0]
    return int(row["updated"]), int(row["below_resolution"]), int(row["unchanged"]), model.weight.detach().view(-1)


def test_fp32_master_updates_below_fp16_resolution_are_counted_exactly(store_path):
    gen = torch.Generator().manual_seed(0)
    w = (torch.rand(len(MULTIPLES) * 50, generator=gen, dtype=torch.float64) + 0.1) * torch.where(
        torch.rand(len(MULTIPLES) * 50, generator=gen) < 0.5, -1.0, 1.0).double()
    k = torch.tensor(MULTIPLES, dtype=torch.float64).repeat(50)
    u = k * 2.0**-11 * w.abs() * torch.where(torch.arange(w.numel()) % 3 == 0, -1.0, 1.0).double()
    mask = torch.arange(w.numel()) % 7 != 0  # a zero gradient: not an update
    updated, below, unchanged, _ = one_update(w.float(), u.float(), mask, store_path)
    assert updated == int(mask.sum())
    assert below == int((mask & (k < 1)).sum())  # the rule |u| < 2^-11 |w|, decided in float64
    assert unchanged == 0  # FP32 keeps every one of them


def test_fp16_weights_lose_exactly_the_updates_fp16_rounding_drops(store_path):
    gen = torch.Generator().manual_seed(1)
    w = ((torch.rand(700, generator=gen) + 0.05) * 8).half()
    k = torch.tensor(MULTIPLES).repeat(100)
    u = (k * 2.0**-11 * w.float().abs()).half()
    mask = torch.ones(700, dtype=torch.bool)
    updated, below, unchanged, after = one_update(w, u, mask, store_path)
    lost = (w.float() + u.float()).half() == w  # torch's own FP16 rounding of the sum
    assert updated == 700 and unchanged == int(lost.sum()) and 0 < unchanged < 700
    assert below == unchanged  # with FP16 weights "below resolution" is exactly "lost"
    assert torch.equal(after == w, lost)


def test_skipped_steps_record_no_updates(store_path, arrival):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    rec = Recorder(model, store=store_path, scaler=scaler, optimizer=optimizer, update_format="fp16")
    for step in range(3):
        optimizer.zero_grad()
        loss = model(torch.ones(3, 4)).sum()
        scaler.scale(loss).backward()
        if step == 1:
            model.bias.grad[0] = float("inf")
        rec.record(loss)
        scaler.step(optimizer)
        scaler.update()
    rec.close()
    stats = Store(store_path).update_stats(rec.run_id)
    assert sorted(stats["step"].unique()) == [0, 2]
    assert Store(store_path).steps(rec.run_id)["skipped"].tolist() == [0, 1, 0]


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "fp16"), (torch.float16, "fp16"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("contiguous", [True, False])  # the numba kernel, and the torch path it falls back to
def test_update_counts_equal_float64_arithmetic(dtype, fmt, contiguous):
    """Large tensors (several numba work items), updates spread around the resolution, zero / NaN / inf
    gradients: the counts equal the rule evaluated in float64 on the stored values."""
    gen = torch.Generator().manual_seed(7)
    n = 2 * 2**17 + 3
    resolution = 2.0 ** -(11 if fmt == "fp16" else 8)
    w = (torch.randn(n, generator=gen, dtype=torch.float64) * 4).to(dtype)
    k = torch.exp2(torch.empty(n, dtype=torch.float64).uniform_(-4, 4, generator=gen))
    new = (w.double() + k * resolution * w.double().abs() * torch.randn(n, generator=gen).sign()).to(dtype)
    grad = torch.randn(n, generator=gen).to(dtype)
    grad[::11], grad[5], grad[7] = 0, float("nan"), float("-inf")
    shape = (3, n // 3) if contiguous else (n // 3, 3)
    target = w[: n // 3 * 3].view(shape).clone()
    target = target if contiguous else target.t().contiguous().t()  # same values, transposed layout
    target.grad = grad[: n // 3 * 3].view(shape).clone()
    tracker = UpdateTracker([target], fmt)
    tracker.before(4)
    with torch.no_grad():
        target.copy_(new[: n // 3 * 3].view(shape))
    tracker.after()
    [(step, [counts])] = tracker.take()
    old, now, g = (x[: n // 3 * 3].double() for x in (w, new, grad))
    moved = g.isfinite() & (g != 0)
    expected = [int(moved.sum()), int((moved & ((now - old).abs() < resolution * old.abs())).sum()),
                int((moved & (now == old)).sum())]
    assert step == 4 and counts == expected
    assert 0 < expected[1] < expected[0] and (expected[2] > 0) == (dtype != torch.float32)  # the data reaches every count


def test_a_target_rebound_to_another_dtype_is_counted_by_its_values_not_read_as_the_old_type():
    """The numba kernel reads its snapshots and the targets by address as the dtype it was built for; a parameter
    whose data was rebound to FP16 after (``p.data = p.data.half()``) is counted by the torch path, and the counts
    equal the rule in float64 on the values before and after the step."""
    gen = torch.Generator().manual_seed(3)
    target = torch.nn.Parameter(torch.randn(4096, generator=gen) * 4)
    tracker = UpdateTracker([target], "fp16")
    assert tracker._kernel is not None  # built for float32: the kernel path
    target.data = target.data.half()
    target.grad = torch.randn(4096, generator=gen).half()
    tracker.before(0)
    old = target.detach().double().clone()
    with torch.no_grad():
        spread = torch.exp2(torch.empty(4096).uniform_(-3, 3, generator=gen)) * torch.randn(4096, generator=gen).sign()
        target.add_((target.float().abs() * 2.0**-11 * spread).half())  # steps around FP16's resolution
    tracker.after()
    [(_, [counts])] = tracker.take()
    now, g = target.detach().double(), target.grad.double()
    moved = g.isfinite() & (g != 0)
    expected = [int(moved.sum()), int((moved & ((now - old).abs() < 2.0**-11 * old.abs())).sum()),
                int((moved & (now == old)).sum())]
    assert counts == expected and 0 < expected[1] < expected[0] and expected[2] > 0


def test_update_targets_must_match_the_model(store_path):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = BackgroundWriter(store_path)
    try:
        with pytest.raises(ValueError, match="update_targets must match"):
            Recorder(model, run=Run.adopt(writer, 1), update_targets=[torch.zeros(3)], optimizer=optimizer,
                     update_format="fp16")
    finally:
        writer.close()
    with pytest.raises(ValueError, match="needs optimizer"):
        Recorder(model, store=":memory:", update_format="fp16")


def test_shadow_comparison_unscales_and_matches_float64(store_path):
    """compare_gradients: relative error and cosine of the unscaled gradient, as numpy computes them."""
    model = nn.Linear(5, 3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(model, store=store_path, scaler=scaler, optimizer=optimizer)
    gen = torch.Generator().manual_seed(2)
    true = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
    ref = [t + 0.1 * torch.randn(t.shape, generator=gen) for t in true]
    for p, t in zip(model.parameters(), true, strict=True):
        p.grad = t * 2.0**10  # what backward of the scaled loss leaves
    rec.record(1.0)
    rec.compare_gradients(ref)
    rec.close()
    stats = Store(store_path).shadow_stats(rec.run_id).set_index("tensor")
    for (name, _), t, r in zip(model.named_parameters(), true, ref, strict=True):
        g, r = t.double().numpy().ravel(), r.double().numpy().ravel()
        assert stats.loc[name, "rel_error"] == pytest.approx(np.linalg.norm(g - r) / np.linalg.norm(r), rel=1e-9)
        assert stats.loc[name, "cosine"] == pytest.approx(g @ r / (np.linalg.norm(g) * np.linalg.norm(r)), rel=1e-9)


DROPOUT_SCRIPT = """
import torch
from torch import nn

def build(device):
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
    return {"model": model, "optimizer": lambda p: torch.optim.SGD(p, lr=0.01),
            "batches": lambda step: (x, y), "loss_fn": lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])}
"""


def test_fp32_shadow_of_an_fp32_run_is_exact_even_with_dropout(write_script, store_path):
    """At O0 the shadow redoes the same computation: same weights, batch and dropout masks, so the error is 0."""
    run_id = train(ModelScript.from_path(write_script(DROPOUT_SCRIPT)),
                   RunConfig(opt_level="O0", steps=6, device="cpu", shadow_every=2), store_path)
    stats = Store(store_path).shadow_stats(run_id)
    assert sorted(stats["step"].unique()) == [0, 2, 4]
    assert (stats["rel_error"] == 0).all() and np.allclose(stats["cosine"], 1.0, rtol=0, atol=1e-12)


def test_o2_shadow_sees_only_rounding_and_o2_tracks_master_updates(store_path):
    run_id = train(ModelScript.from_path(EXAMPLES / "mlp_digits.py"),
                   RunConfig(opt_level="O2", steps=4, device="cpu", shadow_every=2), store_path)
    store = Store(store_path)
    ranking = shadow_ranking(store.shadow_stats(run_id))
    assert len(ranking) == len(store.tensors(run_id)) and ranking["median_rel_error"].max() < 0.01
    per_tensor, per_step = update_shares(store.update_stats(run_id))
    assert store.run(run_id)["update_format"] == "fp16" and list(per_step["step"]) == [0, 1, 2, 3]
    assert (per_tensor["unchanged_share"] < 0.01).all()  # the FP32 masters keep what FP16 could not


def test_shadow_ranking_puts_negligible_references_last():
    shadow = {"step": [0, 0, 0], "tensor": ["a", "bias_before_bn", "c"], "numel": [100, 10, 100],
              "rel_error": [0.01, 500.0, 0.3], "cosine": [0.99, -0.2, 0.95], "ref_norm": [10.0, 1e-7, 10.0]}
    import pandas as pd

    ranking = shadow_ranking(pd.DataFrame(shadow))
    assert ranking["tensor"].tolist() == ["c", "a", "bias_before_bn"]
    assert ranking["meaningful"].tolist() == [True, True, False]
