"""mpdiag/sandbox/launch.py: every run the app starts reaches a final status with a reason the user can read,
whatever happens around its child, and nothing the training code starts outlives its run. Each test starts a
real supervising process (or calls its job function in this process where a failure is injected) and reads the
outcome from the store, as a page would."""

import json
import os
import signal
import time

import psutil
import pytest

from mpdiag.sandbox import launch as launching
from mpdiag.sandbox.bundle import bundle_from_uploads
from mpdiag.store import Store, StoreWriter

pytestmark = pytest.mark.slow

STEPS_THEN = """
import subprocess, sys, time
import torch
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad(); model(torch.ones(4, 3)).sum().backward(); opt.step()
{after}
"""


def stored_upload(store_path, source: str) -> str:
    bundle = bundle_from_uploads([("train.py", source.encode())])
    with StoreWriter(store_path) as writer:
        return writer.add_bundle(bundle.name, bundle.to_zip())


def wait_final(store_path, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        ids = proc.run_ids()
        if ids and not proc.is_alive():
            return Store(store_path).run(ids[0])
        time.sleep(0.3)
    raise AssertionError(f"the job did not end: {proc.ending()}")


def test_a_process_the_training_code_detaches_is_ended_with_the_run_and_said(tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    after = (f"p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
             f"open({str(pid_file)!r}, 'w').write(str(p.pid))")
    store_path = tmp_path / "runs.db"
    sha = stored_upload(store_path, STEPS_THEN.format(after=after))
    proc = launching.launch(launching.watch_job(sha, "train.py", [], False, {}), store_path)
    run = wait_final(store_path, proc)
    assert run["status"] == "finished" and run["steps_done"] == 3
    pid = int(pid_file.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert run["note"] == "The training code left 1 process(es) running when it ended (sleep); they were ended with the run."


def test_a_supervisor_that_fails_marks_its_runs_failed_with_why(tmp_path, monkeypatch):
    store_path = tmp_path / "runs.db"
    sha = stored_upload(store_path, STEPS_THEN.format(after=""))
    job = {**launching.watch_job(sha, "train.py", [], False, {}), "store": str(store_path), "max_runs": 1}

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(launching, "run_task", broken)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OSError):
        launching.supervise_job(job)
    run = Store(store_path).runs().iloc[0]
    assert run["status"] == "failed"
    assert run["error"] == "the run could not be supervised: OSError: [Errno 28] No space left on device"
    assert "could not be supervised" in json.loads((tmp_path / launching.STATUS_FILE).read_text())["message"]


def test_a_queued_run_whose_supervisor_is_gone_reads_crashed(tmp_path):
    """A supervisor killed while its run waits for a slot (every slot taken) leaves a queued row: readers report it
    crashed, saying its process is gone."""
    store_path = tmp_path / "runs.db"
    sha = stored_upload(store_path, STEPS_THEN.format(after=""))
    with launching.run_slot(1):  # the only slot, held here: the job must queue
        proc = launching.launch(launching.watch_job(sha, "train.py", [], False, {}), store_path, max_runs=1)
        deadline = time.time() + 60
        while not proc.run_ids() and time.time() < deadline:
            time.sleep(0.2)
        assert Store(store_path).run(proc.run_ids()[0])["status"] == "queued"
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.time() + 10
        while proc.is_alive() and time.time() < deadline:
            time.sleep(0.1)
        run = Store(store_path).run(proc.run_ids()[0])
    assert run["status"] == "crashed" and run["error"] == "the training process exited without closing the run"


@pytest.mark.parametrize("how", ["SIGTERM to the child", "Stop button"])
def test_a_watched_run_stopped_by_sigterm_says_terminated(tmp_path, how):
    """SIGTERM to the training child, sent to it directly or by the dashboard's Stop (Launched.request_stop): the
    run ends itself, stopped with the signal named (not a protocol refusal), its 3 steps kept; after a Stop, the
    job's ending, which the page shows, says who stopped it."""
    store_path, started = tmp_path / "runs.db", tmp_path / "started"
    after = f"open({str(started)!r}, 'w').write('x'); time.sleep(120)"
    sha = stored_upload(store_path, STEPS_THEN.format(after=after))
    proc = launching.launch(launching.watch_job(sha, "train.py", [], False, {}), store_path)
    deadline = time.time() + 90
    while not started.exists() and time.time() < deadline:
        time.sleep(0.2)
    if how == "Stop button":
        assert not proc.stop_requested()
        proc.request_stop()
    else:
        supervisor = psutil.Process(proc.pid)
        [child] = [c for c in supervisor.children() if "mpdiag.sandbox.child" in " ".join(c.cmdline())]
        child.send_signal(signal.SIGTERM)
    run = wait_final(store_path, proc)
    assert run["status"] == "stopped" and run["error"] == "stopped by signal SIGTERM", run["error"]
    assert run["steps_done"] == 3 and len(Store(store_path).steps(int(run["run_id"]))) == 3
    if how == "Stop button":
        assert proc.ending() == "stopped from the dashboard (its Stop button)"


def test_a_pair_stopped_in_its_first_run_never_trains_its_twin(tmp_path):
    """Stop during a run with its FP32 twin: the first run ends itself on the SIGTERM with the steps it made, and the
    twin, queued, is never trained (it went on to train it, unstopped, before); its row says why it has no steps."""
    from conftest import EXAMPLES

    store_path = tmp_path / "runs.db"
    job = launching.run_job(str(EXAMPLES / "mlp_digits.py"), {"opt_level": "O1", "steps": 100_000, "pair": True})
    proc = launching.launch(job, store_path)
    deadline = time.time() + 90
    while time.time() < deadline and not (store_path.exists() and (Store(store_path).runs()["steps_done"] >= 2).any()):
        time.sleep(0.3)
    proc.request_stop()
    deadline = time.time() + 60
    while proc.is_alive() and time.time() < deadline:
        time.sleep(0.3)
    first, twin = (Store(store_path).run(run_id) for run_id in sorted(proc.run_ids()))
    assert (first["status"], first["error"]) == ("stopped", "stopped by signal SIGTERM")
    assert 2 <= first["steps_done"] < 100_000 and len(Store(store_path).steps(int(first["run_id"]))) == first["steps_done"]
    assert (twin["status"], twin["steps_done"]) == ("failed", 0) and Store(store_path).steps(int(twin["run_id"])).empty
    assert twin["error"] == f"stopped before the FP32 twin of run {first['run_id']} started"


def test_a_queued_job_waits_light(tmp_path):
    """While a job waits for a run slot, its supervising process holds no torch or pandas (the planning process that
    needed them has exited): a queued click costs tens of MB, not hundreds."""
    store_path = tmp_path / "runs.db"
    sha = stored_upload(store_path, STEPS_THEN.format(after=""))
    with launching.run_slot(1):
        proc = launching.launch(launching.watch_job(sha, "train.py", [], False, {}), store_path, max_runs=1)
        deadline = time.time() + 60
        while not proc.run_ids() and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
        supervisor = psutil.Process(proc.pid)
        rss_mb = supervisor.memory_info().rss / 2**20
        maps = open(f"/proc/{proc.pid}/maps").read()
        assert Store(store_path).run(proc.run_ids()[0])["status"] == "queued"
        assert "torch" not in maps and "pandas" not in maps and rss_mb < 60, rss_mb
    run = wait_final(store_path, proc)  # the slot freed: it runs
    assert run["status"] == "finished" and run["steps_done"] == 3


PLAN_IN_A_CHILD = """
import json, os, sys
from mpdiag.sandbox.launch import plan_and_queue, watch_job
store, script, upload = sys.argv[1], sys.argv[2], sys.argv[3]
for job in ({"kind": "run", "script": script, "options": {"opt_level": "O1", "steps": 2, "pair": True}},
            {"kind": "rerun", "run_id": 1, "options": {"opt_level": "bf16"}},
            watch_job(upload, "train.py", [], False, {"opt_level": "O1"})):
    print(json.dumps(plan_and_queue({**job, "store": store, "owner_pid": os.getppid()})["run_ids"]))  # the test: alive
print("torch" in sys.modules)
"""


def test_planning_a_job_imports_no_torch(tmp_path):
    """The planning process of every job the app starts (``--plan``) stores the script and queues its rows, then
    exits: for a run (with its FP32 twin), a rerun and a watched upload it never imports torch (1.5-2 s of CPU a
    click, measured), and the rows it queued are the ones the job will run."""
    import subprocess
    import sys

    from conftest import EXAMPLES, ROOT

    from mpdiag.training.runner import RunConfig, train
    from mpdiag.training.script import ModelScript

    store_path = tmp_path / "runs.db"
    train(ModelScript.from_path(EXAMPLES / "mlp_digits.py"), RunConfig(opt_level="O1", steps=2, device="cpu"),
          store_path)
    upload = stored_upload(store_path, STEPS_THEN.format(after=""))
    done = subprocess.run([sys.executable, "-c", PLAN_IN_A_CHILD, str(store_path), str(EXAMPLES / "mlp_digits.py"),
                           upload], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    pair, rerun, watched, imported = done.stdout.strip().splitlines()[-4:]
    assert [json.loads(pair), json.loads(rerun), json.loads(watched)] == [[2, 3], [4], [5]], done.stdout
    assert imported == "False", done.stdout
    runs = Store(store_path).runs().set_index("run_id")
    assert runs.loc[[2, 3, 4, 5], "status"].tolist() == ["queued"] * 4
    assert runs.loc[[2, 3, 4, 5], "opt_level"].tolist() == ["O1", "O0", "bf16", "O1"]
    assert runs.loc[4, "parent_run_id"] == 1 and runs.loc[5, "config"]["watch"]["bundle"] == upload


def test_a_run_that_hangs_reads_stalled_with_its_last_line_of_output(tmp_path, monkeypatch):
    """Uploaded code that prints, trains 3 steps and hangs: its steps reach the store, and the run reads stalled
    with the last line it printed (the log mirrored while it hangs), as the pages show it."""
    from mpdiag.store import reader

    monkeypatch.setattr(reader, "STALL_S", 2.0)
    store_path = tmp_path / "runs.db"
    after = "print('loading the next shard', flush=True); time.sleep(120)"
    sha = stored_upload(store_path, STEPS_THEN.format(after=after))
    proc = launching.launch(launching.watch_job(sha, "train.py", [], False, {}), store_path)
    deadline, run = time.time() + 90, None
    while time.time() < deadline:
        ids = proc.run_ids()
        run = Store(store_path).run(ids[0]) if ids else None
        # STALL_S is 2 s here, shorter than the child's start (imports before its first heartbeat): wait for the
        # state this is about, stalled after its steps were committed
        if run is not None and run["status"] == "stalled" and run["steps_done"] >= 2:
            break
        time.sleep(0.3)
    assert run is not None and run["status"] == "stalled" and run["steps_done"] == 2
    assert launching.last_output_line(store_path, int(run["run_id"])) == "loading the next shard"
    assert launching.last_output_line(tmp_path / "other.db", int(run["run_id"])) is None
    for process in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        process.kill()


def test_a_run_whose_allocation_the_memory_cap_refused_says_so(tmp_path, monkeypatch):
    """Without CUDA the cap is also an address-space limit: the script's allocation raises MemoryError, watch
    records the run failed, the child exits normally - and the job's ending names the cap, not 'exited normally'."""
    monkeypatch.setenv("MPDIAG_RUN_MEMORY_MB", "1500")
    store_path = tmp_path / "runs.db"
    sha = stored_upload(store_path, STEPS_THEN.format(after="hog = bytearray(4 * 2**30)"))
    proc = launching.launch(launching.watch_job(sha, "train.py", [], False, {}), store_path)
    run = wait_final(store_path, proc)
    assert run["status"] == "failed" and "MemoryError" in run["error"]
    assert proc.ending().startswith("stopped by the memory cap (1,500 MB): an allocation was refused (MemoryError")
