"""CLI commands, store robustness, and durability when the training process is killed."""

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import EXAMPLES, ROOT, imports_torch, run_cli

from mpdiag import Store
from mpdiag.store import StoreError, decode_hist, encode_hist


def test_run_runs_export(tmp_path, store_path):
    result = run_cli("run", EXAMPLES / "mlp_digits.py", "--opt-level", "O1", "--init-scale", "65536",
                     "--steps", "20", "--shadow-every", "10", "--store", store_path)
    assert result.returncode == 0, result.stderr
    assert "run 1 (mlp_digits.py): finished, 20 steps, 0 skipped" in result.stdout
    listing = run_cli("runs", "--store", store_path)
    assert "mlp_digits.py" in listing.stdout and "finished" in listing.stdout
    out = tmp_path / "export"
    exported = run_cli("export", "1", "--out", out, "--store", store_path)
    assert exported.returncode == 0, exported.stderr
    steps = pd.read_parquet(out / "run1_steps.parquet")
    assert len(steps) == 20 and steps["loss"].iloc[-1] < steps["loss"].iloc[0]
    stats = pd.read_csv(out / "run1_tensor_stats.csv")
    assert set(stats["tensor"]) == {"1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"}
    assert len(stats) == 20 * 6
    hist = pd.read_parquet(out / "run1_histograms.parquet")
    per_row = hist.groupby(["step", "tensor"])["count"].sum().reset_index()
    merged = per_row.merge(stats[["step", "tensor", "numel"]], on=["step", "tensor"])
    assert (merged["count"] == merged["numel"]).all()  # every element is in exactly one bin
    assert pd.read_csv(out / "run1_module_stats.csv").empty  # recorded without --trace-modules
    assert pd.read_csv(out / "run1_update_stats.csv").empty  # O1 keeps FP32 weights: no update check
    shadow = pd.read_parquet(out / "run1_shadow_stats.parquet")
    assert sorted(shadow["step"].unique()) == [0, 10] and set(shadow["tensor"]) == set(stats["tensor"])


def test_the_commands_that_only_read_answer_without_importing_torch(tmp_path):
    """``runs``, ``diagnose``, ``export`` and ``--help`` read the store or the parser, and ``check`` hands the
    script to a sandboxed child: torch's import (2-3 s) is left to the processes that run a model, so they answer
    at once (a check imported torch twice, in the command and in its child)."""
    from mpdiag.training.runner import RunConfig, train
    from mpdiag.training.script import ModelScript

    store = tmp_path / "runs.db"
    run_id = train(ModelScript.from_path(EXAMPLES / "mlp_digits.py"), RunConfig(opt_level="O1", steps=2, device="cpu"),
                   store)
    for argv in (["runs", "--store", str(store)], ["diagnose", str(run_id), "--no-probe", "--store", str(store)],
                 ["export", str(run_id), "--out", str(tmp_path / "out"), "--store", str(store)],
                 ["check", str(EXAMPLES / "mlp_digits.py")]):  # check runs the script in its child, torch there
        assert not imports_torch(f"from mpdiag.cli import main; assert main({argv!r}) == 0"), argv
    assert not imports_torch("import mpdiag.cli")


def test_a_training_process_starts_without_pandas_or_fsdp():
    """Every run starts a training process (a child of the app, watch, each rank): pandas (the store's
    reader) and FSDP's DTensor machinery (imported by torch.distributed.tensor) took 2 of its 4.8 s of
    imports. They are imported only where used: reading a run, or sharding a model."""
    code = ("import sys, mpdiag.training.runner, mpdiag.training.watch, mpdiag.recording.recorder; "
            "print(sorted(m for m in ('pandas', 'torch.distributed.tensor', 'torch.distributed.fsdp') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_device_cuda_without_gpu_is_a_clear_error(store_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = run_cli("run", EXAMPLES / "mlp_digits.py", "--device", "cuda", "--steps", "2", "--store", store_path)
    assert result.returncode == 2
    assert "--device cuda: this machine has no CUDA GPU" in result.stderr
    assert not store_path.exists() or Store(store_path).runs().empty


def test_bad_options_exit_2_with_message(store_path):
    result = run_cli("run", EXAMPLES / "mlp_digits.py", "--opt-level", "O9", "--store", store_path)
    assert result.returncode == 2 and "unknown opt level 'O9'" in result.stderr
    assert not store_path.exists()  # refused before the store was created
    Store(store_path)
    result = run_cli("export", "42", "--out", store_path.parent / "x", "--store", store_path)
    assert result.returncode == 2 and "No run 42" in result.stderr


def test_failed_script_exit_1_and_recorded(write_script, store_path):
    path = write_script("def build(device):\n    return None\n")
    result = run_cli("run", path, "--steps", "2", "--store", store_path)
    assert result.returncode == 1
    assert "build(device) returned NoneType; it must return a dict" in result.stderr
    assert Store(store_path).runs()["status"].tolist() == ["failed"]


def test_store_that_is_not_sqlite(tmp_path):
    bogus = tmp_path / "notes.db"
    bogus.write_text("hello, not a database")
    with pytest.raises(StoreError, match="is not an SQLite database"):
        Store(bogus)
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("create table x(a)").connection.commit()
    with pytest.raises(StoreError, match="not an mpdiag store"):
        Store(other)
    with pytest.raises(StoreError, match="No store at"):
        Store(tmp_path / "missing.db", create=False)


@pytest.mark.parametrize("counts", [np.zeros(277, dtype=np.int64), np.eye(277, dtype=np.int64)[5] * 3,
                                    np.arange(277, dtype=np.int64) ** 3])
def test_hist_blob_round_trip(counts):
    assert (decode_hist(encode_hist(counts)) == counts).all()


def _start_long_run(store_path, steps=100_000):
    return subprocess.Popen(
        [sys.executable, "-m", "mpdiag", "run", str(EXAMPLES / "mlp_digits.py"), "--steps", str(steps),
         "--store", str(store_path), "--device", "cpu"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def _wait_for_steps(store_path, n, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if store_path.exists():
            try:
                runs = Store(store_path).runs()
                if len(runs) and runs.iloc[0]["steps_done"] >= n:
                    return runs.iloc[0]
            except StoreError:
                pass
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.2)
    raise AssertionError("the run did not reach its steps in time")


def test_kill_9_keeps_committed_steps_and_marks_crashed(store_path):
    proc = _start_long_run(store_path)
    try:
        running = _wait_for_steps(store_path, 30, proc)
        assert running["status"] == "running"
    finally:
        proc.kill()
        proc.wait()
    store = Store(store_path)
    run = store.runs().iloc[0]
    assert run["status"] == "crashed" and "exited without closing" in run["error"]
    steps = store.steps(int(run["run_id"]))
    assert len(steps) >= 30 and steps["step"].tolist() == list(range(len(steps)))
    assert len(store.tensor_stats(int(run["run_id"]))) >= 30 * 6
    with sqlite3.connect(store_path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_sigterm_marks_stopped_with_reason(store_path):
    """A stop (the dashboard's Stop sends SIGTERM) is no failure of the script: the run is stopped, the signal
    named, and the command exits as python does on SIGTERM (143)."""
    proc = _start_long_run(store_path)
    try:
        _wait_for_steps(store_path, 5, proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    run = Store(store_path).runs().iloc[0]
    assert run["status"] == "stopped" and run["error"] == "stopped by signal SIGTERM"
    assert proc.returncode == 128 + signal.SIGTERM


def test_cli_pair_and_rerun(store_path):
    result = run_cli("run", EXAMPLES / "mlp_digits.py", "--opt-level", "O2", "--steps", "8", "--pair",
                     "--store", store_path)
    assert result.returncode == 0, result.stderr
    assert "run 2 (mlp_digits.py (FP32 twin)): finished" in result.stdout
    assert "loss vs FP32 twin: relative difference above 5% never" in result.stdout
    result = run_cli("rerun", "1", "--opt-level", "O3", "--loss-scale", "dynamic", "--store", store_path)
    assert result.returncode == 0, result.stderr
    run = Store(store_path).run(3)
    assert run["opt_level"] == "O3" and run["scaling"] == "dynamic" and run["parent_run_id"] == 1
    assert run["steps"] == 8  # inherited from the parent
    bad = run_cli("rerun", "1", "--loss-scale", "lots", "--store", store_path)
    assert bad.returncode == 2 and bad.stderr == "mpdiag: --loss-scale must be 'dynamic' or a finite number > 0, got 'lots'\n"


def test_running_totals_equal_the_sum_of_recorded_rows(store_path):
    from mpdiag.store import TOTAL_COLUMNS
    from mpdiag.training.runner import RunConfig, train
    from mpdiag.training.script import ModelScript

    run_id = train(ModelScript.from_path(EXAMPLES / "cnn_digits.py"), RunConfig(opt_level="O1", steps=9, every=2,
                                                                                 device="cpu"), store_path)
    store = Store(store_path)
    stats = store.tensor_stats(run_id)
    expected = stats.groupby("tensor")[["numel", *TOTAL_COLUMNS]].sum()
    totals = store.tensor_totals(run_id).set_index("tensor")
    assert (totals.loc[expected.index, ["numel", *TOTAL_COLUMNS]] == expected).all().all()
    assert set(totals["logged_steps"]) == {5}
    assert store.logged_steps(run_id) == [0, 2, 4, 6, 8]


def test_many_hist_blobs_decode_at_once():
    from mpdiag.store import decode_hists

    rng = np.random.default_rng(1)
    hists = [np.zeros(277, dtype=np.int64) for _ in range(50)]
    for h in hists[1:]:
        lo, width = int(rng.integers(0, 270)), int(rng.integers(1, 8))
        h[lo : lo + width] = rng.integers(0, 2**40, size=width)
    decoded = decode_hists([encode_hist(h) for h in hists])
    assert (decoded == np.stack(hists)).all()


def test_summary_stored_at_the_end_equals_the_steps(store_path):
    import math

    from mpdiag.training.runner import RunConfig, train
    from mpdiag.training.script import ModelScript

    ids = [train(ModelScript.from_path(EXAMPLES / "mlp_digits.py"), RunConfig(opt_level=level, steps=7, device="cpu"),
                 store_path) for level in ("O1", "O3")]  # O3 with Adam ends on a NaN loss
    store = Store(store_path)
    runs = store.runs().set_index("run_id")
    for run_id in ids:
        steps = store.steps(run_id)
        row = runs.loc[run_id]
        assert row["steps_done"] == len(steps) and row["skipped_steps"] == int(steps["skipped"].sum())
        assert row["peak_mem_bytes"] == steps["peak_mem_bytes"].max()
        assert row["median_step_time_s"] == pytest.approx(steps.loc[steps["step"] > 0, "step_time_s"].median())
        last = steps["loss"].iloc[-1]
        assert (math.isnan(row["final_loss"]) and math.isnan(last)) or row["final_loss"] == last
    with sqlite3.connect(store_path) as conn:  # it was stored, not recomputed
        assert conn.execute("SELECT COUNT(*) FROM runs WHERE summary IS NOT NULL").fetchone()[0] == 2
    assert math.isnan(runs.loc[ids[1], "final_loss"])


def test_diagnose_of_a_recorder_run_says_the_fix_in_code_and_why_its_scale_never_grew(tmp_path):
    """A user's own loop: FP16 autocast, a GradScaler from 1 with growth_interval 10**9 (the scale can never grow),
    a loss small enough that FP16 flushes its gradients. diagnose names the disabled growth (told only "use dynamic
    loss scaling", its user read that it already did) and says the fix as the GradScaler call to make, not as
    mpdiag's options ("set loss-scale dynamic" is no GradScaler argument) or a Python dict."""
    from mpdiag import Recorder

    store = tmp_path / "runs.db"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**9)
    recorder = Recorder(model, store=store, name="tiny loss", scaler=scaler, optimizer=optimizer)
    for _ in range(20):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(torch.randn(32, 16)).float(), torch.randn(32, 1)) * 1e-6
        scaler.scale(loss).backward()
        recorder.record(loss)
        scaler.step(optimizer)
        scaler.update()
    recorder.close()
    assert scaler.get_scale() == 1.0  # the ground truth: GradScaler's own scale never moved
    done = run_cli("diagnose", recorder.run_id, "--no-probe", "--store", store)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "The scale could not grow: its GradScaler's growth_interval, 1,000,000,000 steps, is longer than the " \
           "run's 20, so it never rose above its initial 1" in out, out
    k = int(re.search(r"Use dynamic loss scaling from 2\^(\d+)", out).group(1))
    assert (f"cannot rerun it: start the GradScaler at 2^{k} and let it grow and back off: "
            f"torch.amp.GradScaler(init_scale={2**k})") in out and "record it again" in out
    assert "{'" not in out and "set loss-scale" not in out
