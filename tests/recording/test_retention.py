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
from mpdiag.numerics.gradstats import NUMBA_AVAILABLE, GradStatsComputer
from mpdiag.recording.retention import Retention
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


def _kept(rows, numel, underflow=None):
    """(step, reasons) of the steps a Retention(every=10) keeps of ``rows``; ``underflow``: per step, the FP16
    underflow count of each tensor (else none)."""
    retention = Retention(every=10, numel=numel)
    zeros = np.zeros(len(numel), dtype=np.int64)
    kept = []
    for row in rows:
        counts = {name: zeros for name in ("nan", "posinf", "neginf")}
        counts |= {f"{fmt}_{kind}_at_scale": zeros for fmt in ("fp16", "bf16") for kind in ("overflow", "underflow")}
        if underflow is not None:
            counts["fp16_underflow_at_scale"] = np.array(underflow[row.step])
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
