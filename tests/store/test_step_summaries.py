"""A live run's step summary in the runs table (steps done, skips, peak memory, final loss, median step time) is
the truth of the steps written, batch after batch, when each read of the runs table reads only the steps added
since the one before (a summary held between reads: Store's ``held_summaries``); a run that ended shows the
summary its writer stored. The truth is computed here from the rows written, never by the code under test."""

import math
import sqlite3

import numpy as np
import pytest

from mpdiag.store import StepRow, Store, StoreWriter

BATCHES, BATCH = 4, 25


def batch_rows(rng: np.random.Generator, first: int) -> list[StepRow]:
    """BATCH steps from ``first`` with what a long run holds: skipped and unknown steps, NaN and inf losses, steps
    without a time or a peak."""
    rows = []
    for step in range(first, first + BATCH):
        skipped = [0, 1, None][rng.choice(3, p=[0.7, 0.2, 0.1])]
        loss = [float(rng.uniform(0.1, 3.0)), math.nan, math.inf][rng.choice(3, p=[0.8, 0.1, 0.1])]
        step_time = None if rng.random() < 0.1 else float(rng.uniform(0.01, 2.0))
        peak = None if rng.random() < 0.1 else int(rng.integers(10**6, 10**9))
        rows.append(StepRow(step, loss, 2.0**16, skipped, 0, 2.0**16, step_time, peak, 0))
    return rows


def truth(rows: list[StepRow]) -> dict:
    """The summary of ``rows`` (in step order), by its definition."""
    times = [r.step_time_s for r in rows if r.step > 0 and r.step_time_s is not None]
    peaks = [r.peak_mem_bytes for r in rows if r.peak_mem_bytes is not None]
    return {"steps_done": len(rows), "skipped_steps": sum(r.skipped for r in rows if r.skipped is not None),
            "peak_mem_bytes": max(peaks), "final_loss": rows[-1].loss, "median_step_time_s": float(np.median(times))}


def summary_of(runs, run_id: int) -> dict:
    row = runs.set_index("run_id").loc[run_id]
    return {column: row[column] for column in ("steps_done", "skipped_steps", "peak_mem_bytes", "final_loss",
                                               "median_step_time_s")}


def assert_summary(shown: dict, expected: dict) -> None:
    assert shown.keys() == expected.keys()
    for column, value in expected.items():  # a NaN final loss reads NaN: equal here
        assert shown[column] == value or (math.isnan(shown[column]) and math.isnan(value)), column


@pytest.fixture
def live_store(tmp_path):
    """(path, run id, writer) of a running run with no steps yet; the writer stays open."""
    path = tmp_path / "live.db"
    with StoreWriter(path) as writer:
        yield path, writer.create_run(name="live", opt_level="O1"), writer


def test_a_live_runs_summary_read_batch_by_batch_is_the_truth_of_every_step(live_store):
    path, run_id, writer = live_store
    rng, written, held = np.random.default_rng(0), [], {}
    for first in range(0, BATCHES * BATCH, BATCH):
        rows = batch_rows(rng, first)
        writer.write_batch(run_id, rows, [])
        written += rows
        # a new Store each time, as each page run makes one, holding into the session's dict
        assert_summary(summary_of(Store(path, held_summaries=held).runs(), run_id), truth(written))
        assert_summary(summary_of(Store(path).runs(), run_id), truth(written))  # nothing held: read whole
    assert len(held) == 1


def test_a_held_summary_reads_only_the_steps_added_since(live_store):
    path, run_id, writer = live_store
    rng, held = np.random.default_rng(1), {}
    first = batch_rows(rng, 0)
    writer.write_batch(run_id, first, [])
    store = Store(path, held_summaries=held)
    before = summary_of(store.runs(), run_id)
    # a step already summed, changed behind the writer's back (it never rewrites one): a read that summed every
    # step again would see it
    ran = next(row.step for row in first if row.skipped == 0)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE steps SET skipped = 1, peak_mem_bytes = ? WHERE run_id = ? AND step = ?",
                     (10**12, run_id, ran))
    assert summary_of(store.runs(), run_id) == before
    added = batch_rows(rng, BATCH)
    writer.write_batch(run_id, added, [])
    changed = [row._replace(skipped=1, peak_mem_bytes=10**12) if row.step == ran else row for row in first]
    assert_summary(summary_of(store.runs(), run_id), truth(first + added))
    assert_summary(summary_of(Store(path).runs(), run_id), truth(changed + added))  # read whole: sees it


def test_an_ended_run_shows_its_stored_summary_and_is_no_longer_held(live_store):
    path, run_id, writer = live_store
    rows = batch_rows(np.random.default_rng(2), 0)
    writer.write_batch(run_id, rows, [])
    held = {}
    Store(path, held_summaries=held).runs()
    assert len(held) == 1
    writer.end_run(run_id, "finished")
    assert_summary(summary_of(Store(path, held_summaries=held).runs(), run_id), truth(rows))
    assert held == {}


def test_a_run_that_took_a_held_runs_id_is_summed_from_its_own_steps(live_store):
    path, run_id, writer = live_store
    rng, held = np.random.default_rng(3), {}
    writer.write_batch(run_id, batch_rows(rng, 0), [])
    Store(path, held_summaries=held).runs()
    # the run's rows replaced by another run's under the same id (a delete and a new run given its id)
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM steps WHERE run_id = ?", (run_id,))
        conn.execute("UPDATE runs SET started_at = started_at + 1 WHERE run_id = ?", (run_id,))
    other = batch_rows(rng, 0)[:5]
    writer.write_batch(run_id, other, [])
    assert_summary(summary_of(Store(path, held_summaries=held).runs(), run_id), truth(other))


class AppendsAfterTheFirstRead:
    """A connection that has the writer commit ``more`` steps right after its first statement: what a live run's
    writer may do between a summary's reads."""

    def __init__(self, conn: sqlite3.Connection, append):
        self.conn, self.append, self.reads = conn, append, 0

    def execute(self, *args):
        cursor = self.conn.execute(*args)
        self.reads += 1
        if self.reads == 1:
            self.append()
        return cursor


def test_steps_committed_while_a_summary_reads_are_left_to_the_next_read(live_store):
    """The summary's reads are separate statements, each on the store as it is then: steps committed after the
    first are not in this summary (not even in its step times) and are counted once, by the next."""
    from mpdiag.store.schema import StepSummary

    path, run_id, writer = live_store
    rng = np.random.default_rng(4)
    first, later = batch_rows(rng, 0), batch_rows(rng, BATCH)
    writer.write_batch(run_id, first, [])
    with sqlite3.connect(path) as conn:
        summary = StepSummary().extended(AppendsAfterTheFirstRead(conn, lambda: writer.write_batch(run_id, later, [])),
                                         run_id)
        assert_summary(summary.as_dict(), truth(first))
        assert len(summary.step_times) == len([r for r in first if r.step > 0 and r.step_time_s is not None])
        assert_summary(summary.extended(conn, run_id).as_dict(), truth(first + later))
