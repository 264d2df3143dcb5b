"""Finding optimizer-step-nonfinite: O3 + AdamW breaks inside the first optimizer step (FP16 state, eps=1e-8
rounds to 0), from a finite loss and finite gradients; the O2 rerun keeps FP32 state and trains."""

import math

import numpy as np
import torch

from mpdiag import Store
from mpdiag.analysis.findings import diagnose
from mpdiag.training.config import RunConfig
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
