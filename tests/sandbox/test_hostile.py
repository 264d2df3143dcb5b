"""Broken and hostile model scripts: each gets a clear message from `mpdiag check` and, when it gets as far
as training, from a run started the way the app starts runs (supervised child process). Other runs' data and
the store stay intact throughout.

Each script in tests/fixtures/hostile/ states in its header what the check must say (``# check: ...``, or ``ready``)
and, optionally, what its run must end with (``# run: ...``: ``finished`` or text of the run's error).
"""

import sqlite3
import time
from pathlib import Path

import pytest
import torch
from conftest import EXAMPLES, FIXTURES, run_cli

from mpdiag import Store
from mpdiag.sandbox.launch import launch, run_job
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript

pytestmark = pytest.mark.slow
HOSTILE = sorted((FIXTURES / "hostile").glob("*.py"))
LIMITS = {"MPDIAG_CHECK_WALL_S": "20", "MPDIAG_RUN_WALL_S": "40", "MPDIAG_RUN_MEMORY_MB": "3000",
          "MPDIAG_LOG_BYTES": "200000"}
#: a script expected to be stopped at the wall-time limit waits for it: a shorter one (still past a child's
#: start on CI's two cores) saves the suite its difference
WALL_HIT = "stopped at the wall-time limit"
SHORT_WALL = {"check": {"MPDIAG_CHECK_WALL_S": "8"}, "run": {"MPDIAG_RUN_WALL_S": "12"}}


def limits(path: Path, phase: str) -> dict[str, str]:
    """The limits a hostile script's ``phase`` (check or run) runs under."""
    return {**LIMITS, **(SHORT_WALL[phase] if expectations(path).get(phase) == WALL_HIT else {})}


def expectations(path: Path) -> dict[str, str]:
    """The script's ``# check:`` and ``# run:`` lines. ``# check: CUDA`` (a script that calls .cuda()) fails
    its check only where there is no GPU; with one, the runner moves the model to the asked device: ready."""
    found = {}
    for line in path.read_text().splitlines():
        if line.startswith("# check:") or line.startswith("# run:"):
            key, _, value = line[2:].partition(":")
            found[key] = value.strip()
    if found.get("check") == "CUDA" and torch.cuda.is_available():
        found["check"] = "ready"
    return found


def test_there_are_at_least_twenty_hostile_scripts():
    assert len(HOSTILE) >= 20
    assert all("check" in expectations(p) for p in HOSTILE)


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    """A store with a healthy run in it: its rows must never change."""
    path = tmp_path_factory.mktemp("hostile") / "runs.db"
    train(ModelScript.from_path(EXAMPLES / "mlp_digits.py"), RunConfig(opt_level="O1", steps=5, device="cpu"), path)
    return path


def fingerprint(store: Path, run_id: int = 1) -> str:
    s = Store(store)
    run = s.run(run_id)
    error = run["error"] if isinstance(run["error"], str) else None
    return s.steps(run_id).to_csv() + s.tensor_stats(run_id).to_csv() + f"{run['status']} {error}"


@pytest.mark.parametrize("script", HOSTILE, ids=[p.stem for p in HOSTILE])
def test_check_gives_a_clear_verdict(script, monkeypatch):
    for k, v in limits(script, "check").items():
        monkeypatch.setenv(k, v)
    expected = expectations(script)["check"]
    result = run_cli("check", script, "--device", "cpu", env=limits(script, "check"), timeout=120)
    output = result.stdout + result.stderr
    if expected == "ready":
        assert result.returncode == 0 and f"{script}: ready" in output, output[-3000:]
    else:
        assert result.returncode == 1 and "not ready" in output, output[-3000:]
        assert expected in output, output[-3000:]
    assert len(output) < 400_000  # the 100 MB of noise never reaches the user


RUNNABLE = [p for p in HOSTILE if "run" in expectations(p)]


@pytest.mark.parametrize("script", RUNNABLE, ids=[p.stem for p in RUNNABLE])
def test_supervised_run_ends_with_a_clear_record_and_others_untouched(script, shared_store, monkeypatch):
    for k, v in limits(script, "run").items():
        monkeypatch.setenv(k, v)
    before = fingerprint(shared_store)
    known = set(Store(shared_store).runs()["run_id"])
    proc = launch(run_job(str(script), {"opt_level": "O1", "steps": 12, "device": "cpu"}), shared_store)
    deadline = time.time() + 120
    while proc.is_alive() and time.time() < deadline:
        time.sleep(0.3)
    assert not proc.is_alive(), "the supervisor did not stop the run"
    runs = Store(shared_store).runs()
    new = runs[~runs["run_id"].isin(known)]
    assert len(new) == 1, proc.log_tail()
    run = new.iloc[0]
    expected = expectations(script)["run"]
    if expected == "finished":
        assert run["status"] == "finished", run["error"]
    else:
        assert run["status"] == "failed" and expected in run["error"], (run["status"], run["error"])
    after = fingerprint(shared_store)
    assert after == before, [(a, b) for a, b in zip(before.splitlines(), after.splitlines(), strict=False) if a != b][:3]
    with sqlite3.connect(shared_store) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert len(Path(proc.log_path).read_bytes()) <= 200_000 + 100  # the log is bounded


def test_huge_output_keeps_the_last_part(tmp_path):
    from mpdiag.sandbox.supervisor import Limits, supervise

    outcome = supervise(["python3", "-c", "import sys\nfor i in range(200000): print(i)\nprint('LAST LINE')"],
                        Limits(wall_s=30, memory_mb=4000, log_bytes=10_000), tmp_path, tmp_path / "out.log")
    assert outcome.ok and outcome.dropped_bytes > 1_000_000
    text = (tmp_path / "out.log").read_text()
    assert text.startswith("[... ") and text.rstrip().endswith("LAST LINE") and len(text) < 10_100


def test_a_child_killed_by_a_signal_is_described_by_name(tmp_path):
    from mpdiag.sandbox.supervisor import Limits, supervise

    outcome = supervise(["python3", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"],
                        Limits(wall_s=30, memory_mb=4000, log_bytes=1000), tmp_path)
    assert not outcome.ok and outcome.message == "terminated (SIGTERM)"
