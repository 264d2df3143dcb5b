"""The per-step learning rate, global gradient norm and wall time (schema 9) against ground truth: what the
training loop itself saw at each step - its optimizer's learning rate (and its scheduler's ``get_last_lr()``)
and the value ``torch.nn.utils.clip_grad_norm_`` returned - never mpdiag's own computation; for `mpdiag run`,
the analytic gradient and the schedule's formula; for `mpdiag watch`, the loop's own clip call."""

import json
import math
import time

import numpy as np
import pytest
import torch

from mpdiag import Recorder, Store
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript
from mpdiag.training.watch import WatchConfig, watch

STEPS = 12


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 6, generator=generator), torch.randn(32, 3, generator=generator)) for _ in range(STEPS)]


def _assert_same(stored, seen, rel=0.0):
    """Stored values equal the loop's, non-finite ones included (inf as inf, NaN as NaN)."""
    stored, seen = np.asarray(stored, dtype=float), np.asarray(seen, dtype=float)
    assert stored.shape == seen.shape
    assert (np.isnan(stored) == np.isnan(seen)).all(), (stored, seen)
    assert (np.isinf(stored) == np.isinf(seen)).all(), (stored, seen)
    finite = np.isfinite(seen)
    np.testing.assert_array_equal(stored[~finite & ~np.isnan(seen)], seen[~finite & ~np.isnan(seen)])  # same sign
    if rel == 0.0:
        np.testing.assert_array_equal(stored[finite], seen[finite])
    else:
        np.testing.assert_allclose(stored[finite], seen[finite], rtol=rel, atol=0)


def test_fp32_loop_with_one_cycle_schedule_and_clipping_every_step(store_path, arrival):
    """A plain FP32 loop: OneCycleLR stepped per step, gradients clipped to 0.5 after record(); the store holds
    the loop's learning rate and clip_grad_norm_'s return value at every step, bit for bit (whether the values
    reach the host at once or only at close), and a wall time that grows with the steps and stays inside the
    loop's own elapsed time."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=STEPS)
    recorder = Recorder(model, store=store_path, optimizer=optimizer, every=3)
    lrs, scheduled, norms = [], [], []
    started = time.perf_counter()
    for x, y in _batches():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        recorder.record(loss)
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduled.append(scheduler.get_last_lr()[0])
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        optimizer.step()
        scheduler.step()
    elapsed = time.perf_counter() - started
    recorder.close()
    steps = Store(store_path).steps(recorder.run_id)
    assert steps["step"].tolist() == list(range(STEPS))
    assert steps["lr"].tolist() == lrs == scheduled
    assert len(set(lrs)) == STEPS  # the schedule moved at every step, so an off-by-one step would show
    assert steps["grad_norm"].tolist() == norms
    assert any(n > 0.5 for n in norms)  # clipping changed gradients: the stored norm is the one before it
    wall = steps["wall_time_s"].to_numpy()
    assert (wall > 0).all() and (np.diff(wall) > 0).all() and wall[-1] <= elapsed + 1.0


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")  # a skipped step 0
@pytest.mark.parametrize("unscale_before_record", [True, False], ids=["unscaled-first", "scaled-at-record"])
def test_fp16_autocast_gradscaler_loop_every_2_with_skipped_steps(store_path, unscale_before_record):
    """FP16 autocast on the CPU with GradScaler, a LambdaLR schedule and --every 2, the loop unscaling before
    clipping. The initial scale 2**24 overflows the first steps' FP16 gradients: clip_grad_norm_ returns inf or
    NaN there and GradScaler skips them; the store has the same non-finite norms and the same learning rates at
    every step, logged or not. Recorded with the gradients already unscaled, the norm is clip's exactly; recorded
    while they are still scaled (record before unscale_), it is the scaled norm divided by the scale: within 1e-6."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=3)
    recorder = Recorder(model, store=store_path, scaler=scaler, optimizer=optimizer, every=2)
    lrs, norms, skipped = [], [], []
    for x, y in _batches():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if unscale_before_record:
            scaler.unscale_(optimizer)
            recorder.record(loss)
        else:
            recorder.record(loss)
            scaler.unscale_(optimizer)
        lrs.append(optimizer.param_groups[0]["lr"])
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped.append(int(scaler.get_scale() < scale))
        scheduler.step()
    recorder.close()
    store = Store(store_path)
    steps = store.steps(recorder.run_id)
    assert steps["skipped"].astype(int).tolist() == skipped and 0 < sum(skipped) < STEPS
    # the multiples of 2, and the first step of each streak of skips, which the retention keeps (docs/events.md)
    first_skips = {s for s in range(STEPS) if skipped[s] and (s == 0 or not skipped[s - 1])}
    assert set(range(0, STEPS, 2)) | first_skips <= set(store.logged_steps(recorder.run_id))
    assert steps["lr"].tolist() == lrs
    _assert_same(steps["grad_norm"], norms, rel=0.0 if unscale_before_record else 1e-6)
    assert not all(math.isfinite(n) for n in norms)  # the skipped steps' norms are stored, non-finite
    assert steps["wall_time_s"].notna().all()


def test_no_optimizer_given_takes_the_first_seen_and_a_loop_without_one_has_no_rate(store_path):
    """Recorder(model) without optimizer=: the learning rate comes from the first optimizer seen stepping over
    the model's parameters, from step 0 on. A loop that updates the weights by hand has no learning rate (NaN)
    but still its gradient norm."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    recorder = Recorder(model, store=store_path, every=4)
    lrs, norms = [], []
    for x, y in _batches()[:6]:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        recorder.record(1.0)
        lrs.append(optimizer.param_groups[0]["lr"])
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf).item())
        optimizer.step()
        scheduler.step()
    recorder.close()
    steps = Store(store_path).steps(recorder.run_id)
    assert steps["lr"].tolist() == lrs == [0.05, 0.05, 0.025, 0.025, 0.0125, 0.0125]
    assert steps["grad_norm"].tolist() == norms

    by_hand = _model()
    recorder = Recorder(by_hand, store=store_path)
    norms = []
    for x, y in _batches()[:3]:
        by_hand.zero_grad()
        torch.nn.functional.mse_loss(by_hand(x), y).backward()
        recorder.record(1.0)
        norms.append(torch.nn.utils.clip_grad_norm_(by_hand.parameters(), math.inf).item())
        with torch.no_grad():
            for p in by_hand.parameters():
                p -= 0.1 * p.grad
    recorder.close()
    steps = Store(store_path).steps(recorder.run_id)
    assert steps["lr"].isna().all() and steps["grad_norm"].tolist() == norms


# dL/dw = C exactly, whatever w is, so every step's gradient norm is ||C||; the schedule halves the rate each step
SCHEDULED_SCRIPT = """
import torch

C = torch.tensor([0.0, 2.0**-30, 0.5, -1.0, 1000.0, 70000.0, -(2.0**20)])


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(len(C)))

    def forward(self):
        return (self.w * C.to(self.w.device)).sum()


def build(device):
    return {
        "model": Linear(),
        "optimizer": lambda params: torch.optim.SGD(params, lr=0.25),
        "scheduler": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step),
        "clip_grad_norm": 1.0,
        "batches": lambda step: None,
        "loss_fn": lambda model, batch: model(),
    }
"""
C = torch.tensor([0.0, 2.0**-30, 0.5, -1.0, 1000.0, 70000.0, -(2.0**20)], dtype=torch.float64)


def _assert_rows_are_torchs(stats, step: int, grads: dict):
    """``step``'s stored tensor rows (Store.tensor_stats) are one per gradient of ``grads`` (name: the gradient the
    loop saw), each tensor's L2, zeros and FP16 underflow torch's own on it; returns the rows by tensor."""
    rows = stats[stats["step"] == step].set_index("tensor")
    assert sorted(rows.index) == sorted(grads)
    for name, grad in grads.items():
        assert rows.loc[name, "l2"] == pytest.approx(float(torch.linalg.vector_norm(grad.double())), rel=1e-6)
        assert rows.loc[name, "zeros"] == int((grad == 0).sum())
        assert rows.loc[name, "fp16_underflow"] == int(((grad != 0) & (grad.half() == 0)).sum())
    return rows


@pytest.mark.parametrize("opt_level", ["O0", "O1"])
def test_mpdiag_run_records_the_schedule_and_the_analytic_norm_before_its_clip(write_script, store_path, opt_level):
    """`mpdiag run`'s runner (its Recorder attached, --every 2, clip_grad_norm 1.0 and a per-step scheduler):
    every step's learning rate is the schedule's formula 0.25 * 0.5**step and every step's norm is ||C|| (the
    analytic gradient, unscaled at O1 where the loss scale is 2**16), not the clipped 1.0."""
    script = ModelScript.from_path(write_script(SCHEDULED_SCRIPT))
    run_id = train(script, RunConfig(opt_level=opt_level, steps=5, every=2, device="cpu"), store_path)
    store = Store(store_path)
    assert store.run(run_id)["status"] == "finished"
    steps = store.steps(run_id)
    assert steps["lr"].tolist() == [0.25 * 0.5**s for s in range(5)]
    assert steps["grad_norm"].to_numpy() == pytest.approx([float(torch.linalg.vector_norm(C))] * 5, rel=1e-6)
    assert store.logged_steps(run_id) == [0, 2, 4]


WATCHED_SCRIPT = """
import json, sys
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=8)
seen = []
for step in range(8):
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    lr = optimizer.param_groups[0]["lr"]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1).item()
    seen.append([lr, norm])
    optimizer.step()
    scheduler.step()
json.dump(seen, open(sys.argv[1], "w"))
"""


def test_watch_records_the_scripts_own_rate_and_clip_norm(write_script, store_path, tmp_path):
    """`mpdiag watch` over an unmodified loop that clips every step: the stored rate and norm are what the
    script's own optimizer held and its own clip_grad_norm_ call returned (written by the script itself)."""
    script = write_script(WATCHED_SCRIPT, "loop.py")
    out = tmp_path / "seen.json"
    run_id, code = watch(WatchConfig(target=str(script), args=(str(out),), every=3), store_path)
    assert code == 0
    seen = json.loads(out.read_text())
    steps = Store(store_path).steps(run_id)
    assert steps["lr"].tolist() == [lr for lr, _ in seen]
    assert steps["grad_norm"].tolist() == pytest.approx([norm for _, norm in seen], rel=1e-6)


@pytest.mark.parametrize("autocast", [False, True])
def test_sparse_embedding_gradients_are_read_as_the_dense_gradient_they_stand_for(store_path, autocast):
    """``nn.Embedding(sparse=True)`` stepped by SparseAdam beside Adam: its gradient is an uncoalesced sparse COO
    tensor, which ``record`` and the optimizer-step check raised on (NotImplementedError, as ``clip_grad_norm_``
    itself does). Each step's norm is ``clip_grad_norm_``'s over the dense gradients SparseAdam applies (duplicate
    rows summed), and each tensor's L2, zeros and FP16 underflow are torch's on that dense gradient."""
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 50)
    model = torch.nn.Sequential(emb, head)
    sparse_opt, dense_opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-2), torch.optim.Adam(head.parameters())
    rec = Recorder(model, store=store_path, optimizer=[dense_opt, sparse_opt])  # checks every step below 1,000
    norms, dense = [], []
    for step in range(3):
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        idx = torch.randint(0, 50, (6, 4))  # repeated rows: the COO gradient holds duplicate indices
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            logits = model(idx).mean(1)
        loss = torch.nn.functional.cross_entropy(logits.float(), torch.randint(0, 50, (6,)))
        loss = loss * (1e-7 if step == 1 else 1.0)  # step 1: gradients below FP16's smallest subnormal
        loss.backward()
        assert emb.weight.grad.is_sparse and not emb.weight.grad.is_coalesced()
        rec.record(loss)
        dense.append([p.grad.to_dense() if p.grad.is_sparse else p.grad.clone() for p in model.parameters()])
        copies = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        for copy, grad in zip(copies, dense[-1], strict=True):
            copy.grad = grad
        norms.append(float(torch.nn.utils.clip_grad_norm_(copies, float("inf"))))
        sparse_opt.step()
        dense_opt.step()
    rec.close()
    store = Store(store_path)
    assert store.steps(rec.run_id)["grad_norm"].tolist() == norms
    stats = store.tensor_stats(rec.run_id)
    for step, grads in enumerate(dense):
        rows = _assert_rows_are_torchs(stats, step, dict(zip(["0.weight", "1.weight", "1.bias"], grads, strict=True)))
    assert rows.loc["0.weight", "zeros"] > 0  # the rows no index touched
    # step 1's FP32 gradients underflow FP16; under autocast FP16's own backward already flushed them to zeros
    assert (stats["fp16_underflow"].sum() > 0) != autocast
    assert rec.optimizer_step_nonfinite is None


@pytest.mark.parametrize("held", ["from-the-start", "added-when-unfrozen"])
def test_a_layer_unfrozen_while_training_is_recorded_from_its_first_gradient(store_path, held, watched=False):
    """Gradual unfreezing: the first layer is frozen (requires_grad False) when the Recorder starts and unfrozen at
    step 3, either held by the optimizer from the start or added to it then (``add_param_group``). From step 3 its
    tensors have rows, and the norm is ``clip_grad_norm_``'s over every gradient (it left them out, silently:
    0.54 where torch said 0.64); their L2 and FP16 underflow are torch's own on those gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters() if held == "from-the-start" else model[2].parameters(), lr=0.1)
    recorder = Recorder(model, store=store_path, optimizer=optimizer)
    norms, grads = [], []
    generator = torch.Generator().manual_seed(1)
    for step in range(6):
        if step == 3:
            model[0].requires_grad_(True)
            if held == "added-when-unfrozen":
                optimizer.add_param_group({"params": list(model[0].parameters()), "lr": 0.05})
        optimizer.zero_grad()
        x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), y) * (1e-6 if step == 4 else 1.0)  # step 4: FP16 underflow
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        recorder.record(loss)
        optimizer.step()
    recorder.close()
    store = Store(store_path)
    assert store.steps(recorder.run_id)["grad_norm"].tolist() == norms
    stats = store.tensor_stats(recorder.run_id)
    for step, seen in enumerate(grads):  # the unfrozen layer's tensors from step 3 on, not before
        _assert_rows_are_torchs(stats, step, seen)
    assert stats[(stats["step"] == 4) & (stats["tensor"] == "0.weight")]["fp16_underflow"].item() > 0


@pytest.mark.parametrize("every", [1, 4])  # 4: steps 1-3 copied aside (held) and their statistics taken later
def test_complex_and_float64_gradients_are_counted_as_torch_casts_them(store_path, every):
    """A complex64 parameter's statistics count its real and imaginary parts, as torch casts them (read as one real
    tensor, the imaginary parts were dropped: its L2 ~40 % low), and its numel in the tensors table is the values
    counted. A float64 gradient beyond FP32's range (1e39, 1e-50: finite and non-zero) counts as overflowing and
    underflowing FP16 and BF16, as torch's casts of it say, not as inf or zero (its L2 and absmax read inf); its
    L2 and absmax are of the float64 values. The norm is ``clip_grad_norm_``'s over the complex gradient."""
    far = torch.tensor([1.0, 1e39, -1e39, 1e-50, -1e-50, 0.5], dtype=torch.float64)
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.wide = torch.nn.Parameter(torch.ones(6, dtype=torch.float64))
    model.waves = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    recorder = Recorder(model, store=store_path, optimizer=optimizer, every=every)
    grads, norms = [], []
    for step in range(4):
        optimizer.zero_grad()
        x = torch.randn(3, 4, dtype=torch.complex64)
        loss = (model.wide * far * (step + 1)).sum() + (x @ model.waves).abs().pow(2).mean() * 1e-3
        loss.backward()
        recorder.record(loss)
        grads.append({"wide": model.wide.grad.clone(), "waves": model.waves.grad.clone()})
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        optimizer.step()
    recorder.close()
    store = Store(store_path)
    assert store.steps(recorder.run_id)["grad_norm"].tolist() == norms
    tensors = store.tensors(recorder.run_id).set_index("name")
    assert tensors.loc["waves", "numel"] == 32 and tensors.loc["wide", "numel"] == 6
    stats = store.tensor_stats(recorder.run_id)
    assert set(stats["step"]) == set(range(4)) if every == 1 else 0 in set(stats["step"])
    for step in sorted(set(stats["step"])):
        rows = stats[stats["step"] == step].set_index("tensor")
        for name, grad in grads[step].items():
            values = torch.view_as_real(grad) if grad.is_complex() else grad
            row = rows.loc[name]
            assert row["l2"] == pytest.approx(float(torch.linalg.vector_norm(values.double())), rel=1e-6)
            assert row["absmax"] == pytest.approx(float(values.abs().max()), rel=1e-6)
            assert (row["zeros"], row["posinf"], row["neginf"]) == (0, 0, 0)
            for fmt, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
                cast = values.to(dtype)
                assert row[f"{fmt}_underflow"] == int(((values != 0) & (cast == 0)).sum()), (step, name, fmt)
                assert row[f"{fmt}_overflow"] == int(cast.isinf().sum()), (step, name, fmt)
        assert rows.loc["wide", "fp16_overflow"] == 2 and rows.loc["wide", "bf16_underflow"] == 2
