"""Schema versions, migration of real v1/v2 stores, representability by format, and the writer's run context.

Ground truth for migrated data is the old file itself, read with plain SQL before mpdiag touched it.
"""

import json
import shutil
import sqlite3
import struct

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT

from mpdiag.analysis import summaries
from mpdiag.numerics.formats import LOW_PRECISION, SIGNAL_COUNTS
from mpdiag.store import (
    REPRESENTABILITY_COLUMNS,
    REPRESENTABILITY_KINDS,
    SCHEMA_VERSION,
    Representability,
    StepRow,
    Store,
    StoreError,
    StoreWriter,
    TensorRow,
    decode_hist,
    encode_hist,
)
from mpdiag.store.export import run_tables
from mpdiag.store.schema import TENSOR_STEP_COUNT_COLUMNS

DATA = ROOT / "tests" / "fixtures" / "data"


def _raw(path, sql):
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return pd.read_sql_query(sql, conn)


def _stamp(path):
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]


#: the steps columns schema version 9 added (recorded at every step since)
NEW_STEP_COLUMNS = ["lr", "grad_norm", "wall_time_s"]
#: the representability columns schema versions 1 and 2 stored (FP16 and BF16 only)
COLUMN_ERA = [c for c in REPRESENTABILITY_COLUMNS if c.startswith(("fp16", "bf16"))]


@pytest.mark.parametrize("version", [1, 2])
def test_old_store_migrates_in_place_and_reads_back_identical_data(tmp_path, version):
    original = DATA / f"store_v{version}.db"
    assert _stamp(original) == str(version)
    old_rows = _raw(original, "SELECT * FROM tensor_steps ORDER BY run_id, step, tensor_id")
    old_totals = _raw(original, "SELECT * FROM tensor_totals ORDER BY run_id, tensor_id")
    old_runs = _raw(original, "SELECT * FROM runs ORDER BY run_id")
    old_steps = _raw(original, "SELECT * FROM steps ORDER BY run_id, step")
    path = tmp_path / "old.db"
    shutil.copy(original, path)

    store = Store(path)
    assert _stamp(path) == str(SCHEMA_VERSION)
    with sqlite3.connect(path) as conn:
        columns = {r[1] for r in conn.execute("PRAGMA table_info(tensor_steps)")}
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        # version 3 moved the counts to a long table, version 17 back into tensor_steps' columns (checked below)
        assert set(REPRESENTABILITY_COLUMNS) <= columns and "representability" not in tables
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"

    runs = store.runs().sort_values("run_id")
    for col in ("name", "status", "error", "opt_level", "seed", "script_sha256"):
        assert runs[col].tolist() == old_runs[col].tolist(), col
    assert runs["parent_run_id"].isna().tolist() == [True, False] and runs["parent_run_id"].iloc[1] == 1
    for run_id in (1, 2):
        rows = old_rows[old_rows["run_id"] == run_id].reset_index(drop=True)
        steps = store.steps(run_id)
        expected_steps = old_steps[old_steps["run_id"] == run_id].reset_index(drop=True)
        kept = [c for c in steps.columns if c in expected_steps]  # lr, grad_norm, wall_time_s came at version 9
        pd.testing.assert_frame_equal(steps[kept], expected_steps[kept].astype(steps[kept].dtypes.to_dict()))
        assert steps[["lr", "grad_norm", "wall_time_s"]].isna().all().all()
        stats = store.tensor_stats(run_id)
        for col in ["zeros", "nan", "posinf", "neginf", "absmax", "min_nonzero", "l2", *COLUMN_ERA]:
            assert stats[col].tolist() == rows[col].tolist(), col
        # FP8 joined the registry after these runs were recorded: their FP8 counts are unknown, not zero
        assert stats[[c for c in REPRESENTABILITY_COLUMNS if c.startswith("fp8")]].isna().all().all()
        for fmt in ("fp16", "bf16"):
            long = store.representability(run_id, fmt)
            assert list(long.columns) == ["step", "tensor", "numel", *REPRESENTABILITY_KINDS]
            for kind in REPRESENTABILITY_KINDS:
                assert long[kind].tolist() == rows[f"{fmt}_{kind}"].tolist(), (fmt, kind)
        index, counts = store.histogram_matrix(run_id)
        assert (counts == np.stack([decode_hist(b) for b in rows["hist"]])).all()
        names, summed = store.histogram_totals(run_id)  # no writer sums in an old store: summed from the rows
        for name, hist in zip(names, summed, strict=True):
            assert (hist == counts[(index["tensor"] == name).to_numpy()].sum(axis=0)).all()  # rows checked above
        totals = store.tensor_totals(run_id)
        old = old_totals[old_totals["run_id"] == run_id].reset_index(drop=True)
        for col in ["logged_steps", "zeros", "nan", "posinf", "neginf", *COLUMN_ERA]:
            assert totals[col].tolist() == old[col].tolist(), col
    if version == 1:  # version 2 added update tracking and the shadow: a v1 store has none of either
        assert store.update_stats(1).empty and store.shadow_stats(2).empty
        assert runs["update_format"].isna().all()
    if version == 2:
        assert store.update_stats(1)["below_resolution"].tolist() == [0, 0, 1, 1, 2, 2]
        assert store.shadow_stats(2)["ref_norm"].tolist() == [2.0, 3.0] * 3


def test_migrated_store_takes_new_runs(tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(DATA / "store_v1.db", path)
    with StoreWriter(path, finish_runs=True) as writer:
        run_id = writer.create_run(name="after migration")
        writer.add_tensors(run_id, [(0, "w", [3], 3, "float32", "float32")])
        writer.write_batch(run_id, [StepRow(0, 1.0, 1.0, 0, 0, 1.0, 0.1, 10, 1)], [_tensor_row(0, 0, 3)])
    assert run_id == 3 and Store(path).run(3)["status"] == "finished"
    assert Store(path).representability(3, "bf16")["overflow_at_scale"].tolist() == [3 * 10 + 6 + 5]


@pytest.mark.parametrize("opener", [Store, StoreWriter], ids=["Store", "StoreWriter"])
def test_newer_store_is_refused_naming_both_versions_and_left_unchanged(tmp_path, opener):
    path = tmp_path / "future.db"
    Store(path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    before = path.read_bytes()
    with pytest.raises(StoreError, match=rf"schema version 99, newer than this mpdiag's version {SCHEMA_VERSION}"):
        opener(path)
    assert _stamp(path) == "99" and path.read_bytes() == before


def _tensor_row(step, tensor_id, base):
    """A tensor row whose counts are distinct per format and kind: base*10 + position."""
    reps = {fmt: Representability(*(base * 10 + k + 6 * f for k in range(6))) for f, fmt in enumerate(LOW_PRECISION)}
    hist = np.zeros(277, dtype=np.int64)
    hist[100] = base
    return TensorRow(step, tensor_id, encode_hist(hist), 1, 0, 0, 0, 2.0, 0.5, 1.0, reps)


def _new_run(writer, steps=2, tensors=2):
    run_id = writer.create_run(name="t", opt_level="O1")
    writer.add_tensors(run_id, [(t, f"w{t}", [3], 3, "float32", "float32") for t in range(tensors)])
    writer.write_batch(run_id, [StepRow(s, 1.0, 2.0, 0, s, 2.0, 0.1, 100, 1) for s in range(steps)],
                       [_tensor_row(s, t, s + t) for s in range(steps) for t in range(tensors)])
    return run_id


def test_representability_by_format_and_wide_columns_come_from_the_same_rows(tmp_path):
    with StoreWriter(tmp_path / "s.db", finish_runs=True) as writer:
        run_id = _new_run(writer, steps=3)
    store = Store(tmp_path / "s.db")
    bf16 = store.representability(run_id, "bf16", tensor="w1")
    assert bf16["step"].tolist() == [0, 1, 2] and set(bf16["tensor"]) == {"w1"}
    assert bf16["underflow"].tolist() == [10 + 6, 20 + 6, 30 + 6]  # base = step + 1, bf16 starts at position 6
    at_step = store.representability(run_id, "fp16", step=2)
    assert at_step["tensor"].tolist() == ["w0", "w1"] and at_step["overflow_at_scale"].tolist() == [25, 35]
    wide = store.tensor_stats(run_id)
    assert wide["bf16_overflow_at_scale"].tolist() == (store.representability(run_id, "bf16")["overflow_at_scale"]).tolist()
    totals = store.tensor_totals(run_id).set_index("tensor")
    assert totals.loc["w0", "fp16_subnormal"] == sum(10 * b + 1 for b in (0, 1, 2))
    assert (totals[REPRESENTABILITY_COLUMNS] == wide.groupby("tensor")[REPRESENTABILITY_COLUMNS].sum()).all().all()
    with pytest.raises(ValueError, match="unknown format 'fp8'; the known formats are fp16, bf16, fp8_e4m3, fp8_e5m2"):
        store.representability(run_id, "fp8")


def test_a_format_that_joins_the_registry_adds_its_columns_and_reads_nan_for_the_rows_before_it(tmp_path):
    """A format joining the registry adds its six tensor_steps columns when an older store is opened (ALTER TABLE
    ADD COLUMN, no row rewritten): planted here by dropping fp8_e5m2's columns from a store and stamping it with
    the version before, whose migration then finds no long table rows to move. The rows written before read NaN
    for the new format (unknown, not zero); every other count reads back as written; new rows hold all formats."""
    path = tmp_path / "s.db"
    with StoreWriter(path, finish_runs=True) as writer:
        run_id = _new_run(writer, steps=2)
    before = Store(path).tensor_stats(run_id)
    late = [c for c in TENSOR_STEP_COUNT_COLUMNS if c.startswith("fp8_e5m2_")]
    with sqlite3.connect(path) as conn:
        for column in late:
            conn.execute(f"ALTER TABLE tensor_steps DROP COLUMN {column}")
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION - 1),))
    with StoreWriter(path, finish_runs=True) as writer:  # migrates, then writes a run holding every format
        later = _new_run(writer, steps=1)
    store = Store(path)
    assert _stamp(path) == str(SCHEMA_VERSION)
    after = store.tensor_stats(run_id)
    assert after[[c for c in REPRESENTABILITY_COLUMNS if c.startswith("fp8_e5m2")]].isna().all().all()
    kept = [c for c in after.columns if not c.startswith("fp8_e5m2")]
    pd.testing.assert_frame_equal(after[kept], before[kept])
    assert summaries.recorded_formats(store.tensor_totals(run_id)) == list(LOW_PRECISION)  # totals: kept per format
    assert store.representability(later, "fp8_e5m2")["underflow"].tolist() == [0 * 10 + 18, 1 * 10 + 18]


def test_a_row_holding_fewer_formats_stores_null_for_the_others_beside_a_row_holding_all(tmp_path):
    """A row may hold only some formats (a supervised child's rows from an mpdiag of before a format joined): its
    other formats' counts are NULL (NaN when read: unknown, not zero), in the same batch as a row holding all."""
    with StoreWriter(tmp_path / "s.db") as writer:
        run_id = writer.create_run(name="t")
        writer.add_tensors(run_id, [(t, f"w{t}", [3], 3, "float32", "float32") for t in range(2)])
        full, partial = _tensor_row(0, 0, 1), _tensor_row(0, 1, 2)
        partial = partial._replace(representability={f: partial.representability[f] for f in ("fp16", "bf16")})
        writer.write_batch(run_id, [StepRow(0, 1.0, 2.0, 0, 0, 2.0, 0.1, 100, 1)], [full, partial])
    stats = Store(tmp_path / "s.db").tensor_stats(run_id).set_index("tensor")
    for f, fmt in enumerate(LOW_PRECISION):
        for k, kind in enumerate(REPRESENTABILITY_KINDS):
            column = f"{fmt}_{kind}"
            assert stats.loc["w0", column] == 1 * 10 + k + 6 * f, column
            if fmt in ("fp16", "bf16"):
                assert stats.loc["w1", column] == 2 * 10 + k + 6 * f, column
            else:
                assert pd.isna(stats.loc["w1", column]), column


def test_write_batch_refuses_a_format_outside_the_registry(tmp_path):
    with StoreWriter(tmp_path / "s.db") as writer:
        run_id = writer.create_run(name="t")
        row = _tensor_row(0, 0, 1)._replace(representability={"fp8": Representability(0, 0, 0, 0, 0, 0)})
        with pytest.raises(ValueError, match=r"unknown formats \['fp8'\]"):
            writer.write_batch(run_id, [], [row])
    assert Store(tmp_path / "s.db").tensor_stats(run_id).empty


def test_writer_context_marks_its_run_failed_with_the_traceback(tmp_path):
    path = tmp_path / "s.db"

    def boom():
        raise RuntimeError("the loss exploded")

    with pytest.raises(RuntimeError, match="the loss exploded"):
        with StoreWriter(path) as writer:
            run_id = _new_run(writer)
            boom()
    run = Store(path).run(run_id)
    assert run["status"] == "failed" and run["finished_at"] is not pd.NaT
    assert "Traceback" in run["error"] and "in boom" in run["error"] and "RuntimeError: the loss exploded" in run["error"]
    assert run["steps_done"] == 2  # the summary was stored with the status


def test_writer_context_finishes_only_when_asked(tmp_path):
    path = tmp_path / "s.db"
    with StoreWriter(path, finish_runs=True) as writer:
        finished = _new_run(writer)
    with StoreWriter(path) as writer:
        left_open = writer.create_run(name="continued elsewhere")
        ended = writer.create_run(name="ended explicitly")
        writer.end_run(ended, "failed", error="stopped", note="by hand")
    with sqlite3.connect(path) as conn:
        rows = dict(conn.execute("SELECT run_id, status FROM runs").fetchall())
        summary = json.loads(conn.execute("SELECT summary FROM runs WHERE run_id = ?", (finished,)).fetchone()[0])
    assert rows == {finished: "finished", left_open: "running", ended: "failed"}
    assert summary["steps_done"] == 2
    assert Store(path).run(ended)["note"] == "by hand"


def test_run_ids_are_integers(tmp_path):
    path = tmp_path / "s.db"
    with StoreWriter(path) as writer:
        parent = writer.create_run(name="parent")
        child = writer.create_run(name="rerun", parent_run_id=parent)
        writer.update_run(parent, pair_run_id=child)
    runs = Store(path).runs().set_index("name")
    assert str(runs["parent_run_id"].dtype) == "Int64" and str(runs["pair_run_id"].dtype) == "Int64"
    assert runs.loc["rerun", "parent_run_id"] == 1 and repr(runs.loc["rerun", "parent_run_id"]) == "np.int64(1)"
    assert pd.isna(runs.loc["parent", "parent_run_id"]) and runs.loc["parent", "pair_run_id"] == child
    assert runs["run_id"].dtype == np.int64


def test_histogram_totals_kept_by_the_writer_equal_the_sum_of_the_stored_steps(tmp_path):
    """Schema 6: the writer's running per-tensor sums, over batches of several flushes, are the per-step
    histograms summed; the findings read them instead of decoding every (step, tensor) row."""
    import sqlite3

    from mpdiag.training.runner import RunConfig, train
    from mpdiag.training.script import ModelScript

    path = tmp_path / "s.db"
    run_id = train(ModelScript.from_path(ROOT / "mpdiag/examples/mlp_digits.py"),
                   RunConfig(opt_level="O1", steps=9, every=2, device="cpu"), path)
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM hist_totals WHERE run_id = ?", (run_id,)).fetchone()[0] == 6
    store = Store(path)
    names, summed = store.histogram_totals(run_id)
    index, counts = store.histogram_matrix(run_id)
    assert names == list(dict.fromkeys(index["tensor"])) and sorted(index["step"].unique()) == [0, 2, 4, 6, 8]
    for name, hist in zip(names, summed, strict=True):
        assert (hist == counts[(index["tensor"] == name).to_numpy()].sum(axis=0)).all()
        assert hist.sum() > 0


def _tables(path) -> dict[str, pd.DataFrame]:
    """Every table of a store file, read with plain SQL, rows in a fixed order."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name != "
                                            "'sqlite_sequence' ORDER BY name")]
        return {name: pd.read_sql_query(f"SELECT * FROM {name}", conn).pipe(
            lambda df: df.sort_values(list(df.columns)).reset_index(drop=True)) for name in names}


def _migrated(tmp_path, version):
    """(store, path, tables before, tables after) of a copy of the real schema-``version`` fixture, opened (so
    migrated) by this mpdiag and stamped current."""
    original = DATA / f"store_v{version}.db"
    assert _stamp(original) == str(version)
    before = _tables(original)
    path = tmp_path / original.name
    shutil.copy(original, path)
    store = Store(path)
    assert _stamp(path) == str(SCHEMA_VERSION)
    return store, path, before, _in_long_layout(_tables(path))


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(list(df.columns)).reset_index(drop=True)  # as _tables orders a table's rows


def _in_long_layout(after: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """Migrated tables in the layout of schema versions 3 to 16, so that every old row can be compared with what
    it became: tensor_steps without its count columns (version 17), and the long representability table (gone
    since) rebuilt from them, a row per format whose counts are not NULL."""
    assert "representability" not in after  # moved into tensor_steps, then dropped
    rows = after["tensor_steps"]
    long = []
    for fmt in LOW_PRECISION:
        columns = [f"{fmt}_{kind}" for kind in REPRESENTABILITY_KINDS]
        held = rows[rows[columns].notna().all(axis=1)]
        counts = held[columns].set_axis(list(REPRESENTABILITY_KINDS), axis=1).astype("int64")
        long.append(pd.concat([held[["run_id", "step", "tensor_id"]].assign(fmt=fmt), counts], axis=1))
    return {**after, "tensor_steps": _sorted(rows.drop(columns=TENSOR_STEP_COUNT_COLUMNS)),
            "representability": _sorted(pd.concat(long))}


def test_schema_7_store_migrates_to_8_keeping_every_row_and_gains_tags_and_notes(tmp_path):
    """Schema 8 (run management) adds runs.user_note and run_tags in place; every row of every table of a real
    schema-7 file (tests/fixtures/data/make_store_v7.py) reads back as it was, and the new fields start empty."""
    store, path, before, after = _migrated(tmp_path, 7)
    assert "run_tags" in set(after) - set(before) and after["run_tags"].empty
    for table, old in before.items():
        new = after[table]
        if table == "runs":
            assert new["user_note"].isna().all()
            new = new.drop(columns="user_note")
        elif table == "steps":  # version 9's columns, NULL for the steps recorded before
            assert new[NEW_STEP_COLUMNS].isna().all().all()
            new = new.drop(columns=NEW_STEP_COLUMNS)
        elif table == "meta":
            continue
        pd.testing.assert_frame_equal(new, old, check_dtype=False, obj=table)
    runs = store.runs().sort_values("run_id")
    assert runs["tags"].tolist() == [[], [], []] and runs["user_note"].isna().all()
    assert runs["note"].tolist()[2] == "stopped early"  # mpdiag's own note is a different field, kept
    with StoreWriter(path) as writer:  # the migrated store takes every management action
        writer.rename_run(1, "renamed")
        writer.tag_run(1, ["fp16", "baseline"])
        writer.set_user_note(1, "first try\nlr 1e-3")
    run = Store(path).run(1)
    assert (run["name"], run["tags"], run["user_note"]) == ("renamed", ["baseline", "fp16"], "first try\nlr 1e-3")


def test_schema_8_store_migrates_to_9_keeping_every_row_and_gains_per_step_lr_norm_and_wall_time(tmp_path):
    """Schema 9 adds steps.lr, steps.grad_norm and steps.wall_time_s in place (ALTER TABLE ADD COLUMN on the
    WITHOUT ROWID steps table); every row of every table of a real schema-8 file (tests/fixtures/data/make_store_v8.py,
    written by the schema-8 code) reads back as it was, the new columns read NULL / NaN for its steps, and the
    migrated store takes steps with the new columns, which Store.steps returns exactly."""
    store, path, before, after = _migrated(tmp_path, 8)
    for table, old in before.items():
        new = after[table]
        if table == "steps":
            assert list(new.columns) == [*old.columns, *NEW_STEP_COLUMNS]  # appended, where the DDL has them
            assert new[NEW_STEP_COLUMNS].isna().all().all() and len(new) == 9
            new = new.drop(columns=NEW_STEP_COLUMNS)
        elif table == "meta":
            continue
        pd.testing.assert_frame_equal(new, old, check_dtype=False, obj=table)
    steps = store.steps(1)
    assert steps["loss"].tolist() == [2.5, 2.0, 1.5] and steps[NEW_STEP_COLUMNS].isna().all().all()
    runs = store.runs().sort_values("run_id")
    assert runs["tags"].tolist()[0] == ["baseline", "fp16"] and runs["user_note"].tolist()[0] == "first try"
    rows = [StepRow(0, 1.0, 8.0, 0, 0, 8.0, 0.1, 10, 1, 1e-3, 0.25, 0.5),
            StepRow(1, float("nan"), 8.0, 1, 0, 4.0, 0.1, 10, 0, 9e-4, float("inf"), 1.0),
            StepRow(2, 0.5, 4.0, 1, 0, 2.0, 0.1, 10, 0, 8e-4, float("nan"), 1.5),
            StepRow(3, 0.5, 2.0, 0, 1, 2.0, 0.1, 10, 0)]  # a row without them (an older writer's rows) reads NaN
    with StoreWriter(path, finish_runs=True) as writer:
        run_id = writer.create_run(name="after migration")
        writer.write_batch(run_id, rows, [])
    steps = Store(path).steps(run_id)
    assert steps["lr"].tolist()[:3] == [1e-3, 9e-4, 8e-4] and steps["wall_time_s"].tolist()[:3] == [0.5, 1.0, 1.5]
    assert steps["grad_norm"].tolist()[:2] == [0.25, float("inf")] and np.isnan(steps["grad_norm"].iloc[2])
    assert steps.iloc[3][NEW_STEP_COLUMNS].isna().all()


def test_histograms_encoded_together_are_each_the_documented_packing():
    """encode_hists (a step's tensors at once) gives, row by row, the format read back by decode_hists: int16
    first non-empty bin, then int64 counts up to the last non-empty one; an empty row is the 2-byte header alone.
    The expected bytes are packed here, by hand."""
    from mpdiag.store import decode_hists, encode_hists

    rng = np.random.default_rng(0)
    rows = rng.integers(0, 5, (40, 277)) * (rng.random((40, 277)) < 0.05)
    rows[3] = 0
    rows[7, 0], rows[8, -1] = 9, 4  # the first and the last bin
    for row, blob in zip(rows, encode_hists(rows), strict=True):
        bins = np.flatnonzero(row)
        expected = (struct.pack("<h", 0) if not bins.size else
                    struct.pack("<h", bins[0]) + struct.pack(f"<{bins[-1] - bins[0] + 1}q", *row[bins[0]:bins[-1] + 1]))
        assert blob == expected and blob == encode_hist(row)
    assert (decode_hists(encode_hists(rows)) == rows).all()


@pytest.mark.parametrize("name", ["store_v2.db", "store_v8.db"])
def test_a_store_from_before_block_scaled_fp8_migrates_with_empty_block_tables(tmp_path, name):
    """Schema 11 added fp8_blocks and fp8_block_scales: an older store gains them, empty, and its runs read
    back no block rows (with the columns Store.fp8_blocks and Store.fp8_block_scales name)."""
    path = tmp_path / name
    shutil.copy(DATA / name, path)
    store = Store(path)
    assert _stamp(path) == str(SCHEMA_VERSION)
    for run_id in store.runs()["run_id"]:
        blocks, scales = store.fp8_blocks(int(run_id)), store.fp8_block_scales(int(run_id))
        assert blocks.empty and list(blocks.columns) == ["step", "module", "role", "recipe", "blocks", "zero_blocks",
                                                         "clipped_blocks", "wide_blocks"]
        assert scales.empty and list(scales.columns) == ["step", "module", "role", "recipe", "exponent", "count"]


def test_schema_13_store_migrates_to_14_keeping_every_row_and_reads_its_logged_steps_as_kept_every(tmp_path):
    """Schema 14 adds kept_steps (why each logged step's tensor rows are stored): a real schema-13 file
    (tests/fixtures/data/make_store_v13.py, every=2) keeps every row of every table, and its kept steps are exactly
    the steps the old code marked logged, each for "every"; a run written after the migration stores its reasons."""
    store, path, before, after = _migrated(tmp_path, 13)
    for table, old in before.items():
        if table != "meta":
            pd.testing.assert_frame_equal(after[table], old, check_dtype=False, obj=table)
    logged = before["steps"].loc[before["steps"]["logged"] == 1, ["run_id", "step"]]
    assert logged["step"].tolist() == [0, 2, 4, 0, 2, 4]
    kept = after["kept_steps"]
    assert kept[["run_id", "step"]].values.tolist() == logged.values.tolist() and set(kept["reason"]) == {"every"}
    assert store.kept_steps(2).values.tolist() == [[0, "every"], [2, "every"], [4, "every"]]
    with StoreWriter(path, finish_runs=True) as writer:
        run_id = writer.create_run(name="after migration")
        writer.write_batch(run_id, [StepRow(s, 1.0, 1.0, 0, 0, 1.0, 0.1, 10, 0) for s in range(3)], [],
                           kept=[(1, "overflow"), (0, "before"), (0, "every")])
    store = Store(path)
    assert store.kept_steps(run_id).values.tolist() == [[0, "before"], [0, "every"], [1, "overflow"]]
    pd.testing.assert_frame_equal(run_tables(store, run_id)["kept_steps"], store.kept_steps(run_id))  # exported
    assert store.logged_steps(run_id) == [0, 1]  # the kept steps' rows are marked logged


def test_a_store_before_schema_15_gains_step_signals_at_its_logged_steps_from_its_tensor_rows(tmp_path):
    """Schema 15 adds step_signals (every step's inf/NaN and FP16/BF16 under/overflow at the scale, kept or not):
    a real schema-13 file (every=2) keeps every row of every table, and each of its logged steps reads back, per
    tensor, the special counts of its tensor_steps rows and the at-scale counts of its FP16/BF16 representability
    rows as they were stored before (the steps in between were never counted: they have none)."""
    store, _, before, after = _migrated(tmp_path, 13)
    for table, old in before.items():
        if table != "meta":
            pd.testing.assert_frame_equal(after[table], old, check_dtype=False, obj=table)
    rows, reps = before["tensor_steps"], before["representability"]
    for run_id in (1, 2):
        steps, tensor_ids, counts = store.step_signals(run_id)
        assert steps.tolist() == [0, 2, 4]
        for k, step in enumerate(steps.tolist()):
            for t, tensor_id in enumerate(tensor_ids.tolist()):
                at = (rows["run_id"] == run_id) & (rows["step"] == step) & (rows["tensor_id"] == tensor_id)
                expected = rows.loc[at, ["nan", "posinf", "neginf"]].iloc[0].tolist()
                for name in SIGNAL_COUNTS[3:]:
                    fmt, kind = name.split("_", 1)
                    rep = reps[(reps["run_id"] == run_id) & (reps["step"] == step) & (reps["tensor_id"] == tensor_id)
                               & (reps["fmt"] == fmt)]
                    expected.append(int(rep[kind].iloc[0]))
                assert counts[k, t].tolist() == expected, (run_id, step, tensor_id)
        totals = store.step_signal_totals(run_id)
        assert totals[list(SIGNAL_COUNTS)].values.tolist() == counts.sum(axis=1).tolist()


def test_step_signals_round_trip_per_tensor_with_absent_tensors_and_wrong_shapes_refused(tmp_path):
    """What the writer takes is what the reader returns: a step may count a subset of the run's tensors (-1 for
    the others), counts beyond 32 bits survive, a step's second write is ignored, a mis-shaped one is refused."""
    path = tmp_path / "signals.db"
    big = 2**40
    with StoreWriter(path, finish_runs=True) as writer:
        run_id = writer.create_run(name="signals")
        writer.add_tensors(run_id, [(t, f"w{t}", [4], 4, "float32", "float32") for t in range(3)])
        first = np.arange(21).reshape(3, 7)
        writer.write_batch(run_id, [], [], signals=[(0, [0, 1, 2], first), (5, [2], [[0, 0, 0, big, 1, 0, 2]])])
        writer.write_batch(run_id, [], [], signals=[(0, [0, 1, 2], first * 0)])  # ignored: step 0 is stored
        with pytest.raises(ValueError, match="signals of 2 tensors"):
            writer.write_batch(run_id, [], [], signals=[(6, [0, 1], first)])
    store = Store(path)
    steps, tensor_ids, counts = store.step_signals(run_id)
    assert steps.tolist() == [0, 5] and tensor_ids.tolist() == [0, 1, 2]
    assert counts[0].tolist() == first.tolist()
    assert counts[1].tolist() == [[-1] * 7, [-1] * 7, [0, 0, 0, big, 1, 0, 2]]
    assert store.step_signals(run_id, first_step=1)[0].tolist() == [5]
    assert store.step_signal_totals(run_id).values.tolist() == [[0, *first.sum(axis=0).tolist(), 1],
                                                                [5, 0, 0, 0, big, 1, 0, 2, 1]]
    # in ranges of steps: each count's largest at one step of the range, its first step, the steps it holds
    assert store.step_signal_totals(run_id, max_rows=1).values.tolist() == [
        [0, *np.maximum(first.sum(axis=0), [0, 0, 0, big, 1, 0, 2]).tolist(), 2]]


def test_closing_the_writer_leaves_readers_able_to_open_the_store(tmp_path):
    """The last writing connection to close copies the write-ahead log into the file; done under the close's
    exclusive lock, a reader opening the store meanwhile was refused as "locked by another program" (seen in CI
    on a busy disk). A log held back from the automatic checkpoints stands in for a slow disk: ~1 s to copy here,
    against a reader that waits 0.1 s."""
    import os
    import threading
    from contextlib import closing

    from mpdiag.store.schema import close_writing, connect_read, open_for_writing

    path = tmp_path / "runs.db"
    conn = open_for_writing(path)
    conn.execute("PRAGMA wal_autocheckpoint=0")
    conn.execute("CREATE TABLE filler(x BLOB)")
    with conn:
        conn.executemany("INSERT INTO filler VALUES (?)", ((os.urandom(20_000),) for _ in range(2_000)))
    assert os.path.getsize(f"{path}-wal") > 30e6
    refused, reads, closed, given_up = [], [], threading.Event(), threading.Event()

    def read_until_closed():
        while (not closed.is_set() or not reads) and not given_up.is_set():
            try:
                reader = connect_read(path, wait_s=0.1)
                reader.execute("SELECT name FROM sqlite_master").fetchall()
                reader.close()
                reads.append(1)
            except sqlite3.OperationalError as exc:
                refused.append(str(exc))

    reader = threading.Thread(target=read_until_closed)
    reader.start()
    close_writing(conn)
    closed.set()
    reader.join(timeout=30)  # a store no reader can open fails here, not at pytest's timeout
    given_up.set()
    reader.join()
    assert not refused, refused[:3]
    assert reads
    with closing(connect_read(path)) as after:
        assert after.execute("SELECT COUNT(*) FROM filler").fetchone() == (2_000,)
    assert Store(path).runs().empty
