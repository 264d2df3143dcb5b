"""``--stop-on``: an event ends the training cleanly, under ``run`` (the runner's loop) and under ``watch`` (an
unmodified script, ended from inside its step as SIGTERM ends it: its ``finally`` runs), with status ``stopped``, the
reason in the run's error and every step recorded before it kept; watch prints one line per event to stderr."""

import importlib

import pytest
from conftest import EXAMPLES

from mpdiag.options import ConfigError, RunConfig
from mpdiag.recording.events import NONFINITE, SKIPS
from mpdiag.store import Store
from mpdiag.training.runner import train
from mpdiag.training.script import ModelScript
from mpdiag.training.watch import STOPPED_EXIT_CODE, WatchConfig, watch

OVERFLOW = "gallery_activation_overflow"  # FAILING: the loss is non-finite and the step skipped at every step


def _overflow_run(store_path, **options):
    module = importlib.import_module(f"mpdiag.examples.{OVERFLOW}")
    config = RunConfig(steps=20, device="cpu").with_options(**module.FAILING, **options)
    run_id = train(ModelScript.from_path(EXAMPLES / f"{OVERFLOW}.py"), config, store_path)
    return Store(store_path), run_id


def _events(store, run_id):
    return [(int(s), k) for s, k in store.events(run_id)[["step", "kind"]].values]


def test_run_stop_on_nonfinite_stops_at_the_next_record_keeping_every_step(tmp_path, capsys):
    store, run_id = _overflow_run(tmp_path / "runs.db", stop_on="nonfinite")
    run, steps = store.run(run_id), store.steps(run_id)
    assert run["status"] == "stopped"
    assert run["error"].startswith("--stop-on nonfinite: nonfinite at step 0:")
    assert steps["step"].tolist() == [0, 1]  # step 1 was recorded, then not stepped: its skip is unknown
    assert run["error"].endswith("; training stopped at step 1 (recorded, its update not applied)")
    assert steps["skipped"].iloc[0] == 1 and steps["skipped"].isna().iloc[1]
    assert _events(store, run_id) == [(0, NONFINITE)]
    assert "mpdiag: event at step 0: nonfinite" in capsys.readouterr().err


def test_run_stop_on_skips_n_stops_at_the_nth_skip_in_a_row(tmp_path):
    store, run_id = _overflow_run(tmp_path / "runs.db", stop_on="skips:3")
    run = store.run(run_id)
    assert run["status"] == "stopped" and "skips at step 2" in run["error"]
    assert _events(store, run_id) == [(0, NONFINITE), (2, SKIPS)]  # nonfinite is raised, not asked to stop
    assert store.steps(run_id)["step"].tolist() == [0, 1, 2, 3]
    assert "training stopped at step 3 (recorded" in run["error"]  # the last step the run shows


def test_without_stop_on_events_are_recorded_and_the_run_finishes(tmp_path):
    store, run_id = _overflow_run(tmp_path / "runs.db")
    assert store.run(run_id)["status"] == "finished"
    assert [k for _, k in _events(store, run_id)] == [NONFINITE, SKIPS, "scale-collapse"]


def test_stop_on_is_refused_for_a_multi_process_job():
    with pytest.raises(ConfigError, match="--stop-on"):
        RunConfig(nproc=2, stop_on="nonfinite").validate()
    with pytest.raises(ConfigError, match="--stop-on"):
        RunConfig(stop_on="nan").validate()


NAN_LOOP = """
import pathlib, sys
import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
marker = pathlib.Path(sys.argv[1])
try:
    for step in range(30):
        x = torch.randn(8, 4)
        if step == 5:
            x = x * float("nan")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("loop done")
finally:
    marker.write_text("finally ran")
"""


def test_watch_stop_on_ends_the_script_cleanly_stopped_with_one_stderr_line(tmp_path, capsys):
    script, marker, db = tmp_path / "train.py", tmp_path / "marker.txt", tmp_path / "runs.db"
    script.write_text(NAN_LOOP)
    run_id, code = watch(WatchConfig(target=str(script), args=(str(marker),), stop_on="nonfinite"), db)
    store = Store(db)
    run = store.run(run_id)
    assert code == STOPPED_EXIT_CODE and run["status"] == "stopped"
    assert run["error"].startswith("--stop-on nonfinite: nonfinite at step 5:")
    assert marker.read_text() == "finally ran"  # the script's own finally ran
    out = capsys.readouterr()
    assert "loop done" not in out.out
    lines = [line for line in out.err.splitlines() if line.startswith("mpdiag: event")]
    assert len(lines) == 1 and lines[0].startswith("mpdiag: event at step 5: nonfinite")
    assert store.steps(run_id)["step"].tolist() == list(range(7))  # step 6 recorded, not stepped
    assert run["error"].endswith("; training stopped at step 6 (recorded, its update not applied)")
    assert _events(store, run_id) == [(5, NONFINITE)]
    assert run["config"]["watch"]["stop_on"] == "nonfinite"  # a rerun repeats it


def test_watch_without_stop_on_records_the_event_and_finishes(tmp_path):
    script, marker, db = tmp_path / "train.py", tmp_path / "marker.txt", tmp_path / "runs.db"
    script.write_text(NAN_LOOP)
    run_id, code = watch(WatchConfig(target=str(script), args=(str(marker),)), db)
    store = Store(db)
    assert code == 0 and store.run(run_id)["status"] == "finished"
    assert _events(store, run_id) == [(5, NONFINITE)]


def test_both_commands_exit_3_saying_why_and_print_one_line_per_event(tmp_path):
    from conftest import run_cli

    db = tmp_path / "runs.db"
    ran = run_cli("run", "--store", db, "--stop-on", "nonfinite", "--steps", 5, "--device", "cpu",
                  EXAMPLES / f"{OVERFLOW}.py")
    assert ran.returncode == STOPPED_EXIT_CODE, ran.stderr
    assert "mpdiag: event at step 0: nonfinite" in ran.stderr and "stopped: --stop-on nonfinite" in ran.stderr
    script = tmp_path / "train.py"
    script.write_text(NAN_LOOP)
    watched = run_cli("watch", "--store", db, "--stop-on", "nonfinite", script, tmp_path / "marker.txt")
    assert watched.returncode == STOPPED_EXIT_CODE, watched.stderr
    assert watched.stderr.count("mpdiag: event at step") == 1 and "mpdiag watch: stopped: --stop-on" in watched.stderr
    assert [r["status"] for _, r in Store(db).runs().iterrows()] == ["stopped", "stopped"]


def test_a_run_the_app_starts_with_stop_on_ends_stopped_under_its_supervisor(tmp_path, monkeypatch):
    """The forms' --stop-on reaches the supervised child (mpdiag.sandbox.launch), which may end its run as
    stopped: the run reads stopped with the reason, its steps kept, and the supervisor reports no failure."""
    import time

    from mpdiag.sandbox.launch import launch, run_job

    db = tmp_path / "runs.db"
    monkeypatch.setenv("MPDIAG_STORE", str(db))
    proc = launch(run_job(str(EXAMPLES / f"{OVERFLOW}.py"),
                          {"opt_level": "O1", "steps": 8, "device": "cpu",
                           "stop_on": "skips:2"}), db)
    deadline = time.time() + 120
    while proc.is_alive() and time.time() < deadline:
        time.sleep(0.3)
    run = Store(db).run(proc.run_ids()[0])
    assert run["status"] == "stopped", (run["status"], run["error"], proc.log_tail())
    assert run["error"].startswith("--stop-on skips:2: skips at step 1:"), run["error"]
    assert Store(db).steps(run["run_id"])["step"].tolist() == [0, 1, 2]  # as under `mpdiag run`: the next record
    assert _events(Store(db), run["run_id"]) == [(0, NONFINITE), (1, SKIPS)]
