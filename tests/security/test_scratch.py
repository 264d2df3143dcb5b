"""Scratch directories under mpdiag-work go when their check, probe or run ends; stale ones (older than a day,
owner process gone) are cleaned when the next one starts. (The old code left every scratch directory behind.)"""

import os
import time

from conftest import EXAMPLES

from mpdiag.sandbox import child
from mpdiag.sandbox.check import check_script
from mpdiag.sandbox.launch import launch, run_job
from mpdiag.sandbox.supervisor import Limits

DEAD_PID = 2**22 + 12345  # above pid_max's default: no such process


def test_a_checks_scratch_directory_is_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(child, "WORK_DIR", tmp_path / "work")
    source = "import os\nopen('left-behind.txt', 'w').write('x')\n"
    report = check_script("leaves_files.py", source, device="cpu", limits=Limits(60, 3000, 10_000))
    assert not report.ready
    assert list((tmp_path / "work").iterdir()) == []


def test_a_runs_scratch_directory_is_removed_and_its_log_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the supervisor's own scratch root
    monkeypatch.setattr(child, "WORK_DIR", tmp_path / "mpdiag-work")
    proc = launch(run_job(str(EXAMPLES / "mlp_digits.py"), {"steps": 2, "device": "cpu"}), tmp_path / "s.db")
    deadline = time.time() + 120
    while proc.is_alive() and time.time() < deadline:
        time.sleep(0.3)
    left = sorted(p.name.split("-")[0] for p in (tmp_path / "mpdiag-work").iterdir())
    assert left == ["launch", "run"]  # the launch record (log, status) and the run-slots; no run scratch
    assert os.path.exists(proc.log_path)


def test_stale_scratch_directories_are_cleaned(tmp_path, monkeypatch):
    monkeypatch.setattr(child, "WORK_DIR", tmp_path)
    later = time.time() + 2 * 24 * 3600  # clean as if two days had passed
    stale, mine, young = (tmp_path / f"run-{DEAD_PID}-a", tmp_path / f"run-{os.getpid()}-b",
                          tmp_path / f"run-{DEAD_PID}-c")
    for path in (stale, mine, young):
        path.mkdir()
        (path / "output.log").write_text("x")
    os.utime(young, (later - 60, later - 60))  # touched a minute before the clean-up
    (tmp_path / "run-slots").mkdir()  # not a scratch directory: the run slots' lock files
    assert child.clean_stale_scratch(now=later) == [stale]
    assert not stale.exists() and mine.exists() and young.exists() and (tmp_path / "run-slots").exists()
    child.scratch_dir("check")  # starting a child cleans too
