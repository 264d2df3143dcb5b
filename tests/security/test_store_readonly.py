"""A store in a folder the user cannot write, with no -wal/-shm beside it, can be listed, read and diagnosed.

Tests run as root, and root writes anywhere, so the reads run in a forked child that has dropped to the
``nobody`` user: the folder (0555) and file (0444) are then truly read-only to it, as for a real user.
"""

import contextlib
import io
import json
import os
import pwd
import shutil
import sqlite3
import tempfile
import traceback
from pathlib import Path

import pytest
from conftest import EXAMPLES

from mpdiag import cli
from mpdiag.sandbox import launch, probe
from mpdiag.sandbox.supervisor import Outcome
from mpdiag.store import Store, StoreError, StoreWriter
from mpdiag.store.schema import connect_read
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript


def _as_nobody(job):
    """Run ``job()`` in a forked child as the nobody user; returns its JSON-able result or raises its error."""
    nobody = pwd.getpwnam("nobody")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root for good, then run the job
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            payload = {"ok": job()}
        except BaseException:  # noqa: BLE001 - reported to the parent
            payload = {"error": traceback.format_exc()}
        with os.fdopen(write, "w") as out:
            json.dump(payload, out, default=str)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as inp:
        payload = json.load(inp)
    os.waitpid(pid, 0)
    if "error" in payload:
        raise AssertionError(f"the nobody child failed:\n{payload['error']}")
    return payload["ok"]


def _the_probe_result(command, limits, cwd, env=None, **kwargs):
    """Stands in for the supervised probe child (nobody cannot start this interpreter, which lives under /root)."""
    result = {"ok": True, "scales": [1.0, 2.0], "ratios": {}, "failing": [], "functions": []}
    return Outcome(exit_code=0, reason="exited", message="exited with code 0",
                   output_tail="\n" + probe.MARKER + json.dumps(result), dropped_bytes=0, child_pid=1, seconds=0.1)


@pytest.fixture
def readonly_store():
    base = Path(tempfile.mkdtemp(prefix="mpdiag-ro-"))  # pytest's tmp_path sits in a folder only root may enter
    base.chmod(0o755)
    folder = base / "shared"
    path = folder / "runs.db"
    train(ModelScript.from_path(EXAMPLES / "mlp_digits.py"), RunConfig(opt_level="O1", steps=4, device="cpu"), path)
    assert sorted(p.name for p in folder.iterdir()) == ["runs.db"]  # the writer checkpointed and removed -wal/-shm
    path.chmod(0o444)
    folder.chmod(0o555)
    yield path
    folder.chmod(0o755)
    shutil.rmtree(base)


def test_readonly_folder_store_lists_reads_and_diagnoses(readonly_store, monkeypatch):
    path = readonly_store
    monkeypatch.setattr(probe, "supervise", _the_probe_result)
    scratch = path.parent.parent / "scratch"  # the probe's own working folder, which nobody may write
    scratch.mkdir(mode=0o777)
    scratch.chmod(0o777)
    monkeypatch.setattr(launch, "WORK_DIR", scratch)

    def job():
        results = {}
        with contextlib.suppress(sqlite3.OperationalError):  # the plain read-only open cannot work here
            conn = connect_read(path)
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            results["mode=ro worked"] = True
        store = Store(path)
        results["runs"] = store.runs()[["run_id", "status", "steps_done"]].to_dict("records")
        results["stats rows"] = len(store.tensor_stats(1))
        results["fp16 rows"] = len(store.representability(1, "fp16"))
        for argv in (["runs", "--store", str(path)], ["diagnose", "1", "--store", str(path)]):
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                results[f"cli {argv[0]}"] = (cli.main(argv), out.getvalue())
        results["probe"] = probe.run_probe(path, 1)
        try:
            StoreWriter(path)
        except StoreError as exc:
            results["writer"] = str(exc)
        return results

    got = _as_nobody(job)
    assert "mode=ro worked" not in got  # so the immutable fallback is what read the store
    assert got["runs"] == [{"run_id": 1, "status": "finished", "steps_done": 4}]
    assert got["stats rows"] == got["fp16 rows"] == 4 * 6
    code, listing = got["cli runs"]
    assert code == 0 and "mlp_digits.py" in listing and "finished" in listing
    code, diagnosis = got["cli diagnose"]
    assert code == 0 and "Traceback" not in diagnosis, diagnosis
    assert "no findings" in diagnosis or "do:" in diagnosis, diagnosis
    assert got["probe"]["ok"] is True and "Cannot write to the store" in got["probe"]["not_stored"]
    assert "Cannot write to the store" in got["writer"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["runs.db"]
