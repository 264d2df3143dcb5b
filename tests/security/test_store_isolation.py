"""Uploaded code never holds the store: a run started the way the app starts runs gets no store path (not in
argv, the environment, the working directory or its parents, nor its supervisor's argv and environment), and a
forged store call for another run is refused. Other runs' rows stay unchanged. The hunting script reports
what it finds instead of overwriting it: on a shared machine it would find, and damage, other stores lying
in plain sight in /tmp. (On the old code the child's
argv carried ``--store PATH`` and the child wrote the store itself: both tests fail there.)

The supervisor's open files (/proc/PID/fd), where its store connection shows, are hidden from the child by
making the supervisor non-dumpable. That works against processes of the same ordinary user, not against root:
as root that part of the check is skipped.
"""

import ast
import json
import os
import time
from pathlib import Path

import pytest
from conftest import EXAMPLES

from mpdiag import Store
from mpdiag.sandbox.launch import launch, run_job
from mpdiag.store import StoreWriter
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript

BASE = (EXAMPLES / "mlp_digits.py").read_text()

SEARCH = BASE + '''
import os, sys

def _is_store(path):
    try:
        with open(path, "rb") as fh:
            return fh.read(16) == b"SQLite format 3\\x00"
    except OSError:
        return False

def _hunt():
    found = set()
    texts = list(sys.argv) + list(os.environ.values())
    try:
        texts += open(f"/proc/{os.getppid()}/cmdline", "rb").read().decode(errors="replace").split("\\0")
        texts += open(f"/proc/{os.getppid()}/environ", "rb").read().decode(errors="replace").split("\\0")
    except OSError:
        pass
    for text in texts:
        for word in text.split(os.pathsep) + text.split():
            if word.endswith(".db") or _is_store(word):
                found.add(word)
    try:
        os.listdir(f"/proc/{os.getppid()}/fd")
        print("SUPERVISOR-FDS-VISIBLE", flush=True)
    except OSError:
        pass
    for root, _, files in os.walk(os.getcwd()):
        found |= {os.path.join(root, f) for f in files if _is_store(os.path.join(root, f))}
    here = os.path.abspath(os.getcwd())
    while True:
        parent = os.path.dirname(here)
        for name in os.listdir(parent):
            if _is_store(os.path.join(parent, name)):
                found.add(os.path.join(parent, name))
        if parent == here:
            break
        here = parent
    # What it found it would write; it only reports, so that it damages no other store on a shared machine.
    print("STORE-HUNT:" + repr(sorted(found)), flush=True)

_hunt()
'''

FORGER = BASE + '''
import json, os, struct

def _forge():
    body = json.dumps({"kind": "call", "method": "update_run", "args": [1],
                       "kwargs": {"status": "failed", "error": "forged by run 2"}}).encode()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                os.write(int(fd), struct.pack(">I", len(body)) + body)
        except OSError:
            pass

_forge()
'''


@pytest.fixture
def store_with_a_run(tmp_path):
    path = tmp_path / "deep" / "inside" / "runs.db"
    train(ModelScript.from_path(EXAMPLES / "mlp_digits.py"), RunConfig(opt_level="O1", steps=3, device="cpu"), path)
    return path


def fingerprint(store: Path) -> str:
    s = Store(store)
    run = s.run(1)
    error = run["error"] if isinstance(run["error"], str) else None  # None or NaN, as the other rows make it
    return s.steps(1).to_csv() + s.tensor_stats(1).to_csv() + f"{run['status']} {error}"


def start_stored(store: Path, name: str, source: str):
    writer = StoreWriter(store)
    try:
        sha = writer.add_script(name, source)
    finally:
        writer.close()
    proc = launch(run_job(f"sha256:{sha}", {"opt_level": "O1", "steps": 3, "device": "cpu"}), store)
    deadline = time.time() + 180
    while proc.is_alive() and time.time() < deadline:
        time.sleep(0.3)
    assert not proc.is_alive()
    return proc


def test_a_run_from_the_app_finds_no_store_to_write(store_with_a_run):
    before = fingerprint(store_with_a_run)
    proc = start_stored(store_with_a_run, "hunter.py", SEARCH)
    log = Path(proc.log_path).read_text()
    (hunt,) = [ast.literal_eval(line.removeprefix("STORE-HUNT:")) for line in log.splitlines()
               if line.startswith("STORE-HUNT:")]
    # Stores lying directly in /tmp or / (other users' of a shared machine) are in plain sight of any process;
    # this test's store, kept below the test's own directory, must not be found.
    assert not [p for p in hunt if os.path.abspath(p).startswith(str(store_with_a_run.parents[2]))], hunt
    if os.geteuid() != 0:
        assert "SUPERVISOR-FDS-VISIBLE" not in log
    run = Store(store_with_a_run).run(proc.run_ids()[0])
    assert run["status"] == "finished" and run["steps_done"] == 3, run["error"]
    assert fingerprint(store_with_a_run) == before
    status = json.loads((Path(proc.log_path).parent / "status.json").read_text())
    assert str(store_with_a_run) not in json.dumps(status)


def test_a_forged_call_for_another_run_is_refused(store_with_a_run):
    before = fingerprint(store_with_a_run)
    proc = start_stored(store_with_a_run, "forger.py", FORGER)
    assert fingerprint(store_with_a_run) == before
    run = Store(store_with_a_run).run(proc.run_ids()[0])
    assert run["status"] == "failed" and "tried to write run 1" in run["error"], run["error"]
