"""The Plan page's one-click verification (mpdiag.dashboard.verify_job) as it runs: a background process that
reruns the plan as supervised jobs, the app's way, keeping launch's status file so the app shows its rounds, and
going on from the rounds the page found. On a copy of the planted model's store (conftest.plan_runs)."""

import json
import time
from pathlib import Path

from conftest import imports_torch

from mpdiag import Store
from mpdiag.analysis.plan import plan_run
from mpdiag.dashboard import verify_job
from mpdiag.sandbox.launch import STATUS_FILE


def copied(store, folder):
    import sqlite3
    from contextlib import closing

    path = folder / "runs.db"
    with closing(sqlite3.connect(store)) as source, closing(sqlite3.connect(path)) as copy:
        source.backup(copy)
    return path


def wait_ended(job, timeout=300):
    deadline = time.time() + timeout
    while job.is_alive() and time.time() < deadline:
        time.sleep(0.5)
    assert not job.is_alive(), f"the verification did not end in {timeout} s: {job.log_tail()}"


def test_one_click_runs_the_verification_as_supervised_reruns_the_app_shows(plan_runs, tmp_path):
    """From round 2 of a verification whose round 1 promoted the planted outlier and tiny Linears (as the page
    starts it after finding round 1): the process queues round 2 as a supervised rerun of the source, with the plan
    as planned (moments in BF16), lists its run in the status file while it runs, and ends saying it tracks."""
    store = copied(plan_runs.store, tmp_path)
    modules = plan_run(Store(store), plan_runs.source).module_flag()
    before = set(Store(store).runs()["run_id"])
    job = verify_job.start(store, plan_runs.source, 2, modules)
    seen_running = []
    deadline = time.time() + 300
    while job.is_alive() and time.time() < deadline:
        runs = Store(store).runs()
        seen_running += [int(r) for r in runs.loc[runs["run_id"].isin(job.run_ids()) & (runs["status"] == "running"),
                                                  "run_id"]]
        time.sleep(0.5)
    wait_ended(job, 1)
    runs = Store(store).runs().set_index("run_id")
    new = sorted(set(runs.index) - before)
    assert len(new) == 1 and job.run_ids() == new and seen_running and set(seen_running) == set(new), job.log_tail()
    round_run = runs.loc[new[0]]
    assert round_run["status"] == "finished" and int(round_run["parent_run_id"]) == plan_runs.source
    assert round_run["name"].endswith("↻ plan round 2")
    ran = round_run["config"]["run"]
    assert ran["fp8_modules"] == modules and ran["moment_format"] == "bf16" and ran["opt_level"] == "fp8-sim"
    assert json.loads((Path(job.log_path).parent / STATUS_FILE).read_text())["message"] == \
        f"verified: run {new[0]} tracks FP32 run {plan_runs.source}"
    assert job.ending().startswith("verified") and f"run {new[0]} ended" in job.log_tail()


def test_a_verification_that_cannot_go_on_ends_saying_why_and_records_nothing(plan_runs, tmp_path):
    """A run the store does not hold (deleted after the page showed it): the process ends at once, its status
    saying why, and no run is recorded."""
    store = copied(plan_runs.store, tmp_path)
    before = len(Store(store).runs())
    job = verify_job.start(store, 10**6, 1, "")
    wait_ended(job, 60)
    assert job.ending().startswith("the verification could not go on") and "1000000" in job.ending(), job.ending()
    assert job.run_ids() == [] and len(Store(store).runs()) == before


def test_the_job_module_does_not_import_torch():
    assert not imports_torch("import mpdiag.dashboard.verify_job")
