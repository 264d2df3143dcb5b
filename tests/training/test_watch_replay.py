"""The replay under ``mpdiag watch``, against planted truth in an unmodified watched script
(tests/fixtures/scripts/replay_planted.py, FP16 autocast on the CPU with a GradScaler): each planted fault is
replayed at its step and its module named - an attention-score overflow at step 37 of 60 (forward), an overflow in
a custom autograd Function's backward at step 21 (backward), a NaN from log(0) in the loss head, the first under
torch.compile too, and a loss spike from one batch a thousand times larger (its BF16 twin, no scaler). The replay's two hooks on the script's model stay out of the script's own checkpoints and
copies of it, and the watched training is bit-identical to the same script run without mpdiag."""

import json
import runpy
import sys

import pytest
import torch
from conftest import FIXTURES

from mpdiag import Store
from mpdiag.recording.replay import BACKWARD, FORWARD, INPUTS
from mpdiag.training.watch import WatchConfig, watch

SCRIPT = FIXTURES / "scripts" / "replay_planted.py"


def watched(tmp_path, *args):
    """The script watched with ``args`` (and ``--out``): (store, run id, what the script wrote)."""
    store, out = tmp_path / "s.db", tmp_path / "out"
    out.mkdir()
    run_id, code = watch(WatchConfig(target=str(SCRIPT), args=(*args, "--out", str(out))), store)
    assert code == 0
    return Store(store), run_id, out


@pytest.mark.parametrize("args, step, trigger, module, phase", [
    (("60", "sharpen=1e6", "37"), 37, "nonfinite loss", "attn", FORWARD),
    (("30", "gain=1e9", "21"), 21, "nonfinite gradients", "gain", BACKWARD),
    (("40", "confidence=1e4", "30"), 30, "nonfinite loss", "loss_head", FORWARD),
    (("40", "sharpen=1e6", "37", "--compile"), 37, "nonfinite loss", "attn", FORWARD),
    (("45", "batch=1e3", "40", "--spike"), 40, "loss spike", INPUTS, FORWARD),
], ids=["attention-forward", "function-backward", "log0-loss-head", "attention-compiled", "corrupted-batch-spike"])
def test_a_planted_fault_in_a_watched_script_is_named_at_its_step(tmp_path, args, step, trigger, module, phase):
    store, run_id, _ = watched(tmp_path, *args)
    replays = store.replays(run_id)
    assert len(replays) == 1
    found = replays.iloc[0]
    assert (found.step, found.trigger, found.first_module, found.first_phase, bool(found.reproduced)) == \
        (step, trigger, module, phase, True)
    assert len(store.steps(run_id)) == int(args[0])
    # an overflowed gradient is the scaler's to skip: no event, the replay still
    event = {"nonfinite loss": "nonfinite", "loss spike": "loss-spike"}.get(trigger)
    if event is not None:
        assert list(store.events(run_id).query(f"kind == '{event}'").step) == [step]


def test_the_scripts_checkpoints_and_copies_carry_no_mpdiag_hook(tmp_path):
    """At step 3 the replay's two hooks sit on the script's model; its torch.save(model) loads back with
    weights_only=False and with weights_only=True (its own classes allowed), its state_dict with
    weights_only=True, and its copy.deepcopy (an EMA model) holds no hook, each with the model's weights."""
    _, _, out = watched(tmp_path, "6", "batch=1", "0", "--checkpoint-at", "3")
    seen = json.loads((out / "report.json").read_text())["checkpoint"]
    assert seen == {"load_whole": True, "load_whole_weights_only": True, "load_state_dict": True, "deepcopy": True,
                    "hooks_on_model": 2, "hooks_on_copy": 0}
    assert "__reduce_ex__" not in vars(torch.nn.Module)  # watch's patch undone: object's again


def test_the_watched_training_with_its_replay_is_the_training_without_mpdiag(tmp_path, monkeypatch):
    """Dropout draws random numbers in the forward the replay repeats, at step 5: the losses and final weights of
    the watched script are bit-identical to the same script's run without mpdiag."""
    store, run_id, out = watched(tmp_path, "10", "sharpen=1e6", "5", "--dropout", "0.2")
    assert store.replays(run_id).iloc[0].step == 5
    plain = tmp_path / "plain"
    plain.mkdir()
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "10", "sharpen=1e6", "5", "--dropout", "0.2", "--out", str(plain)])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    losses = [json.loads((d / "report.json").read_text())["losses"] for d in (out, plain)]
    assert losses[0] == pytest.approx(losses[1], nan_ok=True, rel=0, abs=0)
    weights = [torch.load(d / "weights.pt") for d in (out, plain)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
