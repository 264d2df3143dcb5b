"""Recorder against ground truth: analytic gradients, and GradScaler's own state for scale and skips."""

import math
import pickle
import time

import numpy as np
import pytest
import torch
from conftest import DEVICES, disk_fills_after

from mpdiag import Recorder, Store
from mpdiag.numerics.formats import BF16, FP16
from mpdiag.numerics.gradstats import category_counts_by_casting
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript

# loss = sum(w * c) has dL/dw = c exactly; c spans fp16 underflow, subnormal, normal and overflow ranges.
ANALYTIC_SCRIPT = """
import torch

C = torch.tensor([0.0, 2.0**-30, -2.0**-25, 2.0**-24, 3 * 2.0**-20, 2.0**-14, 0.5, -1.0, 1000.0, 70000.0, -2.0**40])


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(len(C)))
        self.unused = torch.nn.Parameter(torch.ones(2))

    def forward(self):
        return (self.w * C.to(self.w.device)).sum()


def build(device):
    return {
        "model": Linear(),
        "optimizer": lambda params: torch.optim.SGD(params, lr=0.0),
        "batches": lambda step: None,
        "loss_fn": lambda model, batch: model(),
    }
"""
C = torch.tensor(
    [0.0, 2.0**-30, -(2.0**-25), 2.0**-24, 3 * 2.0**-20, 2.0**-14, 0.5, -1.0, 1000.0, 70000.0, -(2.0**40)]
)


def test_analytic_gradients_value_for_value(write_script, store_path):
    script = ModelScript.from_path(write_script(ANALYTIC_SCRIPT))
    run_id = train(script, RunConfig(opt_level="O1", steps=3, device="cpu"), store_path)
    store = Store(store_path)
    assert store.run(run_id)["status"] == "finished"
    stats = store.tensor_stats(run_id, tensor="w")
    steps = store.steps(run_id)
    assert list(stats["step"]) == [0, 1, 2]
    for _, row in stats.iterrows():
        scale = steps.set_index("step").loc[row["step"], "loss_scale"]
        assert scale == 2.0**16  # lr 0 and no overflow: the scale stays at init for 3 steps
        for fmt in (FP16, BF16):
            for values, suffix in ((C, ""), (C * scale, "_at_scale")):
                for cat, n in category_counts_by_casting(values, fmt).items():
                    assert row[f"{fmt.name}_{cat}{suffix}"] == n, (fmt.name, cat, suffix)
        assert row["zeros"] == 1 and row["nan"] == 0 and row["numel"] == len(C)
        assert row["absmax"] == 2.0**40 and row["min_nonzero"] == 2.0**-30
        assert row["l2"] == pytest.approx(float(torch.linalg.vector_norm(C.double())))
    hist = store.histograms(run_id, tensor="w")
    step0 = hist[(hist["step"] == 0) & hist["exponent"].map(lambda e: isinstance(e, int))]
    expected = {int(math.frexp(abs(v))[1] - 1): 0 for v in C.tolist() if v != 0}
    for v in C.tolist():
        if v != 0:
            expected[math.frexp(abs(v))[1] - 1] += 1
    assert dict(zip(step0["exponent"], step0["count"], strict=True)) == expected
    zero_bin = hist[(hist["step"] == 0) & (hist["exponent"] == "zero")]
    assert zero_bin["count"].tolist() == [1]
    # A parameter without a gradient gets no statistics rows; it is still listed as a tensor.
    assert "unused" in set(store.tensors(run_id)["name"])
    assert store.tensor_stats(run_id, tensor="unused").empty


def _scaler_loop(store_path, overflow_steps, steps=12, unscale_first=False, device="cpu"):
    """A user's own torch.amp loop with the Recorder; returns the ground truth seen from outside."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=3)
    ran = []
    opt.register_step_post_hook(lambda *a: ran.append(True))
    truth = []
    with Recorder(model, store=store_path, name="loop", scaler=scaler) as rec:
        rec.flush_interval_s = 0.0  # commit at every record(): the flush path runs once per step
        for step in range(steps):
            opt.zero_grad()
            with torch.autocast(device, dtype=torch.float16):
                loss = model(torch.ones(2, 4, device=device)).float().mean()
            if step in overflow_steps:
                loss = loss * float("inf")
            scale_used = scaler.get_scale()
            scaler.scale(loss).backward()
            if unscale_first:
                scaler.unscale_(opt)
            grad = model.weight.grad.clone()
            peak_before = torch.cuda.max_memory_allocated() if device == "cuda" else None
            rec.record(loss)
            peak_after = torch.cuda.max_memory_allocated() if device == "cuda" else None
            before = len(ran)
            scaler.step(opt)
            scaler.update()
            state = scaler.state_dict()
            truth.append(
                dict(step=step, loss_scale=scale_used, skipped=int(len(ran) == before),
                     scale_after=state["scale"], growth_tracker=state["_growth_tracker"], grad=grad,
                     peak=(peak_before, peak_after))
            )
    return rec.run_id, truth


@pytest.mark.parametrize("device", DEVICES)
def test_scale_trajectory_matches_gradscaler_state(store_path, arrival, device):
    run_id, truth = _scaler_loop(store_path, overflow_steps={2, 3, 8}, device=device)
    steps = Store(store_path).steps(run_id)
    assert len(Store(store_path).tensor_stats(run_id)) == 12 * 2  # every step's weight and bias
    for row, expected in zip(steps.to_dict("records"), truth, strict=True):
        for key in ("step", "loss_scale", "skipped", "scale_after", "growth_tracker"):
            assert row[key] == expected[key], (key, row, expected)
    assert steps["skipped"].tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0]
    assert math.isinf(steps.loc[2, "loss"])  # inf loss kept as such, never dropped
    assert (steps["step_time_s"] > 0).all() and (steps["peak_mem_bytes"] > 0).all()
    if device == "cuda":  # the caching allocator's peak as torch reads it, between its readings around record()
        for recorded, expected in zip(steps["peak_mem_bytes"], truth, strict=True):
            assert expected["peak"][0] <= recorded <= expected["peak"][1], (recorded, expected["peak"])
    run = Store(store_path).run(run_id)
    assert run["status"] == "finished"
    # the machine, as torch names it: a watched or hand-instrumented run on a GPU says which (it said None)
    assert (run["device"], run["gpu_name"]) == ((f"cuda:{torch.cuda.current_device()}",
                                                 torch.cuda.get_device_name()) if device == "cuda" else ("cpu", None))


def test_grads_unscaled_before_record_are_recognised(store_path, arrival):
    run_id, truth = _scaler_loop(store_path, overflow_steps=set(), steps=3, unscale_first=True)
    store = Store(store_path)
    row = store.tensor_stats(run_id, tensor="weight").iloc[0]
    grad = truth[0]["grad"]  # already unscaled when read
    assert row["absmax"] == float(grad.abs().max())
    for cat, n in category_counts_by_casting(grad * truth[0]["loss_scale"], FP16).items():
        assert row[f"fp16_{cat}_at_scale"] == n


@pytest.mark.parametrize("given", [True, False], ids=["optimizers-given", "optimizers-seen-unscaled"])
def test_grads_unscaled_for_some_optimizers_of_a_shared_scaler(store_path, given):
    """Two optimizers share a GradScaler and only the encoder's gradients were unscaled (to clip them alone) when
    the step is recorded: the decoder's, still S*g, were stored as if unscaled (a norm S times too large, at-scale
    counts of S*g*S). Truth: GradScaler's own unscale_ of the decoder after the record, and torch's FP16 cast of
    the gradients as they were held."""
    torch.manual_seed(0)
    enc, dec = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
    model = torch.nn.Sequential(enc, dec)
    opts = [torch.optim.SGD(enc.parameters(), lr=1e-2), torch.optim.SGD(dec.parameters(), lr=1e-2)]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with Recorder(model, store=store_path, scaler=scaler, optimizer=opts if given else None) as rec:
        loss = torch.nn.functional.mse_loss(model(torch.randn(16, 8)), 4 * torch.randn(16, 2))
        scaler.scale(loss).backward()
        scaler.unscale_(opts[0])
        at_scale = {name: p.grad * (scaler.get_scale() if name.startswith("0.") else 1.0)
                    for name, p in model.named_parameters()}
        rec.record(loss)
        scaler.unscale_(opts[1])
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        l2 = {name: float(p.grad.double().norm()) for name, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(enc.parameters(), 1.0)
        for opt in opts:
            scaler.step(opt)
        scaler.update()
    store = Store(store_path)
    assert store.steps(rec.run_id)["grad_norm"].tolist() == pytest.approx([norm], rel=1e-6)
    stats = store.tensor_stats(rec.run_id).set_index("tensor")
    assert stats["l2"].to_dict() == pytest.approx(l2, rel=1e-6)
    overflow = {name: int((g.half().isinf() & g.isfinite()).sum()) for name, g in at_scale.items()}
    assert stats["fp16_overflow_at_scale"].to_dict() == overflow
    assert overflow["1.weight"] > 0  # the decoder's S*g overflows FP16: a count told from the scaled values


def test_nan_loss_round_trips_as_nan(store_path):
    model = torch.nn.Linear(2, 1)
    with Recorder(model, store=store_path) as rec:
        loss = model(torch.ones(1, 2)).sum() * float("nan")
        loss.backward()
        rec.record(loss)
    steps = Store(store_path).steps(rec.run_id)
    assert math.isnan(steps.loc[0, "loss"])
    stats = Store(store_path).tensor_stats(rec.run_id)
    assert (stats["nan"] == stats["numel"]).all()


def test_every_n_records_tensors_on_multiples_only(store_path):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, store=store_path, optimizer=opt, every=3) as rec:
        for _ in range(7):
            opt.zero_grad()
            loss = model(torch.ones(1, 2)).sum()
            loss.backward()
            rec.record(loss)
            opt.step()
    store = Store(store_path)
    assert len(store.steps(rec.run_id)) == 7
    assert sorted(set(store.tensor_stats(rec.run_id)["step"])) == [0, 3, 6]


def test_failed_context_marks_run_failed_and_keeps_steps(store_path):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(RuntimeError, match="boom"):
        with Recorder(model, store=store_path) as rec:
            loss = model(torch.ones(1, 2)).sum()
            loss.backward()
            rec.record(loss)
            raise RuntimeError("boom")
    run = Store(store_path).run(rec.run_id)
    assert run["status"] == "failed" and "boom" in run["error"]
    steps = Store(store_path).steps(rec.run_id)
    assert len(steps) == 1 and np.isnan(steps.loc[0, "skipped"])  # the step never completed: unknown


def test_invalid_scaling_is_refused_before_training(store_path, write_script):
    from mpdiag.options import ConfigError

    script = ModelScript.from_path(write_script(ANALYTIC_SCRIPT))
    for bad, match in [
        ({"init_scale": 0}, "init-scale"),
        ({"growth_factor": 1.0}, "growth-factor"),
        ({"backoff_factor": 1.0}, "backoff-factor"),
        ({"growth_interval": 0}, "growth-interval"),
    ]:
        with pytest.raises(ConfigError, match=match):
            train(script, RunConfig(device="cpu", **bad), store_path)
    with pytest.raises(ConfigError, match="unknown opt level"):
        train(script, RunConfig(opt_level="O7", device="cpu"), store_path)
    assert Store(store_path).runs().empty  # nothing was written


def test_a_loop_stuck_inside_a_step_has_its_earlier_steps_in_the_store_and_reads_stalled(tmp_path, monkeypatch):
    """The rows of the steps before a hang are committed by the writer's thread on a timer (the training thread,
    stuck, never flushes again), and the run reads stalled once no step has come for STALL_S and STALL_STEPS
    median steps; it is running again at its next step."""
    from mpdiag.store import reader

    monkeypatch.setattr(reader, "STALL_S", 1.0)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(model, store=tmp_path / "runs.db", optimizer=opt)
    rec.flush_interval_s = 3600.0  # the training thread alone would not flush these rows for an hour

    def step():
        opt.zero_grad()
        loss = model(torch.ones(2, 3)).sum()
        loss.backward()
        rec.record(loss)
        opt.step()

    for _ in range(3):
        step()
    store = Store(tmp_path / "runs.db")
    assert store.steps(rec.run_id).empty  # nothing committed yet: the interval has not passed
    rec.flush_interval_s = 0.2  # now the writer's timer flushes what arrived
    deadline = time.time() + 5
    while len(store.steps(rec.run_id)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    # steps 0 and 1 are complete; step 2's row waits for the scaler state after its update (the next step)
    assert store.steps(rec.run_id)["step"].tolist() == [0, 1]
    assert store.run(rec.run_id)["status"] == "running"
    time.sleep(1.5)
    assert store.run(rec.run_id)["status"] == "stalled"
    step()
    deadline = time.time() + 5
    while store.run(rec.run_id)["status"] != "running" and time.time() < deadline:
        time.sleep(0.05)
    assert store.run(rec.run_id)["status"] == "running" and store.steps(rec.run_id)["step"].tolist() == [0, 1, 2]
    rec.close()
    assert store.steps(rec.run_id)["step"].tolist() == [0, 1, 2, 3]


def test_a_full_disk_stops_recording_once_and_lets_training_finish(tmp_path, monkeypatch, capsys):
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    disk_fills_after(monkeypatch, batches=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks_before = len(opt._optimizer_step_pre_hooks), len(_global_optimizer_pre_hooks)
    rec = Recorder(model, store=tmp_path / "runs.db", optimizer=opt)
    rec.flush_interval_s = 0.0  # every record() flushes
    weights = []
    for _ in range(12):
        opt.zero_grad()
        loss = model(torch.ones(2, 3)).sum()
        loss.backward()
        rec.record(loss)
        opt.step()
        weights.append(model.weight.detach().clone())
    rec.close()
    assert len(weights) == 12  # every step trained
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mpdiag:")]
    assert len(said) == 1 and "database or disk is full" in said[0] and "The training itself went on" in said[0]
    run = Store(tmp_path / "runs.db").run(rec.run_id)
    assert run["status"] == "failed" and run["error"].startswith("mpdiag stopped recording at step ")
    assert len(Store(tmp_path / "runs.db").steps(rec.run_id)) >= 1  # what was committed before is kept
    assert (len(opt._optimizer_step_pre_hooks), len(_global_optimizer_pre_hooks)) == hooks_before


def test_a_write_that_fails_on_the_timer_flush_stops_recording_without_hanging(tmp_path, monkeypatch, capsys):
    """The disk is full and the training thread is then stuck inside a step, so the writer's own timer flush is
    the first to meet the error: recording stops on the writer's thread (it used to wait there on itself
    forever, and the training thread's close() with it) and the training goes on."""
    import threading

    disk_fills_after(monkeypatch, batches=0)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(model, store=tmp_path / "runs.db", optimizer=opt)
    rec.flush_interval_s = 2.0  # record() itself does not flush within the test's first steps
    steps_trained, stopped_while_stuck = [], []

    def training():
        for step in range(4):
            opt.zero_grad()
            loss = model(torch.ones(2, 3)).sum()
            loss.backward()
            rec.record(loss)
            opt.step()
            if step == 1:  # step 0's row, complete now, is written: that fails on the writer's thread, and the
                rec.flush()  # error waits for the next write
                time.sleep(0.5)
            if step == 2:  # stuck inside the next step: only the timer flushes (step 1's row) now
                deadline = time.monotonic() + 30
                while rec.stopped_recording is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                stopped_while_stuck.append(rec.stopped_recording is not None)
            steps_trained.append(step)
        rec.close()

    thread = threading.Thread(target=training, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the training thread hung after the failed write"
    assert steps_trained == [0, 1, 2, 3] and stopped_while_stuck == [True]
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mpdiag:")]
    assert len(said) == 1 and "database or disk is full" in said[0]
    assert Store(tmp_path / "runs.db").run(rec.run_id)["status"] == "failed"


def test_an_optimizer_wrapped_by_accelerate_or_lightning_is_recorded_through_the_one_it_steps(store_path):
    """Accelerate's prepared optimizer (an Optimizer subclass built without Optimizer's __init__: registering a
    step hook on it raised AttributeError in the Recorder's constructor) and Lightning's LightningOptimizer are
    recorded through the torch optimizer they step: every step's learning rate and the gradient norm equal what
    the loop's optimizer and Accelerate's own clip_grad_norm_ say."""
    from accelerate import Accelerator
    from pytorch_lightning.core.optimizer import LightningOptimizer

    from mpdiag.recording.recorder import torch_optimizer

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 1.0 / (1 + step))
    model, optimizer, schedule = accelerator.prepare(model, inner, schedule)
    assert optimizer is not inner and isinstance(optimizer, torch.optim.Optimizer)
    assert torch_optimizer(optimizer) is inner and torch_optimizer(LightningOptimizer(inner)) is inner
    lrs, norms = [], []
    with Recorder(model, store=store_path, optimizer=optimizer) as rec:
        for _ in range(3):
            loss = torch.nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,)))
            accelerator.backward(loss)
            rec.record(loss)
            lrs.append(optimizer.param_groups[0]["lr"])
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1e9)))
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
    steps = Store(store_path).steps(rec.run_id)
    assert Store(store_path).run(rec.run_id)["status"] == "finished"
    assert steps["lr"].tolist() == lrs and steps["grad_norm"].tolist() == norms


def test_a_gan_step_records_its_own_models_norm_and_tensors_also_when_gradscaler_skips_it(store_path):
    """DCGAN's loop with AMP and two optimizers: the generator's backward also writes into the discriminator's
    ``.grad``, which no optimizer of that step uses. Each step's gradient norm is the stepping model's, equal to
    ``clip_grad_norm_`` over its parameters (it was the norm over both models'), and a step GradScaler skips (no
    optimizer hook fires; an inf planted in the generator's input) holds the generator's tensors alone (it held
    both models'), the discriminator's steps the discriminator's. The scaler stays picklable while recorded, and
    its class's ``unscale_`` (watched for this) is torch's own again after."""
    unscale = torch.amp.GradScaler.unscale_
    torch.manual_seed(0)
    gen, disc = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)), \
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1))
    both = torch.nn.ModuleDict({"G": gen, "D": disc})
    opt_d, opt_g = (torch.optim.Adam(m.parameters(), lr=2e-4, betas=(0.5, 0.999)) for m in (disc, gen))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    bce = torch.nn.BCEWithLogitsLoss()
    truth = []  # per step: (the model that stepped, its clip_grad_norm_, whether GradScaler skipped it)

    def step(model, optimizer, loss):
        scaler.scale(loss).backward()
        rec.record(loss)
        scaler.unscale_(optimizer)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
        skipped = sum(v.item() for v in scaler._found_inf_per_device(optimizer).values()) > 0
        scaler.step(optimizer)
        truth.append(("D" if model is disc else "G", norm, skipped))

    with Recorder(both, store=store_path, scaler=scaler, optimizer=[opt_d, opt_g]) as rec:
        for iteration in range(4):
            pickle.loads(pickle.dumps(scaler))  # as torch.save(scaler) in a checkpoint between steps
            noise, real = torch.randn(16, 4), torch.randn(16, 8)
            opt_d.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                fake = gen(noise)
                loss_d = bce(disc(real), torch.ones(16, 1)) + bce(disc(fake.detach()), torch.zeros(16, 1))
            step(disc, opt_d, loss_d)
            opt_g.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                if iteration == 2:
                    fake = gen(noise.index_fill(0, torch.tensor([0]), float("inf")))
                loss_g = bce(disc(fake), torch.ones(16, 1))
            step(gen, opt_g, loss_g)
            scaler.update()
    assert torch.amp.GradScaler.unscale_ is unscale and "unscale_" not in vars(scaler)
    store = Store(store_path)
    steps, stats, names = store.steps(rec.run_id), store.tensor_stats(rec.run_id), store.tensors(rec.run_id)
    assert [skipped for *_, skipped in truth] == [False] * 5 + [True] + [False] * 2
    assert steps["skipped"].tolist() == [int(skipped) for *_, skipped in truth]
    stored_norms = steps["grad_norm"].tolist()
    for s, (model, norm, skipped) in enumerate(truth):
        assert stored_norms[s] == norm or (math.isnan(norm) and math.isnan(stored_norms[s])), (s, model)
        tensors = set(stats.loc[stats["step"] == s, "tensor"])
        assert tensors == set(names.loc[names["name"].str.startswith(model + "."), "name"]), (s, model, skipped)


def test_a_recorder_that_cannot_hook_in_ends_its_run_failed_and_leaves_no_hook(store_path):
    """An optimizer refusing a step hook (as Accelerate's wrapped one did) made Recorder(...) raise after its run
    existed: the run was left running (read later as crashed, 0 steps) and the hooks installed before it - on the
    parameters, the modules, the first optimizer - stayed, to run in the loop's steps. The constructor still
    raises; the run ends failed saying why, and every hook is gone: the loop trains on as without mpdiag."""

    class Refusing(torch.optim.SGD):
        def register_step_post_hook(self, hook):
            raise RuntimeError("no hooks here")

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    fine, refusing = torch.optim.SGD(model[0].parameters(), lr=0.1), Refusing(model[2].parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    unscale = torch.amp.GradScaler.unscale_
    with pytest.raises(RuntimeError, match="no hooks here"):
        Recorder(model, store=store_path, optimizer=[fine, refusing], scaler=scaler, trace_modules=True)
    run = Store(store_path).runs().iloc[0]
    assert (run["status"], run["error"]) == ("failed", "mpdiag could not start recording: RuntimeError: no hooks here")
    assert not fine._optimizer_step_pre_hooks and not fine._optimizer_step_post_hooks
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks for m in model.modules())
    assert torch.amp.GradScaler.unscale_ is unscale
    model(torch.randn(2, 4)).sum().backward()
    fine.step()  # as without mpdiag


@pytest.mark.parametrize("optimizer", ["AdamW", "Adam", "SGD"])
@pytest.mark.parametrize("fused", [True, False])
def test_a_fused_optimizer_gradscaler_skips_inside_its_step_is_recorded_skipped(store_path, optimizer, fused):
    """A ``fused=True`` optimizer supports AMP scaling: ``GradScaler.step`` calls its ``step`` even when the
    gradients overflowed, handing it ``found_inf``, and the kernel leaves the weights unchanged. Its step hooks
    fire all the same, so such a step was stored as applied (skipped 0), its overflowed gradients raised a
    ``nonfinite`` event ("the optimizer step ran") and its update counts said every value unchanged. Each step's
    skipped flag, scale and scale after ``update()`` are GradScaler's own (``_found_inf_per_device``, the weights
    unchanged), the norm ``clip_grad_norm_``'s, no event fires, and skipped steps have no update counts; the same
    as with the for-loop implementation."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    kind = {"fused": True} if fused else {"foreach": False}
    opt = getattr(torch.optim, optimizer)(model.parameters(), lr=1e-2, **kind)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    truth = []  # per step: (skipped, scale, scale after update, clip_grad_norm_'s norm)
    with Recorder(model, store=store_path, scaler=scaler, optimizer=opt, update_format="fp16") as rec:
        for step in range(8):
            x, y = torch.randn(8, 16), torch.randn(8, 4)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            loss = loss * 1e30 if step in (3, 6) else loss  # overflows FP16: GradScaler skips these steps
            scaler.scale(loss).backward()
            scale = scaler.get_scale()
            rec.record(loss)
            if step % 2:  # unscaled before the step (as for clipping) every other step
                scaler.unscale_(opt)
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))) / (scale if step % 2 == 0 else 1.0)
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            skipped = sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0
            assert skipped == all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
            scaler.update()
            truth.append((int(skipped), scale, scaler.get_scale(), norm))
    store = Store(store_path)
    steps = store.steps(rec.run_id)
    assert [t[0] for t in truth] == [0, 0, 0, 1, 0, 0, 1, 0]
    assert steps["skipped"].tolist() == [t[0] for t in truth]
    assert steps["loss_scale"].tolist() == [t[1] for t in truth]
    assert steps["scale_after"].tolist() == [t[2] for t in truth]
    for stored, (_, _, _, norm) in zip(steps["grad_norm"].tolist(), truth, strict=True):
        assert stored == norm or (math.isnan(norm) and math.isnan(stored))
    assert store.events(rec.run_id).empty
    assert sorted(set(store.update_stats(rec.run_id)["step"])) == [0, 1, 2, 4, 5, 7]


def test_a_model_whose_parameters_the_backward_never_reached_is_said_in_the_note(tmp_path):
    """Training through ``torch.func.functional_call`` over copies of a module's parameters leaves the module's own
    ``.grad`` empty: each step's norm is 0 (clip_grad_norm_ over no gradient) and no statistics are kept, which the
    run's note now says instead of leaving a plausible flat line (the optimizer's own norm was 1.35, 1.62, ...)."""
    from mpdiag.recording.recorder import NO_GRADIENT_NOTE

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    params = {n: p.detach().clone().requires_grad_(True) for n, p in base.named_parameters()}
    optimizer = torch.optim.Adam(params.values(), lr=1e-2)
    with Recorder(base, store=tmp_path / "s.db", optimizer=optimizer) as recorder:
        for _ in range(3):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(torch.func.functional_call(base, params, (torch.randn(8, 8),)),
                                                torch.randn(8, 2))
            loss.backward()
            recorder.record(loss)
            optimizer.step()
    store = Store(tmp_path / "s.db")
    assert all(p.grad is None for p in base.parameters()) and all(p.grad is not None for p in params.values())
    assert store.steps(recorder.run_id)["grad_norm"].tolist() == [0.0, 0.0, 0.0]
    assert store.run(recorder.run_id)["note"] == NO_GRADIENT_NOTE
