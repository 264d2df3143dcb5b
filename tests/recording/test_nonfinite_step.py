"""The optimizer-step check's one-pass finiteness test (mpdiag.recording.nonfinite_step) against
``torch.isfinite`` on each tensor: sums of magnitudes that overflow from finite values are no finding, and one
NaN or inf anywhere, in any dtype, is."""

import pytest
import torch
from conftest import DEVICES

from mpdiag.recording.nonfinite_step import NonfiniteStepCheck


def _tensors(device):
    g = torch.Generator().manual_seed(0)
    made = [torch.randn(n, generator=g) for n in (1, 7, 300, 4096)]
    made += [torch.randn(64, generator=g).half(), torch.randn(64, generator=g).bfloat16(), torch.tensor(2.5),
             torch.randn(5, generator=g).double()]
    return [t.to(device) for t in made]


@pytest.mark.parametrize("device", DEVICES)
def test_finite_values_whose_magnitudes_sum_past_fp32_are_finite(device):
    huge = torch.full((8,), 3e38, device=device)  # each finite; their sum of magnitudes is inf in fp32
    big_half = torch.full((100_000,), 65504.0, device=device).half()  # sums past fp16's range, not fp32's
    values = [*_tensors(device), huge, big_half]
    assert all(bool(torch.isfinite(v).all()) for v in values)
    assert NonfiniteStepCheck._finite(values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_nonfinite_value_in_any_tensor_and_dtype_is_found(device, bad):
    for index in range(8):
        values = _tensors(device)
        values[index].view(-1)[-1] = bad
        assert not bool(torch.isfinite(values[index]).all())
        assert not NonfiniteStepCheck._finite(values), (index, values[index].dtype)
