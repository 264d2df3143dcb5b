"""FP8 findings on synthetic records: thresholds, the jump's step and ratio, and the fixes chosen; the amax-jump
records are counted here by torch's own casts at scales computed here."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import torch

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
    assert len(above) == 1 and "step 0" in above[0].evidence and "11 of 1,000 underflow (1.10 %)" in above[0].evidence
    assert above[0].evidence.startswith("1 of 2 recorded steps loses more than 1 % of the values")
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


E4M3_MAX, E4M3_OVERFLOW_ABOVE = 448.0, 464.0  # E4M3's cast saturates: past the midpoint to 480, a value overflows
E5M2_MAX = 57344.0
SPREAD = torch.tensor([1.0, -0.5, 0.25, 1e-3, -3e-9])  # times each step's amax: its largest value is the amax


def cast_rows(amaxes, role="input", history=1024, margin=0) -> pd.DataFrame:
    """Delayed-scaling records of one tensor, SPREAD * amax at each step, counted here: the scale is the format's
    largest over the largest amax of the ``history`` steps before (the step's own at step 0), in fp32, over
    2^margin; overflow is E4M3's saturation edge or E5M2's inf from torch's cast; underflow, torch's cast to 0."""
    e5m2 = role == "grad_output"
    fmt, top = ("fp8_e5m2", E5M2_MAX) if e5m2 else ("fp8_e4m3", E4M3_MAX)
    rows = []
    for step, amax in enumerate(amaxes):
        before = amaxes[max(0, step - history):step]
        reference = max(before) if before else amax
        scale = np.float32(top) / np.float32(reference) / np.float32(2.0**margin)
        y = (SPREAD * amax) * torch.tensor(scale)
        cast = y.to(torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn).float()
        overflow = int(torch.isinf(cast).sum()) if e5m2 else int((y.abs() > E4M3_OVERFLOW_ABOVE).sum())
        underflow = int((cast == 0).sum())
        rows.append((step, "fc", role, fmt, "delayed", float(scale), amax, len(SPREAD), underflow, 0, overflow))
    return records(rows)


def test_amax_jump_reports_the_largest_jump_first_and_the_small_rises_apart():
    """Two small rises to a new largest amax (one at step 1, while the history holds one step) overflow one
    value each; the jump the user sees is at step 6: the finding names it first, then the others."""
    amax = [1.0, 1.06, 1.0, 1.0, 1.0, 1.0, 50.0, 50.0, 52.0, 50.0]
    recs = cast_rows(amax)
    over = [s for s, n in zip(recs["step"], recs["overflow"], strict=True) if n]
    assert over == [1, 6, 8]  # 1.06 and 52 / 50 = 1.04 pass E4M3's 464 / 448 = 1.036 headroom; 50 / 1.06 does
    (jump,) = amax_jumps(recs, Fp8Settings())
    ratio = float(np.float32(50.0)) / float(np.float32(1.06))
    lost = int(recs.loc[6, "overflow"])
    assert lost == 3
    assert jump.evidence.startswith(f"Its amax jumps, worst at step 6: 50, {ratio:.4g} times the largest")
    assert f"and {lost} of {len(SPREAD)} values overflowed E4M3. In all, 3 of 10 recorded steps overflow" in jump.evidence
    assert "the other 2 (steps 1, 8) are small rises" in jump.evidence
    assert f"at most {max(1.06, 52 / 50):.4g} times the history's largest" in jump.evidence
    assert "losing 2 values in all" in jump.evidence and "step(s)" not in jump.evidence


def test_one_overflowing_step_is_singular():
    (jump,) = amax_jumps(cast_rows([1.0, 8.0, 8.0]), Fp8Settings())
    assert "worst at step 1: 8, 8 times" in jump.evidence
    assert "In all, 1 of 3 recorded steps overflows (the amax chart's ▲, the layer table's \"overflowing\" steps)." in jump.evidence
    assert "other" not in jump.evidence


def test_amax_jump_ratio_and_the_margin_that_absorbs_it_against_casting():
    amax = [1.0, 1.02, 0.9, 1.01, 8.0, 8.0, 1.0]
    recs = cast_rows(amax, history=3)
    (jump,) = amax_jumps(recs, Fp8Settings(history=3))
    assert "worst at step 4: 8, 7.843 times" in jump.evidence  # 8 / max(1.02, 0.9, 1.01); step 5's history holds 8
    assert "In all, 1 of 7 recorded steps overflows" in jump.evidence
    # the margin it recommends is the smallest under which torch's cast no longer overflows
    margin = int(re.search(r"a margin of (\d+)", jump.recommendation).group(1))
    assert margin == 3 and jump.fix == {"opt_level": "fp8-sim", "fp8": True, "fp8_recipe": "current"}
    assert cast_rows(amax, history=3, margin=margin)["overflow"].sum() == 0
    assert cast_rows(amax, history=3, margin=margin - 1)["overflow"].sum() > 0
    assert amax_jumps(cast_rows(amax, history=3, margin=margin), Fp8Settings(history=3, margin=margin)) == []
    assert amax_jumps(cast_rows([1.0, 1.03, 1.0]), Fp8Settings()) == []  # inside E4M3's headroom


def test_e5m2_jump_uses_its_own_overflow_edge_and_a_non_finite_amax_is_not_a_jump():
    # E5M2: 61440 / 57344 = 1.0714: a rise of 1.07 stays, 1.08 overflows (torch's cast gives inf)
    def jumps(second):
        return amax_jumps(cast_rows([1.0, second], role="grad_output"), Fp8Settings())

    assert jumps(1.07) == [] and len(jumps(1.08)) == 1
    assert amax_jumps(records([row(0, amax=1.0), row(1, amax=np.nan), row(2, amax=np.inf)]), Fp8Settings()) == []


def test_fp8_findings_lists_both_rules():
    recs = records([row(0, role="input", amax=1.0), row(1, role="input", amax=100.0, overflow=20)])
    assert [f.rule for f in fp8_findings(recs, Fp8Settings())] == ["fp8-amax-jump", "fp8-lost-values"]
    assert fp8_findings(records([]), Fp8Settings()) == []


def test_a_block_recipe_recorded_everywhere_under_the_threshold_is_offered_instead_of_bf16():
    """Both per-tensor recipes lose head's input; MXFP8, recorded beside them, holds every tensor: the fix is an
    fp8-sim rerun in MXFP8. Where MXFP8 clips one value anywhere (any module), NVFP4 is next; where neither holds,
    the layer stays in BF16, as before."""
    lost = [row(0, module="head", role="input", underflow=50), row(0, module="head", role="input", recipe="current",
                                                                    underflow=40)]
    holds = [row(0, module=m, role="input", recipe=r, fmt=f, underflow=3)
             for m in ("head", "body") for r, f in (("mxfp8", "fp8_e4m3"), ("nvfp4", "fp4_e2m1"))]
    found = fp8_findings(records(lost + holds), Fp8Settings(recipe="both", block_recipes=("mxfp8", "nvfp4")))
    assert [f.fix for f in found] == [{"opt_level": "fp8-sim", "fp8": True, "fp8_recipe": "mxfp8"}] * 2
    assert "block-scaled MXFP8" in found[0].recommendation
    clipped = holds + [row(1, module="body", role="input", recipe="mxfp8", fmt="fp8_e4m3", overflow=1)]
    assert {f.fix["fp8_recipe"] for f in fp8_findings(records(lost + clipped), Fp8Settings(recipe="both"))} == {"nvfp4"}
    neither = clipped + [row(1, module="body", role="input", recipe="nvfp4", fmt="fp4_e2m1", underflow=500)]
    assert [f.fix.get("fp8_bf16_modules") for f in fp8_findings(records(lost + neither), Fp8Settings(recipe="both"))] \
        == ["head", "head"]
