"""The Plan page's verification in one click: a background process that verifies a run's plan as
``mpdiag plan --verify`` does (:func:`mpdiag.analysis.plan_verify.verify`: the FP32 reference when one is needed,
every round, a promotion after each round that does not track, at most ``MAX_ROUNDS``), with each rerun started
as every run the app starts is, in a supervised child (:func:`mpdiag.sandbox.launch.launch`), and waited for.

Owns that driving process: :func:`start` starts it in its own session with the job on stdin (as launch starts a
supervisor) and hands back a :class:`~mpdiag.sandbox.launch.Launched`; the process keeps launch's status file
(the run ids of its reruns as they are queued, then how the verification ended) and output log, so the app shows
it as it shows every job it started (``frame.launched_panel``: each round's run, its status and progress). It
runs no user code and imports no torch: the reruns train in their supervised children, and it reads the store
only to judge each round. A rerun that records no run (refused, or its supervisor failed) ends the verification
with the supervisor's reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mpdiag.analysis.plan_verify import RerunFn, verify
from mpdiag.sandbox.child import child_env, scratch_dir
from mpdiag.sandbox.launch import (
    LOG_FILE,
    STATUS_FILE,
    STOP_FILE,
    Launched,
    forbid_inspection,
    launch,
    rerun_job,
    store_key,
)
from mpdiag.sandbox.shutdown import exit_without_collecting

#: how often the process looks at the rerun it waits for, seconds
POLL_S = 0.5


class RerunRefused(RuntimeError):
    """A verification's rerun recorded no run; the message is its supervisor's reason."""


class VerificationStopped(RuntimeError):
    """The user stopped the verification (its Stop button): its rerun was stopped, and no round follows."""


def start(store_path: str | os.PathLike, run_id: int, first: int, first_modules: str) -> Launched:
    """Start verifying run ``run_id``'s plan in the background, from round ``first`` whose plan runs
    ``first_modules`` (earlier rounds were run before: ``plan_verify.verify``); returns at once."""
    record = scratch_dir("verify")
    job = {"kind": "verify", "run_id": int(run_id), "first": int(first), "first_modules": first_modules}
    with open(record / "driver.log", "wb") as errors:
        proc = subprocess.Popen([sys.executable, "-m", "mpdiag.dashboard.verify_job"], cwd=record, env=child_env(),
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errors,
                                start_new_session=True)
    proc.stdin.write(json.dumps({**job, "store": os.path.abspath(store_path)}).encode())
    proc.stdin.close()
    return Launched(pid=proc.pid, log_path=str(record / LOG_FILE), job=job, started_at=time.time())


class Progress:
    """The driving process's status file and log, in launch's layout: the run ids so far, then the ending."""

    def __init__(self, record: Path, store_path: str):
        self.record, self.key, self.run_ids = record, store_key(store_path), []

    def write(self, message: str | None = None) -> None:
        said = {"run_ids": self.run_ids, "store_key": self.key, **({"message": message} if message else {})}
        (self.record / STATUS_FILE).write_text(json.dumps(said))

    def say(self, line: str) -> None:
        with open(self.record / LOG_FILE, "a", encoding="utf-8") as log:
            log.write(line + "\n")

    def seen(self, run_id: int) -> None:
        if run_id not in self.run_ids:
            self.run_ids.append(run_id)
            self.write()


def supervised(store_path: str, progress: Progress) -> RerunFn:
    """A RerunFn that starts each rerun as a supervised job and waits for it to end; its run shows in the
    status file as soon as it is queued."""
    def rerun(run_id: int, options: dict) -> int:
        progress.say(f"starting {options.get('name') or 'the FP32 reference'} (a rerun of run {run_id})")
        job = launch(rerun_job(run_id, options), store_path)
        while job.is_alive():
            for new in job.run_ids():
                progress.seen(int(new))
            if (progress.record / STOP_FILE).exists() and not job.stop_requested():
                job.request_stop()  # the rerun ends itself (crashed, SIGTERM); this loop waits for it
            time.sleep(POLL_S)
        if (progress.record / STOP_FILE).exists():
            raise VerificationStopped(f"run {run_id}'s rerun was stopped: {job.ending() or 'no message'}")
        ids = job.run_ids()
        if not ids:
            raise RerunRefused(job.ending() or "the rerun's supervisor ended without saying why")
        progress.seen(int(ids[0]))
        progress.say(f"run {ids[0]} ended: {job.ending() or 'no message'}")
        return int(ids[0])

    return rerun


def drive(job: dict, progress: Progress) -> str:
    """Verify as ``job`` says; returns how it ended, in words."""
    progress.write()
    try:
        reference, rounds = verify(job["store"], job["run_id"], rerun=supervised(job["store"], progress),
                                   first=job["first"], first_modules=job["first_modules"])
    except RerunRefused as exc:
        return f"the verification stopped: a rerun could not run: {exc}"
    except VerificationStopped as exc:
        return f"the verification was stopped from the dashboard: {exc}"
    last = rounds[-1]
    return (f"verified: run {last.run_id} tracks FP32 run {reference}" if last.tracked else
            f"not verified: the last round, run {last.run_id}, does not track FP32 run {reference}")


def main() -> int:
    forbid_inspection()  # as launch's supervisor: a child may not read the store's path out of this process
    job = json.loads(sys.stdin.read())
    progress = Progress(Path.cwd(), job["store"])
    try:
        ending = drive(job, progress)
    except Exception as exc:  # noqa: BLE001 - the page that started it says why it ended, whatever it was
        ending = f"the verification could not go on: {type(exc).__name__}: {exc}"
    progress.say(ending)
    progress.write(ending)
    return 0


if __name__ == "__main__":
    exit_without_collecting(main())
