"""What a ``--trace-modules`` recording says (``Store.module_stats``): where the first inf/NaN appeared,
forward and backward, and each module's magnitudes over steps in the shape the Modules page charts.

The forward pass's first non-finite output is the module that overflowed (everything after it inherits the
inf/NaN); in the backward pass the first in backward order is where the gradient, at the loss scale, first
left the format's range."""

from __future__ import annotations

import numpy as np
import pandas as pd

from mpdiag.numerics.formats import FP16

#: the two passes a trace records, by column prefix: what the page calls them
PASSES = {"fwd": "forward output", "bwd": "gradient into the output (at the loss scale)"}


def module_said(name: str) -> str:
    """A module named in a sentence, as every finding names one: module '0' (a Sequential's children are named
    0, 1, ...: bare, such a name read as a number); a replay's stand-in, (inputs) or (loss), as it is."""
    return name if name.startswith("(") else f"module '{name}'"


def first_nonfinite_modules(modules: pd.DataFrame) -> dict[str, pd.Series]:
    """Per pass ("fwd", "bwd"), the row of the first module whose value was not finite: the earliest step,
    then the earliest in that pass's order. Passes where everything stayed finite are absent."""
    first = {}
    for prefix in PASSES:
        bad = modules[modules[f"{prefix}_finite"] == 0]
        if len(bad):
            step = int(bad["step"].min())
            first[prefix] = bad[bad["step"] == step].sort_values(f"{prefix}_order").iloc[0]
    return first


def first_nonfinite(modules: pd.DataFrame) -> str:
    """With --trace-modules: where the first inf/NaN appeared, forward and backward, as a sentence for a
    finding's evidence ('' without a trace or without a non-finite value)."""
    said = {"fwd": "non-finite activation was the output of",
            "bwd": "non-finite gradient in the backward pass (at the loss scale) flowed into the output of"}
    parts = [f"The first {said[prefix]} {module_said(row['module'])} ({row['type']}) at step {int(row['step'])}"
             + (" in the forward pass." if prefix == "fwd" else ".")
             for prefix, row in first_nonfinite_modules(modules).items()]
    return " " + " ".join(parts) if parts else ""


def module_order(modules: pd.DataFrame) -> list[str]:
    """Module names in forward order (the order of their first call at the first traced step)."""
    return list(dict.fromkeys(modules.sort_values(["step", "fwd_order"], kind="stable")["module"]))


def magnitude_cells(modules: pd.DataFrame) -> pd.DataFrame:
    """One row per traced step, module and pass: ``absmax`` as recorded, ``log2_absmax`` (NaN where it is zero
    or not finite), ``state`` ("finite", "above FP16's max" for a finite value past 65504 — FP32 modules can
    hold one — or "inf/NaN"), and ``first`` (the pass's first non-finite module, see
    :func:`first_nonfinite_modules`)."""
    first = first_nonfinite_modules(modules)
    parts = []
    for prefix, label in PASSES.items():
        rows = modules[modules[f"{prefix}_finite"].notna()]
        absmax = rows[f"{prefix}_absmax"].to_numpy(dtype=float)
        finite = rows[f"{prefix}_finite"].to_numpy() == 1
        with np.errstate(divide="ignore", invalid="ignore"):
            log2 = np.where(finite & (absmax > 0), np.log2(absmax), np.nan)
        state = np.where(~finite, "inf/NaN", np.where(absmax > FP16.max_finite, "above FP16's max", "finite"))
        hit = first.get(prefix)
        is_first = ((rows["step"] == hit["step"]) & (rows["module"] == hit["module"])).to_numpy() if hit is not None \
            else np.zeros(len(rows), dtype=bool)
        parts.append(pd.DataFrame({"step": rows["step"].to_numpy(), "module": rows["module"].to_numpy(),
                                   "type": rows["type"].to_numpy(), "pass": label, "absmax": absmax,
                                   "log2_absmax": log2, "state": state, "first": is_first}))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def module_table(modules: pd.DataFrame) -> pd.DataFrame:
    """Per module in forward order: type, the largest finite |output| and |gradient| seen (as text, 6
    significant digits; "no finite value" where every one was inf/NaN or none was traced), and the first step
    each went non-finite ("never" when it stayed finite)."""
    rows = []
    for name in module_order(modules):
        one = modules[modules["module"] == name]
        row = {"module": name, "type": one["type"].iloc[0]}
        for prefix, what in (("fwd", "output"), ("bwd", "gradient")):
            values = one[f"{prefix}_absmax"].to_numpy(dtype=float)
            finite = values[np.isfinite(values)]
            bad = one[one[f"{prefix}_finite"] == 0]["step"]
            row[f"largest |{what}|"] = f"{finite.max():,.6g}" if finite.size else "no finite value"
            row[f"{what} first inf/NaN at step"] = str(int(bad.min())) if len(bad) else "never"
        rows.append(row)
    return pd.DataFrame(rows)


def drawable_magnitudes(cells: pd.DataFrame, module: str) -> int:
    """How many of one module's traced values (``magnitude_cells``) a log axis can draw: finite and above 0."""
    one = cells[cells["module"] == module]
    return int((np.isfinite(one["absmax"]) & (one["absmax"] > 0)).sum())


def merge_steps(cells: pd.DataFrame, max_columns: int = 200) -> tuple[pd.DataFrame, int]:
    """``magnitude_cells`` with at most ``max_columns`` step columns, so a long trace stays a few thousand
    marks: consecutive steps are merged into columns of ``width`` steps (returned), each keeping its worst
    (the largest |value|, inf/NaN over finite, the first-non-finite mark if any step had it); ``step`` is
    the column's first step."""
    steps = np.sort(cells["step"].unique()) if len(cells) else np.array([], dtype=int)
    width = max(1, -(-len(steps) // max_columns))
    if width == 1:
        return cells, 1
    column = {int(s): int(steps[i - i % width]) for i, s in enumerate(steps)}
    worst = {"finite": 0, "above FP16's max": 1, "inf/NaN": 2}
    merged = cells.assign(step=cells["step"].map(column), rank=cells["state"].map(worst),
                          absmax=cells["absmax"].where(np.isfinite(cells["absmax"])))
    grouped = merged.groupby(["step", "module", "type", "pass"], sort=False).agg(
        absmax=("absmax", "max"), rank=("rank", "max"), first=("first", "any")).reset_index()
    grouped["state"] = grouped["rank"].map({v: k for k, v in worst.items()})
    with np.errstate(divide="ignore", invalid="ignore"):
        grouped["log2_absmax"] = np.where(grouped["absmax"] > 0, np.log2(grouped["absmax"]), np.nan)
    return grouped.drop(columns="rank"), width
