"""`mpdiag export` writes the per-step signals (every step, kept in full or not) and the histogram rollups, and
both read back from its Parquet and CSV files as the run recorded them (issue 28); the Store's reads of the signals
that the findings and Compare use give the same numbers. Ground truth: the gradients planted in a real Recorder loop
with --every 5, cast with torch (signals) and binned with Python's frexp (histograms, summed over each bucket's kept
steps); never the store's own code."""

import numpy as np
import pandas as pd
import pytest
import torch
from ground_truth import exponent_histogram

from mpdiag import Recorder, Store
from mpdiag.numerics.formats import EXP_MIN, SIGNAL_COUNTS
from mpdiag.store import export
from mpdiag.store.export import export_run
from mpdiag.store.schema import ROLLUP_BUCKET_STEPS

EVERY, STEPS, OVERFLOW_AT = 5, 25, 13  # 13: the weight's overflow returns, too few values to be kept in full


def _planted(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    weight = torch.randn(256, generator=g) * 1e-3
    weight[:4] = 1e-9  # below FP16's 2^-25: underflows at every step
    if step in (7, OVERFLOW_AT):
        weight[4 : 4 + (2 if step == 7 else 5)] = 1e5  # past FP16's max; 7 is the first overflow (kept)
    bias = torch.randn(16, generator=g) * 1e-2
    bias[0] = float("nan") if 11 <= step <= 14 else bias[0]  # kept at its first step only, 11 (and 12, after it)
    return {"weight": weight, "bias": bias, "gate": torch.zeros(4)}  # gate: all zero, an empty histogram


def _signals_by_casting(g: torch.Tensor) -> list[int]:
    counts = {"nan": torch.isnan(g), "posinf": torch.isposinf(g), "neginf": torch.isneginf(g)}
    for fmt, cast in (("fp16", g.half()), ("bf16", g.bfloat16())):
        counts[f"{fmt}_underflow_at_scale"] = (cast == 0) & (g != 0)
        counts[f"{fmt}_overflow_at_scale"] = torch.isinf(cast) & torch.isfinite(g)
    return [int(counts[name].sum()) for name in SIGNAL_COUNTS]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(store, run id, planted gradients per step, the export's folder)."""
    folder = tmp_path_factory.mktemp("export_signals")
    model = torch.nn.Module()
    for name, size in (("weight", 256), ("bias", 16), ("gate", 4)):
        setattr(model, name, torch.nn.Parameter(torch.zeros(size)))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    planted = {}
    with Recorder(model, store=folder / "runs.db", optimizer=opt, every=EVERY) as rec:
        for step in range(STEPS):
            planted[step] = _planted(step)
            for name, p in model.named_parameters():
                p.grad = planted[step][name].clone()
            rec.record(1.0)
            opt.step()
    store = Store(folder / "runs.db")
    export_run(store, rec.run_id, folder / "out")
    return store, rec.run_id, planted, folder / "out"


def _read_back(out, run_id, name) -> list[pd.DataFrame]:
    stem = out / f"run{run_id}_{name}"
    return [pd.read_parquet(stem.with_suffix(".parquet")), pd.read_csv(stem.with_suffix(".csv"))]


def test_every_steps_signals_round_trip_as_torch_casts_count_them_kept_or_not(exported):
    store, run_id, planted, out = exported
    kept = set(store.kept_steps(run_id)["step"])
    assert {OVERFLOW_AT, 14} & kept == set() and 11 in kept  # the plant sits on dropped steps too
    truth = [[step, name, *_signals_by_casting(g)] for step, grads in planted.items() for name, g in grads.items()]
    assert any(row[2] for row in truth) and any(row[2 + SIGNAL_COUNTS.index("fp16_overflow_at_scale")]
                                                for row in truth if row[0] == OVERFLOW_AT)
    for read in _read_back(out, run_id, "step_signals"):
        assert read.columns.tolist() == ["step", "tensor", *SIGNAL_COUNTS]
        assert read.values.tolist() == truth
    sums = [[step, *np.sum([_signals_by_casting(g) for g in grads.values()], axis=0).tolist()]
            for step, grads in planted.items()]
    for read in _read_back(out, run_id, "step_signal_totals"):
        assert read.columns.tolist() == ["step", *SIGNAL_COUNTS] and read.values.tolist() == sums


def test_the_signals_written_a_chunk_of_steps_at_a_time_read_back_the_same(exported, tmp_path, monkeypatch):
    """A long run's signals are written SIGNAL_CHUNK_STEPS steps at a time: with chunks of 4 steps (7 of them here,
    the last partial) the files hold the same rows as in one chunk."""
    store, run_id, _, out = exported
    monkeypatch.setattr(export, "SIGNAL_CHUNK_STEPS", 4)
    export.export_run(store, run_id, tmp_path)
    for whole, chunked in zip(_read_back(out, run_id, "step_signals"), _read_back(tmp_path, run_id, "step_signals"),
                              strict=True):
        pd.testing.assert_frame_equal(whole, chunked)
    assert len(chunked) == STEPS * 3


def test_the_histogram_rollups_round_trip_as_the_sums_of_each_buckets_kept_steps(exported):
    store, run_id, planted, out = exported
    kept = sorted(set(store.kept_steps(run_id)["step"]))
    expected = {}
    for name in ("weight", "bias", "gate"):
        for size in ROLLUP_BUCKET_STEPS:
            for bucket in sorted({s // size for s in kept}):
                steps = [s for s in kept if s // size == bucket]
                hists = [exponent_histogram(planted[s][name]) for s in steps]
                expected[(name, size, bucket)] = (steps[0], steps[-1], len(steps), sum(int(h.sum() == 0) for h in hists),
                                                  np.sum(hists, axis=0))
    for read in _read_back(out, run_id, "hist_rollups"):
        assert read.columns.tolist() == ["tensor", "bucket_steps", "bucket", "first_step", "last_step", "steps_kept",
                                         "empty_steps", "exponent", "count"]
        found = {}
        for key, rows in read.groupby(["tensor", "bucket_steps", "bucket"], sort=False):
            first = rows.iloc[0]
            hist = np.zeros_like(expected[key][-1])
            binned = rows.dropna(subset=["exponent"])
            hist[binned["exponent"].astype(int).to_numpy() - EXP_MIN] = binned["count"].astype(int).to_numpy()
            assert len(binned) == len(rows) or (len(rows) == 1 and pd.isna(first["count"]))  # an empty bucket: 1 row
            found[key] = (int(first["first_step"]), int(first["last_step"]), int(first["steps_kept"]),
                          int(first["empty_steps"]), hist)
        assert found.keys() == expected.keys()
        for key, (*meta, hist) in expected.items():
            assert list(found[key][:4]) == meta and (found[key][4] == hist).all(), key
    gate = _read_back(out, run_id, "hist_rollups")[0].query("tensor == 'gate'")
    assert gate["exponent"].isna().all() and (gate["empty_steps"] == gate["steps_kept"]).all()


def test_the_signal_reads_the_findings_and_compare_use_count_every_step_as_torch_casts(exported):
    store, run_id, planted, _ = exported
    truth = {(step, name): _signals_by_casting(g) for step, grads in planted.items() for name, g in grads.items()}
    for k, signal in enumerate(SIGNAL_COUNTS):
        held = [[step, name, counts[k]] for (step, name), counts in truth.items() if counts[k] > 0]
        assert store.signal_counts(run_id, signal).values.tolist() == held, signal
    sums = store.step_signal_sums(run_id)
    assert sums.to_dict() == {"steps": STEPS} | {c: sum(counts[k] for counts in truth.values())
                                                  for k, c in enumerate(SIGNAL_COUNTS)}
    at = store.step_signals_at(run_id, OVERFLOW_AT)  # a dropped step
    assert at.values.tolist() == [[name, *truth[(OVERFLOW_AT, name)]] for name in ("weight", "bias", "gate")]
    assert store.step_signals_at(run_id, STEPS + 10).empty
    with pytest.raises(ValueError, match="unknown signal"):  # the name is put into SQL: only the known ones
        store.signal_counts(run_id, "nan > 0 OR 1")
