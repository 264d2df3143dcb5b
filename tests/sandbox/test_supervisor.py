"""mpdiag/sandbox/supervisor.py: what a supervised child may leave behind, what its log shows while it runs, and
the words for how it ended. Each test runs a real child (python3 -c) and checks what a user would see: processes
alive afterwards (psutil), the log file's text, the outcome's message."""

import os
import time

import psutil
import pytest

from mpdiag.sandbox.supervisor import Limits, supervise

LIMITS = Limits(wall_s=60, memory_mb=4000, log_bytes=100_000)


def _pids(path):
    return [int(line) for line in path.read_text().split()]


@pytest.mark.parametrize("how", ["own session", "double fork"])
def test_nothing_the_child_starts_outlives_it(tmp_path, how):
    """A process started in its own session (``start_new_session=True``) or daemonised by a double fork is neither
    in the child's process group nor, once its parent exits, the child's descendant: it is still the run's, and is
    ended with it; the outcome names it."""
    pids = tmp_path / "pids"
    spawn = {
        "own session": f"import subprocess; p = subprocess.Popen(['sleep', '300'], start_new_session=True); "
                       f"open({str(pids)!r}, 'w').write(str(p.pid))",
        "double fork": f"import os, subprocess\n"
                       f"if os.fork() == 0:\n"
                       f"    os.setsid(); p = subprocess.Popen(['sleep', '300']); open({str(pids)!r}, 'w').write(str(p.pid)); os._exit(0)\n"
                       f"os.wait(); import time; time.sleep(0.5)",
    }[how]
    outcome = supervise(["python3", "-c", spawn], LIMITS, tmp_path)
    assert outcome.ok, outcome.message
    [pid] = _pids(pids)
    deadline = time.time() + 5
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.time() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert "left 1 process(es) running (sleep), ended with it" in outcome.message


def test_the_memory_cap_counts_a_process_in_a_session_of_its_own(tmp_path):
    """Memory held by a detached process counts against the run's cap, and the message names the cap."""
    hog = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
           "'x = b\"x\" * (200 * 2**20); import time; time.sleep(60)'], start_new_session=True); "
           "y = b'y' * (150 * 2**20); time.sleep(60)")  # 350 MB in all, each process under its own 300 MB rlimit
    outcome = supervise(["python3", "-c", hog], Limits(wall_s=30, memory_mb=300, log_bytes=1000), tmp_path)
    assert outcome.reason == "memory"
    assert outcome.message.startswith("stopped by the memory cap (300 MB)")


def test_the_log_file_shows_the_last_line_of_a_child_that_hangs(tmp_path):
    """Output is mirrored to the log file on a timer, not only when more output arrives."""
    log = tmp_path / "out.log"
    hang = "import sys, time\nfor i in range(4): print('step', i, flush=True)\ntime.sleep(3)"
    started = time.monotonic()
    import threading

    seen = {}

    def look():
        while time.monotonic() - started < 2.5:
            if log.exists() and "step 3" in log.read_text():
                seen["at"] = time.monotonic() - started
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=look)
    watcher.start()
    outcome = supervise(["python3", "-c", hang], LIMITS, tmp_path, log)
    watcher.join()
    assert outcome.ok and "at" in seen  # while the child still slept


def test_a_child_killed_by_a_signal_is_described_in_words(tmp_path):
    outcome = supervise(["python3", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], LIMITS, tmp_path)
    assert outcome.message == "killed (SIGKILL)"


def test_the_run_token_is_in_the_childs_environment_only(tmp_path):
    out = tmp_path / "env"
    supervise(["python3", "-c", f"import os; open({str(out)!r}, 'w').write(os.environ['MPDIAG_SUPERVISED_RUN'])"],
              LIMITS, tmp_path)
    assert len(out.read_text()) == 16 and "MPDIAG_SUPERVISED_RUN" not in os.environ


def test_a_child_that_fills_its_directory_is_stopped_at_the_disk_cap(tmp_path):
    writer = "import time\nwith open('big', 'wb') as f:\n    for _ in range(400):\n        f.write(b'x' * 2**20); f.flush(); time.sleep(0.01)\ntime.sleep(30)"
    outcome = supervise(["python3", "-c", writer], Limits(wall_s=60, memory_mb=4000, log_bytes=1000, disk_mb=50),
                        tmp_path)
    assert outcome.reason == "disk"
    assert outcome.message.startswith("stopped by the disk cap (50 MB)")
    assert outcome.seconds < 20


@pytest.mark.parametrize("child_ends_itself", [True, False])
def test_a_stop_sends_sigterm_then_sigkill_after_the_grace(tmp_path, monkeypatch, child_ends_itself):
    """The dashboard's Stop: once ``stop_requested()`` says so, the child's group gets SIGTERM, so a child that
    handles it ends on its own (here: writes that it did, exits 0); one that ignores it is killed once
    STOP_GRACE_S has passed. Either way the outcome says it was stopped from the dashboard, not a crash."""
    from mpdiag.sandbox import supervisor

    monkeypatch.setattr(supervisor, "STOP_GRACE_S", 1.0)
    ready, handled = tmp_path / "ready", tmp_path / "handled"
    on_term = (f"lambda *_: (open({str(handled)!r}, 'w').write('x'), sys.exit(0))" if child_ends_itself
               else "signal.SIG_IGN")
    script = (f"import signal, sys, time\nsignal.signal(signal.SIGTERM, {on_term})\n"
              f"open({str(ready)!r}, 'w').write('x')\ntime.sleep(60)")
    started = time.monotonic()
    outcome = supervise(["python3", "-c", script], LIMITS, tmp_path, stop_requested=ready.exists)
    assert outcome.reason == "stopped" and outcome.message == "stopped from the dashboard (its Stop button)"
    assert not outcome.ok and time.monotonic() - started < 30  # not the child's 60 s sleep
    assert handled.exists() == child_ends_itself
    assert outcome.exit_code == (0 if child_ends_itself else -9)  # SIGKILL only for the one that ignored SIGTERM
