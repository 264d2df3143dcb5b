"""--fp8 end to end: the Recorder's FP8 rows in the store equal torch's casting of the planted tensors, the
command line records a bundled model and diagnose names the layer, and the options are checked."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import run_cli
from ground_truth import by_casting, exponent_histogram
from test_fp8_capture import expected_scale, planted_batch, planted_model, planted_step

from mpdiag.analysis.findings import diagnose, evidence_link, rerun_outcomes
from mpdiag.analysis.fp8_findings import recorded_settings
from mpdiag.examples import EXAMPLES_DIR
from mpdiag.numerics.fp8 import EXP_MIN
from mpdiag.numerics.fp8_recipes import Fp8Settings
from mpdiag.options import ConfigError, RunConfig
from mpdiag.recording.recorder import Recorder
from mpdiag.store import Store


def record_planted_run(tmp_path, scaler, every: int, steps: int, settings: Fp8Settings):
    """The planted model trained ``steps`` steps under ``scaler`` with the Recorder; returns the store, the
    run and, per step, the tensors an FP8 recipe casts (output gradients divided by that step's loss scale)."""
    model = planted_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    store = Store(tmp_path / "s.db")
    recorder = Recorder(model, store, scaler=scaler, optimizer=optimizer, every=every, fp8=settings)
    truths = {}
    for step in range(steps):
        scale = scaler.get_scale()
        loss, truths[step] = planted_step(model, optimizer, step, scale, lambda loss: scaler.scale(loss).backward())
        recorder.record(loss)
        scaler.step(optimizer)
        scaler.update()
    recorder.close()
    return store, recorder.run_id, truths


def assert_records_equal_casting(store: Store, run_id: int, truths: dict, settings: Fp8Settings) -> None:
    """Every logged step's rows and histograms equal casting the step's tensors at scales computed here."""
    rows, hists = store.fp8(run_id), store.fp8_histograms(run_id)
    seen: dict[tuple[str, str], list[float]] = {}
    for step in sorted(rows["step"].unique()):
        for (module, role), tensor in truths[step].items():
            fmt = "fp8_e5m2" if role == "grad_output" else "fp8_e4m3"
            amax = float(tensor.abs().max())
            seen.setdefault((module, role), []).append(amax)
            for recipe in ("current", "delayed"):
                row = rows[(rows["step"] == step) & (rows["module"] == module) & (rows["role"] == role)
                           & (rows["recipe"] == recipe)].iloc[0]
                scale = expected_scale(recipe, seen[(module, role)], fmt, settings.history)
                assert row["fmt"] == fmt and row["scale"] == float(scale), (step, module, role, recipe)
                assert row["amax"] == amax or math.isnan(amax) and math.isnan(row["amax"])
                assert row["numel"] == tensor.numel()
                assert (row["underflow"], row["subnormal"], row["overflow"]) == by_casting(tensor, float(scale), fmt)
            stored = hists[(hists["step"] == step) & (hists["module"] == module) & (hists["role"] == role)]
            expected = exponent_histogram(tensor)
            assert dict(zip(stored["exponent"], stored["count"], strict=True)) == \
                {EXP_MIN + int(b): int(expected[b]) for b in np.flatnonzero(expected)}


def test_recorder_stores_exact_fp8_records_of_logged_steps_with_the_loss_scale_divided_out(tmp_path):
    loss_scale, settings = 2.0**10, Fp8Settings(recipe="both", history=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=loss_scale, growth_interval=1000)
    store, run_id, truths = record_planted_run(tmp_path, scaler, every=2, steps=5, settings=settings)
    assert scaler.get_scale() == loss_scale  # nothing overflowed: every step divided by the same scale
    rows = store.fp8(run_id)
    assert sorted(rows["step"].unique()) == [0, 2, 4]  # every=2: the delayed history holds logged steps only
    assert len(rows) == 3 * 2 * 3 * 2
    assert_records_equal_casting(store, run_id, truths, settings)
    assert recorded_settings(store.run(run_id)["config"]) == settings  # the recipe is stored with the run


def test_recorder_stores_block_scaled_recipes_equal_to_torchao(tmp_path):
    """mxfp8 and nvfp4 beside both per-tensor recipes: per logged step, Linear and role, Store.fp8's rows of the
    block recipes, Store.fp8_blocks and Store.fp8_block_scales equal torchao's reference casts of the tensors
    the test holds (output gradients divided by the loss scale; rows of 6 and 4 values: one partial block)."""
    pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    from ground_truth import reference_counts

    loss_scale = 2.0**10
    settings = Fp8Settings(recipe="both", history=2, block_recipes=("mxfp8", "nvfp4"))
    scaler = torch.amp.GradScaler("cpu", init_scale=loss_scale, growth_interval=1000)
    store, run_id, truths = record_planted_run(tmp_path, scaler, every=2, steps=3, settings=settings)
    rows, blocks, scales = store.fp8(run_id), store.fp8_blocks(run_id), store.fp8_block_scales(run_id)
    assert len(rows) == 2 * 2 * 3 * 4 and len(blocks) == 2 * 2 * 3 * 2
    assert_records_equal_casting(store, run_id, truths, settings)  # the per-tensor recipes are unchanged
    lost = 0
    for step in (0, 2):
        for (module, role), tensor in truths[step].items():
            for recipe, fmt in (("mxfp8", "fp8_e4m3"), ("nvfp4", "fp4_e2m1")):
                key = (step, module, role, recipe)
                row = rows.set_index(["step", "module", "role", "recipe"]).loc[key]
                block = blocks.set_index(["step", "module", "role", "recipe"]).loc[key]
                ref = reference_counts(tensor.reshape(-1, tensor.shape[-1]), recipe)
                assert row["fmt"] == fmt and row["numel"] == tensor.numel() and row["amax"] == float(tensor.abs().max())
                assert (row["underflow"], row["subnormal"], row["overflow"]) == \
                    (ref["underflow"], ref["subnormal"], ref["overflow"]), key
                assert (block["blocks"], block["clipped_blocks"]) == (ref["blocks"], ref["clipped_blocks"]), key
                one = scales[(scales["step"] == step) & (scales["module"] == module) & (scales["role"] == role)
                             & (scales["recipe"] == recipe)]
                assert dict(zip(one["exponent"], one["count"], strict=True)) == ref["scale_exponents"], key
                lost += ref["underflow"]
    assert lost > 0  # the planted tiny values underflow: the comparison is not of zeros only
    assert recorded_settings(store.run(run_id)["config"]) == settings


def test_a_skipped_steps_inf_gradients_stay_out_of_the_delayed_history(tmp_path):
    """GradScaler grows its scale to 2^127 after every good step, so every other step's output gradient of
    layer 0 overflows to inf and the step is skipped. Those infs are stored as their own step's amax, but the next
    steps' delayed scales come from the finite amaxes before them (the bug was scale 1 for H steps)."""
    settings = Fp8Settings(recipe="both", history=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_factor=2.0**87, backoff_factor=2.0**-87,
                                  growth_interval=1)
    store, run_id, truths = record_planted_run(tmp_path, scaler, every=1, steps=7, settings=settings)
    steps = store.steps(run_id)
    assert steps["skipped"].astype(bool).tolist() == [False, True] * 3 + [False]
    grad = {s: float(truths[s][("0", "grad_output")].abs().max()) for s in range(7)}
    assert [math.isinf(grad[s]) for s in range(7)] == [False, True] * 3 + [False]
    assert_records_equal_casting(store, run_id, truths, settings)
    rows = store.fp8(run_id)
    delayed = rows[(rows["module"] == "0") & (rows["role"] == "grad_output") & (rows["recipe"] == "delayed")]
    by_step = delayed.set_index("step")["scale"]
    assert (by_step != 1.0).all()  # no step reads the skipped steps' inf as its reference
    assert by_step[4] == float(np.float32(57344.0) / np.float32(max(grad[0], grad[2])))  # E5M2's max / the finite two
    assert np.isinf(delayed.set_index("step")["amax"][[1, 3, 5]]).all()  # the skipped steps keep their own amax


def test_cli_records_the_bundled_amax_jump_and_diagnose_links_the_layer_on_the_fp8_page(tmp_path):
    from mpdiag.examples.fp8_amax_jump import JUMP

    db = tmp_path / "s.db"
    run_cli("run", str(EXAMPLES_DIR / "fp8_amax_jump.py"), "--opt-level", "bf16", "--fp8", "--fp8-recipe", "both",
            "--steps", str(JUMP + 2), "--store", str(db))
    store = Store(db)
    rows = store.fp8(1)
    assert set(rows["recipe"]) == {"current", "delayed"} and set(rows["role"]) == {"input", "weight", "grad_output"}
    head = rows[(rows["module"] == "head") & (rows["role"] == "input")]
    assert head[(head["step"] == JUMP) & (head["recipe"] == "delayed")]["overflow"].iloc[0] > 1000
    assert head[(head["step"] == JUMP) & (head["recipe"] == "current")]["overflow"].iloc[0] == 0
    findings = {f.rule: f for f in diagnose(store, 1)}
    jump = findings["fp8-amax-jump"]
    assert f"worst at step {JUMP}" in jump.evidence and jump.tensors == ["head:input"]
    assert evidence_link(jump, 1) == "/FP8?run=1&layer=head&role=input&recipe=delayed"
    out = run_cli("diagnose", "1", "--no-probe", "--store", str(db)).stdout
    command = "rerun 1 --opt-level fp8-sim --fp8 --fp8-recipe current"
    assert command in out
    # the fix, verified by the fp8-sim rerun it names: its own FP8 records no longer show either finding, and
    # its loss has no spike at the jump, unlike fp8-sim with the recorded (delayed) recipe
    assert run_cli(*command.split(), "--store", str(db)).returncode == 0
    assert run_cli("rerun", "1", "--opt-level", "fp8-sim", "--fp8", "--fp8-recipe", "delayed", "--store", str(db)).returncode == 0
    outcome = rerun_outcomes(store, 1, list(findings.values()))
    fixed = outcome[outcome["run"] == 2].iloc[0]
    assert fixed["fp8-amax-jump"] == "gone" and fixed["fp8-lost-values"] == "gone"
    delayed = outcome[outcome["run"] == 3].iloc[0]
    assert delayed["fp8-amax-jump"] == "still there"
    bf16, fixed_loss, delayed_loss = (store.steps(r)["loss"].to_numpy() for r in (1, 2, 3))
    assert run_cli("export", "1", "--out", tmp_path / "out", "--store", str(db)).returncode == 0
    exported = pd.read_csv(tmp_path / "out" / "run1_fp8.csv")
    assert list(exported.columns) == list(rows.columns) and len(exported) == len(rows)
    assert delayed_loss[JUMP] > bf16[JUMP] + 0.3 and abs(fixed_loss[JUMP] / bf16[JUMP] - 1) < 0.02


def test_fp8_recipe_options_need_fp8_or_fp8_sim_and_one_process():
    RunConfig(opt_level="O1", fp8=True, fp8_recipe="both", fp8_margin=2).validate()
    with pytest.raises(ConfigError, match="--fp8-margin.*any level with --fp8"):
        RunConfig(opt_level="O1", fp8_margin=2).validate()
    with pytest.raises(ConfigError, match="--fp8 records one process"):
        RunConfig(fp8=True, nproc=2).validate()
    with pytest.raises(ConfigError, match="--fp8-history"):
        RunConfig(fp8=True, fp8_history=0).validate()
    assert RunConfig(opt_level="bf16", fp8=True, fp8_blocks="mxfp8, nvfp4").fp8_settings().block_recipes == (
        "mxfp8", "nvfp4")
    with pytest.raises(ConfigError, match="--fp8-blocks.*any level with --fp8"):
        RunConfig(opt_level="fp8-sim", fp8_blocks="mxfp8").validate()  # recorded, never simulated
    with pytest.raises(ConfigError, match="--fp8-blocks must name mxfp8 and/or nvfp4"):
        RunConfig(opt_level="bf16", fp8=True, fp8_blocks="mxfp4").validate()
    # a rerun that drops --fp8 at a level without FP8 drops the recipe with it; one that keeps it keeps it
    recorded = RunConfig(opt_level="bf16", fp8=True, fp8_margin=3)
    assert recorded.with_options(opt_level="O1").fp8_margin == 3
    assert recorded.with_options(opt_level="O1", fp8=False).fp8_margin == 0


FP8_LOOP = '''
import json, sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
log = []
for step in range(4):
    x = torch.randn(32, 8) * (100.0 if step == 3 else 1.0)
    opt.zero_grad()
    hidden = model[0](x)
    hidden.retain_grad()
    loss = model[2](model[1](hidden)).square().mean()
    scale = scaler.get_scale()
    scaler.scale(loss).backward()
    log.append({"input": float(x.abs().max()), "grad_output": float((hidden.grad / scale).abs().max()),
                "weight": float(model[0].weight.detach().abs().max())})
    scaler.step(opt)
    scaler.update()
json.dump(log, open(sys.argv[1], "w"))
'''


def test_watch_fp8_records_an_unmodified_loops_linears_against_its_own_tensors(tmp_path, write_script):
    from mpdiag.training.watch import WatchConfig, watch

    log, db = tmp_path / "log.json", tmp_path / "s.db"
    script = write_script(FP8_LOOP, "fp8_loop.py")
    settings = Fp8Settings(recipe="both", history=2, block_recipes=("nvfp4",))
    config = WatchConfig(target=str(script), args=(str(log),), fp8=settings)
    run_id, code = watch(config, db)
    assert code == 0
    import json

    own = json.loads(log.read_text())
    rows = Store(db).fp8(run_id)
    first = rows[(rows["module"] == "0") & (rows["recipe"] == "current")]
    assert set(rows["module"]) == {"0", "2"}
    for step in sorted(first["step"].unique()):  # every step whose forward ran after watch hooked in
        for role in ("input", "grad_output", "weight"):
            got = first[(first["step"] == step) & (first["role"] == role)]["amax"].iloc[0]
            assert got == pytest.approx(own[step][role], rel=1e-6), (step, role)
    assert 3 in set(first["step"])
    blocks = rows[rows["recipe"] == "nvfp4"]  # the block recipe beside both: same steps, modules and roles
    assert len(blocks) == len(first) * 2 and len(Store(db).fp8_blocks(run_id)) == len(blocks)
    jump = diagnose(Store(db), run_id)
    assert any(f.rule == "fp8-amax-jump" and f.tensors == ["0:input"] for f in jump)  # the 100x input at step 3
    assert all("nvfp4" not in f.title for f in jump)  # the findings judge the per-tensor recipes only
    # its rerun keeps the recipe
    from mpdiag.training.watch_config import rerun_config

    again = rerun_config(run_id, "x", Store(db).run(run_id)["config"]["watch"], opt_level="bf16")
    assert again.fp8 == settings


def test_watch_cli_refuses_a_recipe_option_without_fp8(tmp_path, write_script):
    script = write_script(FP8_LOOP, "fp8_loop.py")
    done = run_cli("watch", "--store", tmp_path / "s.db", "--fp8-margin", "2", script, tmp_path / "log.json")
    assert done.returncode == 2 and "--fp8-margin" in done.stderr and not (tmp_path / "log.json").exists()


def record_planted(store: Store, settings: Fp8Settings, steps: int = 6) -> int:
    """The planted model trained ``steps`` steps under a Recorder with ``settings``; returns the run id."""
    model = planted_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with Recorder(model, store, optimizer=optimizer, fp8=settings) as recorder:
        for step in range(steps):
            x, g = planted_batch(step)
            optimizer.zero_grad()
            loss = (model(x) * g).sum()
            loss.backward()
            recorder.record(loss)
            optimizer.step()
    return recorder.run_id


@pytest.mark.parametrize("margin, pow2", [(3, False), (0, True), (5, True)])
def test_whatif_from_one_recording_reproduces_another_recordings_scales_and_bounds_its_counts(tmp_path, margin, pow2):
    from mpdiag.analysis.fp8_summaries import recorded_counts, whatif

    store = Store(tmp_path / "s.db")
    base = Fp8Settings(recipe="both", history=2)
    recorded = record_planted(store, base)
    other = Fp8Settings(recipe="both", history=2, margin=margin, pow2=pow2)
    truth = store.fp8(record_planted(store, other))  # the capture itself, checked against casting above
    records, hists = store.fp8(recorded), store.fp8_histograms(recorded)
    for module, role in truth[["module", "role"]].drop_duplicates().itertuples(index=False):
        for recipe in ("current", "delayed"):
            got = whatif(records, hists, module, role, recipe, other)
            want = truth[(truth["module"] == module) & (truth["role"] == role) & (truth["recipe"] == recipe)]
            want = want.sort_values("step").reset_index(drop=True)
            assert got["scale"].tolist() == want["scale"].tolist()  # bit for bit: the same arithmetic
            for name in ("underflow", "subnormal", "overflow"):
                assert (got[f"{name} low"] <= want[name]).all() and (want[name] <= got[f"{name} high"]).all(), \
                    (module, role, recipe, name)
            if recipe == "current":  # the amax scales to the format's largest value: never an overflow
                assert (got["overflow high"] == 0).all()
    # with the recorded settings, the page states the recorded count itself
    rows = records[(records["module"] == "1") & (records["role"] == "input") & (records["recipe"] == "delayed")]
    assert recorded_counts(records, "1", "input", "delayed", base, base) == int((rows["underflow"] + rows["overflow"]).sum())
    assert recorded_counts(records, "1", "input", "delayed", other, base) is None


def test_heatmap_columns_merge_past_the_limit_without_hiding_a_lost_value():
    from mpdiag.analysis.fp8_summaries import lost_cells

    steps = np.arange(1000)
    records = pd.DataFrame({"step": steps, "module": "fc", "role": "input", "fmt": "fp8_e4m3", "recipe": "delayed",
                            "scale": 1.0, "amax": np.where(steps == 637, 500.0, 1.0), "numel": 100, "underflow": 0,
                            "subnormal": 0, "overflow": np.where(steps == 637, 1, 0)})
    cells = lost_cells(records, "delayed", "input", max_columns=200)
    assert len(cells) == 200 and cells["step"].tolist() == list(range(0, 1000, 5))
    lost = cells[cells["lost"] > 0]
    assert lost["step"].tolist() == [635] and lost["lost_share"].tolist() == [0.01] and lost["amax"].tolist() == [500.0]
    assert len(lost_cells(records.iloc[:150], "delayed", "input", max_columns=200)) == 150  # under the limit: as is
