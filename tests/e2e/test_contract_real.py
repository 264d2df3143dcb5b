"""Real-code shapes through `mpdiag watch`: a nanoGPT-style script (its own LayerNorm, tied weights, AdamW with
two parameter groups from configure_optimizers, warmup+cosine LR, accumulation, GradScaler, clipping) run
unmodified; what is stored is checked against what the script computed itself."""

import json
import math
import os

import pytest
from conftest import ROOT as REPOSITORY

from mpdiag.store import Store
from mpdiag.training.watch import WatchConfig, watch

ROOT = os.fspath(REPOSITORY)
NANOGPT_STYLE = os.path.join(ROOT, "tests", "fixtures", "scripts", "nanogpt_style.py")


def run_nanogpt_style(store_path, log_path, *args, **options):
    config = WatchConfig(target=NANOGPT_STYLE, args=(f"--log={log_path}", *args), **options)
    run_id, code = watch(config, store_path)
    assert code == 0
    return Store(store_path), run_id, json.loads(log_path.read_text())


@pytest.mark.parametrize(("dtype", "scaling"), [("float16", "dynamic"), ("bfloat16", "none"), ("float32", "none")])
def test_nanogpt_style_script_unmodified(store_path, tmp_path, dtype, scaling):
    store, run_id, log = run_nanogpt_style(store_path, tmp_path / "log.json", f"--dtype={dtype}")
    run, steps, stats = store.run(run_id), store.steps(run_id), store.tensor_stats(run_id)
    assert (run["status"], run["scaling"]) == ("finished", scaling)
    assert len(steps) == 6  # one step per optimizer step, not per micro-batch
    assert steps["loss"].tolist() == pytest.approx(log["loss"], rel=1e-6)  # the mean of the 3 micro-batch losses
    assert steps["loss_scale"].tolist() == log["scale"]
    for step, norm in enumerate(log["grad_norm"]):  # before clipping, unscaled
        assert math.sqrt((stats[stats["step"] == step]["l2"] ** 2).sum()) == pytest.approx(norm, rel=2e-6)
    names = store.tensors(run_id)["name"].tolist()
    assert names[0] == "transformer.wte.weight" and "lm_head.weight" not in names  # the tied weight, once
    assert "transformer.h.0.ln_1.weight" in names and len(names) == len(set(names)) == 28  # 2 embeddings + 2 x 12 per block + ln_f


def test_nanogpt_style_levels(store_path, tmp_path):
    log_path = tmp_path / "log.json"
    store, o0, _ = run_nanogpt_style(store_path, log_path, opt_level="O0")
    assert store.run(o0)["scaling"] == "none" and set(store.tensors(o0)["grad_dtype"]) == {"float32"}
    _, o1, log = run_nanogpt_style(store_path, log_path, "--dtype=bfloat16", opt_level="O1", init_scale=2.0**10)
    assert store.run(o1)["scaling"] == "dynamic" and store.steps(o1)["loss_scale"].iloc[0] == 2.0**10
    assert log["scale"][0] == 2.0**10  # the script's own scaler, enabled and started at --init-scale
