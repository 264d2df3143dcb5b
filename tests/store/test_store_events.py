"""The events table (schema 12): older stores gain it in place, empty, keeping every row; the writer's
add_events and Store.events round-trip an event's step, kind and evidence; the status vocabulary knows
``stopped``."""

import json
import shutil
import sqlite3

import pandas as pd
import pytest
from conftest import ROOT

from mpdiag.store import SCHEMA_VERSION, STATUSES, Store, StoreWriter

DATA = ROOT / "tests" / "fixtures" / "data"


def _tables(path):
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {name: pd.read_sql_query(f"SELECT * FROM {name}", conn) for name in names}


@pytest.mark.parametrize("version", [1, 2, 7, 8])
def test_older_store_gains_an_empty_events_table_in_place_and_keeps_every_row(tmp_path, version):
    original = DATA / f"store_v{version}.db"
    before = _tables(original)
    assert "events" not in before
    path = tmp_path / "old.db"
    shutil.copy(original, path)
    store = Store(path)
    after = _tables(path)
    assert after["meta"].set_index("key").loc["schema_version", "value"] == str(SCHEMA_VERSION)
    assert after["events"].empty
    for table in ("runs", "tensors", "tensor_steps"):
        assert len(after[table]) == len(before[table]), table
    run_id = int(store.runs()["run_id"].iloc[0])
    assert store.events(run_id).empty
    with StoreWriter(path) as writer:
        writer.add_events(run_id, [(3, "nonfinite", json.dumps({"loss": "nan", "summary": "s"}), 1.0)])
    events = Store(path).events(run_id)
    assert events[["step", "kind"]].values.tolist() == [[3, "nonfinite"]]
    assert events["evidence"].iloc[0] == {"loss": "nan", "summary": "s"}


def test_events_round_trip_in_step_order_and_a_run_ends_stopped(tmp_path):
    path = tmp_path / "runs.db"
    with StoreWriter(path) as writer:
        run_id = writer.create_run(name="r")
        other = writer.create_run(name="other")
        writer.add_events(run_id, [(40, "loss-spike", json.dumps({"value": 9.0}), 2.0),
                                   (7, "skips", json.dumps({"streak": 5}), 1.0)])
        writer.add_events(other, [(1, "nonfinite", json.dumps({}), 3.0)])
        with pytest.raises(ValueError, match="JSON object"):
            writer.add_events(run_id, [(1, "nonfinite", json.dumps([1]), 3.0)])
        writer.end_run(run_id, "stopped", error="--stop-on spike: loss-spike at step 40")
    store = Store(path)
    assert store.events(run_id)[["step", "kind"]].values.tolist() == [[7, "skips"], [40, "loss-spike"]]
    assert len(store.events()) == 3 and store.events_version() == (3, 3.0)
    run = store.run(run_id)
    assert "stopped" in STATUSES and run["status"] == "stopped" and run["error"].startswith("--stop-on spike")


def test_a_runs_events_are_exported_with_it_and_deleted_with_it(tmp_path):
    from mpdiag.store.export import run_tables

    path = tmp_path / "runs.db"
    with StoreWriter(path) as writer:
        run_id = writer.create_run(name="r")
        writer.add_events(run_id, [(4, "skips", json.dumps({"streak": 5}), 1.0)])
        writer.end_run(run_id, "finished")
    exported = run_tables(Store(path), run_id)["events"]
    assert exported[["step", "kind"]].values.tolist() == [[4, "skips"]]
    assert json.loads(exported["evidence"].iloc[0]) == {"streak": 5}
    with StoreWriter(path) as writer:
        assert writer.delete_run(run_id)["events"] == 1
    assert Store(path).events(run_id).empty
