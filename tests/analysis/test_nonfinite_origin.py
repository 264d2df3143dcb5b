"""The ``nonfinite-origin`` finding: it names the module, phase and step the replay of the first non-finite step
found, and says whether the replay reproduced it - from a real Recorder run with a planted overflow, and on the
replay's rows for the cases a run rarely shows (nothing reproduced, the inputs, the loss)."""

import pandas as pd
import torch
from torch import nn

from mpdiag import Recorder, Store
from mpdiag.analysis.findings import diagnose, evidence_link, loss_spike_origin, nonfinite_origin


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.scores = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x, boost=1.0):
        return self.head(self.scores(torch.relu(self.embed(x))) * boost).mean()


def test_a_recorded_forward_overflow_is_named_with_its_step_phase_and_reproduction(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with Recorder(model, store=tmp_path / "s.db", scaler=scaler, optimizer=opt, replay=True) as rec:
        for step in range(15):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8), boost=1e6 if step == 9 else 1.0) ** 2
            scaler.scale(loss).backward()
            rec.record(loss)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    found = {f.rule: f for f in diagnose(Store(tmp_path / "s.db"), rec.run_id)}
    origin = found["nonfinite-origin"]
    # the product by boost happens in Net's own code, between `scores` (finite) and `head` (fed inf): the first
    # module whose inputs were finite and output not is the root, named by its class
    assert origin.severity == "error"
    assert origin.title == "step 9: the first inf/NaN was born in module 'Net' (Net) in the forward"
    assert "module 'Net' (Net)" in origin.evidence and "reproduced the event" in origin.evidence
    assert "held" in origin.evidence and "under FP16" in origin.evidence
    assert evidence_link(origin, rec.run_id) == f"/Modules?run={rec.run_id}&replay=9"


def replay(first_module, first_phase, reproduced=True, note=None):
    return pd.DataFrame([dict(step=4, trigger="nonfinite loss", reproduced=reproduced, first_module=first_module,
                              first_phase=first_phase, low_format="fp16", format_max=65504.0, note=note)])


MODULES = pd.DataFrame([dict(step=4, phase="backward", ord=0, module="act", type="Softplus", absmax=70000.0,
                             nonfinite=0, in_absmax=3.0, in_nonfinite=0)])


def test_an_overflow_past_fp16s_max_is_quoted_and_a_backward_offender_gets_backward_advice():
    origin = nonfinite_origin(replay("act", "backward"), MODULES)
    assert "backward gradient reached 70000, past FP16's largest finite value 65504" in origin.evidence
    assert "output gradient was finite (absmax 3)" in origin.evidence
    assert "backward" in origin.recommendation and origin.severity == "error"
    assert origin.title == "step 4: the first inf/NaN was born in module 'act' (Softplus) in the backward"


def test_a_backward_offender_fed_a_large_input_is_sent_to_its_input_not_to_a_custom_function():
    """A user's unnormalised batch (absmax ~30,000) reached a plain Linear at ~15,000, whose weight gradient (output
    gradient times input) overflowed FP16 in the backward: the advice sent them to "the backward of '4' (a custom
    autograd Function's in particular)". With the replay's forward row of that module, it names the input."""
    rows = pd.DataFrame([
        dict(step=4, phase="backward", ord=1, module="4", type="Linear", absmax=63744.0, nonfinite=74,
             in_absmax=1077.0, in_nonfinite=0),
        dict(step=4, phase="forward", ord=4, module="4", type="Linear", absmax=23856.0, nonfinite=0,
             in_absmax=15432.0, in_nonfinite=0)])
    origin = nonfinite_origin(replay("4", "backward"), rows)
    assert origin.title == "step 4: the first inf/NaN was born in module '4' (Linear) in the backward"
    assert origin.recommendation.startswith("Its input in the forward reached absmax 15,432, and a weight's gradient "
                                            "is the output gradient times that input: scale the inputs down")
    assert "custom autograd Function" not in origin.recommendation
    small = rows.assign(in_absmax=[1077.0, 3.0])  # a small input: the backward itself, as before
    assert "custom autograd Function" in nonfinite_origin(replay("4", "backward"), small).recommendation


def test_not_reproduced_is_a_warning_that_points_away_from_numerics():
    origin = nonfinite_origin(replay(None, None, reproduced=False), MODULES.iloc[:0])
    assert origin.severity == "warning" and "did not reproduce" in origin.title
    assert "non-determinism" in origin.evidence


def test_the_inputs_and_the_loss_are_named_as_such():
    assert "data loader" in nonfinite_origin(replay("(inputs)", "forward"), MODULES.iloc[:0]).recommendation
    assert "loss function" in nonfinite_origin(replay("(loss)", "backward"), MODULES.iloc[:0]).recommendation


def test_no_replay_no_finding():
    assert nonfinite_origin(replay(None, None).iloc[:0], MODULES.iloc[:0]) is None


def test_weights_broken_before_the_step_point_to_an_earlier_optimizer_step():
    origin = nonfinite_origin(replay("act", "backward", note="its weights already held inf/NaN before the step: "
                                     "act.weight"), MODULES)
    assert "but its weights already held inf/NaN before the step: act.weight" in origin.evidence
    assert "earlier optimizer step" in origin.recommendation


def test_a_loss_spikes_replay_is_its_own_finding_and_never_nonfinite_origin():
    spike = replay(None, None, reproduced=False, note="no module's output was 10x its output on step 3's batch")
    spike["trigger"] = "loss spike"
    assert nonfinite_origin(spike, MODULES) is None
    found = loss_spike_origin(spike, losses(3.0))
    assert (found.rule, found.severity, found.page, found.focus) == ("loss-spike-origin", "warning", "Modules",
                                                                     {"replay": 4})
    assert found.title == "step 4's loss spike was not localised in the model"
    assert "(a loss spike: 100% above the mean of up to 128 finite losses before it)" in found.evidence
    assert found.evidence.endswith(": no module's output was 10x its output on step 3's batch: the spike came from "
                                   "outside the model (the loss function, the targets) or from a rise spread over "
                                   "many modules.")
    assert loss_spike_origin(replay("act", "backward"), losses(3.0)) is None  # a non-finite step's replay is not a spike's
    named = replay("0", "forward", reproduced=False, note="0's output at step 4 was 12x")
    named["trigger"] = "loss spike"
    # a Sequential's child '0' is quoted as every finding quotes a module: bare, "began in 0" read as a number
    assert loss_spike_origin(named, losses(3.0)).title == "step 4's loss spike began in module '0'"


def losses(at_spike: float) -> pd.DataFrame:
    """A run's steps: losses 1.0, 2.0, 1.5 (mean 1.5; a NaN among them is no value of the mean), then ``at_spike``
    at step 4, the replayed spike's step."""
    return pd.DataFrame({"step": range(5), "loss": [1.0, float("nan"), 2.0, 1.5, at_spike]})


def test_a_small_rise_nothing_in_the_model_explains_is_information_not_a_warning():
    """The Quick start's failing run: a flat loss rising 15 % (6 sigma of its window) was a warning to check the
    loss function and the targets, where nothing was wrong with them. Below a 50 % rise an unlocalised spike is
    information; a module or a batch behind it stays a warning whatever the rise."""
    spike = replay(None, None, reproduced=False, note="no module's output was 10x its output on step 3's batch")
    spike["trigger"] = "loss spike"
    small = loss_spike_origin(spike, losses(1.725))  # 15 % above the mean 1.5
    assert (small.severity, small.title) == ("info", "step 4's loss rose 15%: no module or batch behind it")
    assert "15% above the mean" in small.evidence and small.recommendation.startswith("Nothing to change")
    assert small.evidence.endswith("on step 3's batch.")  # no word of the loss function or the targets
    assert loss_spike_origin(spike, losses(2.25)).severity == "warning"  # 50 %
    named = replay("0", "forward", reproduced=False, note="0's output at step 4 was 12x")
    named["trigger"] = "loss spike"
    assert loss_spike_origin(named, losses(1.725)).severity == "warning"


def test_the_spike_window_is_the_spike_rules():
    from mpdiag.analysis import findings
    from mpdiag.recording import events

    assert findings.SPIKE_WINDOW == events.SPIKE_WINDOW
