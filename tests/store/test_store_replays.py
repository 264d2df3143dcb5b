"""The replay tables (schema 13): older stores gain them in place, empty, keeping every row; the writer's add_replay
and Store.replays / Store.replay_modules round-trip a replayed step (NaN absmax as NULL, forward rows before
backward rows); an exported run carries them."""

import math
import shutil
import sqlite3

import pandas as pd
import pytest
from conftest import ROOT

from mpdiag.store import SCHEMA_VERSION, Store, StoreWriter
from mpdiag.store.export import run_tables

DATA = ROOT / "tests" / "fixtures" / "data"


def _tables(path):
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {name: pd.read_sql_query(f"SELECT * FROM {name}", conn) for name in names}


SUMMARY = (9, "nonfinite loss", True, "attn", "forward", "fp16", 65504.0, None)
MODULES = [(9, "backward", 0, "Net", "Net", math.nan, 0, 3.0, 0),
           (9, "forward", 1, "attn", "Attention", 0.0, 12, 2.5, 0),
           (9, "forward", 0, "attn.q", "Linear", 2.5, 0, 1.0, 0)]


@pytest.mark.parametrize("version", [1, 8])
def test_older_store_gains_empty_replay_tables_in_place_and_keeps_every_row(tmp_path, version):
    original = DATA / f"store_v{version}.db"
    before = _tables(original)
    path = tmp_path / "old.db"
    shutil.copy(original, path)
    store = Store(path)
    after = _tables(path)
    assert SCHEMA_VERSION >= 13  # the replay tables came with 13
    assert after["meta"].set_index("key").loc["schema_version", "value"] == str(SCHEMA_VERSION)
    assert after["replays"].empty and after["replay_modules"].empty
    for table in ("runs", "tensors", "tensor_steps"):
        assert len(after[table]) == len(before[table]), table
    run_id = int(store.runs()["run_id"].iloc[0])
    assert store.replays(run_id).empty and store.replay_modules(run_id).empty
    with StoreWriter(path) as writer:
        writer.add_replay(run_id, SUMMARY, MODULES)
    assert Store(path).replays(run_id)["first_module"].tolist() == ["attn"]


def test_a_replay_round_trips_forward_rows_first_and_is_exported(tmp_path):
    path = tmp_path / "runs.db"
    with StoreWriter(path) as writer:
        run_id = writer.create_run(name="r")
        writer.add_replay(run_id, SUMMARY, MODULES)
    store = Store(path)
    replay = store.replays(run_id).iloc[0]
    assert (replay.step, replay.trigger, replay.reproduced, replay.first_module, replay.first_phase) == \
        (9, "nonfinite loss", True, "attn", "forward")
    assert replay.format_max == 65504.0 and replay.note is None
    modules = store.replay_modules(run_id)
    assert list(zip(modules.phase, modules.ord, strict=True)) == [("forward", 0), ("forward", 1), ("backward", 0)]
    assert math.isnan(modules.absmax.iloc[2]) and modules.nonfinite.tolist() == [0, 12, 0]
    assert store.replay_modules(run_id, step=3).empty
    tables = run_tables(store, run_id)
    assert len(tables["replays"]) == 1 and len(tables["replay_modules"]) == 3
