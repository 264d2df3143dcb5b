"""Anomaly-preserving retention against planted truth: a real Recorder loop with --every 5 whose gradients overflow
FP16 at step 7 (between two multiples) stores that step, with the steps around it, exactly as torch's own casts
count it, says why each step was kept, and the fp16-overflow finding and the Gradients page's heatmap caption
name it; and the rules' edges on rows (a
streak keeps its first step, not all of them). Ground truth: torch's casts of the gradients captured in the loop."""

import numpy as np
import pytest
import torch
from ground_truth import exponent_histogram

from mpdiag import Recorder, Store
from mpdiag.analysis.findings import diagnose, evidence_link
from mpdiag.dashboard import gradients_model
from mpdiag.numerics.formats import SIGNAL_COUNTS
from mpdiag.numerics.gradstats import NUMBA_AVAILABLE, GradStatsComputer
from mpdiag.recording.retention import DENSE_START_STEPS, THIN_EVERY, Retention
from mpdiag.store import StepRow

EVERY, PLANTED, STEPS = 5, 7, 12


def test_an_overflow_between_multiples_of_every_is_stored_exactly_with_its_neighbours_and_found(store_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # fixed weights: only the planted step's gradients are huge
    with Recorder(model, store=store_path, optimizer=opt, every=EVERY) as rec:
        for step in range(STEPS):
            opt.zero_grad()
            loss = model(torch.randn(32, 8)).pow(2).mean()
            (loss * (1e6 if step == PLANTED else 1.0)).backward()
            if step == PLANTED:
                planted = {name: p.grad.clone() for name, p in model.named_parameters()}
            rec.record(loss)
            opt.step()
    store = Store(store_path)
    kept = store.kept_steps(rec.run_id)
    assert kept.values.tolist() == [[0, "every"], [5, "every"], [6, "before"], [7, "overflow"], [8, "after"],
                                    [10, "every"]]
    assert store.logged_steps(rec.run_id) == [0, 5, 6, 7, 8, 10]
    stats = store.tensor_stats(rec.run_id, step=PLANTED).set_index("tensor")
    index, hists = store.histogram_matrix(rec.run_id, step=PLANTED)
    overflowing = []
    for name, g in planted.items():
        truth = int((torch.isinf(g.half()) & torch.isfinite(g)).sum())  # torch's own cast
        assert stats.loc[name, "fp16_overflow"] == stats.loc[name, "fp16_overflow_at_scale"] == truth, name
        assert (hists[index["tensor"].tolist().index(name)] == exponent_histogram(g)).all(), name
        overflowing += [name] * (truth > 0)
    assert overflowing and len(overflowing) < len(planted)  # planted: some values overflow, not all
    finding = next(f for f in diagnose(store, rec.run_id) if f.rule == "fp16-overflow")
    assert finding.title.endswith(f"first at step {PLANTED}") and "kept: overflow" in finding.evidence
    assert set(finding.tensors) == set(overflowing)
    assert evidence_link(finding, rec.run_id).endswith(f"&step={PLANTED}")  # the Gradients page at that step
    runs = store.runs()
    model = gradients_model.gradients(store, runs[runs["run_id"] == rec.run_id].iloc[0], True, runs)
    shown = model.tensor(model.ranking("fp16", at_scale=False), overflowing[0], show_bf16=False)
    assert shown.kept == (f"Statistics are stored every {EVERY} steps; the columns between them are not stored, "
                          f"except where something happened: overflow at step {PLANTED}, and 2 steps next to them.")


def _rows(skipped, scale):
    """Step rows of a scaled run: ``skipped`` flags, the scale each ran at (it halves after a skip)."""
    return [StepRow(s, 1.0, sc, sk, 0, sc / 2 if sk else sc, 0.1, 0, 0, 1e-3, 1.0, 0.1)
            for s, (sk, sc) in enumerate(zip(skipped, scale, strict=True))]


def _kept(rows, numel, underflow=None, every=10, overflow=None):
    """(step, reasons) of the steps a Retention(every) keeps of ``rows``; ``underflow``, ``overflow``: per step,
    the FP16 underflow or overflow count of each tensor (else none)."""
    retention = Retention(every=every, numel=numel)
    zeros = np.zeros(len(numel), dtype=np.int64)
    kept = []
    for row in rows:
        counts = {name: zeros for name in ("nan", "posinf", "neginf")}
        counts |= {f"{fmt}_{kind}_at_scale": zeros for fmt in ("fp16", "bf16") for kind in ("overflow", "underflow")}
        if underflow is not None:
            counts["fp16_underflow_at_scale"] = np.array(underflow[row.step])
        if overflow is not None:
            counts["fp16_overflow_at_scale"] = np.array(overflow[row.step])
        retention.see_row(row, [])
        retention.see_stats(row.step, np.arange(len(numel)), counts, row.step)
        kept += [(step, reasons) for step, _, reasons in retention.decide(row.step)]
    return kept + [(step, reasons) for step, _, reasons in retention.decide(None)]


def test_a_streak_of_skips_keeps_its_first_step_and_its_neighbours_only():
    skipped = [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    scale = [8.0, 8.0, 8.0, 8.0, 4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert _kept(_rows(skipped, scale), [4]) == [(0, ["every"]), (2, ["before"]), (3, ["scale-change", "skipped"]),
                                                 (4, ["after"]), (10, ["every"])]


def test_an_underflow_jump_counts_when_enough_values_moved_not_one_value_of_a_small_tensor():
    """A 4-element bias with one value more underflowing (25 points, 1 value) is no jump; a 10,000-element weight
    with 200 more (2 points, 200 values) is."""
    underflow = [[0, 100], [0, 100], [1, 100], [0, 100], [0, 300], [0, 300], [0, 300]] + [[0, 300]] * 5
    assert _kept(_rows([0] * 12, [1.0] * 12), [4, 10_000], underflow) == [
        (0, ["every"]), (3, ["before"]), (4, ["underflow"]), (5, ["after"]), (10, ["every"])]


def test_a_scale_change_known_a_step_late_stores_it_and_the_step_before_from_their_held_gradients(store_path):
    """Between multiples of every the Recorder holds each step's gradients and counts only what the rules read; a
    scale growth (GradScaler's, at its growth interval) is known only once the step's update ran, yet the step and
    the one before it are stored exactly as torch's casts count their captured gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=4)  # grows at steps 3, 7, 11
    captured = {}
    with Recorder(model, store=store_path, scaler=scaler, optimizer=opt, every=10) as rec:
        for step in range(12):
            opt.zero_grad()
            loss = model(torch.randn(32, 8)).pow(2).mean()
            scaler.scale(loss).backward()
            captured[step] = (scaler.get_scale(), {n: p.grad.clone() for n, p in model.named_parameters()})
            rec.record(loss)
            scaler.step(opt)
            scaler.update()
    store = Store(store_path)
    assert store.kept_steps(rec.run_id).values.tolist() == [
        [0, "every"], [2, "before"], [3, "scale-change"], [4, "after"], [6, "before"], [7, "scale-change"],
        [8, "after"], [10, "before"], [10, "every"], [11, "scale-change"]]
    for step in (2, 3, 4, 6, 7, 8, 10, 11):
        scale, grads = captured[step]
        stats = store.tensor_stats(rec.run_id, step=step).set_index("tensor")
        index, hists = store.histogram_matrix(rec.run_id, step=step)
        for name, scaled in grads.items():
            g = scaled * torch.tensor(scale, dtype=torch.float64).reciprocal().float()  # GradScaler's unscale
            assert stats.loc[name, "fp16_underflow_at_scale"] == int(((scaled.half() == 0) & (scaled != 0)).sum())
            assert stats.loc[name, "fp16_underflow"] == int(((g.half() == 0) & (g != 0)).sum()), (step, name)
            assert stats.loc[name, "bf16_underflow"] == int(((g.bfloat16() == 0) & (g != 0)).sum()), (step, name)
            assert (hists[index["tensor"].tolist().index(name)] == exponent_histogram(g)).all(), (step, name)
            assert stats.loc[name, "absmax"] == float(g.abs().max())


@pytest.mark.skipif(not NUMBA_AVAILABLE, reason="the CPU's held steps are the numba backend's")
def test_steps_between_multiples_run_the_full_statistics_only_when_kept(store_path, monkeypatch):
    """With nothing happening, the full statistics pass runs at the multiples of every alone: the steps between
    them make only the light pass over their held copy (what retention decides with)."""
    full_passes = []
    numba_stats = GradStatsComputer._numba_stats
    monkeypatch.setattr(GradStatsComputer, "_numba_stats",
                        lambda self, *args: full_passes.append(1) or numba_stats(self, *args))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with Recorder(model, store=store_path, optimizer=opt, every=EVERY) as rec:
        for _ in range(STEPS):
            opt.zero_grad()
            model(torch.randn(32, 8)).pow(2).mean().backward()
            rec.record(0.0)
            opt.step()
    assert Store(store_path).logged_steps(rec.run_id) == [0, 5, 10] and len(full_passes) == 3


def test_the_default_keeps_every_step_to_1000_then_every_50th_and_the_anomalies_with_their_neighbours():
    """Retention(None), issue 28's default: steps 0..999 whole (reason start), then the multiples of 50 and a
    skipped step (a scale backoff) between them with its neighbours; --every 1 keeps every step for "every"."""
    assert (DENSE_START_STEPS, THIN_EVERY) == (1000, 50)
    skipped = [0] * 1200
    skipped[1123] = 1
    scale = [8.0] * 1124 + [4.0] * 76
    rows = _rows(skipped, scale)
    kept = _kept(rows, [4], every=None)
    assert kept[:1000] == [(step, ["start"]) for step in range(1000)]
    assert kept[1000:] == [(1000, ["every"]), (1050, ["every"]), (1100, ["every"]), (1122, ["before"]),
                           (1123, ["scale-change", "skipped"]), (1124, ["after"]), (1150, ["every"])]
    assert _kept(rows, [4], every=1) == [(step, ["every"] + (["before"] if step == 1122 else [])
                                          + (["scale-change", "skipped"] if step == 1123 else [])
                                          + (["after"] if step == 1124 else [])) for step in range(1200)]


def _signals_by_casting(g: torch.Tensor) -> list[int]:
    """SIGNAL_COUNTS of one unscaled gradient (scale 1: S*g is g) by torch's own casts."""
    low = {"fp16": g.half(), "bf16": g.bfloat16()}
    counts = {"nan": torch.isnan(g), "posinf": torch.isposinf(g), "neginf": torch.isneginf(g)}
    for fmt, cast in low.items():
        counts[f"{fmt}_underflow_at_scale"] = (cast == 0) & (g != 0)
        counts[f"{fmt}_overflow_at_scale"] = torch.isinf(cast) & torch.isfinite(g)
    return [int(counts[name].sum()) for name in SIGNAL_COUNTS]


def test_the_default_recorder_stores_every_steps_signals_as_torch_casts_count_them_kept_or_not(store_path):
    """A real Recorder loop at the default retention over 1,060 steps: gradients small enough that some values
    underflow FP16 at every step, and an overflow planted at step 1,027 (between the multiples 1,000 and 1,050).
    The store keeps 0..999, the multiples and the anomalies with their neighbours, and holds every step's signals,
    per tensor, equal to torch's casts of the captured gradients: on kept steps (full statistics) and dropped
    ones (the light pass)."""
    planted, steps = 1027, 1060
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    truth = {}
    with Recorder(model, store=store_path, optimizer=opt) as rec:
        for step in range(steps):
            opt.zero_grad()
            loss = model(torch.randn(32, 8)).pow(2).mean()
            (loss * (1e6 if step == planted else 1e-6)).backward()
            truth[step] = [_signals_by_casting(p.grad) for p in model.parameters()]
            rec.record(loss)
            opt.step()
    store = Store(store_path)
    kept = store.kept_steps(rec.run_id)
    assert (kept.loc[kept["step"] < 1000, "reason"] == "start").all() and kept["step"].nunique() == 1006
    # the planted step is also a gradient-norm spike, and the step after it an underflow jump (back to tiny values)
    assert kept[kept["step"] >= 1000].values.tolist() == [
        [1000, "every"], [1026, "before"], [1027, "before"], [1027, "grad-norm-spike"], [1027, "overflow"],
        [1028, "after"], [1028, "underflow"], [1029, "after"], [1050, "every"]]
    stored_steps, tensor_ids, counts = store.step_signals(rec.run_id)
    assert stored_steps.tolist() == list(range(steps)) and tensor_ids.tolist() == [0, 1, 2, 3]
    assert counts.tolist() == [truth[step] for step in range(steps)]
    dropped = ~np.isin(stored_steps, kept["step"].to_numpy())
    assert dropped.sum() == 54 and counts[dropped][..., SIGNAL_COUNTS.index("fp16_underflow_at_scale")].sum() > 0
    totals = store.step_signal_totals(rec.run_id)
    assert totals[list(SIGNAL_COUNTS)].values.tolist() == counts.sum(axis=1).tolist()


def test_a_tensor_flickering_at_the_edge_of_fp16_keeps_its_first_overflow_not_every_return():
    """A 10,000-element weight whose FP16 overflow flickers between none and one value (a tensor at the edge of
    the range, for hundreds of steps in a long run) keeps its first overflowing step; its returns are in the
    signals only. A real jump (2 points, 200 values) later is kept again."""
    overflow = [[0], [0], [1], [0], [1], [0], [0], [1], [1], [0], [0], [0], [0], [200], [0]]
    assert _kept(_rows([0] * 15, [1.0] * 15), [10_000], overflow=overflow) == [
        (0, ["every"]), (1, ["before"]), (2, ["overflow"]), (3, ["after"]), (10, ["every"]), (12, ["before"]),
        (13, ["overflow"]), (14, ["after"])]
