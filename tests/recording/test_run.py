"""The run handle's contract (mpdiag/recording/run.py): created -> running -> ended, an idempotent end that keeps the
first ending, fields written once; read back from the store's run row. And that it is the only code that writes
the run row."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

from mpdiag.recording.background import BackgroundWriter
from mpdiag.recording.distributed import DiscardingWriter
from mpdiag.recording.run import Run
from mpdiag.store import Store

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def writer(store_path):
    w = BackgroundWriter(store_path, heartbeat=False)
    yield w
    w.close()


def test_create_describe_end(writer, store_path):
    run = Run.create(writer, name="r", opt_level="O1", scaling="dynamic", every=2, config={"run": {"steps": 3}})
    assert run.state == "running" and not run.ended and run.config == {"run": {"steps": 3}}
    writer.call(lambda w: None)
    row = Store(store_path).run(run.run_id)
    assert row["status"] == "running" and row["name"] == "r" and row["opt_level"] == "O1" and row["every"] == 2
    assert row["config"] == {"run": {"steps": 3}}

    run.describe(batch_size=8, device="cpu", wait=True)
    row = Store(store_path).run(run.run_id)
    assert row["batch_size"] == 8 and row["device"] == "cpu" and row["name"] == "r"  # the rest kept

    assert run.end("finished", note="all good", wait=True) is True
    row = Store(store_path).run(run.run_id)
    assert run.ended and row["status"] == "finished" and row["note"] == "all good"
    assert pd.notna(row["finished_at"]) and pd.isna(row["error"])


def test_end_is_idempotent_and_the_first_ending_is_kept(writer, store_path):
    run = Run.create(writer, name="r", opt_level="O0", scaling="none", every=1)
    assert run.fail("the script broke", wait=True) is True
    assert run.end("finished", note="late", wait=True) is False  # a second end writes nothing
    assert run.fail("another error", status="crashed", wait=True) is False
    row = Store(store_path).run(run.run_id)
    assert row["status"] == "failed" and row["error"] == "the script broke"
    assert not isinstance(row["note"], str) or row["note"] != "late"


def test_an_ended_run_is_not_described_and_an_ending_must_be_one(writer):
    run = Run.create(writer, name="r", opt_level="O0", scaling="none", every=1)
    with pytest.raises(ValueError, match="ends as one of"):
        run.end("running")
    assert not run.ended  # a refused end ends nothing
    run.end("finished")
    with pytest.raises(RuntimeError, match="was ended"):
        run.describe(note="after the end")


def test_config_is_held_once_and_a_finding_keeps_the_rest(writer, store_path):
    run = Run.create(writer, name="r", opt_level="O3", scaling="none", every=1, config={"run": {"steps": 4}})
    record = {"step": 2, "optimizer": "AdamW", "state_dtype": "float16", "weight_dtype": "float16",
              "tensors": ["w"], "values": ["w (exp_avg_sq)"]}
    run.found_optimizer_step(record)
    assert run.config == {"run": {"steps": 4}, "optimizer_step_nonfinite": record}
    writer.call(lambda w: None)
    assert Store(store_path).run(run.run_id)["config"] == run.config
    run.describe(config={"run": {"steps": 4}, "optimizer": {"class": "AdamW", "state_dtype": None}}, wait=True)
    assert Store(store_path).run(run.run_id)["config"] == run.config == {
        "run": {"steps": 4}, "optimizer": {"class": "AdamW", "state_dtype": None}}


def test_queued_rows_wait_and_an_adopted_handle_ends_them(writer, store_path):
    """The app's launcher queues rows a child fills in; the supervisor ends those the child left."""
    run = Run.create(writer, queued=True, name="q", opt_level="O1", scaling="none", every=1)
    assert run.state == "queued"
    writer.call(lambda w: None)
    assert Store(store_path).run(run.run_id)["status"] == "queued"
    adopted = Run.adopt(writer, run.run_id)
    assert adopted.run_id == run.run_id and adopted.state == "running"
    adopted.fail("the child never started", wait=True)
    row = Store(store_path).run(run.run_id)
    assert row["status"] == "failed" and row["error"] == "the child never started"


def test_a_discarding_writer_writes_nothing(store_path):
    """A rank other than 0: every write is dropped, the run has no id."""
    run = Run.create(DiscardingWriter(), name="r", opt_level="O0", scaling="none", every=1)
    assert run.run_id is None
    run.describe(batch_size=3)
    assert run.end("finished") is True and run.end("failed", error="x") is False
    assert not store_path.exists()


RUN_ROW_WRITE = re.compile(r"\.(create_run|update_run|end_run)\(")
#: who may call the store writer's run-row methods besides the run handle, and why:
ALLOWED = {
    "mpdiag/recording/run.py": "the run handle: the one owner of the run row",
    "mpdiag/store/writer.py": "the store's writer defines them (its __exit__ ends the runs it created)",
    "mpdiag/recording/background.py": "the writer thread's sink passes every call through, and sends the heartbeat",
}


def test_only_the_run_handle_writes_the_run_row():
    """No module calls create_run/update_run/end_run but the run handle and the writer beneath it. The sandbox's
    forwarding of a child's calls (mpdiag/sandbox/launch.py's RunOwner, mpdiag/sandbox/child.py's
    StoreCallForwarder) names them as strings in its protocol, by method name, and calls none directly."""
    offenders = []
    for path in sorted((ROOT / "mpdiag").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if RUN_ROW_WRITE.search(line):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert not offenders, "the run row is written through mpdiag.recording.run.Run only:\n" + "\n".join(offenders)


def test_the_recorder_has_no_alternate_constructor():
    source = (ROOT / "mpdiag/recording/recorder.py").read_text()
    assert "__new__" not in source and "RunnerAttachment" not in source and "def attached" not in source
    runner = (ROOT / "mpdiag/training/runner.py").read_text()
    assert "NonfiniteStepCheck" not in runner  # one optimizer-step check: the Recorder's
