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


def reference_run(runs: pd.DataFrame, run_id: int, prefer: list[int] | None = None) -> int | None:
    """The FP32 (O0) run that ``run_id`` should be compared with, or None (see module docstring).

    Only finished O0 runs of the same script source and seed qualify; among them the ``--pair`` twin wins,
    then the newest of ``prefer`` (e.g. the runs a user selected), then the newest overall.
    """
    by_id = runs.set_index("run_id")
    if run_id not in by_id.index or by_id.loc[run_id, "opt_level"] == "O0":
        return None
    run = by_id.loc[run_id]
    candidates = runs[
        (runs["opt_level"] == "O0")
        & (runs["script_sha256"] == run["script_sha256"])
        & (runs["seed"] == run["seed"])
        & (runs["status"] == "finished")
    ]["run_id"].astype(int)
    if candidates.empty:
        return None
    if pd.notna(run["pair_run_id"]) and int(run["pair_run_id"]) in set(candidates):
        return int(run["pair_run_id"])
    preferred = [c for c in candidates if c in set(prefer or [])]
    return max(preferred) if preferred else int(candidates.max())


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


def default_selection(runs: pd.DataFrame) -> list[int]:
    """Runs to compare when the user chose none: the newest run with its FP32 reference; else with the newest
    other run of the same script; else the two newest runs. ``runs``: Store.runs (newest first)."""
    newest = runs.iloc[0]
    ref = reference_run(runs, int(newest["run_id"]))
    if ref is not None:
        return [int(newest["run_id"]), ref]
    same = runs[(runs["script_sha256"] == newest["script_sha256"]) & (runs["run_id"] != newest["run_id"])]
    if len(same):
        return [int(newest["run_id"]), int(same["run_id"].iloc[0])]
    return runs["run_id"].head(2).astype(int).tolist()


def cost_table(chosen: pd.DataFrame, labels: list[str]) -> pd.DataFrame:
    """What each chosen run cost, one row per run (``labels`` name them): median step time, throughput
    (batch size / median step time), peak memory, the bytes of model state (weights, gradients, master
    weights, optimizer state; the ``params`` count excluded), skipped steps and final loss."""
    return pd.DataFrame({
        "run": labels,
        "median step ms": (chosen["median_step_time_s"] * 1e3).round(2).to_numpy(),
        "samples/s": (chosen["batch_size"] / chosen["median_step_time_s"]).round(1).to_numpy(),
        "peak memory MB": (chosen["peak_mem_bytes"] / 2**20).round(1).to_numpy(),
        "model state MB": [round(sum(v for k, v in s.items() if k != "params") / 2**20, 3) if s else None
                           for s in chosen["model_state"]],
        "skipped steps": chosen["skipped_steps"].to_numpy(),
        "final loss": chosen["final_loss"].to_numpy(),
    })


#: run settings the Compare page lays side by side
CONFIG_FIELDS = ["opt_level", "scaling", "init_scale", "loss_scale", "growth_factor", "backoff_factor",
                 "growth_interval", "min_scale", "max_scale", "seed", "steps", "every", "device", "gpu_name",
                 "torch_version", "script_sha256", "batch_size", "params", "status"]


def config_table(chosen: pd.DataFrame, labels: list[str], only_differences: bool) -> pd.DataFrame:
    """Settings (rows, as text) by run (columns named by ``labels``); with ``only_differences`` only the
    settings on which the runs disagree."""
    config = chosen.set_index(pd.Index(labels))[CONFIG_FIELDS].T.astype(str)
    return config[config.nunique(axis=1) > 1] if only_differences else config
