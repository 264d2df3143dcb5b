"""Finding optimizer-step-nonfinite: O3 + AdamW breaks inside the first optimizer step (FP16 state, eps=1e-8
rounds to 0), from a finite loss and finite gradients; the O2 rerun keeps FP32 state and trains."""

import json
import math

import numpy as np
import pytest
import torch
from loops import HALF_LOOP, first_broken_step

from mpdiag import Store
from mpdiag.analysis.findings import diagnose
from mpdiag.options import RunConfig
from mpdiag.training.runner import rerun, train
from mpdiag.training.script import ModelScript

SCRIPT = """
import torch

def build(device):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
            "batches": lambda step: (x, y),
            "loss_fn": lambda m, b: torch.nn.functional.mse_loss(m(b[0]).float(), b[1].float())}
"""


def test_o3_adamw_breaks_in_the_step_and_o2_fixes_it(write_script, store_path):
    path = write_script(SCRIPT, name="adamw_fp16.py")
    run_id = train(ModelScript.from_path(path), RunConfig(opt_level="O3", steps=4, device="cpu"), store_path)
    store = Store(store_path)
    assert store.run(run_id)["status"] == "finished", store.run(run_id)["error"]
    losses = store.steps(run_id)["loss"]
    assert math.isfinite(losses.iloc[0]) and not np.isfinite(losses.iloc[1:]).any()  # finite, then broken
    findings = diagnose(store, run_id)
    rules = [f.rule for f in findings]
    assert "optimizer-step-nonfinite" in rules
    finding = findings[rules.index("optimizer-step-nonfinite")]
    assert finding.severity == "error" and finding.fix == {"opt_level": "O2"}
    assert "AdamW" in finding.evidence and "float16" in finding.evidence and "Step 0" in finding.evidence
    names = set(store.tensors(run_id)["name"])
    assert finding.tensors and set(finding.tensors) <= names
    assert finding.tensors[0] in finding.evidence
    if "scale-collapse" in rules:
        assert rules.index("optimizer-step-nonfinite") < rules.index("scale-collapse")
    # ground truth: the same step in plain torch makes that tensor non-finite
    torch.manual_seed(0)
    spec = ModelScript.from_path(path).load_module().build(torch.device("cpu"))
    model = spec["model"].half()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    spec["loss_fn"](model, tuple(t.half() for t in spec["batches"](0))).backward()
    optimizer.step()
    assert not torch.isfinite(dict(model.named_parameters())[finding.tensors[0]]).all()
    assert optimizer.state[model[0].weight]["exp_avg_sq"].dtype == torch.float16

    fixed = rerun(store_path, run_id, opt_level=finding.fix["opt_level"])
    assert np.isfinite(store.steps(fixed)["loss"]).all()
    assert "optimizer-step-nonfinite" not in [f.rule for f in diagnose(store, fixed)]
    assert store.run(fixed)["config"]["optimizer"] == {"class": "AdamW", "state_dtype": "float32"}


def test_finite_run_records_no_event(write_script, store_path):
    path = write_script(SCRIPT, name="adamw_fp32.py")
    run_id = train(ModelScript.from_path(path), RunConfig(opt_level="O1", steps=3, device="cpu"), store_path)
    config = Store(store_path).run(run_id)["config"]
    assert "optimizer_step_nonfinite" not in config and config["run"]["opt_level"] == "O1"


# -- users' own loops: the Recorder, and mpdiag watch of an unmodified script ------------------------------------

def test_watch_of_a_loop_that_keeps_fp16_weights_finds_the_broken_step(store_path, write_script, tmp_path):
    from mpdiag.training.watch import WatchConfig, watch

    path = write_script(HALF_LOOP, name="half_loop.py")
    run_id, code = watch(WatchConfig(target=str(path), args=(str(tmp_path / "truth.json"),)), store_path)
    assert code == 0
    step, broken = first_broken_step(json.loads((tmp_path / "truth.json").read_text()))
    store = Store(store_path)
    config = store.run(run_id)["config"]
    event = config["optimizer_step_nonfinite"]
    assert event["step"] == step and event["optimizer"] == "AdamW"
    assert event["state_dtype"] == "float16" and event["weight_dtype"] == "float16"
    assert set(event["tensors"]) == set(broken) and set(broken) <= set(store.tensors(run_id)["name"])
    assert config["watch"]["argv"][-2:] == [str(path), str(tmp_path / "truth.json")]  # the rest is kept
    finding = next(f for f in diagnose(store, run_id) if f.rule == "optimizer-step-nonfinite")
    assert finding.fix is None and "FP32" in finding.recommendation and "model.half()" in finding.recommendation


def test_recorder_in_a_users_loop_finds_the_broken_step_and_keeps_its_config(store_path):
    from mpdiag import Recorder

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).half()
    optimizer = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 1e-4}])
    x, y = torch.randn(32, 8).half(), torch.randn(32, 1).half()
    truth = []
    with Recorder(model, store_path, config={"lr": 1e-3}) as recorder:  # no optimizer given: found by its hooks
        for _ in range(3):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
            loss.backward()
            recorder.record(loss)
            before = bool(torch.isfinite(loss)) and all(
                bool(torch.isfinite(p.grad).all()) and bool(torch.isfinite(p).all()) for p in model.parameters())
            optimizer.step()
            truth.append({"finite_before": before,
                          "broken": [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]})
    step, broken = first_broken_step(truth)
    config = Store(store_path).run(recorder.run_id)["config"]
    assert config["lr"] == 1e-3
    assert config["optimizer_step_nonfinite"]["step"] == step
    assert set(config["optimizer_step_nonfinite"]["tensors"]) == set(broken)
    assert recorder.optimizer_step_nonfinite == config["optimizer_step_nonfinite"]


def train_two_heads(store_path, **options) -> tuple[dict, list[dict]]:
    """An FP16 model of two heads: step 0 trains head a (gradients near 2, nothing underflows), later steps head b
    on inputs of 1e-5 (its first AdamW step squares gradients that underflow FP16: 0 / (0 + eps) with eps=1e-8
    also 0), so the update breaks at step 1. Returns the run's config and the loop's own account."""
    from mpdiag import Recorder

    torch.manual_seed(0)
    heads = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 1), "b": torch.nn.Linear(8, 1)}).half()
    optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-3)
    truth = []
    with Recorder(heads, store_path, optimizer=optimizer, **options) as recorder:
        for step in range(3):
            head, x = (heads["a"], torch.ones(4, 8)) if step == 0 else (heads["b"], torch.full((4, 8), 1e-5))
            optimizer.zero_grad(set_to_none=True)
            out = head(x.half()).float()
            loss = torch.nn.functional.mse_loss(out, out.detach() + 1)
            loss.backward()
            recorder.record(loss)
            before = bool(torch.isfinite(loss)) and all(
                (p.grad is None or bool(torch.isfinite(p.grad).all())) and bool(torch.isfinite(p).all())
                for p in heads.parameters())
            optimizer.step()
            truth.append({"finite_before": before,
                          "broken": [n for n, p in heads.named_parameters() if not bool(torch.isfinite(p).all())]})
    return Store(store_path).run(recorder.run_id)["config"], truth


def test_recorder_checks_logged_steps_only_and_only_when_asked(store_path):
    config, truth = train_two_heads(store_path)
    step, broken = first_broken_step(truth)
    assert step == 1 and broken == ["b.weight"]  # the loop's own account, as the docstring says
    assert config["optimizer_step_nonfinite"]["step"] == 1
    assert config["optimizer_step_nonfinite"]["tensors"] == ["b.weight"]
    # every=2 logs steps 0 and 2: step 1 is not checked, and step 2 starts from non-finite weights
    assert "optimizer_step_nonfinite" not in train_two_heads(store_path, every=2)[0]
    assert "optimizer_step_nonfinite" not in train_two_heads(store_path, check_optimizer_step=False)[0]


def test_recorder_in_an_fp32_loop_records_no_event(store_path):
    from mpdiag import Recorder

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Recorder(model, store_path, optimizer=optimizer) as recorder:
        for _ in range(3):
            optimizer.zero_grad()
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            recorder.record(loss)
            optimizer.step()
    assert "optimizer_step_nonfinite" not in Store(store_path).run(recorder.run_id)["config"]


@pytest.mark.parametrize("forged", [{"step": "0", "values": 5}, {"step": 0}, "broke", [1, 2],
                                    {"step": 0, "optimizer": "A", "weight_dtype": "f", "state_dtype": None,
                                     "tensors": [], "values": []}])
def test_a_forged_record_is_ignored_not_trusted(store_path, forged):
    """A run's config can come from a child running uploaded code: a record that is not the check's own shape
    gives no finding and no error (the Findings page and diagnose live on)."""
    from mpdiag import Recorder
    from mpdiag.store import StoreWriter

    model = torch.nn.Linear(2, 1)
    with Recorder(model, store_path) as recorder:
        model(torch.ones(1, 2)).sum().backward()
        recorder.record(1.0)
    StoreWriter(store_path).set_optimizer_step_nonfinite(recorder.run_id, forged)
    assert "optimizer-step-nonfinite" not in [f.rule for f in diagnose(Store(store_path), recorder.run_id)]


def test_recorder_checking_every_step_finds_a_step_it_does_not_log(store_path):
    """mpdiag's runner asks for every step (its single optimizer-step check is the Recorder's): at every=2 the
    broken step 1 is found although its statistics are not logged."""
    config, truth = train_two_heads(store_path, every=2, check_optimizer_step="every step")
    assert first_broken_step(truth) == (1, ["b.weight"])
    assert config["optimizer_step_nonfinite"]["step"] == 1
    assert config["optimizer_step_nonfinite"]["tensors"] == ["b.weight"]
    with pytest.raises(ValueError, match="check_optimizer_step"):
        train_two_heads(store_path, check_optimizer_step="sometimes")


def test_a_run_that_fails_after_the_broken_step_keeps_the_finding_and_its_optimizer(write_script, store_path):
    """The runner stores its whole configuration at the finding, not only at the end."""
    failing = SCRIPT.replace('"batches": lambda step: (x, y),',
                             '"batches": lambda step: (x, y) if step < 2 else 1 / 0,')
    path = write_script(failing, name="adamw_fp16_fails.py")
    run_id = train(ModelScript.from_path(path), RunConfig(opt_level="O3", steps=4, device="cpu"), store_path)
    run = Store(store_path).run(run_id)
    assert run["status"] == "failed" and "ZeroDivisionError" in run["error"]
    assert run["config"]["optimizer_step_nonfinite"]["step"] == 0
    assert run["config"]["optimizer"]["class"] == "AdamW" and run["config"]["run"]["opt_level"] == "O3"
