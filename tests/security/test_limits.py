"""At most N runs from the app train at once; the rest wait, shown as ``queued``. The limits are stated in
words the pages can show. (The old launcher started every run at once and had no queued state.)"""

import time

from conftest import EXAMPLES

from mpdiag import Store
from mpdiag.sandbox import launch as launching
from mpdiag.sandbox.launch import launch, limits_text, max_concurrent_runs, run_job, run_slot


def _status(store, run_id):
    runs = Store(store).runs()
    return runs.set_index("run_id").loc[run_id, "status"] if run_id in set(runs["run_id"]) else None


def test_a_run_beyond_the_limit_waits_as_queued_then_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the supervisor's slots live under its own temp dir
    monkeypatch.setattr(launching, "WORK_DIR", tmp_path / "mpdiag-work")
    store = tmp_path / "q.db"
    with run_slot(1):  # this test holds the only slot
        proc = launch(run_job(str(EXAMPLES / "mlp_digits.py"), {"opt_level": "O1", "steps": 3, "device": "cpu"}),
                      store, max_runs=1)
        deadline = time.time() + 120
        while not proc.run_ids() and time.time() < deadline:
            time.sleep(0.2)
        (run_id,) = proc.run_ids()
        assert _status(store, run_id) == "queued"
        time.sleep(2)  # still waiting for the slot
        assert _status(store, run_id) == "queued" and proc.is_alive()
    while proc.is_alive() and time.time() < deadline:
        time.sleep(0.3)
    assert _status(store, run_id) == "finished"


def test_the_limit_comes_from_the_environment_or_the_cpu_count(monkeypatch):
    import os

    monkeypatch.delenv("MPDIAG_MAX_RUNS", raising=False)
    assert max_concurrent_runs() == (os.cpu_count() or 1)
    monkeypatch.setenv("MPDIAG_MAX_RUNS", "3")
    assert max_concurrent_runs() == 3


def test_limits_are_stated_for_the_pages(monkeypatch):
    monkeypatch.setenv("MPDIAG_RUN_MEMORY_MB", "1234")
    monkeypatch.setenv("MPDIAG_MAX_RUNS", "2")
    monkeypatch.setenv("MPDIAG_RUN_DISK_MB", "500")
    text = limits_text()
    assert "1,234 MB of memory" in text and "at most 2 run(s)" in text and "queued" in text
    assert "write up to 500 MB into its directory" in text and "everything it starts ends with it" in text
