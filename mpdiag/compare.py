"""Comparing a mixed-precision run with its FP32 reference: pure functions over Store DataFrames.

The reference of a run is its ``--pair`` twin when it has one, else the most recent finished O0 run of the
same script source (hash) and seed, which had identical initial weights and batches.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

#: Losses diverge at the first step where |loss - loss_ref| > DIVERGENCE_RTOL * |loss_ref|, or where exactly
#: one of the two is non-finite.
DIVERGENCE_RTOL = 0.05


def reference_run(runs: pd.DataFrame, run_id: int) -> int | None:
    """The FP32 (O0) run that ``run_id`` should be compared with, or None (see module docstring)."""
    by_id = runs.set_index("run_id")
    if run_id not in by_id.index:
        return None
    run = by_id.loc[run_id]
    if run["opt_level"] == "O0":
        return None
    pair = run["pair_run_id"]
    if pd.notna(pair) and int(pair) in by_id.index and by_id.loc[int(pair), "opt_level"] == "O0":
        return int(pair)
    candidates = runs[
        (runs["opt_level"] == "O0")
        & (runs["script_sha256"] == run["script_sha256"])
        & (runs["seed"] == run["seed"])
        & (runs["status"] == "finished")
    ]
    return int(candidates["run_id"].max()) if len(candidates) else None


def loss_comparison(reference_steps: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per common step: loss_ref, loss, diff (loss - loss_ref) and rel_diff (diff / |loss_ref|)."""
    merged = reference_steps[["step", "loss"]].merge(steps[["step", "loss"]], on="step", suffixes=("_ref", ""))
    merged["diff"] = merged["loss"] - merged["loss_ref"]
    with np.errstate(divide="ignore", invalid="ignore"):
        merged["rel_diff"] = merged["diff"] / merged["loss_ref"].abs()
    return merged


def first_divergence(comparison: pd.DataFrame, rtol: float = DIVERGENCE_RTOL) -> int | None:
    """First step where the losses differ by more than ``rtol`` relative, or only one is finite."""
    finite_ref = np.isfinite(comparison["loss_ref"])
    finite = np.isfinite(comparison["loss"])
    apart = (finite_ref != finite) | (finite_ref & finite & (comparison["diff"].abs() > rtol * comparison["loss_ref"].abs()))
    steps = comparison.loc[apart, "step"]
    return int(steps.iloc[0]) if len(steps) else None
