"""Compare and Findings on thinned runs (issue 28). Compare shows a value wherever a thinned run has one: the
Configuration table writes a default-retention run's ``every`` (stored as none) as the retention it had, and a
loop's steps (it plans no count) as those recorded, never "—"; the overlaid histograms at a step a run did not keep
in full say what it counted there all the same (its per-step signals). The Findings page names that dropped step
with its count. Two Recorder loops over gradients planted by hand: the default retention and --every 3; ground
truth: torch's FP16 casts of the planted gradients."""

import pytest
import torch
from app_helpers import app, step_slider, texts
from conftest import ROOT
from streamlit.testing.v1 import AppTest

from mpdiag import Recorder, Store
from mpdiag.analysis.compare import DEFAULT_RETENTION, MISSING, config_table

TIMEOUT = 60
STEPS, EVERY, DROPPED = 12, 3, 4  # --every 3 keeps 0, 3, 6, 9 and the overflow at 1 with its neighbours; 4 is dropped


def _planted(step: int) -> dict[str, torch.Tensor]:
    weight = torch.randn(64, generator=torch.Generator().manual_seed(step)) * 1e-2
    weight[-5:] = 1e-9  # below FP16's 2^-25: 5 values underflow at every step
    if step in (1, DROPPED):  # 1: the weight's first overflow, 2 values (kept); 4: its return, 3 (under a jump)
        weight[: 2 if step == 1 else 3] = 7e4
    bias = torch.full((8,), 0.5)
    return {"weight": weight, "bias": bias}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Run 1: the default retention; run 2: --every 3; the same planted gradients. Returns (path, planted)."""
    path = tmp_path_factory.mktemp("compare_retention") / "runs.db"
    planted = {step: _planted(step) for step in range(STEPS)}
    for every, name in ((None, "default"), (EVERY, "every 3")):
        model = torch.nn.Module()
        model.weight, model.bias = torch.nn.Parameter(torch.zeros(64)), torch.nn.Parameter(torch.zeros(8))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with Recorder(model, store=path, optimizer=opt, every=every, name=name) as rec:
            for step in range(STEPS):
                for tensor, p in model.named_parameters():
                    p.grad = planted[step][tensor].clone()
                rec.record(1.0)
                opt.step()
    kept = set(Store(path).kept_steps(2)["step"])
    assert DROPPED not in kept and DROPPED in set(Store(path).kept_steps(1)["step"])
    return path, planted


def test_the_configuration_writes_the_default_retention_and_the_steps_recorded(store):
    path, _ = store
    runs = Store(path).runs().set_index("run_id").loc[[1, 2]].reset_index()
    table = config_table(runs, ["#1", "#2"], only_differences=False)
    assert table.loc["every"].tolist() == [DEFAULT_RETENTION, "3"]
    assert DEFAULT_RETENTION == "every step to 999, then every 50th (the default)"
    assert table.loc["steps"].tolist() == [f"{STEPS} recorded (none planned)"] * 2
    assert config_table(runs, ["#1", "#2"], only_differences=True).loc["every"].tolist() == [DEFAULT_RETENTION, "3"]
    assert MISSING not in table.loc[["every", "steps"]].to_numpy().ravel()


def test_the_overlay_at_a_dropped_step_says_what_that_run_counted_there(store, monkeypatch):
    path, planted = store
    monkeypatch.setenv("MPDIAG_STORE", str(path))
    at = AppTest.from_file(str(ROOT / "pages" / "3_Compare.py"), default_timeout=TIMEOUT)
    at.query_params["runs"] = ["1", "2"]
    at.run()
    at.selectbox(key="hist_tensor").set_value("weight").run()
    step_slider(at, "hist_step").set_value(DROPPED).run()
    assert not at.exception, [e.value for e in at.exception]
    said = "\n".join(c.value for c in at.caption).replace("\\", "")  # plain()'s escapes
    g = planted[DROPPED]["weight"]
    nonfinite = int((~torch.isfinite(g)).sum())
    overflow = int((torch.isinf(g.half()) & torch.isfinite(g)).sum())
    underflow = int(((g.half() == 0) & (g != 0)).sum())
    assert (nonfinite, overflow, underflow) == (0, 3, 5)  # the plant, as torch casts it
    assert f"No line: these runs did not log step {DROPPED}: #2 · every 3 · custom." in said
    assert (f"Counted at step {DROPPED} all the same (every step's inf/NaN and FP16 over/underflow are kept, its "
            f"histogram only at the steps kept in full): #2 · every 3 · custom: {nonfinite} inf/NaN, {overflow} "
            f"overflowing and {underflow} underflowing FP16 at its loss scale.") in said


def test_the_findings_page_names_the_dropped_step_with_its_count(store, monkeypatch):
    path, planted = store
    at = app("pages/5_Findings.py", path, monkeypatch, run="2")
    assert not at.exception, [e.value for e in at.exception]
    first, dropped = (int((torch.isinf(planted[s]["weight"].half())).sum()) for s in (1, DROPPED))
    assert (first, dropped) == (2, 3)
    said = texts(at)
    assert "Gradient values exceed FP16's range, first at step 1" in said
    assert (f"At step 1 (statistics kept: overflow), weight: {first} values cast to inf in FP16 (its largest value is "
            "65504). Counted at every step, kept or not: 2 steps held such values, 1 of them with statistics not "
            f"kept in full (their counts are the per-step signals); weight: {first + dropped} values at 2 steps, the "
            f"most at step {DROPPED} ({dropped}, statistics not kept).") in said
