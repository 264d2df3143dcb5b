"""Schema 15's histogram rollups: each tensor's histograms summed over buckets of 16, 256 and 4,096 steps.

Ground truth is never the rollup code: the exact per-step rows read back with plain SQL and summed here, and for a
real recorded run the gradients themselves, binned with torch's own frexp. Checked at every level, with partial
last buckets, sparse kept steps, steps written out of order, flushes that cut buckets, a run written on by a second
writer (resumed), and stores migrated from before schema 15.
"""

import shutil
import sqlite3

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ROOT

from mpdiag import Recorder
from mpdiag.numerics.formats import EXP_MIN, LOW_PRECISION, N_EXP_BINS
from mpdiag.store import SCHEMA_VERSION, StepRow, Store, StoreWriter, TensorBatch, decode_hists
from mpdiag.store.schema import ROLLUP_BUCKET_STEPS

DATA = ROOT / "tests" / "fixtures" / "data"


def _raw(path, sql, params=()):
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return conn.execute(sql, params).fetchall()


def _exact(path, run_id) -> dict[tuple[int, int], np.ndarray]:
    """(step, tensor_id) -> the stored exact histogram, read with plain SQL."""
    rows = _raw(path, "SELECT step, tensor_id, hist FROM tensor_steps WHERE run_id = ?", (run_id,))
    return dict(zip([(s, t) for s, t, _ in rows], decode_hists([h for _, _, h in rows]), strict=True))


def _expected_rollups(exact: dict[tuple[int, int], np.ndarray]) -> dict[tuple, tuple]:
    """(tensor, bucket_steps, bucket) -> (first step, last step, steps kept, empty steps, summed histogram)."""
    out: dict[tuple, list] = {}
    for (step, tensor), hist in sorted(exact.items()):
        for size in ROLLUP_BUCKET_STEPS:
            key = (tensor, size, step // size)
            if key not in out:
                out[key] = [step, step, 0, 0, np.zeros(N_EXP_BINS, dtype=np.int64)]
            held = out[key]
            held[0], held[1] = min(held[0], step), max(held[1], step)
            held[2] += 1
            held[3] += int(hist.sum() == 0)
            held[4] = held[4] + hist
    return {key: tuple(value) for key, value in out.items()}


def _stored_rollups(path, run_id) -> dict[tuple, tuple]:
    rows = _raw(path, "SELECT tensor_id, bucket_steps, bucket, first_step, last_step, steps_kept, empty_steps, hist "
                      "FROM hist_rollups WHERE run_id = ?", (run_id,))
    hists = decode_hists([r[-1] for r in rows])
    return {tuple(r[:3]): (*r[3:7], h) for r, h in zip(rows, hists, strict=True)}


def _assert_rollups_are_the_sums(path, run_id) -> dict[tuple, tuple]:
    expected, stored = _expected_rollups(_exact(path, run_id)), _stored_rollups(path, run_id)
    assert set(stored) == set(expected)  # a row for every bucket with a kept step, at every level, and no other
    for key, (first, last, kept, empty, hist) in expected.items():
        assert stored[key][:4] == (first, last, kept, empty), key
        assert (stored[key][4] == hist).all(), key
    assert {size for _, size, _ in stored} == set(ROLLUP_BUCKET_STEPS)
    return stored


def _batch(rng, steps: list[int], tensors: int, empty_share: float = 0.05) -> TensorBatch:
    n = len(steps) * tensors
    hist = rng.integers(0, 9, (n, N_EXP_BINS)) * (rng.random((n, N_EXP_BINS)) < 0.1)
    hist[rng.random(n) < empty_share] = 0  # a step whose gradient held no finite non-zero value
    formats = len(LOW_PRECISION)
    return TensorBatch(np.repeat(np.asarray(steps, dtype=np.int64), tensors),
                       np.tile(np.arange(tensors, dtype=np.int64), len(steps)), hist,
                       np.zeros((n, 4), dtype=np.int64), np.ones(n), np.ones(n), np.ones(n),
                       np.zeros((n, formats, 6), dtype=np.int64), np.ones((n, formats), dtype=bool))


def _write(writer, run_id, rng, steps: list[int], tensors: int) -> None:
    writer.write_batch(run_id, [StepRow(s, 1.0, 1.0, 0, 0, 1.0, 0.1, 10, 0) for s in steps], _batch(rng, steps, tensors),
                       kept=[(s, "every") for s in steps])


def _new_run(writer, tensors: int) -> int:
    run_id = writer.create_run(name="rollups")
    writer.add_tensors(run_id, [(t, f"t{t}", [3], 3, "float32", "float32") for t in range(tensors)])
    return run_id


# kept steps as retention keeps them: every 5th step and a stretch around an anomaly, up to a last bucket cut short
KEPT = sorted({*range(0, 9_000, 5), *range(4_090, 4_110), 8_999})


def test_each_rollup_is_the_sum_of_the_exact_histograms_it_covers_at_every_level(tmp_path):
    """Batches of uneven length cut buckets at every level; a stretch is written late (steps kept around an
    anomaly reach the writer after later steps); the last buckets of each level are partial."""
    path, rng, tensors = tmp_path / "s.db", np.random.default_rng(0), 3
    late = [s for s in KEPT if 4_090 <= s < 4_110]
    on_time = [s for s in KEPT if s not in late]
    with StoreWriter(path, finish_runs=True) as writer:
        run_id = _new_run(writer, tensors)
        cuts = np.cumsum(rng.integers(1, 90, len(on_time)))
        for part in np.split(np.asarray(on_time), cuts[cuts < len(on_time)]):
            _write(writer, run_id, rng, part.tolist(), tensors)
            if part[-1] > 4_200 and late:
                _write(writer, run_id, rng, late, tensors)
                late = []
    stored = _assert_rollups_are_the_sums(path, run_id)
    last_bucket = [s for s in KEPT if s >= 8_192]  # partial: steps 8,192 to 8,999 of 8,192 to 12,287
    assert stored[(0, 4096, 2)][:3] == (last_bucket[0], 8_999, len(last_bucket))
    assert any(empty for _, _, _, empty, _ in stored.values())


def test_a_run_resumed_by_a_second_writer_keeps_adding_to_the_same_buckets(tmp_path):
    """A run written by one writer, closed mid-bucket, then written on by another (as a resumed run, or a
    supervised child's rows relayed by a new process): the buckets cut by the pause hold both parts."""
    path, rng, tensors = tmp_path / "s.db", np.random.default_rng(1), 2
    with StoreWriter(path) as writer:
        run_id = _new_run(writer, tensors)
        _write(writer, run_id, rng, list(range(0, 300)), tensors)
    with StoreWriter(path, finish_runs=False) as writer:
        _write(writer, run_id, rng, list(range(300, 700)), tensors)
        writer.end_run(run_id, "finished")
    stored = _assert_rollups_are_the_sums(path, run_id)
    assert stored[(1, 16, 18)][:3] == (288, 303, 16) and stored[(1, 256, 1)][:3] == (256, 511, 256)


def _downgrade_to_14(path) -> None:
    """The file as schema 14 left it: no hist_rollups table, stamped 14."""
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE hist_rollups")
        conn.execute("UPDATE meta SET value = '14' WHERE key = 'schema_version'")


def test_migration_to_15_builds_the_rollups_the_writer_would_have_kept(tmp_path):
    """A store written before schema 15 (here: one written now, its rollups dropped and its stamp set back) gets
    them built in place when opened: the sums of its stored rows, identical to what the writer kept; every other
    table unchanged."""
    path, rng, tensors = tmp_path / "s.db", np.random.default_rng(2), 3
    with StoreWriter(path, finish_runs=True) as writer:
        runs = [_new_run(writer, tensors) for _ in range(2)]
        for start in range(0, 600, 70):
            for run_id in runs:
                _write(writer, run_id, rng, [s for s in KEPT if start <= s < start + 70], tensors)
    kept_by_writer = {run_id: _stored_rollups(path, run_id) for run_id in runs}
    _downgrade_to_14(path)
    Store(path)  # opening migrates
    assert _raw(path, "SELECT value FROM meta WHERE key = 'schema_version'")[0][0] == str(SCHEMA_VERSION)
    for run_id in runs:
        migrated = _assert_rollups_are_the_sums(path, run_id)
        assert migrated.keys() == kept_by_writer[run_id].keys()
        for key, value in migrated.items():
            assert value[:4] == kept_by_writer[run_id][key][:4] and (value[4] == kept_by_writer[run_id][key][4]).all()


def test_a_real_schema_13_store_migrates_with_rollups_of_its_stored_rows(tmp_path):
    """The schema-13 fixture (every=2, 5 steps, two runs) crosses two migrations; its rollups are its rows' sums."""
    path = tmp_path / "store_v13.db"
    shutil.copy(DATA / "store_v13.db", path)
    store = Store(path)
    for run_id in (1, 2):
        _assert_rollups_are_the_sums(path, run_id)
        names = store.tensors(run_id)["name"].tolist()
        index, counts = store.histogram_columns(run_id, names[0], max_columns=1)
        assert index[["step", "last_step", "steps_kept"]].values.tolist() == [[0, 4, 3]]  # one bucket of 16
        assert (counts[0] == sum(h for (s, t), h in _exact(path, run_id).items() if t == 0)).all()


def _frexp_histogram(g: torch.Tensor) -> np.ndarray:
    """Ground truth: |g|'s finite non-zero values binned by torch.frexp (2**e <= |x| < 2**(e+1): e = frexp - 1)."""
    g = g.detach().double().reshape(-1)
    g = g[torch.isfinite(g) & (g != 0)]
    exponents = torch.frexp(g.abs()).exponent.long() - 1 - EXP_MIN
    return np.bincount(exponents.numpy(), minlength=N_EXP_BINS)


def test_rollups_of_a_real_recorded_run_are_the_sums_of_torchs_own_binning_of_its_gradients(tmp_path):
    """A small model trained through the Recorder at every step, flushed mid-bucket: every rollup at every level
    equals the gradients' histograms (torch.frexp) summed over the bucket's steps, and the heatmap's columns
    read through Store.histogram_columns are those sums too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    steps, truth = 40, {}
    with Recorder(model, store=tmp_path / "r.db", name="frexp", optimizer=opt, every=1) as rec:
        for step in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[step % 8 * 8:][:8]), y[step % 8 * 8:][:8])
            loss.backward()
            for k, (_, p) in enumerate(model.named_parameters()):
                truth[(step, k)] = _frexp_histogram(p.grad)
            rec.record(loss)
            opt.step()
            if step in (7, 21):
                rec.flush()  # a flush boundary inside a bucket of 16
    path, run_id = tmp_path / "r.db", rec.run_id
    names = Store(path).tensors(run_id)["name"].tolist()
    assert names == [name for name, _ in model.named_parameters()]
    stored = _stored_rollups(path, run_id)
    for (tensor, size, bucket), (first, last, kept, empty, hist) in stored.items():
        covered = [s for s in range(steps) if s // size == bucket]
        assert (first, last, kept, empty) == (covered[0], covered[-1], len(covered), 0)
        assert (hist == sum(truth[(s, tensor)] for s in covered)).all(), (tensor, size, bucket)
    assert {(size, bucket) for _, size, bucket in stored} == {(16, 0), (16, 1), (16, 2), (256, 0), (4096, 0)}
    index, counts = Store(path).histogram_columns(run_id, names[2], max_columns=3)
    assert index[["step", "last_step", "steps_kept"]].values.tolist() == [[0, 15, 16], [16, 31, 16], [32, 39, 8]]
    for (first, last), column in zip(index[["step", "last_step"]].values.tolist(), counts, strict=True):
        assert (column == sum(truth[(s, 2)] for s in range(first, last + 1))).all()


def _columns_run(tmp_path, rng):
    """A run of 2 tensors over 3,000 kept steps, some of whose histograms are empty."""
    path = tmp_path / "c.db"
    with StoreWriter(path, finish_runs=True) as writer:
        run_id = _new_run(writer, 2)
        for start in range(0, 3_000, 250):
            _write(writer, run_id, rng, list(range(start, start + 250)), 2)
    return path, run_id


@pytest.mark.parametrize("max_columns", [5_000, 3_000, 1_000, 200, 12, 1])
def test_histogram_columns_are_exact_sums_of_whole_kept_steps_and_fit_the_width_where_they_can(tmp_path,
                                                                                               max_columns):
    """The finest level whose bucket count fits; a bucket holding an empty step, or a step of split_at, is read
    finer down to the exact rows; every kept step is in exactly one column; each column is the sum of its steps."""
    rng = np.random.default_rng(3)
    path, run_id = _columns_run(tmp_path, rng)
    exact = _exact(path, run_id)
    split_at = [1_000, 1_001, 2_050]
    index, counts = Store(path).histogram_columns(run_id, "t1", max_columns, split_at=split_at)
    firsts, lasts, kept = (index[c].to_numpy() for c in ("step", "last_step", "steps_kept"))
    assert (firsts[1:] > lasts[:-1]).all() and kept.sum() == 3_000  # in step order, every kept step once
    for first, last, n, column in zip(firsts, lasts, kept, counts, strict=True):
        covered = [s for s in range(first, last + 1) if (s, 1) in exact]
        assert n == len(covered) and (column == sum(exact[(s, 1)] for s in covered)).all()
        assert not any(first < s <= last for s in split_at)  # one loss scale per column
        if n > 1:
            assert all(exact[(s, 1)].sum() > 0 for s in covered)  # an empty step is a column of its own
    blank = [s for s in range(3_000) if exact[(s, 1)].sum() == 0]
    exact_rows = index[index["steps_kept"] == 1].set_index("step")
    assert set(blank) <= set(exact_rows.index) and exact_rows["zeros"].notna().all()
    if max_columns >= 3_000:
        assert len(index) == 3_000  # the exact rows when they fit
    elif max_columns >= 200:
        # the level of 16 (188 buckets) fits; only the buckets with an empty or split step are read finer
        assert len(index) < 188 + 16 * (len(blank) + len(split_at))


def test_histogram_columns_of_an_unknown_tensor_are_empty(tmp_path):
    path, run_id = _columns_run(tmp_path, np.random.default_rng(4))
    index, counts = Store(path).histogram_columns(run_id, "no such tensor", 100)
    assert index.empty and counts.shape == (0, N_EXP_BINS)
    assert isinstance(index, pd.DataFrame)


def test_columns_read_from_the_last_bucket_on_complete_what_was_held_as_a_fresh_read_would(tmp_path):
    """A live page holds the columns it read and, as the run grows, reads again only from its last bucket (which
    may have grown) on: held columns before that bucket plus the new read are the fresh read, at every level."""
    path, rng = tmp_path / "live.db", np.random.default_rng(5)
    with StoreWriter(path) as writer:
        run_id = _new_run(writer, 1)
        held = None
        for start in range(0, 2_000, 130):
            _write(writer, run_id, rng, list(range(start, start + 130)), 1)
            store = Store(path)
            for max_columns in (5_000, 100, 3):
                fresh_index, fresh_counts = store.histogram_columns(run_id, "t0", max_columns)
                level = fresh_index.attrs["bucket_steps"]
                if held is not None and held[0].attrs["bucket_steps"] == level and max_columns == held[2]:
                    index, counts = held[:2]
                    last = int(index["step"].iloc[-1])
                    start_at = last + 1 if level == 1 else last // level * level
                    new_index, new_counts = store.histogram_columns(run_id, "t0", max_columns, from_step=start_at)
                    keep = (index["step"] < start_at).to_numpy()
                    merged = pd.concat([index[keep], new_index], ignore_index=True)
                    pd.testing.assert_frame_equal(merged, fresh_index)
                    assert (np.concatenate([counts[keep], new_counts]) == fresh_counts).all()
                if max_columns == 100:
                    held = (fresh_index, fresh_counts, max_columns)


def _closed_only(expected: dict[tuple, tuple]) -> dict[tuple, tuple]:
    """The expected rollups without each tensor's latest bucket per level (the writer holds it open)."""
    latest = {}
    for tensor, size, bucket in expected:
        latest[(tensor, size)] = max(bucket, latest.get((tensor, size), -1))
    return {key: value for key, value in expected.items() if key[2] < latest[key[:2]]}


def test_a_bucket_is_stored_once_it_closes_and_the_open_ones_when_the_run_ends(tmp_path):
    """While the run goes on, the store holds exactly the buckets each tensor has moved past, each the sum of its
    exact rows; the open ones (each tensor's latest at each level) are stored when the run ends."""
    path, rng, tensors = tmp_path / "s.db", np.random.default_rng(6), 2
    with StoreWriter(path) as writer:
        run_id = _new_run(writer, tensors)
        kept = [s for s in KEPT if s < 5_000]
        cuts = np.cumsum(rng.integers(1, 120, len(kept)))
        for part in np.split(np.asarray(kept), cuts[cuts < len(kept)]):
            _write(writer, run_id, rng, part.tolist(), tensors)
            expected, stored = _closed_only(_expected_rollups(_exact(path, run_id))), _stored_rollups(path, run_id)
            assert set(stored) == set(expected)
            for key, (first, last, n, empty, hist) in expected.items():
                assert stored[key][:4] == (first, last, n, empty) and (stored[key][4] == hist).all(), key
        writer.end_run(run_id, "finished")
    _assert_rollups_are_the_sums(path, run_id)


_CRASHING_WRITER = """
import os, sys
import numpy as np
sys.path.insert(0, {tests!r})
from store.test_histogram_rollups import KEPT, _new_run, _write
from mpdiag.store import StoreWriter
writer = StoreWriter({path!r})
run_id = _new_run(writer, 2)
rng = np.random.default_rng(7)
kept = [s for s in KEPT if s < 4_700]
for start in range(0, len(kept), 97):
    _write(writer, run_id, rng, kept[start:start + 97], 2)
os._exit(1)  # killed: the writer never closes
"""


def test_after_a_crash_the_columns_still_sum_every_kept_step_once(tmp_path):
    """A process killed mid-run loses its open buckets' sums: the store has no row for them, and
    Store.histogram_columns reads their steps from the finer levels and the exact rows, at every width."""
    import subprocess
    import sys

    path = tmp_path / "crash.db"
    script = _CRASHING_WRITER.format(tests=str(ROOT / "tests"), path=str(path))
    assert subprocess.run([sys.executable, "-c", script], cwd=ROOT).returncode == 1
    expected, stored = _expected_rollups(_exact(path, 1)), _stored_rollups(path, 1)
    assert set(stored) == set(_closed_only(expected)) and len(stored) < len(expected)
    exact = _exact(path, 1)
    kept = sorted(s for s, t in exact if t == 1)
    for max_columns in (10_000, 300, 20, 1):
        index, counts = Store(path).histogram_columns(1, "t1", max_columns)
        firsts, lasts, n = (index[c].to_numpy() for c in ("step", "last_step", "steps_kept"))
        assert (firsts[1:] > lasts[:-1]).all() and n.sum() == len(kept)  # every kept step once, in order
        for first, last, steps, column in zip(firsts, lasts, n, counts, strict=True):
            covered = [s for s in kept if first <= s <= last]
            assert steps == len(covered) and (column == sum(exact[(s, 1)] for s in covered)).all()


def test_a_batch_whose_transaction_fails_adds_nothing_to_the_sums_held_in_memory(tmp_path):
    """A batch SQLite refuses after its sums were added (here its kept_steps insert, as a full disk would refuse
    the commit) is rolled back; the open buckets and the histogram totals the writer holds in memory are too, so
    the rows written after it still sum to the stored exact rows."""
    import sqlite3 as sqlite

    def refuse_kept_steps(action, table, *_):
        return sqlite.SQLITE_DENY if action == sqlite.SQLITE_INSERT and table == "kept_steps" else sqlite.SQLITE_OK

    path, rng, tensors = tmp_path / "s.db", np.random.default_rng(8), 2
    with StoreWriter(path) as writer:
        run_id = _new_run(writer, tensors)
        _write(writer, run_id, rng, list(range(0, 40)), tensors)
        writer._conn.set_authorizer(refuse_kept_steps)
        with pytest.raises(sqlite.DatabaseError):
            _write(writer, run_id, rng, list(range(40, 60)), tensors)
        writer._conn.set_authorizer(None)
        _write(writer, run_id, rng, list(range(40, 300)), tensors)
        writer.end_run(run_id, "finished")
    _assert_rollups_are_the_sums(path, run_id)
    exact = _exact(path, run_id)
    totals = dict(_raw(path, "SELECT tensor_id, hist FROM hist_totals WHERE run_id = ?", (run_id,)))
    for tensor in range(tensors):
        truth = sum(hist for (_, t), hist in exact.items() if t == tensor)
        assert (decode_hists([totals[tensor]])[0] == truth).all()
