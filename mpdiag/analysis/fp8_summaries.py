"""What the FP8 page shows, computed from a run's FP8 records (``Store.fp8``) and histograms
(``Store.fp8_histograms``): the lost share per layer and step, the per-layer table worst first, one tensor's
amax against what its recipe's scale lets through, the what-if of another recipe from the stored series, and the
block-scaled recipes' table (``Store.fp8_blocks``, ``Store.fp8_block_scales``).

Pure functions over DataFrames; the scale arithmetic and the bounds are :mod:`mpdiag.numerics.fp8_recipes`'
(the same code the capture and fp8-sim use), so a what-if with the recorded settings reproduces the recorded
scales bit for bit.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from mpdiag.numerics.formats import EXP_MIN, N_EXP_BINS
from mpdiag.numerics.fp8_recipes import FP8_FORMATS, Fp8Settings, recipe_scales, whatif_counts

#: a recorded step where more than this share of a tensor's values underflow, or any value overflows, is past
#: the fp8-lost-values finding's threshold (the finding and the layer table count such steps the same way)
LOST_SHARE = 0.01


def overflows(records: pd.DataFrame) -> pd.Series:
    """Which records (one tensor at one recorded step) overflow: the cast at that step's scale put at least one
    value past the format's largest. The one test of "a step that overflows": the amax-jump finding, the amax
    chart's markers and caption and the layer table's "overflowing" all count with it."""
    return records["overflow"] > 0


def loses_any(records: pd.DataFrame) -> pd.Series:
    """Which records lose any value (at least one underflows to 0 or overflows): the heatmap's coloured
    cells and the layer table's "losing"."""
    return (records["underflow"] + records["overflow"]) > 0


def past_threshold(records: pd.DataFrame) -> pd.Series:
    """Which records the fp8-lost-values finding counts: more than LOST_SHARE of the values underflow, or
    any value overflows (the layer table's "flagged" steps)."""
    share = records["underflow"] / records["numel"].where(records["numel"] > 0)
    return (share > LOST_SHARE) | overflows(records)


#: the layer table's columns, short enough that the table fits a 1,280 px window, and what each counts (the
#: page shows these as the columns' help); the step counts are the tests above, counted by :func:`step_counts`
TABLE_COLUMNS = {
    "layer": "The Linear module",
    "role": "input and weight are cast to E4M3; grad_output (the output gradient) to E5M2, or E4M3 if chosen",
    "recipe": "delayed: the scale from the amax history; current: from the tensor's own amax",
    "worst lost": "The largest share of the tensor's values lost (underflow + overflow) at one recorded step",
    "at step": "The recorded step of that worst share (blank where no recorded step lost a value)",
    "steps": "Recorded steps",
    "overflowing": "Recorded steps where at least one value overflows (the amax chart's markers; the amax-jump "
                      "finding's count)",
    "flagged": f"Recorded steps where more than {100 * LOST_SHARE:g} % of the values underflow or any value "
                     "overflows (the lost-values finding's count)",
    "losing": "Recorded steps where at least one value underflows or overflows (the heatmap's coloured "
                    "cells): includes steps losing a single value",
    "underflow": "Values that underflow to 0, summed over the recorded steps",
    "overflow": "Values that overflow, summed over the recorded steps",
    "subnormal": "Values that land in the format's subnormal range (fewer significant bits), summed over the "
                 "recorded steps",
}
#: what the layer table's two kinds of count are (said above it: the headers alone read as near-synonyms)
TABLE_CAPTION = ("One row per layer, role and recipe. \"steps\" to \"losing\" count recorded steps; \"underflow\", "
                 "\"overflow\" and \"subnormal\" count values, summed over all recorded steps (a finding quotes one "
                 "step's). Hover a header for its exact test.")
#: the step counts, each with the one test that defines it
STEP_TESTS = {"overflowing": overflows, "flagged": past_threshold, "losing": loses_any}


def step_counts(records: pd.DataFrame) -> pd.DataFrame:
    """Per layer, role and recipe (the index: module, role, recipe): "steps" (recorded steps) and the steps
    each of :data:`STEP_TESTS` counts. Every number of steps on the FP8 page comes from here."""
    tests = {name: test(records) for name, test in STEP_TESTS.items()} if len(records) else {}
    flags = records[["module", "role", "recipe", "step"]].assign(**tests)
    grouped = flags.groupby(["module", "role", "recipe"], sort=False)
    counts = grouped.agg(steps=("step", "nunique"), **{name: (name, "sum") for name in STEP_TESTS})
    return counts.astype(int)


def with_lost(records: pd.DataFrame) -> pd.DataFrame:
    """The records with ``lost`` (underflow + overflow: values the cast loses), ``lost_share`` (of numel)
    and ``losing`` (:func:`loses_any`)."""
    lost = records["underflow"] + records["overflow"]
    return records.assign(lost=lost, lost_share=lost / records["numel"].where(records["numel"] > 0),
                          losing=loses_any(records))


def lost_cells(records: pd.DataFrame, recipe: str, role: str, max_columns: int = 200) -> pd.DataFrame:
    """One row per layer and recorded step for ``recipe`` and ``role`` (the FP8 page's heatmap): module,
    step, lost, lost_share, losing, underflow, overflow, amax. Past ``max_columns`` recorded steps, consecutive
    steps share a column (``step`` its first): the worst share and amax, the summed counts, losing where any
    of them loses, so a single lost value still colours its column."""
    rows = with_lost(records[(records["recipe"] == recipe) & (records["role"] == role)])
    rows = rows[["module", "step", "lost", "lost_share", "losing", "underflow", "overflow", "amax"]]
    steps = np.sort(rows["step"].unique())
    if len(steps) <= max_columns:
        return rows.reset_index(drop=True)
    width = -(-len(steps) // max_columns)
    column = pd.Series(steps[np.arange(len(steps)) // width * width], index=steps)
    grouped = rows.assign(step=rows["step"].map(column)).groupby(["module", "step"], sort=False)
    return grouped.agg(lost=("lost", "sum"), lost_share=("lost_share", "max"), losing=("losing", "any"),
                       underflow=("underflow", "sum"), overflow=("overflow", "sum"), amax=("amax", "max")).reset_index()


def number(x: float) -> str:
    """A value for the FP8 page's text: 6 significant digits, thousands separators from 1,000 on (an exponent
    only past 1e15 or below 1e-4)."""
    x = float(x)
    if not np.isfinite(x) or abs(x) < 1e3 or abs(x) >= 1e15:
        return f"{x:.6g}"
    text = f"{x:,.{max(0, 5 - int(np.floor(np.log10(abs(x)))))}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def percent(share: float) -> str:
    """A share as a percentage: 2 decimals from 1 % (67.99 %), 2 significant digits below (0.012 %), so a
    non-zero share never reads 0.00 %; "0 %" for none."""
    pct = 100 * float(share)
    if not np.isfinite(pct):
        return "n/a"
    if pct == 0:
        return "0 %"
    return f"{pct:,.2f} %" if pct >= 1 else f"{pct:.2g} %"


def fmt_label(fmt_name: str) -> str:
    """``fp8_e4m3`` -> ``E4M3``."""
    return fmt_name.removeprefix("fp8_").upper()


def layer_table(records: pd.DataFrame) -> pd.DataFrame:
    """Per layer, role and recipe, the columns of :data:`TABLE_COLUMNS`: the worst recorded step's lost share,
    the step counts of :func:`step_counts` and the summed value counts; sorted worst first (largest worst
    share, then most overflow)."""
    if records.empty:
        return pd.DataFrame(columns=list(TABLE_COLUMNS))
    counts = step_counts(records)
    rows = with_lost(records)
    out = []
    for (module, role, recipe), one in rows.groupby(["module", "role", "recipe"], sort=False):
        worst = one.loc[one["lost_share"].fillna(0).idxmax()]
        out.append({"layer": module, "role": role, "recipe": recipe,
                    "worst lost": float(worst["lost_share"]),
                    # a row that loses nothing has no worst step: blank, not its first step
                    "at step": f"{int(worst['step']):,}" if worst["lost_share"] > 0 else "",
                    **counts.loc[(module, role, recipe)].to_dict(),
                    "underflow": int(one["underflow"].sum()), "overflow": int(one["overflow"].sum()),
                    "subnormal": int(one["subnormal"].sum())})
    table = pd.DataFrame(out, columns=list(TABLE_COLUMNS))
    return table.sort_values(["worst lost", "overflow"], ascending=False, kind="stable").reset_index(drop=True)


def overflow_limit(scale: np.ndarray, fmt_name: str) -> np.ndarray:
    """The largest |x| a tensor scaled by ``scale`` can hold in ``fmt_name`` without overflowing (the format's
    overflow threshold divided by the scale): what the recipe's scale lets through."""
    return FP8_FORMATS[fmt_name].overflow_threshold / np.asarray(scale, dtype=np.float64)


def amax_series(records: pd.DataFrame, module: str, role: str, recipe: str) -> pd.DataFrame:
    """One tensor's recorded steps under ``recipe``: step, amax, scale, limit (:func:`overflow_limit`),
    underflow, overflow, and ``overflows`` (:func:`overflows`: the chart's markers and its caption's count)."""
    one = records[(records["module"] == module) & (records["role"] == role) & (records["recipe"] == recipe)]
    one = one.sort_values("step")
    limit = overflow_limit(one["scale"].to_numpy(), one["fmt"].iloc[0]) if len(one) else np.array([])
    return one[["step", "amax", "scale", "underflow", "overflow"]].assign(
        limit=limit, overflows=overflows(one)).reset_index(drop=True)


def histogram_rows(histograms: pd.DataFrame, module: str, role: str, steps: np.ndarray) -> np.ndarray:
    """One tensor's stored exponent histograms as a (len(steps), N_EXP_BINS) matrix in ``steps`` order."""
    one = histograms[(histograms["module"] == module) & (histograms["role"] == role)]
    position = {int(s): i for i, s in enumerate(steps)}
    out = np.zeros((len(steps), N_EXP_BINS), dtype=np.int64)
    rows = one["step"].map(position)
    keep = rows.notna().to_numpy()
    out[rows[keep].astype(int).to_numpy(), (one["exponent"].to_numpy()[keep] - EXP_MIN)] = one["count"].to_numpy()[keep]
    return out


def whatif(records: pd.DataFrame, histograms: pd.DataFrame, module: str, role: str, recipe: str,
           settings: Fp8Settings) -> pd.DataFrame:
    """What ``recipe`` under ``settings`` (history, margin, pow2, and the output gradients' format) would
    have done to one tensor at each recorded step, from its stored amax series and histograms alone: step,
    amax, scale, and lower / upper bounds of the underflow, subnormal and overflow counts (equal where the
    histogram decides them). The delayed history runs over the recorded steps, as the capture's does."""
    series = records[(records["module"] == module) & (records["role"] == role)].drop_duplicates("step")
    series = series.sort_values("step")
    fmt = settings.role_format(role)
    amax = series["amax"].to_numpy(np.float32)
    scales = recipe_scales(amax, recipe, fmt, settings)
    hists = histogram_rows(histograms, module, role, series["step"].to_numpy())
    rows = []
    for step, a, scale, hist in zip(series["step"], amax, scales, hists, strict=True):
        bounds = whatif_counts(hist, EXP_MIN, float(scale), fmt, float(a))
        rows.append({"step": int(step), "amax": float(a), "scale": float(scale),
                     **{f"{name} {side}": bounds[name][i] for name in bounds for i, side in enumerate(("low", "high"))}})
    return pd.DataFrame(rows, columns=["step", "amax", "scale", *(f"{n} {s}" for n in ("underflow", "subnormal",
                                                                                      "overflow")
                                                                   for s in ("low", "high"))])


def recorded_counts(records: pd.DataFrame, module: str, role: str, recipe: str, settings: Fp8Settings,
                    recorded: Fp8Settings) -> int | None:
    """The exact recorded number of values lost (underflow + overflow) by one tensor over the recorded steps
    when the what-if's ``settings`` are the ones it was recorded with (and ``recipe`` was recorded), else None."""
    same = (settings.history, settings.margin, settings.pow2, settings.role_format(role)) == \
        (recorded.history, recorded.margin, recorded.pow2, recorded.role_format(role))
    rows = records[(records["module"] == module) & (records["role"] == role) & (records["recipe"] == recipe)]
    if not same or rows.empty:
        return None
    return int((rows["underflow"] + rows["overflow"]).sum())


#: the block-scaled recipes' table: per layer, role and recipe (mxfp8, nvfp4) over the recorded steps
BLOCK_TABLE_COLUMNS = {
    "layer": "The Linear module",
    "role": "input, weight or grad_output, each in blocks along its last dimension",
    "recipe": "mxfp8: E4M3 elements, blocks of 32, a power-of-two (E8M0) scale per block; nvfp4: E2M1 elements, "
              "blocks of 16, an E4M3 scale per block and an fp32 scale per tensor",
    "steps": "Recorded steps",
    "worst underflow": "The largest share of the tensor's values that underflow to 0 at one recorded step",
    "worst subnormal": "The largest share of the tensor's values that land subnormal at one recorded step",
    "clipped": "Values clipped to the element format's largest, summed over the recorded steps",
    "worst clipped blocks": "The largest share of blocks holding a clipped value at one recorded step",
    "worst wide blocks": "The largest share of blocks whose largest over smallest non-zero |x| exceeds the element "
                         "format's range (E4M3 448 / 2^-9, E2M1 6 / 0.5) at one recorded step",
    "block scales": "The binades of the blocks' scales over the recorded steps (blocks with a non-zero value)",
}


def block_table(records: pd.DataFrame, blocks: pd.DataFrame, scales: pd.DataFrame) -> pd.DataFrame:
    """Per layer, role and block recipe, the columns of :data:`BLOCK_TABLE_COLUMNS`, worst underflow first;
    ``records`` are Store.fp8's rows of the block recipes, ``blocks`` and ``scales`` Store.fp8_blocks' and
    Store.fp8_block_scales'."""
    if records.empty or blocks.empty:
        return pd.DataFrame(columns=list(BLOCK_TABLE_COLUMNS))
    keys = ["step", "module", "role", "recipe"]
    rows = records.merge(blocks, on=keys)
    numel = rows["numel"].where(rows["numel"] > 0)
    n_blocks = rows["blocks"].where(rows["blocks"] > 0)
    rows = rows.assign(u=rows["underflow"] / numel, s=rows["subnormal"] / numel,
                       c=rows["clipped_blocks"] / n_blocks, w=rows["wide_blocks"] / n_blocks)
    table = rows.groupby(["module", "role", "recipe"], sort=False).agg(
        steps=("step", "nunique"), u=("u", "max"), s=("s", "max"), clipped=("overflow", "sum"), c=("c", "max"),
        w=("w", "max")).reset_index()
    span = scales.groupby(["module", "role", "recipe"])["exponent"].agg(["min", "max"]) if len(scales) else None
    table["block scales"] = [
        f"2^{int(span.loc[k, 'min'])} to 2^{int(span.loc[k, 'max'])}" if span is not None and k in span.index else ""
        for k in zip(table["module"], table["role"], table["recipe"], strict=True)]
    table = table.rename(columns={"module": "layer", "u": "worst underflow", "s": "worst subnormal",
                                  "c": "worst clipped blocks", "w": "worst wide blocks"})
    return table.sort_values("worst underflow", ascending=False, kind="stable")[list(BLOCK_TABLE_COLUMNS)]

