"""Processes that create the same new store at the same moment all succeed and find one healthy store."""

import multiprocessing
import sqlite3

import pytest

from mpdiag.store import SCHEMA_VERSION, Store, StoreWriter

RACERS = 6
ROUNDS = 4


def _race(path, barrier, results, k):
    """Wait for every racer, then open the new store (half read it, half write a run) and report."""
    try:
        barrier.wait(timeout=60)
        if k % 2:
            Store(path).runs()
        else:
            with StoreWriter(path) as writer:
                writer.create_run(name=f"racer {k}")
        results.put((k, "ok"))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put((k, f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_racing_creators_all_succeed(tmp_path, round_):
    path = tmp_path / f"new-{round_}.db"
    ctx = multiprocessing.get_context("fork")  # the racers start from this process's imports, so they line up
    barrier, results = ctx.Barrier(RACERS), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(path, barrier, results, k)) for k in range(RACERS)]
    for p in procs:
        p.start()
    outcomes = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert outcomes == {k: "ok" for k in range(RACERS)}
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (str(SCHEMA_VERSION),)
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert sorted(Store(path).runs()["name"]) == [f"racer {k}" for k in range(0, RACERS, 2)]
