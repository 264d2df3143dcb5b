"""The precision plan (mpdiag.analysis.plan) and its verification (mpdiag.analysis.plan_verify), held-out style:
a model with planted FP8-hostile Linears keeps exactly those in higher precision, its rerun tracks FP32 and an
all-FP8 rerun does not; a healthy model puts every Linear in FP8. The counts a plan states are checked against
torch's own FP8 cast of the recomputed input, never against mpdiag's numbers."""

import json

import pytest
import torch
from conftest import EXAMPLES, FIXTURES, run_cli

from mpdiag.analysis.plan import FP8_CLASS, PLAN_LOST_SHARE, next_promotion, plan_run, tracks
from mpdiag.store import Store
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript


def copied(store, folder):
    """A copy of the session's store in ``folder``: a test that adds runs must not change what others count."""
    import sqlite3
    from contextlib import closing

    path = folder / "runs.db"
    with closing(sqlite3.connect(store)) as source, closing(sqlite3.connect(path)) as copy:
        source.backup(copy)
    return path


def test_the_planted_layers_and_only_they_stay_in_higher_precision(plan_runs):
    plan = plan_run(Store(plan_runs.store), plan_runs.source)
    choices = {layer.layer: layer.choice for layer in plan.layers}
    assert choices["outlier"] in ("bf16", "fp32") and choices["tiny"] in ("bf16", "fp32")
    assert choices["head"] in FP8_CLASS
    assert plan.run_precision == "bf16"  # the 2^-40 gradients fit no FP16 loss scale


def test_the_outlier_layers_evidence_is_torchs_cast_count(plan_runs):
    """The plan names the worst recorded step of the outlier Linear's input under current scaling and how many
    of its values underflow: recomputed here from the script's own batch and torch's float8_e4m3fn cast."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("planted", FIXTURES / "scripts" / "plan_planted.py")
    planted = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planted)
    from mpdiag.examples.data import digits

    x, y, _, _ = digits(torch.device("cpu"))
    store = Store(plan_runs.store)
    counts = {}
    for step in sorted(store.fp8(plan_runs.source)["step"].unique()):
        inputs = planted.batch_at(x, y, int(step))[0]
        scale = torch.tensor(448.0) / inputs.abs().amax()  # current scaling: E4M3's largest over the amax, fp32
        cast = (inputs * scale).to(torch.float8_e4m3fn).float()
        counts[int(step)] = (int(((cast == 0) & (inputs != 0)).sum()), inputs.numel())
    worst = max(counts, key=lambda s: counts[s][0])  # the first step of the largest count
    assert counts[worst][0] > PLAN_LOST_SHARE * counts[worst][1]
    said = plan_run(store, plan_runs.source).layers
    outlier = next(layer for layer in said if layer.layer == "outlier")
    assert f"worst input at step {worst}: {counts[worst][0]:,} of {counts[worst][1]:,} underflow" \
        in outlier.rejected["current"]


def test_the_plans_rerun_tracks_fp32_and_an_all_fp8_rerun_does_not(plan_runs):
    store = Store(plan_runs.store)
    assert plan_runs.reference == plan_runs.source  # an O0 source is its own reference
    first = plan_runs.rounds[0]
    assert len(plan_runs.rounds) == 1 and first.tracked, first.said
    run = store.run(first.run_id)
    assert int(run["parent_run_id"]) == plan_runs.source and run["opt_level"] == "fp8-sim"
    assert run["config"]["run"]["fp8_modules"] == first.plan.module_flag()
    tracked, rel, said = tracks(store.steps(plan_runs.reference), store.steps(plan_runs.all_fp8))
    assert not tracked and rel > 0.05, said


def test_a_round_that_breaks_training_promotes_the_layer_and_the_next_round_tracks(plan_runs, monkeypatch, tmp_path):
    """A plan wrongly optimistic about both planted Linears (FP8 current, the outlier's evidence closest to the
    threshold): round 1 reruns it and does not track FP32; the outlier is promoted to BF16; round 2 tracks (the
    tiny gradients' loss does not move the loss). Each round is a rerun linked to the source. On a copy of the
    session's store, whose runs other tests count."""
    from dataclasses import replace

    from mpdiag.analysis import plan_verify

    store = copied(plan_runs.store, tmp_path)
    honest = plan_run(Store(store), plan_runs.source)
    shares = {"outlier": 0.5, "tiny": 0.3}
    optimistic = replace(honest, layers=[replace(layer, choice="current", worst_share=shares[layer.layer])
                                         if layer.layer in shares else layer for layer in honest.layers])
    monkeypatch.setattr(plan_verify, "plan_run", lambda store, run_id: optimistic)
    reference, rounds = plan_verify.verify(store, plan_runs.source)
    assert reference == plan_runs.source
    assert [r.tracked for r in rounds] == [False, True] and rounds[0].promoted == "outlier", [r.said for r in rounds]
    assert rounds[1].plan.module_flag() == "head=current,outlier=bf16,tiny=current"
    runs = Store(store).runs().set_index("run_id")
    assert [int(runs.loc[r.run_id, "parent_run_id"]) for r in rounds] == [plan_runs.source] * 2


def test_a_healthy_model_puts_every_linear_in_fp8_its_rerun_confirms_it_and_the_accounts_add_up(tmp_path):
    from mpdiag.analysis.plan_verify import verify

    store = tmp_path / "runs.db"
    config = RunConfig(opt_level="O0", steps=12, every=4, device="cpu", fp8=True, fp8_recipe="both")
    run_id = train(ModelScript.from_path(EXAMPLES / "mlp_digits.py"), config, store)
    plan = plan_run(Store(store), run_id)
    assert [layer.choice in ("delayed", "current") for layer in plan.layers] == [True] * 3, plan.module_flag()
    _, rounds = verify(store, run_id)
    assert len(rounds) == 1 and rounds[0].tracked, rounds[0].said
    # the 16Ψ account by hand: an FP8 weight 1 byte, its BF16 gradient 2, an FP32 master 4, two moments
    tensors = Store(store).tensors(run_id)
    weights = int(tensors.loc[tensors["name"].str.endswith("weight"), "numel"].sum())
    rest = int(tensors["numel"].sum()) - weights
    moment = {"bf16": 2, "fp8": 1, "fp32": 4}[plan.moment_format]
    assert plan.memory["bytes"]["fp32"] == 16 * (weights + rest)
    assert plan.memory["bytes"]["plan"] == weights * (1 + 2 + 4 + 2 * moment) + rest * (2 + 2 + 4 + 2 * moment)
    # a failed round promotes the FP8 Linear whose evidence came closest to the threshold, to BF16
    layer = next_promotion(plan)
    assert layer == max(plan.layers, key=lambda one: one.worst_share).layer
    promoted = plan.promoted(layer)
    assert dict(pair.split("=") for pair in promoted.module_flag().split(","))[layer] == "bf16"
    assert promoted.memory["bytes"]["plan"] > plan.memory["bytes"]["plan"]


def test_the_planted_models_moments_break_training_in_fp8_and_track_fp32_in_bf16(plan_runs, tmp_path):
    """The plan's moments choice, proven by rerun: held in FP8 (E4M3 at a per-tensor scale) Adam's second moment
    loses the small values the plan's evidence says it loses, and the loss stops being finite; held in BF16 it
    tracks FP32 (measured on the planted model; --moment-format at O0, every other setting the source's)."""
    from mpdiag.training.runner import rerun

    plan = plan_run(Store(plan_runs.store), plan_runs.source)
    assert plan.moment_format == "bf16" and "FP8 (E4M3): m loses at most" in plan.moment_evidence
    store = copied(plan_runs.store, tmp_path)
    reference = Store(store).steps(plan_runs.source)
    outcome = {}
    for fmt in ("bf16", "fp8"):
        new = rerun(store, plan_runs.source, opt_level="O0", fp8=False, moment_format=fmt)
        assert Store(store).run(new)["config"]["run"]["moment_format"] == fmt
        outcome[fmt] = tracks(reference, Store(store).steps(new))
    assert outcome["bf16"][0], outcome["bf16"][2]
    assert not outcome["fp8"][0] and "not finite" in outcome["fp8"][2], outcome["fp8"][2]


def test_a_plan_whose_run_is_fp16_reruns_fp16_autocast_with_a_grad_scaler_from_the_planned_scale(tmp_path):
    """A healthy model recorded with --trace-modules: its outputs fit FP16, so the plan's run is FP16 with dynamic
    scaling from 2^k; the verify round runs fp8-sim-fp16 (FP16 autocast, a GradScaler) starting at 2^k, with the
    plan's recipe per Linear and moments format, and the scaler's state is recorded at every step."""
    from mpdiag.analysis.plan_verify import verify

    store = tmp_path / "runs.db"
    config = RunConfig(opt_level="O0", steps=12, every=4, device="cpu", fp8=True, fp8_recipe="both",
                       trace_modules=True)
    run_id = train(ModelScript.from_path(EXAMPLES / "mlp_digits.py"), config, store)
    plan = plan_run(Store(store), run_id)
    assert plan.run_precision == "fp16" and plan.loss_scale_log2 is not None, plan.run_evidence
    _, rounds = verify(store, run_id)
    assert rounds[0].tracked, rounds[0].said
    run = Store(store).run(rounds[0].run_id)
    ran = run["config"]["run"]
    assert run["opt_level"] == "fp8-sim-fp16" and run["scaling"] == "dynamic"
    assert ran["init_scale"] == 2.0**plan.loss_scale_log2 and ran["fp8_modules"] == plan.module_flag()
    assert ran["moment_format"] == (plan.moment_format if plan.moment_format != "fp32" else "")
    steps = Store(store).steps(rounds[0].run_id)
    assert steps["loss_scale"].iloc[0] == 2.0**plan.loss_scale_log2 and steps["scale_after"].notna().all()


def test_the_command_prints_the_plan_and_refuses_a_run_without_fp8_statistics(plan_runs):
    done = run_cli("plan", plan_runs.source, "--json", "--store", plan_runs.store)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert {layer["layer"]: layer["choice"] for layer in said["layers"]}["outlier"] == "bf16"
    refused = run_cli("plan", plan_runs.all_fp8, "--store", plan_runs.store)
    assert refused.returncode == 2 and "recorded no FP8 statistics" in refused.stderr


def test_plan_verify_on_the_command_line_reruns_the_plan_and_says_it_tracks(plan_runs, tmp_path, capsys):
    from mpdiag.cli import main

    store = copied(plan_runs.store, tmp_path)
    assert main(["plan", str(plan_runs.source), "--verify", "--store", str(store)]) == 0
    said = capsys.readouterr().out
    new = int(Store(store).runs()["run_id"].max())
    assert f"round 1: run {new} tracks FP32" in said
    assert "  ran: run BF16; Linears: 1 FP8 current, 2 BF16; moments BF16" in said  # the plan as planned
    assert "  predicted: the loss tracks FP32 within 5%; saves " in said and "  measured: the loss " in said
    assert "the bytes predicted only: fp8-sim keeps FP32 weights" in said
    assert f"verified: run {new} tracks FP32 run {plan_runs.source}; take it: --opt-level fp8-sim --fp8-modules " \
           "head=current,outlier=bf16,tiny=bf16" in said


@pytest.mark.parametrize("modules", ["head=current,head=bf16", "head=fp4", "head"])
def test_fp8_modules_is_checked_before_training(modules):
    from mpdiag.options import ConfigError

    with pytest.raises(ConfigError, match="--fp8-modules"):
        RunConfig(opt_level="fp8-sim", fp8_modules=modules).validate()


def test_docs_state_the_plans_thresholds_with_the_codes_values():
    """docs/plan.md's thresholds table is generated from plan.py's constants (the docs hook), and the rules
    written by hand state the same numbers."""
    import sys

    from conftest import ROOT

    from mpdiag.analysis import plan

    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        from findings_thresholds import PLAN_MARKER, PLAN_MODULES, thresholds_table
    finally:
        sys.path.remove(str(ROOT / "docs" / "hooks"))
    page = (ROOT / "docs" / "plan.md").read_text()
    assert PLAN_MARKER in page
    for name in ("PLAN_LOST_SHARE", "BF16_GRAD_LOST_SHARE", "MOMENT_LOST_SHARE", "TRACK_RTOL", "TRACK_WINDOW",
                 "MAX_ROUNDS"):
        assert f"| `{name}` |" in thresholds_table(PLAN_MODULES), name
    for name in ("PLAN_LOST_SHARE", "BF16_GRAD_LOST_SHARE", "MOMENT_LOST_SHARE", "TRACK_RTOL"):
        assert f"`{name}` ({getattr(plan, name):.0%}".replace("%", " %") in page, name
    assert f"`MAX_ROUNDS` ({plan.MAX_ROUNDS})" in page


def test_what_is_not_recorded_is_said_not_guessed():
    """No gradient histograms (no logged step): the run stays BF16 and the moments FP32, each saying why; FP16
    is refused while the module outputs' range is unknown, even where a loss scale fits the gradients."""
    import numpy as np

    from mpdiag.analysis.plan import moment_format, run_precision
    from mpdiag.numerics.formats import EXP_MIN, N_EXP_BINS

    assert run_precision("O0", np.zeros(0), None)[0::2] == ("bf16", "the gradients' histograms are not recorded "
                                                                     "(no logged step): BF16, FP32's range")
    assert moment_format(np.zeros((0, N_EXP_BINS)))[0] == "fp32"
    hist = np.zeros(N_EXP_BINS, dtype=np.int64)
    hist[-10 - EXP_MIN] = 1000  # every gradient in 2^-10: fits FP16 at 2^16
    assert run_precision("O0", hist, None)[:2] == ("bf16", None)
    assert run_precision("O0", hist, 10.0)[:2] == ("fp16", 16)
    assert run_precision("O0", hist, 70000.0)[:2] == ("bf16", None)


def test_a_round_run_against_the_evidence_is_read_as_it_ran_and_promoted_first(plan_runs):
    """The Plan page reads each round as it ran (its --fp8-modules): a round that ran the planted Linears in FP8
    against their evidence (flags changed by hand) is read with them in FP8, and when it fails, the first of them
    is promoted before the Linear the evidence put in FP8; a round that ran the plan is read as the plan."""
    from mpdiag.analysis.plan import after_round, as_ran

    plan = plan_run(Store(plan_runs.store), plan_runs.source)
    assert as_ran(plan, plan.module_flag()).module_flag() == plan.module_flag()
    by_hand = as_ran(plan, "head=current,outlier=current,tiny=current")
    assert by_hand.module_flag() == "head=current,outlier=current,tiny=current"
    assert next(layer for layer in by_hand.layers if layer.layer == "outlier").evidence.startswith(
        "run in FP8 current, not as planned (was BF16: ")
    assert after_round(plan, "head=current,outlier=current,tiny=current", tracked=False).module_flag() == \
        "head=current,outlier=bf16,tiny=current"
    assert by_hand.memory["bytes"]["plan"] < plan.memory["bytes"]["plan"]  # the accounts follow what ran
