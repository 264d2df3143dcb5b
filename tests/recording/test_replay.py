"""The replay that localises a non-finite step, against planted truth: a Recorder in a plain user loop under FP16
autocast on CPU (with a GradScaler) meets an overflow planted in one named module at a known step - in the forward
(attention scores), in a custom autograd Function's backward, a NaN from log(0) in the loss head, the same under
torch.compile, a corrupted batch - and must replay that step, name that module and phase, and say it reproduced.
The replay must not change the training: the same seeded run with and without it is bit-identical."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fixtures.scripts.replay_planted import D, GradGain, Net, at  # the planted faults, shared with the watched tests
from fixtures.scripts.replay_planted import train as planted_train
from torch import nn

from mpdiag import Recorder, Store
from mpdiag.analysis.findings import diagnose, evidence_link
from mpdiag.recording.replay import BACKWARD, FORWARD, INPUTS


def train(store, steps, plant, *, replay=True, record=True, **options):
    """The planted loop (FP16 autocast on the CPU, a GradScaler) recorded by a Recorder in the user's loop, or
    (``record=False``) without mpdiag. Returns (recorder or None, losses, final weights)."""
    def recorder(called, scaler, opt):
        return Recorder(called, store=store, scaler=scaler, optimizer=opt, replay=replay) if record else None

    return planted_train(steps, plant, recorder=recorder, **options)


def replayed(store, rec):
    replays = Store(store).replays(rec.run_id)
    assert len(replays) == 1
    return replays.iloc[0]


def test_attention_score_overflow_in_the_forward_is_named_at_its_step(tmp_path):
    store = tmp_path / "s.db"
    rec, _, _ = train(store, 60, at(37, {"sharpen": 1e6}))
    found = replayed(store, rec)
    assert (found.step, found.trigger, found.first_module, found.first_phase) == (37, "nonfinite loss", "attn", FORWARD)
    assert found.reproduced and found.low_format == "fp16" and found.format_max == 65504.0
    modules = Store(store).replay_modules(rec.run_id, step=37)
    forward = modules[modules.phase == FORWARD]
    # execution order: a module completes after the modules it calls; attn's own inputs were finite
    assert list(forward.module) == ["inp", "drop", "attn.q", "attn.k", "attn.v", "attn.out", "attn", "mid", "gain",
                                    "logits", "loss_head", "Net"]
    by_name = forward.set_index("module")
    assert by_name.loc["attn", "nonfinite"] > 0 and by_name.loc["attn", "in_nonfinite"] == 0
    assert by_name.loc["attn.q", "nonfinite"] == 0
    assert (modules.phase == BACKWARD).sum() == 0  # the forward already named it: no backward replayed
    assert list(Store(store).events(rec.run_id).step) == [37]


def test_overflow_inside_a_custom_autograd_functions_backward_is_named_in_backward(tmp_path):
    store = tmp_path / "s.db"
    rec, _, _ = train(store, 30, at(21, {"gain": 1e9}))
    found = replayed(store, rec)
    assert (found.step, found.trigger, found.first_module, found.first_phase) == \
        (21, "nonfinite gradients", "gain", BACKWARD)
    assert found.reproduced
    modules = Store(store).replay_modules(rec.run_id, step=21)
    backward = modules[modules.phase == BACKWARD].set_index("module")
    assert backward.loc["gain", "nonfinite"] > 0 and backward.loc["gain", "in_nonfinite"] == 0
    assert backward.loc["logits", "nonfinite"] == 0  # reached before it, finite
    assert backward.loc["mid", "in_nonfinite"] > 0  # it received the overflow: not where it was born
    assert modules[modules.phase == FORWARD].nonfinite.sum() == 0


def test_nan_from_log_of_zero_in_the_loss_head_is_named(tmp_path):
    store = tmp_path / "s.db"
    rec, _, _ = train(store, 40, at(30, {"confidence": 1e4}))  # logits far apart: a probability underflows to 0
    found = replayed(store, rec)
    assert (found.step, found.first_module, found.first_phase, found.reproduced) == (30, "loss_head", FORWARD, True)


def test_under_torch_compile_the_eager_module_is_replayed_and_named(tmp_path):
    store = tmp_path / "s.db"
    rec, _, _ = train(store, 45, at(37, {"sharpen": 1e6}), compile_=True)
    found = replayed(store, rec)
    assert (found.step, found.first_module, found.first_phase, found.reproduced) == (37, "attn", FORWARD, True)


def test_a_corrupted_batch_names_the_inputs(tmp_path):
    store = tmp_path / "s.db"
    rec, _, _ = train(store, 12, at(7, factor=float("nan")))
    found = replayed(store, rec)
    assert (found.step, found.first_module, found.first_phase) == (7, INPUTS, FORWARD)


@pytest.mark.parametrize("steps, spike", [(20, False), (45, True)], ids=["fp16", "bf16-past-the-spike-window"])
def test_healthy_run_replays_nothing(tmp_path, steps, spike):
    """Nothing planted: no replay, also past the 32 losses the spike rule needs."""
    store = tmp_path / "s.db"
    rec, _, _ = train(store, steps, at(-1), spike=spike)
    assert rec.replayed is None and rec.spike_replayed is None and Store(store).replays(rec.run_id).empty


@pytest.mark.parametrize("step, kwargs, factor, steps, spike", [(5, {"sharpen": 1e6}, 1.0, 12, False),
                                                                (5, {"gain": 1e9}, 1.0, 12, False),
                                                                (40, {}, 1e3, 42, True)],
                         ids=["forward", "backward", "spike"])
def test_the_replay_changes_nothing_in_the_training(tmp_path, step, kwargs, factor, steps, spike):
    """Dropout draws random numbers in the forward the replay repeats: the replay must restore the random state,
    and leave the weights, gradients and scaler alone; bit-identical to the same run without it and without
    mpdiag at all (a spike's replay runs two forwards, and keeps the previous step's batch a step longer)."""
    plant = at(step, kwargs, factor)
    with_replay, losses, weights = train(tmp_path / "a.db", steps, plant, dropout=0.2, spike=spike)
    replayed = with_replay.spike_replayed if spike else with_replay.replayed
    assert replayed is not None and replayed.step == step and replayed.reproduced
    for other in (dict(replay=False), dict(record=False)):
        _, other_losses, other_weights = train(tmp_path / "b.db", steps, plant, dropout=0.2, spike=spike, **other)
        assert other_losses == pytest.approx(losses, nan_ok=True, rel=0, abs=0)
        assert all(torch.equal(weights[k], other_weights[k]) for k in weights)


def test_a_default_recorder_leaves_the_model_picklable_as_the_user_saves_it(tmp_path):
    """torch.save of the whole model under a default Recorder holds nothing of mpdiag's: torch.load with
    weights_only=True (the default) takes it back, allowing only the model's own classes."""
    import io

    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    rec = Recorder(model, store=tmp_path / "s.db")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals([nn.Sequential, nn.Linear, nn.ReLU]):
        loaded = torch.load(buffer)
    assert torch.equal(loaded[0].weight, model[0].weight)
    rec.close()


class InPlace(nn.Module):
    """A block that applies ReLU in place to its Linear's output, functionally: full backward hooks refuse it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return self.lin(x).relu_()


def in_place_loop(store, model, plant_step, loss_factor=1.0, gain=1.0, sharpen=1.0):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Recorder(model, store=store, optimizer=opt, replay=True) as rec:
        for step in range(6):
            planted = step == plant_step
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(4, D) * (sharpen if planted else 1.0), gain if planted else 1.0)
            (out.float() ** 2).mean().backward()
            rec.record((out.float() ** 2).mean().detach())
            opt.step()
            opt.zero_grad()
    return rec.replayed


class ReluNet(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.a, self.act, self.block, self.gain, self.b = nn.Linear(D, D), nn.ReLU(inplace=True), block, GradGain(), \
            nn.Linear(D, 1)

    def forward(self, x, gain):
        return self.b(self.gain(self.block(self.act(self.a(x))), gain=gain))


def test_relu_in_place_modules_do_not_stop_the_backward_replay(tmp_path):
    found = in_place_loop(tmp_path / "s.db", ReluNet(nn.Sequential(nn.Linear(D, D), nn.ReLU(inplace=True))), 3,
                          gain=1e9)
    assert (found.step, found.first_module, found.first_phase, found.reproduced, found.note) == \
        (3, "gain", BACKWARD, True, None)


def test_an_in_place_op_in_a_forward_falls_back_to_replaying_the_forward(tmp_path):
    torch.manual_seed(0)
    model = ReluNet(InPlace())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Recorder(model, store=tmp_path / "s.db", optimizer=opt, replay=True) as rec:
        for step in range(6):
            with torch.no_grad():  # planted: block.lin's weights blown up at step 2, restored after its record
                model.block.lin.weight.mul_(1e5 if step == 2 else 1.0)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(4, D), 1.0)
            loss = (out.float() ** 2).mean()
            loss.backward()
            rec.record(loss)
            with torch.no_grad():
                model.block.lin.weight.div_(1e5 if step == 2 else 1.0)
            opt.zero_grad()  # no optimizer step: the weights stay as planted
    found = rec.replayed
    # block.lin's fp16 output overflows to inf (its inputs finite); relu_ in InPlace refuses backward hooks
    assert (found.step, found.first_module, found.first_phase, found.reproduced) == (2, "block.lin", FORWARD, True)
    assert found.note.startswith("the forward only")


def test_a_replay_that_cannot_copy_the_model_says_so_and_training_goes_on(tmp_path, monkeypatch):
    import mpdiag.recording.replay as replay_module

    def refuse(_):
        raise torch.OutOfMemoryError("no room for the copy")

    monkeypatch.setattr(replay_module, "copy", SimpleNamespace(deepcopy=refuse))  # the replay's copy alone
    rec, losses, _ = train(tmp_path / "s.db", 10, at(4, {"sharpen": 1e6}))
    assert len(losses) == 10
    found = replayed(tmp_path / "s.db", rec)
    assert found.step == 4 and found.first_module is None and not found.reproduced
    assert found.note == "the replay failed: OutOfMemoryError: no room for the copy"


def test_weights_already_broken_are_said_in_the_note(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Recorder(model, store=tmp_path / "s.db", optimizer=opt, replay=True) as rec:
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model.mid.weight[0, 0] = float("nan")  # as an optimizer step that broke it would leave it
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 6, D), torch.randint(0, 4, (4,)))
            loss.backward()
            rec.record(loss)
            opt.step()
            opt.zero_grad()
    found = rec.replayed
    assert (found.step, found.first_module, found.first_phase) == (2, "mid", FORWARD)
    assert found.note == "its weights already held inf/NaN before the step: mid.weight"


def spiked(store, plant):
    """The planted loop's finite twin (BF16, no scaler; tests/fixtures/scripts/replay_planted.py's ``--spike``),
    45 steps, a spike planted at step 40 (the loss-spike rule needs 32 losses before it)."""
    rec, losses, _ = train(store, 45, plant, spike=True)
    replays = Store(store).replays(rec.run_id)
    assert len(replays) == 1 and rec.replayed is None
    return rec, losses, replays.iloc[0], Store(store).replay_modules(rec.run_id)


def test_a_loss_spike_from_one_corrupted_batch_names_the_inputs(tmp_path):
    """One batch a thousand times larger at step 40: the loss spikes (finite) and the replay of steps 39 and 40 on
    one copy says the batch was already about 1000x larger before any module ran."""
    rec, losses, found, modules = spiked(tmp_path / "s.db", at(40, factor=1e3))
    assert losses[40] > 50 * max(losses[:40])  # planted: a spike, finite
    assert (found.step, found.trigger, found.first_module, found.first_phase, found.reproduced) == \
        (40, "loss spike", INPUTS, FORWARD, True)
    assert list(Store(tmp_path / "s.db").events(rec.run_id).query("kind == 'loss-spike'").step) == [40]
    root = modules[modules.module == "SpikeNet"].set_index("step")
    batch_ratio = root.loc[40, "in_absmax"] / root.loc[39, "in_absmax"]
    assert 1e3 / 1.5 < batch_ratio < 1e3 * 1.5  # planted x1000; two random batches' absmax differ by less than 1.5x
    assert found.note.startswith(f"the batch at step 40 was already {batch_ratio:.3g}x larger than the step before")
    # the replayed spike step's loss is the loss the training computed
    assert root.loc[40, "absmax"] == pytest.approx(losses[40], rel=1e-6)
    origin = next(f for f in diagnose(Store(tmp_path / "s.db"), rec.run_id) if f.rule == "loss-spike-origin")
    assert origin.title == "step 40's loss spike came in with its batch"
    rise = losses[40] / np.mean([v for v in losses[:40] if np.isfinite(v)]) - 1  # the training's own losses
    assert f"forwards of step 40 (a loss spike: {rise:.0%} above the mean of up to 128 finite losses before it) and " \
           f"of step 39 on one copy of the model with step 40's weights: {found.note}." in origin.evidence
    assert evidence_link(origin, rec.run_id) == f"/Modules?run={rec.run_id}&replay=40"
    assert not any(f.rule == "nonfinite-origin" for f in diagnose(Store(tmp_path / "s.db"), rec.run_id))


def test_a_loss_spike_born_in_a_module_names_that_module(tmp_path):
    """``boost`` multiplies its output by 100 at step 40, its inputs unchanged: named, with its rise."""
    _, _, found, modules = spiked(tmp_path / "s.db", at(40, {"boost": 100.0}))
    assert (found.step, found.first_module, found.first_phase) == (40, "boost", FORWARD)
    boost = modules[modules.module == "boost"].set_index("step")
    rise = boost.loc[40, "absmax"] / boost.loc[39, "absmax"]
    assert 100 / 1.5 < rise < 100 * 1.5  # planted x100 on the output of two different batches
    assert found.note.startswith(f"boost's output at step 40 was {rise:.3g}x its output on step 39's batch")


def test_a_spike_in_a_batch_of_token_ids_is_named_at_its_embedding():
    """Integer ids have no magnitude to compare (their ratio is unknown, and not said): the first module whose
    output rose 10x while its inputs did not - the embedding, when the batch is to blame - is named."""
    from mpdiag.recording.spike_rule import spike_offender

    nan = float("nan")
    previous = [("tok", "Embedding", 1.0, 0, nan, 0), ("head", "Linear", 2.0, 0, 1.0, 0), ("LM", "LM", 2.0, 0, nan, 0)]
    current = [("tok", "Embedding", 30.0, 0, nan, 0), ("head", "Linear", 60.0, 0, 30.0, 0), ("LM", "LM", 60.0, 0, nan, 0)]
    assert spike_offender(5, previous, current, nan, nan) == \
        ("tok", "tok's output at step 5 was 30x its output on step 4's batch (absmax 30 against 1)")


def test_a_spike_no_module_explains_names_the_largest_rise_as_a_module():
    """Nothing rose 10x: the note names the largest rise seen, the module quoted as the page's other findings
    quote one (a bare '1' beside the ratio read as a number: "largest rise: 1, 1.5x")."""
    from mpdiag.recording.spike_rule import spike_offender

    previous = [("0", "Linear", 2.0, 0, 1.0, 0), ("1", "Linear", 2.0, 0, 2.0, 0)]
    current = [("0", "Linear", 2.2, 0, 1.0, 0), ("1", "Linear", 3.0, 0, 2.2, 0)]
    name, note = spike_offender(7, previous, current, 1.0, 1.0)
    assert name is None and "(largest rise: module '1', 1.5x; the batch was 1x)" in note
