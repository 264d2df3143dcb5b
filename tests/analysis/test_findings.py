"""Findings, proved both ways: every gallery script produces its documented finding and its recommended
rerun removes it; the healthy examples produce no warning; the rules' thresholds behave as documented."""

import importlib
import json
import re

import numpy as np
import pandas as pd
import pytest
from conftest import EXAMPLES, run_cli

from mpdiag import Store
from mpdiag.analysis.findings import LOW_RANGE_SHARE, LOW_RANGE_TARGET, diagnose, recommended_scale, scale_collapse
from mpdiag.analysis.summaries import whatif_shares
from mpdiag.numerics.formats import EXP_MIN, N_EXP_BINS
from mpdiag.sandbox.probe import run_probe
from mpdiag.training.runner import RunConfig, rerun, train, train_pair
from mpdiag.training.script import ModelScript

GALLERY = sorted(p.stem for p in EXAMPLES.glob("gallery_*.py"))


def diagnosed(store_path, run_id):
    """Findings as the CLI computes them: probe first when the run scales its loss."""
    if Store(store_path).run(run_id)["scaling"] != "none":
        run_probe(store_path, run_id)
    return diagnose(Store(store_path), run_id)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return tmp_path_factory.mktemp("findings") / "runs.db"


@pytest.mark.parametrize("name", GALLERY)
def test_gallery_failure_is_found_and_its_recommended_rerun_removes_it(name, gallery_runs):
    module = importlib.import_module(f"mpdiag.examples.{name}")
    store_path, ids = gallery_runs
    run_id = ids[name][0]  # trained at module.FAILING for 20 steps
    findings = {f.rule: f for f in diagnosed(store_path, run_id)}
    assert module.FINDING in findings, [f.as_dict() for f in findings.values()]
    finding = findings[module.FINDING]
    assert finding.severity in ("warning", "error") and finding.fix and finding.evidence
    child = rerun(store_path, run_id, **finding.fix)
    assert Store(store_path).run(child)["status"] == "finished"
    assert module.FINDING not in {f.rule for f in diagnosed(store_path, child)}


@pytest.mark.parametrize("name, level", [("mlp_digits.py", "O1"), ("cnn_digits.py", "O1"),
                                         ("transformer_lm.py", "O1"), ("mlp_digits.py", "O2"),
                                         ("cnn_digits.py", "bf16")])
def test_healthy_examples_produce_no_warning(name, level, store_path):
    run_id = train(ModelScript.from_path(EXAMPLES / name),
                   RunConfig(opt_level=level, steps=20, device="cpu", shadow_every=5), store_path)
    assert len(Store(store_path).shadow_stats(run_id)) > 0  # the FP32 shadow rule had data to judge
    serious = [f.as_dict() for f in diagnosed(store_path, run_id) if f.severity in ("warning", "error")]
    assert serious == []


def test_ignored_grad_output_names_the_function_and_the_ratio(store_path):
    run_id = train(ModelScript.from_path(EXAMPLES / "gallery_ignored_grad_output.py"),
                   RunConfig(opt_level="O1", steps=2, device="cpu"), store_path)
    probe = run_probe(store_path, run_id)
    assert probe["functions"] == ["FusedMSE"]
    low, high = probe["scales"]
    assert set(probe["failing"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for ratio in probe["ratios"].values():
        assert ratio == pytest.approx(low / high, rel=1e-3)  # unscaled gradients shrink exactly as S grows


def test_recommended_scale_prefers_2_16_and_backs_off_from_overflow():
    hist = np.zeros(N_EXP_BINS, dtype=np.int64)
    hist[-20 - EXP_MIN] = 100  # |g| in [2^-20, 2^-19)
    assert recommended_scale(hist) == 16
    hist[-2 - EXP_MIN] = 1  # 2^-2 * 2^16 = 2^14 still fits; 2^-2 * 2^18 would overflow
    assert recommended_scale(hist) == 16
    hist[3 - EXP_MIN] = 1  # [2^3, 2^4) * 2^12 lands in FP16's top bin, whose values >= 65520 overflow: 2^11
    assert recommended_scale(hist) == 11
    shares = whatif_shares(hist, 11)
    assert shares["overflow"][1] == 0 and shares["underflow"][1] + shares["subnormal"][1] <= LOW_RANGE_TARGET
    hist[-40 - EXP_MIN] = 1000  # far too wide for FP16 at any scale that does not overflow
    assert recommended_scale(hist) is None


def test_recommended_scale_goes_above_2_16_when_the_gradients_need_it():
    """Gradients that need more than GradScaler's 2^16 get the scale that fits them, not "use bf16": the run at
    2^16 would show the same finding, and a run at 2^20 would not."""
    hist = np.zeros(N_EXP_BINS, dtype=np.int64)
    hist[-34 - EXP_MIN] = 100  # 2^-34 * 2^16 = 2^-18, subnormal in FP16; * 2^20 = 2^-14, FP16's min normal
    hist[-8 - EXP_MIN] = 1  # the largest: [2^-8, 2^-7) * 2^22 fits; * 2^23 is FP16's top bin (>= 65520 overflows)
    assert recommended_scale(hist) == 20
    assert whatif_shares(hist, 16)["subnormal"][0] > LOW_RANGE_SHARE  # 2^16 itself would keep the finding
    # an FP16 run's own histogram misses what it flushed (all below what it recorded): the most headroom
    assert recommended_scale(hist, complete=False) == 22
    assert recommended_scale(hist, ceiling=16) is None  # scale collapse never recommends above 2^16


def test_underflow_advice_is_consistent_across_runs_of_one_script(tmp_path):
    """Issue 27 item 6, as a class: the same model at a static scale of 1 with its FP32 twin, and dynamic from 2^8
    without one, are each told a scale (never "no single loss scale fits" when one does); the rerun at that
    scale, the ground truth, no longer shows the finding."""
    store_path = tmp_path / "runs.db"
    script = ModelScript.from_path(EXAMPLES / "gallery_underflow.py")
    failing, _twin = train_pair(script, RunConfig(opt_level="O1", steps=30, device="cpu").with_options(loss_scale=1.0),
                                store_path)
    # another seed: no FP32 run of the same training (the twin above, same script and seed, would be its reference
    # and its histograms the basis), so the advice is read from the run's own histograms
    low_start = train(script, RunConfig(opt_level="O1", steps=30, device="cpu", seed=1).with_options(init_scale=2.0**8),
                      store_path)
    for run_id, basis in ((failing, "by the FP32 twin's gradient histograms"),
                          (low_start, "by this run's recorded histograms")):
        finding = {f.rule: f for f in diagnosed(store_path, run_id)}["gradient-underflow"]
        assert finding.fix["loss_scale"] == "dynamic" and basis in finding.recommendation, finding.recommendation
        totals = Store(store_path).tensor_totals(run_id)
        said = {kind: int(totals[f"fp16_{kind}_at_scale"].sum()) for kind in ("subnormal", "underflow")}
        named = {"subnormal": re.search(r"subnormal in FP16 \(([\d,]+) values\)", finding.evidence),
                 "underflow": re.search(r"would underflow(?: in FP16)? \(([\d,]+)", finding.evidence)}
        for kind, count in said.items():  # each part named with its exact count, or not at all: never "(0)"
            assert (named[kind].group(1) if named[kind] else None) == (f"{count:,}" if count else None), \
                (kind, count, finding.evidence)
        child = rerun(store_path, run_id, **finding.fix)
        assert "gradient-underflow" not in {f.rule for f in diagnosed(store_path, child)}


def test_scale_collapse_thresholds():
    run = pd.Series({"scaling": "dynamic"})
    hist = np.zeros(N_EXP_BINS, dtype=np.int64)
    hist[-10 - EXP_MIN] = 5

    def steps(skips, loss=1.0, scale=1024.0):
        n = 100
        return pd.DataFrame({"step": range(n), "skipped": [1.0 if i in skips else 0.0 for i in range(n)],
                             "loss": [loss] * n, "loss_scale": [scale] * n})

    assert scale_collapse(run, steps({3, 50, 90}), hist) is None  # 3 %, no run of 5, scale >= 1
    assert scale_collapse(run, steps(set(range(10, 15))), hist).severity == "warning"  # 5 in a row
    assert scale_collapse(run, steps({1}, scale=0.5), hist) is not None  # scale below 1
    static = scale_collapse(run, steps(set(), scale=2.0**-83), hist)  # below 1, nothing skipped: no overflow
    assert static.severity == "warning" and "below 1" in static.title and "skipped" not in static.title
    assert static.fix == {"init_scale": 2.0**recommended_scale(hist, ceiling=16), "loss_scale": "dynamic"}
    forward = scale_collapse(run, steps(set(range(100)), loss=float("nan")), hist)
    assert forward.severity == "error" and forward.fix == {"opt_level": "bf16"}
    # some skips after a non-finite loss, some not (a user's outlier batches): said, with how many of each
    mixed = steps(set(range(10, 20)))
    mixed.loc[mixed["step"].isin([12, 15, 17]), "loss"] = float("inf")
    some = scale_collapse(run, mixed, hist)
    assert some.severity == "warning" and some.title.endswith("some after an overflow in the forward pass")
    assert "3 of the 10 skipped steps had a non-finite loss" in some.evidence
    assert "forward" not in scale_collapse(run, steps(set(range(10, 15))), hist).title


def test_cli_diagnose_text_and_json(store_path):
    run_id = train(ModelScript.from_path(EXAMPLES / "gallery_activation_overflow.py"),
                   RunConfig(opt_level="O1", steps=8, device="cpu"), store_path)
    text = run_cli("diagnose", run_id, "--store", store_path)
    assert text.returncode == 0 and "[error] Overflow in the forward pass" in text.stdout
    assert f"python -m mpdiag rerun {run_id} --opt-level bf16" in text.stdout
    as_json = json.loads(run_cli("diagnose", run_id, "--json", "--store", store_path).stdout)
    assert as_json[0]["rule"] == "scale-collapse" and as_json[0]["fix"] == {"opt_level": "bf16"}


def test_trace_modules_attributes_the_first_nonfinite_activation(store_path):
    script = ModelScript.from_path(EXAMPLES / "gallery_activation_overflow.py")
    run_id = train(script, RunConfig(opt_level="O1", steps=3, device="cpu", trace_modules=True), store_path)
    modules = Store(store_path).module_stats(run_id)
    assert len(modules) == 3 * 3  # three leaf modules (Linear, ReLU, Linear), every step
    step0 = modules[modules["step"] == 0].set_index("module")
    assert step0.loc["0", "fwd_finite"] == 0 and step0.loc["0", "fwd_order"] == 0  # the overflowing first layer
    finding = [f for f in diagnose(Store(store_path), run_id) if f.rule == "scale-collapse"][0]
    assert "output of module '0' (Linear) at step 0 in the forward pass" in finding.evidence
    child = rerun(store_path, run_id, opt_level="bf16")  # the trace setting is inherited
    traced = Store(store_path).module_stats(child)
    assert len(traced) == 9 and (traced["fwd_finite"] == 1).all() and (traced["bwd_finite"] == 1).all()


def test_trace_modules_records_magnitudes_of_outputs_and_incoming_gradients(store_path):
    import torch

    from mpdiag import Recorder

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh())
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 2.0], [-3.0, 0.5], [0.0, 0.0]]))
        model[0].bias.zero_()
    x = torch.tensor([[1.0, 1.0]])
    with Recorder(model, store=store_path, trace_modules=True) as rec:
        out = model(x)
        (out * 4.0).sum().backward()
        rec.record(out.sum())
    rows = Store(store_path).module_stats(rec.run_id).set_index("module")
    assert rows.loc["0", "fwd_absmax"] == 3.0  # |(-3 + 0.5)| = 2.5 < |1 + 2| = 3
    assert rows.loc["1", "fwd_absmax"] == pytest.approx(float(torch.tanh(torch.tensor(3.0))))
    assert rows.loc["1", "bwd_absmax"] == 4.0  # the gradient flowing into the Tanh output
    assert rows.loc["1", "bwd_order"] == 0 and rows.loc["0", "bwd_order"] == 1  # backward runs last-to-first


def test_trace_modules_ignores_a_deep_copy_of_the_traced_model(store_path):
    """An EMA copy made with ``copy.deepcopy`` after the Recorder hooked in carries the tracer's hooks; its
    forward passes (here on inputs 1000 times larger) must not be recorded as the traced model's modules."""
    import copy

    import torch

    from mpdiag import Recorder

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    x = torch.randn(5, 4)
    with Recorder(model, store=store_path, trace_modules=True) as rec:
        ema = copy.deepcopy(model)
        out = model(x)
        out.sum().backward()
        with torch.no_grad():
            ema(x * 1000.0)
        rec.record(out.sum())
    rows = Store(store_path).module_stats(rec.run_id).set_index("module")
    with torch.no_grad():
        linear_out = x @ model[0].weight.T + model[0].bias  # the traced model's own first output, by hand
    assert rows.loc["0", "fwd_absmax"] == pytest.approx(float(linear_out.abs().max()), rel=1e-6)
    assert rows.loc["1", "fwd_absmax"] == pytest.approx(float(linear_out.clamp(min=0).max()), rel=1e-6)
    assert rows.loc["1", "bwd_absmax"] == 1.0 and rows.loc["1", "fwd_order"] == 1


def test_gradient_error_ranks_underflowing_tensors_and_the_fix_removes_it(store_path):
    """The FP32 shadow both ways: unscaled FP16 gradients that underflow are far from FP32 (the finding, with
    the tensors ranked), and the recommended scale brings them back (no finding)."""
    run_id = train(ModelScript.from_path(EXAMPLES / "gallery_underflow.py"),
                   RunConfig(opt_level="O1", steps=10, device="cpu", shadow_every=3).with_options(loss_scale=1.0), store_path)
    findings = {f.rule: f for f in diagnosed(store_path, run_id)}
    finding = findings["gradient-error"]
    assert finding.tensors and set(finding.tensors) <= set(Store(store_path).tensors(run_id)["name"])
    assert finding.fix == findings["gradient-underflow"].fix  # the cause's fix
    child = rerun(store_path, run_id, **finding.fix)
    assert "gradient-error" not in {f.rule for f in diagnosed(store_path, child)}
    assert len(Store(store_path).shadow_stats(child)) > 0  # the rerun kept the shadow


def test_masters_keeping_small_updates_is_a_note_not_a_warning(store_path):
    run_id = train(ModelScript.from_path(EXAMPLES / "gallery_swamped_updates.py"),
                   RunConfig(opt_level="O2", steps=10, device="cpu"), store_path)
    notes = {f.rule: f for f in diagnose(Store(store_path), run_id)}
    assert notes["masters-needed"].severity == "info" and "update-swamping" not in notes


UNDERFLOWING_LOOP = """
import sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=1.0) if sys.argv[1] == "scaler" else None
for step in range(6):
    x = torch.randn(16, 32)
    with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
        loss = torch.nn.functional.mse_loss(model(x).float(), x[:, :1] * 1e-4) * 1e-3
    optimizer.zero_grad()
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
"""


def test_a_watched_fp16_loop_with_a_loss_scaler_is_judged_in_fp16(tmp_path, write_script):
    """The script's own settings ("custom", as under watch or an upload) with FP16 autocast and a GradScaler whose
    scale (1) leaves the gradients subnormal or flushed in FP16: the gradient-underflow warning, as the same loop
    gets at --opt-level O1 (it read healthy: only the named FP16 levels were judged), its share that of the stored
    counts (each torch's FP16 cast, tests/numerics). The same loop in FP32 without a scaler is not judged in FP16."""
    from mpdiag.training.watch import WatchConfig, watch

    script, store = write_script(UNDERFLOWING_LOOP, "loop.py"), tmp_path / "runs.db"
    scaled, _ = watch(WatchConfig(target=str(script), args=("scaler",)), store)
    plain, _ = watch(WatchConfig(target=str(script), args=("fp32",)), store)
    runs = Store(store).runs().set_index("run_id")
    assert runs.loc[scaled, ["opt_level", "scaling"]].tolist() == ["custom", "dynamic"]
    findings = {f.rule: f for f in diagnose(Store(store), scaled)}
    assert "gradient-underflow" in findings, [f.as_dict() for f in findings.values()]
    totals = Store(store).tensor_totals(scaled)
    share = (totals["fp16_underflow_at_scale"] + totals["fp16_subnormal_at_scale"]).sum() / (
        totals["numel"] - totals["zeros"] - totals["nan"] - totals["posinf"] - totals["neginf"]).sum()
    assert f"{share:.2%} of the finite non-zero gradient values" in findings["gradient-underflow"].evidence
    assert "gradient-underflow" not in {f.rule for f in diagnose(Store(store), plain)}


def test_a_watched_runs_fp32_reference_is_an_o0_run_of_the_same_command(tmp_path, write_script):
    """A watched script has no stored hash or seed, so no O0 run was ever its reference: its fix could not be
    judged against FP32 ("vs FP32: None"). An O0 watch of the same command (script, arguments, folder) is its
    reference; one with other arguments is not; and Compare's note says how to record one (watch runs no twin)."""
    from mpdiag.analysis.compare import fp32_twin_row, reference_hint, reference_run
    from mpdiag.analysis.summaries import flushed_to_zero, overall_flushed
    from mpdiag.training.watch import WatchConfig, watch

    script, store = write_script(UNDERFLOWING_LOOP, "loop.py"), tmp_path / "runs.db"
    mixed, _ = watch(WatchConfig(target=str(script), args=("scaler",)), store)
    runs = Store(store).runs()
    assert reference_run(runs, mixed) is None
    assert f"rerun {mixed} --opt-level O0" in reference_hint(runs[runs["run_id"] == mixed].iloc[0])
    other, _ = watch(WatchConfig(target=str(script), args=("fp32",), opt_level="O0"), store)
    reference, _ = watch(WatchConfig(target=str(script), args=("scaler",), opt_level="O0"), store)
    runs = Store(store).runs()
    assert runs.set_index("run_id").loc[[other, reference], "opt_level"].tolist() == ["O0", "O0"]
    assert reference_run(runs, mixed) == reference
    # and the FP32 twin the watched FP16 run's flushed values are estimated against (watch records no --pair twin:
    # Compare drew the O0 run's would-underflow bars beside none for the FP16 run)
    assert int(fp32_twin_row(runs, runs[runs["run_id"] == mixed].iloc[0])["run_id"]) == reference
    flushed = overall_flushed(Store(store).tensor_totals(mixed),
                              flushed_to_zero(Store(store).tensor_totals(mixed), Store(store).tensor_totals(reference)))
    found = {f.rule: f for f in diagnose(Store(store), mixed)}["gradient-underflow"]
    assert f"{flushed:.2%} of all gradient values flushed to zero before recording (underflow), estimated against " \
           "the FP32 twin" in found.evidence



def test_rank_nonfinite_names_the_rank_whose_batch_broke_not_a_step_every_rank_overflowed():
    """A 2-rank job (the shape of a real DDP run's rows): at step 2 both ranks overflowed at the scale (1 and 4
    values, finite losses), at step 7 rank 1 alone (4 values, finite loss: the scale probing), at step 20 rank 1's
    batch broke (5,121 values, its loss NaN, rank 0's finite). The finding named "rank 0's batch" at step 2; it names
    rank 1 at step 20 and counts the others. With only the finite-loss steps it names step 7, saying the loss was
    finite; with only step 2, nothing."""
    from mpdiag.analysis.findings import rank_nonfinite

    nan = float("nan")
    rows = pd.DataFrame([(2, 0, 29.2, 1), (2, 1, 28.5, 4), (7, 0, 22.0, 0), (7, 1, 26.5, 4), (20, 0, 9.1, 0),
                         (20, 1, nan, 5121)], columns=["step", "rank", "loss", "nonfinite"])
    steps = pd.DataFrame({"step": [2, 7, 20], "skipped": [1.0, 1.0, 1.0]})
    found = rank_nonfinite(rows, steps)
    assert found.title == "rank 1's batch produced inf/NaN gradients and loss the other ranks' did not"
    assert found.evidence.startswith("step 20: rank 1's local gradients held 5121 inf/NaN before the all-reduce; "
                                     "every rank skipped the step. 1 other step(s)")
    assert "At 1 step(s) every rank held them" in found.evidence
    found = rank_nonfinite(rows[rows["step"] < 20], steps)
    assert found.evidence.startswith("step 7: rank 1's") and "Its loss was finite" in found.evidence
    assert rank_nonfinite(rows[rows["step"] == 2], steps) is None


def test_a_run_already_at_the_recommended_scale_is_not_offered_it_again():
    """Read from the run's own histograms (no twin), the recommended scale is the largest that cannot overflow: a
    rerun at it still had a tensor over the threshold and was offered the same scale again. Such a run is offered
    BF16; the first run is offered the scale, its promise said to be of the values recorded (FP16's flushed ones
    are not among them)."""
    from mpdiag.analysis.findings import _scale_advice

    hist = np.zeros(N_EXP_BINS)
    hist[[-30 - EXP_MIN, -24 - EXP_MIN, -2 - EXP_MIN]] = [10, 1000, 5]  # largest |g| ~2^-2: 2^16 room above
    k = recommended_scale(hist, complete=False)
    first = pd.Series({"scaling": "dynamic", "init_scale": 1.0, "config": {"watch": {}}})
    advice, fix, settled = _scale_advice(hist, None, first)
    assert fix == {"loss_scale": "dynamic", "init_scale": float(2**k)} and not settled
    assert "of the values recorded (not those FP16 flushed)" in advice and "--pair" not in advice  # watch: no twin
    rerun = pd.Series({**first.to_dict(), "init_scale": float(2**k)})
    advice, fix, settled = _scale_advice(hist, None, rerun)
    assert fix == {"opt_level": "bf16"} and f"already used dynamic loss scaling from 2^{k}" in advice and not settled
    # the same rerun whose loss stays within 5 % of its FP32 reference: nothing to change (the fix worked)
    advice, fix, settled = _scale_advice(hist, None, rerun, tracks_fp32=True)
    assert settled and advice.startswith("Nothing to change for the training") and fix == {"opt_level": "bf16"}


HALF_LOOP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).half()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x = torch.randn(8, 16).half()
    loss = model(x).float().pow(2).mean() * 1e-4
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


def test_a_watched_half_model_without_a_scaler_is_judged_in_fp16_and_its_fix_says_what_watch_cannot_do(
        tmp_path, write_script):
    """A script that casts its model to half and has no GradScaler: FP16 gradients (torch's dtype, in the tensors
    table), most of them subnormal, and diagnose said "no findings". It is judged in FP16; the fix (a loss scale) is
    not offered as a watch rerun, which would change nothing without a GradScaler in the script: it says so."""
    from mpdiag.analysis.findings import fix_not_rerunnable
    from mpdiag.training.watch import WatchConfig, watch

    store = tmp_path / "runs.db"
    run_id, _ = watch(WatchConfig(target=str(write_script(HALF_LOOP, "half.py"))), store)
    run = Store(store).runs().set_index("run_id").loc[run_id]
    assert (run["opt_level"], run["scaling"], bool(run["fp16_gradients"])) == ("custom", "none", True)
    assert set(Store(store).tensors(run_id)["grad_dtype"]) == {"float16"}
    found = {f.rule: f for f in diagnose(Store(store), run_id)}
    assert "gradient-underflow" in found, [f.as_dict() for f in found.values()]
    blocked = fix_not_rerunnable(run["config"], found["gradient-underflow"].fix, run["world_size"], run["scaling"])
    assert blocked.startswith("The script has no GradScaler for mpdiag watch to start at")


def test_a_rerun_left_with_only_information_of_a_rule_has_resolved_it():
    """The fix rerun whose gradients stay partly subnormal at the largest safe scale while its loss tracks FP32 gets
    gradient-underflow as information; the Reruns table said the finding was 'still there' and the fix failed."""
    from mpdiag.analysis.finding import Finding
    from mpdiag.analysis.findings import finding_resolved

    def said(severity):
        return Finding(rule="gradient-underflow", severity=severity, title="", evidence="", recommendation="")

    assert finding_resolved(said("warning"), [said("info")])
    assert not finding_resolved(said("warning"), [said("warning")])
    assert finding_resolved(said("warning"), [])


def test_an_fp16_run_whose_every_gradient_flushed_is_sent_to_the_underflow_not_upstream(tmp_path):
    """A user's loop in FP16 at scale 1 with a loss of ~1e-7: FP16's backward flushes every gradient to zero (the
    same model in FP32 on the same batches has none zero: the ground truth), and the values that underflowed are
    not in the record, so gradient-underflow has nothing to count. dead-gradients said "find what blocks the gradient
    upstream", and its user went looking for a detach; it names the flushing and offers BF16."""
    import copy

    import torch

    from mpdiag import Recorder

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    fp32 = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**9)
    recorder = Recorder(model, store=tmp_path / "runs.db", scaler=scaler, optimizer=optimizer)
    for _ in range(5):
        optimizer.zero_grad()
        fp32.zero_grad()
        x, y = torch.randn(32, 16), torch.randn(32, 1)
        (torch.nn.functional.mse_loss(fp32(x), y) * 1e-7).backward()
        assert all((p.grad != 0).any() for p in fp32.parameters())  # in FP32 no tensor's gradient is all zero
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y) * 1e-7
        scaler.scale(loss).backward()
        assert all((p.grad == 0).all() for p in model.parameters())  # in FP16 every one is
        recorder.record(loss)
        scaler.step(optimizer)
        scaler.update()
    recorder.close()
    finding = {f.rule: f for f in diagnose(Store(tmp_path / "runs.db"), recorder.run_id)}["dead-gradients"]
    assert finding.recommendation.startswith("Every gradient of this FP16 run is zero while its loss is not: its "
                                             "backward pass flushed them all: train in BF16"), finding.recommendation
    assert finding.fix == {"opt_level": "bf16"}


def test_underflow_after_the_scale_collapsed_below_one_is_listed_after_the_collapse_and_says_so(tmp_path):
    """Overflowing batches back GradScaler's scale off from 2^16 to below 1 (the skipped steps and the scale are
    GradScaler's own); the steps after them underflow at that scale. The underflow is the collapse's consequence: a
    user read it, listed first, as the cause. It comes after scale-collapse and says why."""
    import torch

    from mpdiag import Recorder
    from mpdiag.options import scale_text

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=10**6)
    recorder = Recorder(model, store=tmp_path / "runs.db", scaler=scaler, optimizer=optimizer)
    scales, skipped = [], 0
    for step in range(60):
        optimizer.zero_grad()
        big = 1e6 if step < 24 else 1.0  # an unnormalised feature: the backward overflows FP16
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(torch.randn(32, 16) * big).float(), torch.randn(32, 1)) * 1e-3
        scaler.scale(loss).backward()
        recorder.record(loss)
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < before
        scales.append(scaler.get_scale())
    recorder.close()
    assert skipped >= 17 and min(scales) < 1  # GradScaler's own: it backed off below 1
    rules = [f.rule for f in diagnose(Store(tmp_path / "runs.db"), recorder.run_id)]
    assert rules.index("scale-collapse") < rules.index("gradient-underflow"), rules
    underflow = diagnose(Store(tmp_path / "runs.db"), recorder.run_id)[rules.index("gradient-underflow")]
    assert f"The scale backed off to {scale_text(min(scales))} after overflows (scale-collapse, above)" \
        in underflow.evidence, underflow.evidence
    # a Recorder's loop takes no mpdiag option: "What to change" says the code ("--opt-level bf16" was advised)
    for finding in diagnose(Store(tmp_path / "runs.db"), recorder.run_id):
        assert "--" not in finding.recommendation, finding.recommendation
    assert "BF16 autocast without a GradScaler" in diagnose(Store(tmp_path / "runs.db"), recorder.run_id)[
        rules.index("scale-collapse")].recommendation
