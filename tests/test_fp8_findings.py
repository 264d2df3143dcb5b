"""FP8 findings on synthetic records: thresholds, the jump's step and ratio, and the fixes chosen."""

from __future__ import annotations

import numpy as np
import pandas as pd

from mpdiag.analysis.fp8_findings import LOST_SHARE, amax_jumps, fp8_findings, lost_values
from mpdiag.numerics.fp8_recipes import Fp8Settings
from mpdiag.recording.fp8_capture import RECORD_COLUMNS


def records(rows) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=list(RECORD_COLUMNS))


def row(step, module="fc", role="grad_output", recipe="delayed", amax=1.0, numel=1000, underflow=0, overflow=0,
        fmt=None):
    fmt = fmt or ("fp8_e5m2" if role == "grad_output" else "fp8_e4m3")
    return (step, module, role, fmt, recipe, 1.0, amax, numel, underflow, 0, overflow)


def test_lost_share_threshold_is_strict_and_any_overflow_counts():
    at_threshold = records([row(0, underflow=int(LOST_SHARE * 1000))])
    assert lost_values(at_threshold) == []
    above = lost_values(records([row(0, underflow=11), row(1, underflow=3)]))
    assert len(above) == 1 and "step 0" in above[0].evidence and "11 of 1,000" in above[0].evidence
    assert above[0].fix == {"opt_level": "fp8-sim", "fp8": True, "fp8_recipe": "current"}
    one_overflow = lost_values(records([row(3, role="input", overflow=1)]))
    assert len(one_overflow) == 1 and one_overflow[0].tensors == ["fc:input"]


def test_delayed_only_losses_recommend_current_scaling_and_losses_under_both_keep_the_layer_in_bf16():
    only_delayed = records([row(0, underflow=50), row(0, recipe="current", underflow=2)])
    found = lost_values(only_delayed)
    assert [f.fix for f in found] == [{"opt_level": "fp8-sim", "fp8": True, "fp8_recipe": "current"}]
    both = records([row(0, module="head", underflow=50), row(0, module="head", recipe="current", underflow=40)])
    fixes = [f.fix for f in lost_values(both)]
    assert fixes == [{"opt_level": "fp8-sim", "fp8": True, "fp8_recipe": recipe, "fp8_bf16_modules": "head"}
                     for recipe in ("delayed", "current")]


def test_amax_jump_step_ratio_and_the_margin_that_absorbs_it():
    amax = [1.0, 1.02, 0.9, 1.01, 8.0, 8.0, 1.0]  # E4M3 absorbs a rise up to 464 / 448 = 1.036
    recs = records([row(s, role="input", amax=a) for s, a in enumerate(amax)]
                   + [row(s, role="input", recipe="current", amax=a) for s, a in enumerate(amax)])
    (jump,) = amax_jumps(recs, Fp8Settings(history=3))
    assert "At 1 recorded step(s) (first 4)" in jump.evidence
    assert "7.843 times" in jump.evidence  # 8 / max(1.02, 0.9, 1.01); step 5's history holds the 8
    # 8 / 1.02 * 448 / 2^m must not exceed 464: m = 3
    assert "margin of 3" in jump.recommendation and jump.fix == {"opt_level": "fp8-sim", "fp8": True, "fp8_recipe": "current"}
    assert amax_jumps(recs, Fp8Settings(history=3, margin=3)) == []
    assert len(amax_jumps(recs, Fp8Settings(history=3, margin=2))) == 1
    assert amax_jumps(records([row(s, role="input", amax=a) for s, a in enumerate([1.0, 1.03, 1.0])]),
                      Fp8Settings()) == []


def test_e5m2_jump_uses_its_own_overflow_edge_and_nan_amax_is_not_a_jump():
    # E5M2: 61440 / 57344 = 1.0714: a rise of 1.07 stays, 1.08 overflows
    def jumps(second):
        return amax_jumps(records([row(0, amax=1.0), row(1, amax=second)]), Fp8Settings())

    assert jumps(1.07) == [] and len(jumps(1.08)) == 1
    assert jumps(np.nan) == [] and jumps(np.inf) == []


def test_fp8_findings_lists_both_rules():
    recs = records([row(0, role="input", amax=1.0), row(1, role="input", amax=100.0, overflow=20)])
    assert [f.rule for f in fp8_findings(recs, Fp8Settings())] == ["fp8-amax-jump", "fp8-lost-values"]
    assert fp8_findings(records([]), Fp8Settings()) == []
