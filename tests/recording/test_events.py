"""Events while training, against planted truth: a NaN loss, one corrupted batch's loss spike, a scale collapse and
a streak of skipped steps, each at a known step, found at that step and kind by a real Recorder in a user's loop;
the rules' edges on rows; and healthy runs (every bundled example in its fixed form, the gallery's FP32 twins)
raise none."""

import importlib
import math

import pytest
import torch
from conftest import EXAMPLES

from mpdiag import Recorder, Store
from mpdiag.options import ConfigError, StopOn
from mpdiag.recording.events import (
    GRAD_NORM_SPIKE,
    LOSS_SPIKE,
    MAX_PER_KIND,
    NONFINITE,
    SCALE_COLLAPSE,
    SKIP_STREAK,
    SKIPS,
    SPIKE_MIN_VALUES,
    EventLog,
)
from mpdiag.store import StepRow
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript

NAN = float("nan")


def row(step, loss=1.0, skipped=0, scale=1.0, scale_after=1.0, norm=1.0):
    return StepRow(step, loss, scale, skipped, 0, scale_after, 0.1, 0, 1, 1e-3, norm, 0.1)


def kinds(log: EventLog):
    return [(event[0], event[1]) for event in log.take()]


# -- the rules on rows ---------------------------------------------------------------------------------------
def test_nonfinite_loss_fires_once_at_its_step():
    log = EventLog()
    for step in range(10):
        log.see(row(step, loss=NAN if step >= 6 else 1.0, norm=NAN if step >= 6 else 1.0))
    assert kinds(log) == [(6, NONFINITE)]


def test_overflow_the_scaler_skips_is_no_nonfinite_event_but_applied_inf_gradients_are():
    log = EventLog()
    log.see(row(0, norm=math.inf, skipped=1, scale=2.0**16, scale_after=2.0**15))  # the scaler's job
    log.see(row(1))
    assert kinds(log) == []
    log.see(row(2, norm=math.inf, skipped=0))  # no scaler: inf gradients applied
    assert kinds(log) == [(2, NONFINITE)]


def test_an_inf_norm_of_finite_gradients_is_not_called_non_finite_gradients(store_path):
    """Gradients of 1e20 are finite, but their squares pass FP32's range: the norm is inf (torch's too). The event
    fires at that step and says the norm is non-finite and why it may be, not that the gradients are."""
    w = torch.nn.Parameter(torch.ones(4))
    model = torch.nn.Module()
    model.w = w
    optimizer = torch.optim.SGD([w], lr=0.0)
    with Recorder(model, store=store_path, optimizer=optimizer) as recorder:
        for step in range(3):
            optimizer.zero_grad()
            loss = (w * (1e20 if step == 1 else 1.0)).sum()
            loss.backward()
            recorder.record(loss)
            assert w.grad.isfinite().all()
            assert math.isinf(torch.nn.utils.clip_grad_norm_([w], 1e30)) == (step == 1)
            optimizer.step()
    events = Store(store_path).events(recorder.run_id)
    assert events[["step", "kind"]].values.tolist() == [[1, NONFINITE]]
    summary = events["evidence"][0]["summary"]
    assert "non-finite gradient norm" in summary and "values too large to square" in summary


def test_a_loop_that_gives_no_loss_is_no_nonfinite_event():
    log = EventLog()
    for step in range(5):
        log.see(row(step, loss=NAN))  # watch saw no backward: NaN loss, finite gradients
    assert kinds(log) == []
    log = EventLog(grads_read=False)  # a process that reads no gradient norm: its rows hold NaN
    log.see(row(0, norm=NAN))
    assert kinds(log) == []


def test_a_skip_streak_fires_at_the_step_that_makes_it_and_again_for_a_later_streak():
    log = EventLog()
    skipped = [0, 1, 1, 1, 1, 0, *([1] * SKIP_STREAK), 1, 1, 0, *([1] * SKIP_STREAK)]
    for step, s in enumerate(skipped):
        log.see(row(step, skipped=s))
    first = 6 + SKIP_STREAK - 1
    second = len(skipped) - 1
    assert kinds(log) == [(first, SKIPS), (second, SKIPS)]


def test_scale_collapse_fires_once_below_one():
    log = EventLog()
    scale = 8.0
    for step in range(8):
        log.see(row(step, skipped=1 if step < 2 else 0, scale=scale, scale_after=scale / 2 if step < 5 else scale))
        scale = scale / 2 if step < 5 else scale
    # 8 -> 4 -> 2 -> 1 -> 0.5 at step 3; skipped steps 0-1 only (no streak of 5)
    assert kinds(log) == [(3, SCALE_COLLAPSE)]


def test_spike_rules_need_a_full_window_and_a_real_rise():
    log = EventLog()
    for step in range(SPIKE_MIN_VALUES - 1):
        log.see(row(step, loss=1.0 + 0.01 * (step % 3)))
    log.see(row(SPIKE_MIN_VALUES - 1, loss=50.0))  # too early: the window is not full yet
    assert kinds(log) == []
    log = EventLog()
    for step in range(100):
        log.see(row(step, loss=1.0 + 1e-9 * (step % 2)))  # flat: sigma tiny
    log.see(row(100, loss=1.0 + 1e-6))  # above mean + 6 sigma, yet no real rise
    log.see(row(101, loss=3.0, norm=40.0))
    assert kinds(log) == [(101, LOSS_SPIKE), (101, GRAD_NORM_SPIKE)]


def test_events_of_one_kind_are_capped_and_stop_on_names_the_first():
    log = EventLog(StopOn.parse("spike"))
    step = 0
    for _ in range(MAX_PER_KIND + 5):
        for _ in range(SPIKE_MIN_VALUES):
            log.see(row(step))
            step += 1
        log.see(row(step, loss=1e6 * step))
        step += 1
    events = log.take()
    assert sum(e[1] == LOSS_SPIKE for e in events) == MAX_PER_KIND
    assert log.stop_reason.startswith(f"--stop-on spike: {LOSS_SPIKE} at step {SPIKE_MIN_VALUES}:")


def test_stop_on_is_parsed_and_refused_naming_the_flag():
    stop = StopOn.parse(" nonfinite, skips:3 ")
    assert (stop.nonfinite, stop.spike, stop.skips, stop.text) == (True, False, 3, "nonfinite,skips:3")
    assert not StopOn.parse("") and StopOn.parse("spike")
    for bad in ("nan", "skips", "skips:0", "spike:2"):
        with pytest.raises(ConfigError, match="--stop-on"):
            StopOn.parse(bad)
    log = EventLog(StopOn.parse("skips:2"))  # skips:N sets the streak the rule reports
    for step in range(3):
        log.see(row(step, skipped=1))
    assert kinds(log) == [(1, SKIPS)] and "skips at step 1" in log.stop_reason


# -- planted truth: a real Recorder in a user's loop ---------------------------------------------------------
def _loop(tmp_path, steps, corrupt=None, scaler=None, stop_on=None, overflow=lambda step: False):
    """A small regression model trained for ``steps``; ``corrupt(step, x, y)`` plants a fault in a batch;
    ``overflow(step)``: that step's backward overflows (a gradient inf, the loss finite)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    true_w = torch.randn(8, 1)
    recorder = Recorder(model, tmp_path / "runs.db", scaler=scaler, optimizer=opt)
    if stop_on:
        recorder.events.configure(StopOn.parse(stop_on))
    for step in range(steps):
        x = torch.randn(32, 8)
        y = x @ true_w + 0.1 * torch.randn(32, 1)
        if corrupt is not None:
            x, y = corrupt(step, x, y)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if overflow(step):
            model[2].bias.grad.fill_(math.inf)
        recorder.record(loss)
        if recorder.events.stop_reason is not None:  # --stop-on: this step is not taken
            break
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    recorder.close()
    store = Store(tmp_path / "runs.db")
    return store, recorder.run_id


def _found(store, run_id):
    return [(int(s), k) for s, k in store.events(run_id)[["step", "kind"]].values]


def test_a_nan_loss_planted_at_step_40_is_the_nonfinite_event_at_40(tmp_path):
    def corrupt(step, x, y):
        return (x * NAN, y) if step == 40 else (x, y)

    store, run_id = _loop(tmp_path, 60, corrupt)
    assert _found(store, run_id) == [(40, NONFINITE)]
    evidence = store.events(run_id)["evidence"].iloc[0]
    assert evidence["loss"] == "nan" and evidence["skipped"] == 0 and "summary" in evidence


def test_one_corrupted_batch_at_step_70_is_a_loss_and_gradient_norm_spike_at_70(tmp_path):
    def corrupt(step, x, y):
        return (x, y * 30.0) if step == 70 else (x, y)  # one batch with wildly wrong labels

    store, run_id = _loop(tmp_path, 90, corrupt)
    # the damaged weights' gradient norm stays high at step 71: the same episode, no second event
    assert _found(store, run_id) == [(70, LOSS_SPIKE), (70, GRAD_NORM_SPIKE)]
    assert store.run(run_id)["status"] == "finished"


def test_overflow_from_step_10_is_a_skip_streak_and_a_scale_collapse_at_their_steps(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    store, run_id = _loop(tmp_path, 20, scaler=scaler, overflow=lambda step: step >= 10)  # every step skipped
    # skipped from step 10: the 5th in a row is step 14; the scale 16 halves at each: 8, 4, 2, 1, 0.5 after 14
    assert _found(store, run_id) == [(14, SKIPS), (14, SCALE_COLLAPSE)]


def test_stop_on_nonfinite_ends_a_recorder_loop_stopped_with_the_reason_and_every_row(tmp_path):
    def corrupt(step, x, y):
        return (x * NAN, y) if step == 12 else (x, y)

    store, run_id = _loop(tmp_path, 60, corrupt, stop_on="nonfinite")
    run = store.run(run_id)
    assert run["status"] == "stopped" and "nonfinite at step 12" in run["error"]
    steps = store.steps(run_id)
    assert steps["step"].tolist() == list(range(14))  # stopped at the next record: step 13 did not step
    assert math.isnan(steps["skipped"].iloc[-1]) and (steps["skipped"].iloc[:-1] == 0).all()


# -- healthy runs raise none ---------------------------------------------------------------------------------
def test_a_healthy_example_raises_no_event(tmp_path):
    run_id = train(ModelScript.from_path(EXAMPLES / "mlp_digits.py"),
                   RunConfig(opt_level="O1", steps=SPIKE_MIN_VALUES + 20, device="cpu"), tmp_path / "runs.db")
    store = Store(tmp_path / "runs.db")
    assert store.run(run_id)["status"] == "finished" and store.events(run_id).empty


@pytest.mark.slow
@pytest.mark.parametrize("name, level, steps", [("mlp_digits.py", "O1", 200), ("mlp_digits.py", "O2", 200),
                                                ("cnn_digits.py", "O1", 120), ("cnn_digits.py", "bf16", 120),
                                                ("transformer_lm.py", "O1", 60), ("fp8_amax_jump.py", "O0", 60)])
def test_bundled_examples_raise_no_event(tmp_path, name, level, steps):
    run_id = train(ModelScript.from_path(EXAMPLES / name), RunConfig(opt_level=level, steps=steps, device="cpu"),
                   tmp_path / "runs.db")
    store = Store(tmp_path / "runs.db")
    assert store.run(run_id)["status"] == "finished"
    assert store.events(run_id)[["step", "kind"]].values.tolist() == []


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("gallery_*.py")))
def test_gallery_fixed_forms_and_fp32_twins_raise_no_event(tmp_path, name):
    module = importlib.import_module(f"mpdiag.examples.{name}")
    config = RunConfig(steps=60, device="cpu").with_options(**module.FIXED)
    script = ModelScript.from_path(EXAMPLES / f"{name}.py")
    fixed = train(script, config, tmp_path / "runs.db")
    twin = train(script, RunConfig(steps=60, device="cpu").with_options(**module.FAILING).fp32_twin(),
                 tmp_path / "runs.db")
    store = Store(tmp_path / "runs.db")
    for run_id in (fixed, twin):
        assert store.run(run_id)["status"] == "finished"
        assert store.events(run_id)[["step", "kind"]].values.tolist() == [], (name, run_id)
