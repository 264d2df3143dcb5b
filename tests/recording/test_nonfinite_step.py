"""The optimizer-step check's one-pass finiteness test (mpdiag.recording.nonfinite_step) against
``torch.isfinite`` on each tensor: sums of magnitudes that overflow from finite values are no finding, and one
NaN or inf anywhere, in any dtype, is; counted by numba's pass over bit patterns and by torch. The check
keeps the loss's value, not the loss."""

import gc
import weakref

import pytest
import torch
from conftest import DEVICES

from mpdiag import Recorder
from mpdiag.recording import nonfinite_step
from mpdiag.recording.nonfinite_step import EVERY_STEP, NonfiniteStepCheck


def _tensors(device):
    g = torch.Generator().manual_seed(0)
    made = [torch.randn(n, generator=g) for n in (1, 7, 300, 4096)]
    made += [torch.randn(64, generator=g).half(), torch.randn(64, generator=g).bfloat16(), torch.tensor(2.5),
             torch.randn(5, generator=g).double()]
    return [t.to(device) for t in made]


@pytest.fixture(params=["numba", "torch"])
def counted_by(request, monkeypatch):
    """Both ways of counting: the numba kernel over bit patterns (CPU) and the foreach norms (any device; on the
    CPU where numba is missing)."""
    if request.param == "torch":
        monkeypatch.setattr(nonfinite_step, "NUMBA_AVAILABLE", False)
    else:  # numba is a requirement: the kernel counts CPU tensors
        assert nonfinite_step._nonfinite_on_cpu([torch.zeros(1)]) == 0
    return request.param


@pytest.mark.parametrize("device", DEVICES)
def test_finite_values_whose_magnitudes_sum_past_fp32_are_finite(device, counted_by):
    huge = torch.full((8,), 3e38, device=device)  # each finite; their sum of magnitudes is inf in fp32
    big_half = torch.full((100_000,), 65504.0, device=device).half()  # sums past fp16's range, not fp32's
    values = [*_tensors(device), huge, big_half]
    assert all(bool(torch.isfinite(v).all()) for v in values)
    assert NonfiniteStepCheck._finite(values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_nonfinite_value_in_any_tensor_and_dtype_is_found(device, bad, counted_by):
    for index in range(8):
        values = _tensors(device)
        values[index].view(-1)[-1] = bad
        assert not bool(torch.isfinite(values[index]).all())
        assert not NonfiniteStepCheck._finite(values), (index, values[index].dtype)


def test_the_checked_loss_is_not_kept_alive(tmp_path):
    """The check needs the loss's value before the optimizer step, not the loss: the Recorder held the tensor (and
    through it the step's autograd graph) until the next record, past the loop's own last reference."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(model, store=tmp_path / "runs.db", optimizer=opt, check_optimizer_step=EVERY_STEP)
    loss = model(torch.randn(16, 4)).square().mean()
    loss.backward()
    rec.record(loss)
    recorded = weakref.ref(loss)
    del loss
    gc.collect()
    assert recorded() is None
    opt.step()  # the check runs on the value it kept (tests/analysis/test_optimizer_step_finding.py: it still finds)
    rec.close()
