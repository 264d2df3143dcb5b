"""A running run sends a heartbeat; readers show a run whose heartbeat stopped for more than 30 s as
``stalled`` (its process SIGSTOP'd, or a zombie) and one whose process is gone as ``crashed``. The clock the reader uses is
moved ahead so the test need not wait 30 s. (The old store had no heartbeat apart from committed rows and no
stalled state.)"""

import os
import signal
import time

import psutil
from conftest import EXAMPLES

from mpdiag import Store
from mpdiag.sandbox.launch import launch, run_job
from mpdiag.store import StoreWriter

SLOW = (EXAMPLES / "mlp_digits.py").read_text() + '''
import time as _time
_build = build

def build(device):
    spec = _build(device)
    loss_fn = spec["loss_fn"]
    spec["loss_fn"] = lambda model, batch: (_time.sleep(0.1), loss_fn(model, batch))[1]
    return spec
'''
AHEAD_S = 15  # the reader's clock runs this far ahead: a beating run (beats every 5 s) still reads running
# once its process is stopped, this far ahead: its last heartbeat was before the stop, so 30 - 28 s + 2 s of margin
# of real time after it, the reader sees a heartbeat older than 30 s
STOPPED_AHEAD_S = 28


def _run(store, run_id):
    return Store(store).runs().set_index("run_id").loc[run_id]


def test_a_stopped_run_reads_stalled_and_a_dead_one_crashed(tmp_path, monkeypatch):
    monkeypatch.setenv("MPDIAG_RUN_WALL_S", "300")
    store = tmp_path / "live.db"
    writer = StoreWriter(store)
    sha = writer.add_script("slow.py", SLOW)
    writer.close()
    proc = launch(run_job(f"sha256:{sha}", {"opt_level": "O1", "steps": 5000, "device": "cpu"}), store)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (proc.run_ids() and _run(store, proc.run_ids()[0])["steps_done"] > 2):
            time.sleep(0.3)
        (run_id,) = proc.run_ids()
        real_time = time.time
        monkeypatch.setattr(time, "time", lambda: real_time() + AHEAD_S)
        assert _run(store, run_id)["status"] == "running"
        (child,) = psutil.Process(proc.pid).children()
        os.kill(child.pid, signal.SIGSTOP)
        monkeypatch.setattr(time, "time", lambda: real_time() + STOPPED_AHEAD_S)
        time.sleep(30 - STOPPED_AHEAD_S + 2)  # real seconds without a heartbeat
        assert _run(store, run_id)["status"] == "stalled"
        os.kill(proc.pid, signal.SIGKILL)
        os.kill(child.pid, signal.SIGKILL)
        os.waitpid(proc.pid, 0)  # this test started the supervisor: reap it, or it lingers as a zombie (stalled)
        run = _run(store, run_id)
        assert run["status"] == "crashed" and "exited without closing the run" in run["error"]
    finally:
        for pid in [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))] \
                if proc.is_alive() else []:
            os.kill(pid, signal.SIGKILL)
