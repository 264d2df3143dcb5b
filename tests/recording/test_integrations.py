"""The framework callbacks (mpdiag/integrations/) record the run `mpdiag watch` records of the same script, seed
and settings: the same steps (loss, scale, skipped), the same tensors and, per step and tensor, the same
statistics; and both hold the framework's own numbers (Lightning's tensors handed to its hooks)."""

import json
import os
import runpy
import sys

import pandas as pd
import pytest
from conftest import FIXTURES

from mpdiag.store import Store
from mpdiag.training.watch import WatchConfig, watch

pytestmark = pytest.mark.slow

SCRIPTS = os.fspath(FIXTURES / "scripts")
STATS = ["step", "tensor", "numel", "zeros", "nan", "posinf", "neginf", "absmax", "min_nonzero", "l2",
         "fp16_underflow", "fp16_subnormal", "fp16_overflow", "bf16_underflow", "bf16_subnormal", "bf16_overflow"]


def run_as_main(monkeypatch, script, *args):
    """``python SCRIPT ARGS`` in this process, without mpdiag watch."""
    monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
    runpy.run_path(script, run_name="__main__")


def assert_same_run(store, callback_run, watched_run):
    steps = [store.steps(run)[["step", "loss", "loss_scale", "scale_after", "skipped"]] for run in (callback_run, watched_run)]
    assert len(steps[0]) > 0
    pd.testing.assert_frame_equal(*steps)
    tensors = [store.tensors(run)[["tensor_id", "name", "shape", "numel"]] for run in (callback_run, watched_run)]
    pd.testing.assert_frame_equal(*tensors)
    stats = [store.tensor_stats(run)[STATS].sort_values(["step", "tensor"], ignore_index=True)
             for run in (callback_run, watched_run)]
    assert len(stats[0]) > 0
    pd.testing.assert_frame_equal(*stats)
    assert store.run(callback_run)["status"] == "finished"


@pytest.mark.parametrize("args", [("--precision", "32-true", "--clip", "0.5"),
                                  ("--precision", "bf16-mixed", "--accumulate", "2"),
                                  ("--precision", "cpu-fp16", "--accumulate", "2", "--clip", "0.1"),
                                  ("--manual",), ("--two-optimizers",), ("--precision", "cpu-fp16", "--two-optimizers")],
                         ids=["32-clip", "bf16-accumulate", "16-mixed-scaled", "manual", "two-optimizers",
                              "two-optimizers-scaled"])
def test_lightning_callback_records_what_watch_records(store_path, tmp_path, monkeypatch, args):
    script = os.path.join(SCRIPTS, "frameworks", "lightning_trainer.py")
    truth_path = tmp_path / "truth.json"
    run_as_main(monkeypatch, script, truth_path, *args, "--max-steps", 4, "--mpdiag-callback", store_path)
    truth = json.loads(truth_path.read_text())
    watched_run, code = watch(WatchConfig(target=script, args=(str(tmp_path / "watched.json"), *args, "--max-steps", "4")),
                              store_path)
    store = Store(store_path)
    callback_run = int(store.runs()["run_id"].min())
    assert code == 0 and store.run(callback_run)["name"] == "lightning callback"
    assert_same_run(store, callback_run, watched_run)
    assert store.steps(callback_run)["loss"].tolist() == pytest.approx(truth["loss"], rel=1e-6)
    stats = store.tensor_stats(callback_run)
    for step, norms in enumerate(truth["norms"]):  # the stepping optimizer's tensors (None: another's), no other
        rows = stats[stats["step"] == step].set_index("tensor")["l2"]
        held = [name for name, norm in zip(truth["names"], norms, strict=True) if norm is not None]
        assert sorted(rows.index) == sorted(held), step
        assert [rows[name] for name in held] == pytest.approx([n for n in norms if n is not None], rel=1e-6)
    # the per-step global norm and learning rate: Lightning's gradients as its hook saw them (before its clip) and
    # the script's StepLR (1e-2, halved every 2 steps of the first optimizer, whose rate is recorded; with two
    # optimizers it steps at the even steps)
    steps = store.steps(callback_run)
    global_norms = [sum(n**2 for n in norms if n is not None) ** 0.5 for norms in truth["norms"]]
    assert steps["grad_norm"].tolist() == pytest.approx(global_norms, rel=1e-6)
    first_steps = [(step + 1) // 2 if "--two-optimizers" in args else step for step in steps["step"]]
    assert steps["lr"].tolist() == [1e-2 * 0.5 ** (count // 2) for count in first_steps]


def test_lightning_callback_under_watch_stands_aside(store_path, tmp_path):
    script = os.path.join(SCRIPTS, "frameworks", "lightning_trainer.py")
    run_id, code = watch(WatchConfig(target=script, args=(str(tmp_path / "t.json"), "--max-steps", "2",
                                                          "--mpdiag-callback", str(store_path))), store_path)
    assert code == 0 and Store(store_path).runs()["run_id"].tolist() == [run_id]


def test_hugging_face_callback_records_what_watch_records(store_path, tmp_path, monkeypatch):
    """The Trainer clips through Accelerate (max_grad_norm) and accumulates 2 micro-batches: both runs hold the
    gradients before the clip; the Trainer's own logged grad_norm is their global norm."""
    script = os.path.join(SCRIPTS, "hf_trainer.py")
    out = tmp_path / "callback"
    run_as_main(monkeypatch, script, out, "--mpdiag-callback", store_path)
    watched_run, code = watch(WatchConfig(target=script, args=(str(tmp_path / "watched"),)), store_path)
    store = Store(store_path)
    callback_run = int(store.runs()["run_id"].min())
    assert code == 0 and store.run(callback_run)["name"] == "trainer callback"
    assert_same_run(store, callback_run, watched_run)
    logged = [entry["grad_norm"] for entry in json.loads((out / "log_history.json").read_text()) if "grad_norm" in entry]
    stats = store.tensor_stats(callback_run)
    norms = stats.groupby("step")["l2"].apply(lambda l2: float((l2 ** 2).sum() ** 0.5)).tolist()
    assert norms == pytest.approx(logged, rel=1e-5)
    # the per-step global norm (before Accelerate's clip) and learning rate against the Trainer's own log
    log = [entry for entry in json.loads((out / "log_history.json").read_text()) if "grad_norm" in entry]
    steps = store.steps(callback_run)
    assert steps["grad_norm"].tolist() == pytest.approx(logged, rel=1e-5)
    assert steps["lr"].tolist() == [entry["learning_rate"] for entry in log]
