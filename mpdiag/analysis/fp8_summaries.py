"""What the FP8 page shows, computed from a run's FP8 records (``Store.fp8``) and histograms
(``Store.fp8_histograms``): the lost share per layer and step, the per-layer table worst first, one tensor's
amax against what its recipe's scale lets through, and the what-if of another recipe from the stored series.

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


def past_threshold(records: pd.DataFrame) -> pd.Series:
    """Which records (one tensor at one recorded step) the fp8-lost-values finding counts: more than
    LOST_SHARE of the values underflow, or any value overflows."""
    share = records["underflow"] / records["numel"].where(records["numel"] > 0)
    return (share > LOST_SHARE) | (records["overflow"] > 0)


def with_lost(records: pd.DataFrame) -> pd.DataFrame:
    """The records with ``lost`` (underflow + overflow: values the cast loses) and ``lost_share`` (of numel)."""
    lost = records["underflow"] + records["overflow"]
    return records.assign(lost=lost, lost_share=lost / records["numel"].where(records["numel"] > 0))


def lost_cells(records: pd.DataFrame, recipe: str, role: str, max_columns: int = 200) -> pd.DataFrame:
    """One row per layer and recorded step for ``recipe`` and ``role`` (the FP8 page's heatmap): module,
    step, lost, lost_share, underflow, overflow, amax. Past ``max_columns`` recorded steps, consecutive
    steps share a column (``step`` its first): the worst share and amax, the summed counts, so a single lost
    value still colours its column."""
    rows = with_lost(records[(records["recipe"] == recipe) & (records["role"] == role)])
    rows = rows[["module", "step", "lost", "lost_share", "underflow", "overflow", "amax"]]
    steps = np.sort(rows["step"].unique())
    if len(steps) <= max_columns:
        return rows.reset_index(drop=True)
    width = -(-len(steps) // max_columns)
    column = pd.Series(steps[np.arange(len(steps)) // width * width], index=steps)
    grouped = rows.assign(step=rows["step"].map(column)).groupby(["module", "step"], sort=False)
    return grouped.agg(lost=("lost", "sum"), lost_share=("lost_share", "max"), underflow=("underflow", "sum"),
                       overflow=("overflow", "sum"), amax=("amax", "max")).reset_index()


def layer_table(records: pd.DataFrame) -> pd.DataFrame:
    """Per layer, role and recipe: the worst recorded step's lost share and counts, the recorded steps, those
    that lost any value and those past the fp8-lost-values finding's threshold (:func:`past_threshold`, the
    count the finding states), and the totals; sorted worst first (largest worst share, then most overflow)."""
    if records.empty:
        return pd.DataFrame(columns=["module", "role", "recipe", "fmt", "worst lost share", "worst step",
                                     "recorded steps", "steps losing any value", "steps the finding counts",
                                     "underflow", "overflow", "subnormal"])
    rows = with_lost(records).assign(past=past_threshold(records))
    out = []
    for (module, role, recipe), one in rows.groupby(["module", "role", "recipe"], sort=False):
        worst = one.loc[one["lost_share"].fillna(0).idxmax()]
        out.append({"module": module, "role": role, "recipe": recipe, "fmt": one["fmt"].iloc[0],
                    "worst lost share": float(worst["lost_share"]), "worst step": int(worst["step"]),
                    "recorded steps": int(one["step"].nunique()), "steps losing any value": int((one["lost"] > 0).sum()),
                    "steps the finding counts": int(one["past"].sum()), "underflow": int(one["underflow"].sum()),
                    "overflow": int(one["overflow"].sum()), "subnormal": int(one["subnormal"].sum())})
    table = pd.DataFrame(out)
    return table.sort_values(["worst lost share", "overflow"], ascending=False, kind="stable").reset_index(drop=True)


def overflow_limit(scale: np.ndarray, fmt_name: str) -> np.ndarray:
    """The largest |x| a tensor scaled by ``scale`` can hold in ``fmt_name`` without overflowing (the format's
    overflow threshold divided by the scale): what the recipe's scale lets through."""
    return FP8_FORMATS[fmt_name].overflow_threshold / np.asarray(scale, dtype=np.float64)


def amax_series(records: pd.DataFrame, module: str, role: str, recipe: str) -> pd.DataFrame:
    """One tensor's recorded steps under ``recipe``: step, amax, scale, limit (:func:`overflow_limit`),
    underflow, overflow."""
    one = records[(records["module"] == module) & (records["role"] == role) & (records["recipe"] == recipe)]
    one = one.sort_values("step")
    limit = overflow_limit(one["scale"].to_numpy(), one["fmt"].iloc[0]) if len(one) else np.array([])
    return one[["step", "amax", "scale", "underflow", "overflow"]].assign(limit=limit).reset_index(drop=True)


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
