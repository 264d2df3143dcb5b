"""The format registry's typed-in limits against torch's own (torch.finfo is the ground truth)."""

import math

import pytest
import torch
from conftest import imports_torch

from mpdiag.numerics.formats import FP32, LOW_PRECISION, Format


@pytest.mark.parametrize("fmt", [FP32, *LOW_PRECISION.values()], ids=lambda f: f.name)
def test_registry_entry_equals_torch_finfo(fmt: Format):
    info = torch.finfo(fmt.dtype)
    assert fmt.dtype is getattr(torch, fmt.dtype_name)
    assert fmt.max_finite == float(info.max)
    assert fmt.min_normal == float(info.smallest_normal)
    assert fmt.min_subnormal == float(info.smallest_normal) * float(info.eps)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[info.bits // 8]
    assert fmt.min_subnormal == float(torch.tensor([1], dtype=bits).view(fmt.dtype).float()[0])  # the bit pattern 1
    assert 2.0**-fmt.mantissa_bits == float(info.eps)
    if fmt.overflow_above is not None:  # a saturating format: the midpoint to the step its bits cannot reach
        assert fmt.overflow_above == fmt.max_finite + 2.0 ** (fmt.max_exponent - fmt.mantissa_bits) / 2
        at, past = torch.tensor([fmt.overflow_above, math.nextafter(fmt.overflow_above, math.inf)]).to(fmt.dtype)
        assert float(at) == fmt.max_finite  # the tie rounds to the even max
        assert float(past) == fmt.max_finite or math.isnan(float(past))  # saturates (torch 2.13) or NaN (2.11)


def test_registry_imports_no_torch():
    # Loaded from its file: the module itself must not pull torch in (mpdiag/__init__ imports the Recorder).
    assert not imports_torch("import importlib.util as u, sys\n"
                             "s = u.spec_from_file_location('formats', 'mpdiag/numerics/formats.py')\n"
                             "f = sys.modules['formats'] = u.module_from_spec(s); s.loader.exec_module(f)\n"
                             "f.LOW_PRECISION['fp16'].max_exponent")
