"""Findings count every step, kept in full or not (issue 28): a real Recorder loop with --every 5 whose gradients
are planted by hand, so that a tensor overflows FP16 at steps whose full statistics are dropped (an overflow's
return, too few values to be a jump: mpdiag.recording.retention), underflows at every step, and one tensor is zero
at every kept step but not between. The fp16-overflow finding names those dropped steps and tensors with their
exact counts, gradient-underflow counts the underflow of every step, and dead-gradients says its zeros are the
kept steps'. Ground truth: torch's own FP16 casts of the planted gradients."""

import pytest
import torch

from mpdiag import Recorder, Store
from mpdiag.analysis.findings import diagnose

EVERY, STEPS = 5, 25
#: step -> (tensor, how many values of it planted past FP16's max); 7 and 18 are each tensor's first overflow (kept),
#: 13 and 22 their returns: a few values (under retention's jump of 64 values), between multiples of 5 (dropped)
OVERFLOWS = {7: ("weight", 3), 13: ("weight", 6), 18: ("bias", 1), 22: ("bias", 2)}
DROPPED = (13, 22)
#: values just inside FP16's range at every step (65,000 rounds to 65,024), so the gradient norm barely moves
EDGE, PAST = 65_000.0, 70_000.0
TINY, UNDERFLOWING = 1e-9, 100  # 1e-9 < 2^-25: cast to FP16 it is 0


def _planted(step: int, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    grads = {name: g.clone() for name, g in base.items()}
    grads["weight"][:10] = EDGE
    grads["weight"][-UNDERFLOWING:] = TINY
    if step in OVERFLOWS:
        name, n = OVERFLOWS[step]
        grads[name][:n] = PAST
    # zero at every step kept in full (the multiples of 5 and the overflows' neighbours), not at the others
    grads["gate"][:] = 0.0 if step % EVERY == 0 or any(abs(step - s) <= 1 for s in (7, 18)) else 1.0
    return grads


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(store, run id, per step the planted gradients) of an O1-labelled loop without a GradScaler (scale 1)."""
    path = tmp_path_factory.mktemp("every_step") / "runs.db"
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.zeros(1024))
    model.bias = torch.nn.Parameter(torch.zeros(32))
    model.gate = torch.nn.Parameter(torch.zeros(8))
    base = {"weight": torch.randn(1024) * 1e-2, "bias": torch.randn(32) * 1e-2, "gate": torch.zeros(8)}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    planted = {}
    with Recorder(model, store=path, optimizer=opt, every=EVERY, config={"opt_level": "O1"}) as rec:
        for step in range(STEPS):
            planted[step] = _planted(step, base)
            for name, p in model.named_parameters():
                p.grad = planted[step][name].clone()
            rec.record(1.0)
            opt.step()
    return Store(path), rec.run_id, planted


def _overflowing(g: torch.Tensor) -> int:
    return int((torch.isinf(g.half()) & torch.isfinite(g)).sum())


def _underflowing(g: torch.Tensor) -> int:
    return int(((g.half() == 0) & (g != 0)).sum())


def test_the_planted_overflows_between_multiples_are_dropped_in_full_and_counted_in_the_signals(recorded):
    store, run_id, planted = recorded
    kept = set(store.kept_steps(run_id)["step"])
    assert kept == {0, 5, 6, 7, 8, 10, 15, 17, 18, 19, 20} and not kept & set(DROPPED)
    truth = [(step, name, _overflowing(g)) for step, grads in planted.items() for name, g in grads.items()
             if _overflowing(g)]
    assert [(s, name, n) for s, (name, n) in OVERFLOWS.items()] == truth  # the plant, as torch casts it
    assert store.signal_counts(run_id, "fp16_overflow_at_scale").values.tolist() == [list(t) for t in truth]


def test_fp16_overflow_names_the_dropped_steps_and_tensors_with_their_exact_counts(recorded):
    store, run_id, planted = recorded
    finding = {f.rule: f for f in diagnose(store, run_id)}["fp16-overflow"]
    assert finding.title.endswith("first at step 7") and finding.focus == {"step": 7}
    assert "At step 7 (statistics kept: overflow), weight: 3 values cast to inf in FP16" in finding.evidence
    per_step = {name: {s: _overflowing(grads[name]) for s, grads in planted.items()} for name in ("weight", "bias")}
    weight, bias = (sum(per_step[name].values()) for name in ("weight", "bias"))
    assert (weight, bias) == (9, 3)
    assert ("Counted at every step, kept or not: 4 steps held such values, 2 of them with statistics not kept in "
            f"full (their counts are the per-step signals); weight: {weight} values at 2 steps, the most at step 13 "
            f"({per_step['weight'][13]}, statistics not kept); bias: {bias} values at 2 steps, the most at step 22 "
            f"({per_step['bias'][22]}, statistics not kept).") in finding.evidence
    assert finding.tensors == ["weight", "bias"]  # the first step's tensor first: the evidence link opens it


def test_gradient_underflow_counts_every_step_and_says_its_shares_are_the_kept_steps(recorded):
    store, run_id, planted = recorded
    finding = {f.rule: f for f in diagnose(store, run_id)}["gradient-underflow"]
    kept = store.kept_steps(run_id)["step"].nunique()
    every_step = sum(_underflowing(g) for grads in planted.values() for g in grads.values())
    at_kept = sum(_underflowing(g) for s, grads in planted.items() if s in set(store.logged_steps(run_id))
                  for g in grads.values())
    assert (every_step, at_kept) == (STEPS * UNDERFLOWING, kept * UNDERFLOWING)
    assert f"of the finite non-zero gradient values recorded at the {kept} steps kept in full (of {STEPS} counted)" \
        in finding.evidence
    assert (f"Counted at every one of the {STEPS} steps, kept in full or not: {every_step:,} values would underflow "
            f"in FP16 at the scale used ({at_kept:,} of them at the kept steps).") in finding.evidence


def test_dead_gradients_says_its_zeros_are_those_of_the_kept_steps(recorded):
    """gate is zero at every kept step and 1 between: its zeros are counted at kept steps only, and the finding
    says so rather than claiming every step."""
    store, run_id, planted = recorded
    assert any(planted[s]["gate"].any() for s in DROPPED)
    finding = {f.rule: f for f in diagnose(store, run_id)}["dead-gradients"]
    assert finding.tensors == ["gate"]
    kept = store.kept_steps(run_id)["step"].nunique()
    assert finding.evidence == (f"gate: every value exactly zero at all {kept} logged steps (the steps whose full "
                                f"statistics were kept, of {STEPS} counted: exact zeros are counted at kept steps "
                                "only).")
