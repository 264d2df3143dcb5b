"""Pure data shaping between the Store and the charts: aggregation, shares, what-if scaling, event counts.

Everything here takes and returns pandas / numpy objects and never touches SQLite or Streamlit.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from mpdiag.analysis.run_choice import script_names
from mpdiag.numerics.formats import EXP_MIN, FP16, LOW_PRECISION, Format
from mpdiag.options import scale_text
from mpdiag.recording.retention import AFTER, BEFORE, DENSE_START_STEPS, EVERY, START, THIN_EVERY

#: Largest number of marks one chart sends to the browser.
MAX_MARKS = 20_000


def nonzero_finite(df: pd.DataFrame) -> pd.Series:
    """Count of finite non-zero values per row of a tensor_stats-like frame (the share denominator)."""
    return df["numel"] - df["zeros"] - df["nan"] - df["posinf"] - df["neginf"]


def recorded_formats(totals: pd.DataFrame) -> list[str]:
    """The registry formats a run has representability counts for: all of them, except for a run recorded
    before a format joined the registry (its counts read NaN; FP8 joined in schema version 5)."""
    return [fmt for fmt in LOW_PRECISION if f"{fmt}_underflow" in totals and totals[f"{fmt}_underflow"].notna().all()]


def tensor_ranking(totals: pd.DataFrame, fmt: str = "fp16", at_scale: bool = False) -> pd.DataFrame:
    """Tensors ranked by ``fmt`` underflow share, then overflow share (worst first).

    ``totals``: one row per tensor with summed counts (``Store.tensor_totals``). Shares are exact counts
    divided by the finite non-zero values; NaN when a tensor had none.
    """
    suffix = "_at_scale" if at_scale else ""
    denom = nonzero_finite(totals).astype(float).replace(0, np.nan)
    out = pd.DataFrame(
        {
            "tensor": totals["tensor"],
            "numel": totals["numel_per_step"],
            "underflow_share": totals[f"{fmt}_underflow{suffix}"] / denom,
            "subnormal_share": totals[f"{fmt}_subnormal{suffix}"] / denom,
            "overflow_share": totals[f"{fmt}_overflow{suffix}"] / denom,
            "nonfinite": totals["nan"] + totals["posinf"] + totals["neginf"],
            "zero_share": totals["zeros"] / totals["numel"],
        }
    )
    return out.sort_values(["underflow_share", "overflow_share"], ascending=False, na_position="last").reset_index(drop=True)


def whatif_shares(hist: np.ndarray, log2_scale: int, fmt: Format = FP16) -> dict[str, tuple[float, float]]:
    """Bounds on the share of finite non-zero values that would underflow / be subnormal / overflow in
    ``fmt`` if the unscaled gradient were multiplied by 2**log2_scale.

    ``hist``: exponent histogram of the unscaled gradient (bins EXP_MIN..). Multiplying by 2**k moves bin e
    to bin e + k exactly, but the three bins that contain a rounding edge (|x| = 2**-25 ties to zero, the top
    of the 2**-15 bin rounds up to normal, |x| >= 65520 overflows, for FP16) hold values on both sides of it,
    so each share is returned as (lower, upper). The exact counts at the scale actually used are recorded.
    """
    hist = np.asarray(hist, dtype=np.int64)
    total = hist.sum()
    if total == 0:
        return {k: (math.nan, math.nan) for k in ("underflow", "subnormal", "overflow")}
    exponents = np.arange(hist.size) + EXP_MIN + int(log2_scale)
    tie_bin = fmt.min_subnormal_exponent - 1  # holds |x| == 2**-25, which becomes 0
    below_normal = fmt.min_normal_exponent - 1  # its top values round up to min normal
    top_bin = fmt.max_exponent  # its top values round up to inf

    def share(mask) -> float:
        return float(hist[mask].sum() / total)

    return {
        "underflow": (share(exponents < tie_bin), share(exponents <= tie_bin)),
        "subnormal": (share((exponents > tie_bin) & (exponents < below_normal)),
                      share((exponents >= tie_bin) & (exponents <= below_normal))),
        "overflow": (share(exponents > top_bin), share(exponents >= top_bin)),
    }


#: the what-if scale control always spans at least 2^-WHATIF_SPAN .. 2^WHATIF_SPAN, wider when the run used more
WHATIF_SPAN = 40


def log2_exponent(scale: float) -> int | None:
    """The nearest integer power of two to a loss scale, or None when the scale is zero, negative or not finite."""
    return round(math.log2(scale)) if math.isfinite(scale) and scale > 0 else None


def whatif_exponents(steps: pd.DataFrame) -> list[int]:
    """The powers of two the what-if control offers: -WHATIF_SPAN..WHATIF_SPAN, widened to every scale the run
    used (``steps``: Store.steps), so the scale of any recorded step is always one of them."""
    # each scale once: a long run has 100k steps and a handful of scales
    used = [k for k in map(log2_exponent, steps["loss_scale"].astype(float).unique()) if k is not None] \
        if len(steps) else []
    return list(range(min([-WHATIF_SPAN, *used]), max([WHATIF_SPAN, *used]) + 1))


#: the opt levels whose gradients are computed in FP16, so values too small for it are already exact zeros when
#: recorded (shared with the gradient-underflow finding)
FP16_LEVELS = ("O1", "O2", "O3", "fp8-sim-fp16", "custom-fp16")
#: the scaling modes that mean a loss scale is in use (Store.runs' ``scaling``)
LOSS_SCALED = ("dynamic", "static")
FLUSHED_LABEL = "flushed to zero before recording (underflow)"


def judged_level(run: pd.Series) -> str:
    """The opt level a run's gradients are judged at: its own, except that the script's own settings ("custom":
    ``watch``, the framework callbacks, an upload) with a loss scale in use, or with FP16 gradients (a model the
    script cast to half: ``fp16_gradients``, Store.runs), read as "custom-fp16", one of FP16_LEVELS: a loss scale
    serves FP16's narrow range alone, so its backward ran in FP16 and flushed what FP16 cannot hold. (Judged as
    "custom", a watched FP16 script read healthy where the same loop at --opt-level O1 had 99.8 % of its
    gradients subnormal and the gradient-underflow warning; a half model's 25 % subnormal gradients, the same.)
    A custom run under FP16 autocast without a loss scaler (FP32 gradients) is not told apart from an FP32 one."""
    if run["opt_level"] == "custom" and (run.get("scaling") in LOSS_SCALED or run.get("fp16_gradients") in (True,)):
        return "custom-fp16"
    return str(run["opt_level"])


def run_label(run: pd.Series) -> str:
    """``#id · name · level`` as plain text (for tables, st.text and code); pass it through ``plain`` for Markdown."""
    return f"#{run['run_id']} · {run['name']} · {run['opt_level']}"


def flushed_to_zero(totals: pd.DataFrame, twin_totals: pd.DataFrame) -> pd.Series:
    """Per tensor (index), the share of all its values that FP16 flushed to zero before they were recorded,
    estimated as max(0, its zero share - the zero share of the same tensor in the FP32 twin) over the logged
    steps: an underflowed value is an exact zero in the record, so the exact counts cannot see it, but the twin
    (same weights and batches, no FP16) shows which zeros are genuine. NaN for a tensor the twin lacks.
    ``totals``/``twin_totals``: Store.tensor_totals of the FP16 run and of its FP32 twin."""
    mine = totals.set_index("tensor")
    twin = twin_totals.set_index("tensor").reindex(mine.index)
    return (mine["zeros"] / mine["numel"] - twin["zeros"] / twin["numel"]).clip(lower=0)


def overall_flushed(totals: pd.DataFrame, flushed: pd.Series) -> float:
    """The share of all gradient values of the run flushed to zero before recording (``flushed``: per tensor,
    :func:`flushed_to_zero`), each tensor weighted by its number of values."""
    numel = totals.set_index("tensor")["numel"]
    known = flushed.dropna().index
    return float((flushed[known] * numel[known]).sum() / numel[known].sum()) if len(known) else math.nan


def flushed_text(share: float | None, shadow_steps: int = 0, recorded_by: str = "run",
                 parted_at: int | None = None) -> str:
    """The flushed share (:func:`flushed_to_zero`) as it is stated wherever an FP16 underflow share is, or, with
    no FP32 twin (``share`` None), why it cannot be known and how to record a run where it can, as the run was
    recorded (``recorded_by``, options.recorded_by: --pair is ``mpdiag run``'s; watch records no twin; a Recorder
    records what its loop trains); or, where the twin's loss parted from the run's at step ``parted_at``
    (compare.twin_parted_at), why it was not estimated."""
    if share is not None and not math.isnan(share):
        return f"{share:.2%} of all values {FLUSHED_LABEL}, estimated against the FP32 twin."
    if share is not None:
        return f"Share {FLUSHED_LABEL}: unknown (the FP32 twin did not record this tensor)."
    if parted_at is not None:
        return (f"Share {FLUSHED_LABEL}: not estimated: the FP32 twin's loss parts from this run's at step "
                f"{parted_at:,}, and from there their weights differ, so its zeros no longer show which of this "
                "run's FP16 flushed.")
    shadow = (" The FP32 shadow of this run stores only norms and errors per tensor, so it cannot count them."
              if shadow_steps else "")
    how = {"watch": "watch records no FP32 twin; an O0 rerun of the same command shows the loss FP32 reaches",
           "recorder": "record the same loop in FP32 (no autocast, the same seed and batches) beside it, and compare "
                       "the two runs' zero shares on the Compare page"}.get(
        recorded_by, "record it with --pair (an FP32 twin from the same weights and batches)")
    return (f"Share {FLUSHED_LABEL}: cannot be known from this run (those values are recorded as exact zeros); "
            f"{how}.{shadow}")


def gradient_ranking(totals: pd.DataFrame, fmt: str, at_scale: bool, flushed_by_fp16: bool,
                     twin_totals: pd.DataFrame | None) -> tuple[pd.DataFrame, str]:
    """The Gradients page's ranking of tensors (worst first) and a sentence saying what it ranks by.

    The recorded ``fmt`` underflow share (:func:`tensor_ranking`) sees only the values the record still holds: an
    FP16 run (``flushed_by_fp16``: its gradients were computed in FP16 and the format is fp16) has already
    flushed the values that underflowed to exact zeros, so every tensor can read 0% and nothing ranks. Such a run
    is ranked by the share of its values flushed to zero against its FP32 twin (``twin_totals``, Store.tensor_totals
    of the twin: :func:`flushed_to_zero`, the zeros beyond the twin's), then by the recorded underflow and overflow;
    without a twin by its zero share (flushed and genuine zeros together: the record cannot tell them apart).
    Adds a column ``flushed_share`` (NaN where not known)."""
    ranking = tensor_ranking(totals, fmt, at_scale)
    if twin_totals is not None:
        flushed = flushed_to_zero(totals, twin_totals)
        ranking["flushed_share"] = ranking["tensor"].map(flushed).astype(float)
    else:
        ranking["flushed_share"] = np.nan
    recorded = f"{fmt} underflow, then overflow, of the recorded finite non-zero values"
    if not flushed_by_fp16:
        return ranking, f"Ranked by {recorded}."
    if twin_totals is not None:
        keys, said = ["flushed_share", "underflow_share", "overflow_share"], (
            "Ranked by the share of all values flushed to zero before recording, estimated against the FP32 twin "
            f"(the zeros beyond the twin's: values non-zero in FP32 that FP16 lost), then by {recorded}: the "
            "values FP16 flushed are exact zeros in this record, so its own underflow share cannot see them.")
    else:
        # the zeros (FP16's flushed values among them) and the values FP16 keeps only as subnormals or loses, of all
        # values: ranked by zeros alone, a tensor with 0.04 % zeros came first, one with 9.6 % subnormal far below
        suffix = "_at_scale" if at_scale else ""
        low = (totals[f"{fmt}_underflow{suffix}"] + totals[f"{fmt}_subnormal{suffix}"] + totals["zeros"]) / \
            totals["numel"].replace(0, np.nan)
        ranking["zero_or_low_share"] = ranking["tensor"].map(dict(zip(totals["tensor"], low, strict=True)))
        keys, said = ["zero_or_low_share", "overflow_share"], (
            f"Ranked by the share of values recorded as exact zeros or as {fmt} subnormals or underflow, then by "
            f"{fmt} overflow: the values FP16 flushed are exact zeros in this record, so its underflow share cannot "
            "see them, and without an FP32 twin whose loss tracks this run's the zeros FP16 made cannot be told from "
            "genuine ones.")
    ranking = ranking.sort_values(keys, ascending=False, na_position="last", kind="stable").reset_index(drop=True)
    return ranking, said


def blank_steps(index: pd.DataFrame, counts: np.ndarray, steps: pd.DataFrame, stats: pd.DataFrame | None = None,
                at_scale: bool = False) -> pd.DataFrame:
    """The logged steps at which one tensor has nothing to place on the gradient heatmap's exponent axis, and
    why: columns step, reason ("all zero", "all NaN or inf", "zero, NaN or inf", "loss scale 0" in the S·g view,
    where the scale was 0 or not finite) and skipped (GradScaler skipped that step's update). ``index``/``counts``:
    the tensor's Store.histogram_matrix; ``steps``: Store.steps; ``stats``: its Store.tensor_stats over steps
    (zeros, nan, posinf, neginf, numel per step), to tell all-zero from non-finite (without it the reason is
    "zero, NaN or inf")."""
    empty = pd.DataFrame({"step": pd.Series(dtype=int), "reason": pd.Series(dtype=str),
                          "skipped": pd.Series(dtype=bool)})
    if len(index) == 0:
        return empty
    step_values = index["step"].to_numpy()
    none = np.asarray(counts).sum(axis=1) == 0
    by_step = steps.set_index("step") if len(steps) else None
    reason = np.where(none, "zero, NaN or inf", "")
    if stats is not None and len(stats):
        s = stats.set_index("step").reindex(step_values)
        nonfinite = (s["nan"] + s["posinf"] + s["neginf"]).to_numpy()
        zeros, numel = s["zeros"].to_numpy(), s["numel"].to_numpy()
        reason = np.where(none & (zeros == numel), "all zero", reason)
        reason = np.where(none & (nonfinite == numel), "all NaN or inf", reason)
    if at_scale and by_step is not None:
        scale = by_step["loss_scale"].reindex(step_values).astype(float).to_numpy()
        bad = ~np.isfinite(scale) | (scale == 0)
        reason = np.where(bad & ~none, "loss scale 0", reason)
        none = none | bad
    skipped = (by_step["skipped"].reindex(step_values).fillna(0).to_numpy() == 1 if by_step is not None
               and "skipped" in by_step else np.zeros(len(step_values), dtype=bool))
    return pd.DataFrame({"step": step_values[none].astype(int), "reason": reason[none],
                         "skipped": skipped[none].astype(bool)})


def _step_list(values, most: int = 8) -> str:
    """Steps as "3, 5-7 and 9" (runs of consecutive steps joined), the first ``most`` runs then "and N more"."""
    values = sorted(int(v) for v in values)
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    words = [f"{a:,}" if a == b else f"{a:,}–{b:,}" for a, b in runs]
    if len(words) > most:
        return ", ".join(words[:most]) + f" and {len(runs) - most:,} more runs of steps"
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def blank_steps_text(blank: pd.DataFrame, logged: int) -> str:
    """The sentence under the gradient heatmap naming its blank columns (:func:`blank_steps`) and why they are
    blank; "" when there are none. ``logged``: the number of logged steps."""
    if blank.empty:
        return ""
    what = {"all zero": "the gradient was all zero", "all NaN or inf": "every value was NaN or inf",
            "zero, NaN or inf": "every value was 0, NaN or inf",
            "loss scale 0": "the loss scale was 0 (S·g holds no finite non-zero value)"}
    parts = []
    for reason, group in blank.groupby("reason", sort=False):
        skipped = group.loc[group["skipped"], "step"]
        note = ("" if skipped.empty else " (all skipped steps: GradScaler skipped their update)"
                if len(skipped) == len(group) else f" (skipped steps among them: {_step_list(skipped)})")
        parts.append(f"{what[reason]} at step{'s' if len(group) > 1 else ''} {_step_list(group['step'])}{note}")
    return (f"Blank columns ({len(blank):,} of {logged:,} logged steps): nothing to place on the exponent axis, "
            + "; ".join(parts) + ".")


def kept_steps_text(kept: pd.DataFrame, every) -> str | None:
    """The sentence under the gradient heatmap saying why its columns have gaps: statistics stored every ``every``
    steps (the run's --every; None: the default retention, every step to DENSE_START_STEPS, then every THIN_EVERY)
    and, named with their reasons, the steps kept for an anomaly (``kept``: Store.kept_steps;
    mpdiag.recording.retention); None when every step was stored."""
    if (every is None or pd.isna(every)) and (kept["reason"] == START).any():
        if kept["step"].max() < DENSE_START_STEPS:
            return None  # a run short enough to be kept whole
        text = (f"Statistics are stored at every step up to step {DENSE_START_STEPS - 1:,}, then every "
                f"{THIN_EVERY:,} steps; the columns between them are not stored")
    elif every is None or pd.isna(every) or int(every) <= 1:
        return None
    else:
        text = f"Statistics are stored every {int(every):,} steps; the columns between them are not stored"
    anomalies = kept[~kept["reason"].isin((START, EVERY, BEFORE, AFTER))]
    if anomalies.empty:
        return text + "."
    around = kept.loc[kept["reason"].isin((BEFORE, AFTER)), "step"].nunique()
    parts = [f"{reason} at step{'s' if len(group) > 1 else ''} {_step_list(group['step'])}"
             for reason, group in anomalies.groupby("reason", sort=False)]
    return (text + ", except where something happened: " + "; ".join(parts)
            + (f", and {around:,} step{'s' if around > 1 else ''} next to them" if around else "") + ".")


def histogram_grid(index: pd.DataFrame, counts: np.ndarray, order: list[str], fmt: str = "fp16",
                   log2_scale: float = 0.0, limit: int | None = None) -> tuple[pd.DataFrame, list[str], list[str]]:
    """Every tensor's exponent histogram at one step, for small multiples: (bars, drawn, empty).

    ``index``/``counts``: Store.histogram_matrix at one step (one row per tensor); ``order``: the tensors worst
    first (the page's ranking); ``log2_scale``: the shift of the view (0 for g, log2 of the step's loss scale for
    S·g); ``limit``: draw at most this many of them (None: all). ``bars``: one row per non-empty bin of each
    drawn tensor, as :func:`step_histogram` labels it (tensor, log2_lo, log2_hi, count, share of the tensor's
    finite non-zero values, region in ``fmt``); ``drawn``: the tensors drawn, worst first; ``empty``: those
    (within the limit) with no finite non-zero value at that step, so nothing to draw."""
    rows = dict(zip(index["tensor"], np.asarray(counts), strict=True)) if len(index) else {}
    ordered = set(order)  # once: a 500-tensor run asked it 500 times
    ranked = [t for t in order if t in rows] + [t for t in index["tensor"] if t not in ordered]
    chosen = ranked if limit is None else ranked[:limit]
    parts, drawn, empty = [], [], []
    if math.isfinite(log2_scale):
        for name in chosen:
            hist = rows[name]
            if hist.sum() == 0:
                empty.append(name)
                continue
            bars = step_histogram(hist, {}, LOW_PRECISION[fmt], log2_scale)
            bars = bars.astype({"count": np.int64, "log2_lo": float})
            parts.append(bars.assign(tensor=name, log2_hi=bars["log2_lo"] + 1, share=bars["count"] / hist.sum()))
            drawn.append(name)
    else:
        empty = list(chosen)
    columns = ["tensor", "log2_lo", "log2_hi", "count", "share", "region"]
    bars = pd.concat(parts, ignore_index=True)[columns] if parts else pd.DataFrame(columns=columns)
    return bars, drawn, empty


def tensor_summary_line(chosen: pd.Series, fmt: str) -> str:
    """One tensor's shares over all logged steps (a :func:`tensor_ranking` row) as plain text: underflow,
    subnormal and overflow of its finite non-zero values, or, when it had none, what its values were instead
    (never "nan%")."""
    if math.isnan(chosen["underflow_share"]):
        return (f"{fmt} underflow, subnormal, overflow: n/a, no finite non-zero values over all logged steps "
                f"(zeros {chosen['zero_share']:.2%} of all values, {int(chosen['nonfinite']):,} NaN/inf).")
    return (f"{fmt} underflow {chosen['underflow_share']:.2%}, subnormal {chosen['subnormal_share']:.2%}, "
            f"overflow {chosen['overflow_share']:.2%} of its finite non-zero values over all logged steps.")


def heatmap_width(total: np.ndarray, max_marks: int = MAX_MARKS) -> int:
    """How many step columns the gradient heatmap of a tensor draws at most: ``max_marks`` over the exponent bins
    its histograms occupy (``total``: their sum, Store.histogram_totals' row), so its cells stay within the budget."""
    return max(1, max_marks // max(1, int((np.asarray(total) > 0).sum())))


def scale_changes(steps: pd.DataFrame) -> tuple[int, ...]:
    """The steps a column of the S·g heatmap must not span with the step before (Store.histogram_columns'
    ``split_at``): where the loss scale differs from the previous step's (no scale reads 1, as heatmap_cells
    takes it), and each step whose scale has no finite log2 (0, inf) and the step after it, so such a step is a
    column of its own (heatmap_cells leaves it out; blank_steps names it). ``steps``: Store.steps."""
    if not len(steps):
        return ()
    scale = steps["loss_scale"].astype(float).fillna(1.0).to_numpy()
    step = steps["step"].to_numpy(dtype=np.int64)
    changed = step[1:][scale[1:] != scale[:-1]]
    bad = step[~np.isfinite(scale) | (scale <= 0)]
    return tuple(np.unique(np.concatenate([changed, bad, bad + 1])).tolist())


def _columns_said(first: np.ndarray, last: np.ndarray, kept: np.ndarray) -> list[str]:
    """What each heatmap column holds, for its tooltip: one step, or a sum over steps a-b (how many kept), so a
    sum is never read as one step."""
    return [f"step {a:,}" if n == 1 else f"steps {a:,}–{b:,}, {n:,} steps kept (counts summed)"
            for a, b, n in zip(first.tolist(), last.tolist(), kept.tolist(), strict=True)]


def heatmap_cells(index: pd.DataFrame, counts: np.ndarray, steps: pd.DataFrame | None = None,
                  at_scale: bool = False, max_marks: int = MAX_MARKS) -> pd.DataFrame:
    """Long frame of non-empty (step bucket, exponent bin) cells for one tensor's histograms over steps.

    ``index``/``counts``: one tensor's columns in step order, as ``Store.histogram_columns`` gives them (each row
    the sum of the kept steps from ``step`` to ``last_step``, ``steps_kept`` of them) or exact rows as
    ``Store.histogram_matrix`` gives them (one step each). Rows are grouped into equal buckets so that at most
    ``max_marks`` cells reach the browser. With ``at_scale`` each bin is moved by log2 of the loss scale at the
    row's first step (``steps`` gives it; a summed row holds one scale: Store.histogram_columns' ``split_at``),
    showing S*g as it was in the backward pass. Columns: step_start, step_end (its last kept step + 1),
    steps_kept, steps (the tooltip's words: the step, or "steps a–b, n steps kept"), log2_lo, log2_hi, count.
    """
    columns = ["step_start", "step_end", "steps_kept", "steps", "log2_lo", "log2_hi", "count"]
    if len(index) == 0:
        return pd.DataFrame(columns=columns)
    step_values = index["step"].to_numpy()
    last = index["last_step"].to_numpy() if "last_step" in index else step_values
    kept = index["steps_kept"].to_numpy() if "steps_kept" in index else np.ones(len(index), dtype=np.int64)
    shift = np.zeros(len(index))
    if at_scale and steps is not None:
        scale = steps.set_index("step")["loss_scale"].reindex(step_values).fillna(1.0).to_numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            shift = np.log2(scale)
        # at a scale of 0 (or not finite) S·g holds no finite non-zero value: such steps have no cell
        keep = np.isfinite(shift)
        counts, shift, step_values, last, kept = counts[keep], shift[keep], step_values[keep], last[keep], kept[keep]
        if len(step_values) == 0:
            return pd.DataFrame(columns=columns)
    n_buckets = min(len(step_values), heatmap_width(counts.sum(axis=0), max_marks))
    bucket = np.minimum((np.arange(len(step_values)) * n_buckets) // len(step_values), n_buckets - 1)
    # Rows are in step order, so each (bucket, scale) group is a contiguous segment: sum segments at once.
    starts = np.flatnonzero(np.r_[True, (np.diff(bucket) != 0) | (np.diff(shift) != 0)])
    summed = np.add.reduceat(counts, starts, axis=0)
    ends = np.r_[starts[1:], len(step_values)] - 1
    kept_in = np.add.reduceat(kept, starts)
    said = np.array(_columns_said(step_values[starts], last[ends], kept_in), dtype=object)
    seg, bins = np.nonzero(summed)
    return pd.DataFrame({
        "step_start": step_values[starts][seg],
        "step_end": last[ends][seg] + 1,
        "steps_kept": kept_in[seg],
        "steps": said[seg],
        "log2_lo": bins + EXP_MIN + shift[starts][seg],
        "log2_hi": bins + EXP_MIN + shift[starts][seg] + 1,
        "count": summed[seg, bins],
    })


def picked_step(selection: list[dict], logged: list[int]) -> int | None:
    """The logged step a click on the gradient heatmap picked: the first logged step at or after the clicked
    column's ``step_start`` (a merged column starts at its first step), None without a click."""
    if not selection or "step_start" not in selection[0]:
        return None
    start = float(selection[0]["step_start"])
    return next((s for s in logged if s >= start), logged[-1] if logged else None)


def step_histogram(hist: np.ndarray, specials: dict[str, int], fmt: Format = FP16, log2_scale: float = 0.0) -> pd.DataFrame:
    """Bars for one tensor at one step: one per non-empty exponent bin (shifted by ``log2_scale``), labelled
    with the ``fmt`` region its values fall in, plus zero / NaN / +inf / -inf bars. Columns: bin, label,
    log2_lo, count, region."""
    bins = np.flatnonzero(hist)
    lo = bins + EXP_MIN + log2_scale
    region = np.select(
        [lo + 1 <= fmt.min_subnormal_exponent - 1, lo < fmt.min_normal_exponent, lo >= fmt.max_exponent + 1],
        ["underflow", "subnormal", "overflow"],
        "normal",
    )
    edge = (lo == fmt.min_subnormal_exponent - 1) | (lo == fmt.min_normal_exponent - 1) | (lo == fmt.max_exponent)
    region = np.where(edge, region + " (edge bin)", region)
    bars = pd.DataFrame({"label": [f"2^{int(v)}" if float(v).is_integer() else f"2^{v:.1f}" for v in lo],
                         "log2_lo": lo, "count": hist[bins], "region": region})
    special = pd.DataFrame({"label": list(specials), "log2_lo": np.nan, "count": list(specials.values()),
                            "region": "zero / non-finite"})
    return pd.concat([bars, special[special["count"] > 0]], ignore_index=True)


def scale_events(steps: pd.DataFrame) -> dict[str, int]:
    """Skips, backoffs and growths as recorded (scale_after versus the scale the step used)."""
    if steps.empty:
        return {"skips": 0, "backoffs": 0, "growths": 0, "min_scale": math.nan, "max_scale": math.nan}
    before, after = steps["loss_scale"], steps["scale_after"]
    return {
        "skips": int((steps["skipped"] == 1).sum()),
        "backoffs": int((after < before).sum()),
        "growths": int((after > before).sum()),
        "min_scale": float(before.min()),
        "max_scale": float(before.max()),
    }


def loss_scale_notes(steps: pd.DataFrame, scaling: str, opt_level: str) -> list[str]:
    """What the Loss scale panel (charts.loss_scale_panel) cannot draw, and why, as sentences: steps whose scale
    was 0 (a log axis has no 0; a dynamic scale backed off below FP32's smallest value) and a growth tracker
    that does not exist (no dynamic GradScaler) or was not recorded. ``steps``: Store.steps."""
    notes = []
    scale = steps["loss_scale"].astype(float)
    zero = steps.loc[scale == 0, "step"]
    if len(zero) == len(steps):
        notes.append("The loss scale was 0 at every recorded step: a log axis has no 0, so there is no scale panel. "
                     "With a scale of 0 every scaled gradient is 0, and GradScaler cannot grow 0 back.")
    elif len(zero):
        notes.append(f"The loss scale fell to 0 at step {int(zero.iloc[0]):,} ({len(zero):,} of {len(steps):,} "
                     "steps at 0, the red rules: a log axis has no 0): each backoff multiplied it until it was "
                     "below FP32's smallest value. With a scale of 0 every scaled gradient is 0, and GradScaler "
                     "cannot grow 0 back.")
    other = steps.loc[~np.isfinite(scale), "step"]
    if len(other):
        notes.append(f"The loss scale was not finite at {len(other):,} steps (first at step {int(other.iloc[0]):,}): "
                     "those steps are red rules on the scale panel.")
    if steps["growth_tracker"].isna().all():
        why = {"none": f"{opt_level} has no GradScaler", "static": "a static scale never grows or backs off"}.get(
            scaling, "this run did not record GradScaler's growth tracker")
        notes.append(f"No growth-tracker panel: {why}.")
    return notes


def thin_steps(steps: pd.DataFrame, max_points: int = 5000) -> pd.DataFrame:
    """At most about ``max_points`` evenly spaced rows, always keeping skipped and non-finite-loss steps."""
    if len(steps) <= max_points:
        return steps
    stride = math.ceil(len(steps) / max_points)
    keep = (np.arange(len(steps)) % stride == 0) | (steps["skipped"] == 1).to_numpy() | ~np.isfinite(steps["loss"].to_numpy())
    if "grad_norm" in steps:  # a non-finite gradient norm is a red rule: never thinned away
        keep |= recorded_norms(steps).to_numpy() & ~np.isfinite(steps["grad_norm"].to_numpy(dtype=float))
    return steps[keep]


#: the per-step signal lines: Store.step_signal_totals' column of each, in drawing order
SIGNAL_LINES = {
    "NaN values": "nan",
    "+inf values": "posinf",
    "-inf values": "neginf",
    "FP16 overflow at the scale": "fp16_overflow_at_scale",
    "FP16 underflow at the scale": "fp16_underflow_at_scale",
    "BF16 overflow at the scale": "bf16_overflow_at_scale",
    "BF16 underflow at the scale": "bf16_underflow_at_scale",
}
#: the most points a signal line is drawn with
SIGNAL_POINTS = 5000
#: the low-precision format an opt level's backward computes in (None: FP32); a level not here (a watched
#: script's "custom") is not known
LEVEL_FORMAT = {**dict.fromkeys(FP16_LEVELS, "FP16"), "bf16": "BF16", "bf16-pure": "BF16", "fp8-sim": "BF16",
                "O0": None}
#: what a signal line of a format its run does not compute in is called: what that format would have lost
IF_CAST = ", if cast"


def _line_name(line: str, opt_level: str | None) -> str:
    """A SIGNAL_LINES name as a run at ``opt_level`` shows it: FP16's and BF16's counts of a run computing in
    another format (or FP32) are what a cast would have lost, said so (an FP32 twin's "FP16 underflow" line read as
    if the twin had underflowed, worse than the failing FP16 run beside it)."""
    computes = LEVEL_FORMAT.get(opt_level, "unknown")
    cast = line.split(" ", 1)[0]
    return line + IF_CAST if cast in ("FP16", "BF16") and computes != "unknown" and cast != computes else line


def signal_lines(totals: pd.DataFrame, opt_level: str | None = None) -> pd.DataFrame:
    """The per-step signals as lines to draw: step, line (a SIGNAL_LINES name, ", if cast" added for a format
    the run at ``opt_level`` does not compute in) and values (summed over the step's tensors), for the lines with
    a value above 0 at some step. Over SIGNAL_POINTS rows (a live run's, read step by step), each run of rows is
    drawn as its largest value at its first step, as Store.step_signal_totals' ranges are, so a one-step spike is
    never thinned away. ``totals``: that read."""
    drawn = pd.DataFrame({"step": totals["step"].to_numpy()}
                         | {line: totals[column].to_numpy() for line, column in SIGNAL_LINES.items()})
    if len(drawn) > SIGNAL_POINTS:
        bucket = np.arange(len(drawn)) // math.ceil(len(drawn) / SIGNAL_POINTS)
        drawn = drawn.groupby(bucket).agg({"step": "first"} | {line: "max" for line in SIGNAL_LINES})
    shown = [line for line in SIGNAL_LINES if (drawn[line] > 0).any()]
    long = drawn.melt(id_vars="step", value_vars=shown, var_name="line", value_name="values")
    return long.assign(line=long["line"].map(lambda line: _line_name(line, opt_level)))


def signal_note(totals: pd.DataFrame, kept_steps: int, opt_level: str) -> str:
    """What the per-step signal panel shows, in words: how many steps were counted against how many kept
    their full statistics, or that none overflowed (``totals``: Store.step_signal_totals; ``kept_steps``: the
    number of logged steps; ``opt_level``: the run's, whose FP16 backward may have flushed values before they
    were counted)."""
    if totals.empty:
        return ("No per-step over/underflow counts: this run was recorded before mpdiag stored them at every step "
                "(schema 16), and its kept steps hold none either.")
    counted = (f"{int(totals['steps'].sum()):,} steps counted, {kept_steps:,} of them with full statistics (the "
               "Gradients page)")
    if not (totals[list(SIGNAL_LINES.values())].to_numpy() > 0).any():
        # said with what it cannot see: under autocast a gradient that underflowed in the backward reaches mpdiag as
        # a zero, so "no underflow" here stood beside a finding that half the values were flushed (the gallery's #1)
        # (its first words were "no underflow" on a run whose FP16 backward had flushed 88 % of its values: said first)
        if opt_level in FP16_LEVELS:  # an FP32 or BF16 backward flushed nothing FP16 could have held
            return (f"No inf/NaN or overflow at any step, and no recorded value that would underflow FP16 at the loss "
                    f"scale ({counted}); but this run's backward computed in FP16, so a value it flushed to zero was "
                    "recorded as a zero, which these counts cannot tell from a true zero: the Gradients and Findings "
                    "pages estimate the flushed share against an FP32 twin while its loss tracks this run's.")
        return f"No inf/NaN and no FP16/BF16 overflow or underflow at the loss scale at any step ({counted})."
    computes = LEVEL_FORMAT.get(opt_level, "unknown")
    cast_lines = any(_line_name(line, opt_level).endswith(IF_CAST) and (totals[column] > 0).any()
                     for line, column in SIGNAL_LINES.items())
    cast = "" if not cast_lines else (
        f" This run computes in {computes or 'FP32'}: a line \"{IF_CAST.removeprefix(', ')}\" counts what a cast of its "
        f"gradients to {'FP16 or BF16' if computes is None else ({'FP16', 'BF16'} - {computes}).pop()} would have lost, "
        "not something that happened.")
    return (f"Values that overflow or underflow FP16/BF16 at the loss scale (S·g, as the backward produced them) "
            f"and inf/NaN values, summed over the tensors, at every step whether its full statistics were kept or "
            f"not ({counted}); a line's point over a range of steps is its largest there; symmetric-log axis." + cast)


def recorded_norms(steps: pd.DataFrame) -> pd.Series:
    """Which steps have a gradient norm recorded (those of runs recorded since schema 9, which also have a wall
    time): there, NaN is a NaN norm (SQLite stores NaN as NULL); in the rows of older runs it is no record."""
    return steps["wall_time_s"].notna() if "wall_time_s" in steps else pd.Series(False, index=steps.index)


def lr_norm_notes(steps: pd.DataFrame) -> list[str]:
    """Why the learning-rate or gradient-norm panel (charts.loss_scale_panel) is missing, and what its red rules
    are, as sentences. ``steps``: Store.steps."""
    recorded = recorded_norms(steps)
    if not recorded.any():
        return ["No learning-rate or gradient-norm panel: this run was recorded before mpdiag kept them at every "
                "step (store schema 9); record it again to see them."]
    notes = []
    if steps["lr"].isna().all():
        notes.append("No learning-rate panel: the recording knew no optimizer (none was given to the Recorder and "
                     "none from torch.optim stepped over the model's parameters, e.g. weights updated by hand).")
    norm = steps.loc[recorded, "grad_norm"].astype(float)
    bad = steps.loc[recorded & ~np.isfinite(steps["grad_norm"].astype(float)), "step"]
    if len(bad):
        notes.append(f"The gradient norm was inf or NaN at {len(bad):,} of {len(norm):,} steps (first at step "
                     f"{int(bad.iloc[0]):,}): the red rules on its panel. Such steps overflowed; GradScaler skips them.")
    zero = steps.loc[recorded & (steps["grad_norm"].astype(float) == 0), "step"]
    if len(zero) == len(norm):
        notes.append("No gradient-norm panel: the gradient norm was 0 at every step (no gradient, or all zero), "
                     "and a log axis has no 0.")
    elif len(zero):
        notes.append(f"The gradient norm was 0 at {len(zero):,} steps (first at step {int(zero.iloc[0]):,}; no "
                     "gradient, or all zero): grey rules, a log axis has no 0.")
    return notes


def format_lines(formats: tuple[str, ...] = ("fp16",)) -> pd.DataFrame:
    """Horizontal reference lines (log2 magnitude) for each format's min subnormal, min normal and max:
    format, kind, limit (its name, as a legend says it), log2."""
    rows = []
    for name in formats:
        fmt = LOW_PRECISION[name]
        rows += [
            {"format": name, "kind": "min subnormal", "limit": f"{name} min subnormal 2^{fmt.min_subnormal_exponent}",
             "log2": fmt.min_subnormal_exponent},
            {"format": name, "kind": "min normal", "limit": f"{name} min normal 2^{fmt.min_normal_exponent}",
             "log2": fmt.min_normal_exponent},
            {"format": name, "kind": "max", "limit": f"{name} max {fmt.max_finite:,.6g}", "log2": math.log2(fmt.max_finite)},
        ]
    return pd.DataFrame(rows)


#: a format limit within this many binades of a gradient heatmap's data is drawn on it; one further away would
#: squeeze the data into a thin band (FP16's max 2^16 over gradients near 2^-20), so the page names it instead
LIMIT_REACH = 6


def heatmap_view(cells: pd.DataFrame, lines: pd.DataFrame,
                 data: str) -> tuple[pd.DataFrame, tuple[float, float], list[str]]:
    """What the gradient heatmap draws: the format lines within LIMIT_REACH binades of its cells, the y extent
    (the cells and those lines, a binade of room each side), and, as sentences, each limit left off and how far
    it lies from the data. ``cells``: :func:`heatmap_cells` (not empty); ``lines``: :func:`format_lines`;
    ``data``: whose values the cells are, as the sentences name them ("of fc.weight at any logged step"): two
    charts of one page give two distances to one limit, and each must say which values it measured from."""
    lo, hi = float(cells["log2_lo"].min()), float(cells["log2_hi"].max())
    near = (lines["log2"] >= lo - LIMIT_REACH) & (lines["log2"] <= hi + LIMIT_REACH)
    drawn = lines[near].reset_index(drop=True)
    extent = (min([lo, *drawn["log2"]]) - 1, max([hi, *drawn["log2"]]) + 1)
    off = [f"{row.limit} is {row.log2 - hi:,.0f} binades above the largest value {data}" if row.log2 > hi else
           f"{row.limit} is {lo - row.log2:,.0f} binades below the smallest value {data}"
           for row in lines[~near].itertuples()]
    return drawn, extent, off


#: a tensor whose FP32 reference gradient has an RMS below this fraction of the whole model's gradient RMS
#: (at that step) is numerically zero in FP32 too (a bias before BatchNorm, say): its relative error is noise
NEGLIGIBLE_GRAD_RMS = 1e-3


def shadow_ranking(shadow: pd.DataFrame) -> pd.DataFrame:
    """Tensors ranked by how much precision their gradients lost against the FP32 shadow (worst first).

    ``shadow``: ``Store.shadow_stats``. Per tensor over the shadow steps: the median and max relative error,
    the minimum cosine, and ``meaningful`` False when its reference gradient was negligible
    (:data:`NEGLIGIBLE_GRAD_RMS`) at most steps. Non-finite errors (overflow) rank first."""
    columns = ["tensor", "numel", "steps", "median_rel_error", "max_rel_error", "min_cosine", "meaningful"]
    if shadow.empty:
        return pd.DataFrame(columns=columns)
    df = shadow.assign(sq=shadow["ref_norm"] ** 2)
    model_rms = np.sqrt(df.groupby("step")["sq"].sum() / df.groupby("step")["numel"].sum())
    rms = df["ref_norm"] / np.sqrt(df["numel"])
    df["meaningful"] = rms >= NEGLIGIBLE_GRAD_RMS * df["step"].map(model_rms)
    df["rel_error"] = df["rel_error"].fillna(np.inf)  # NaN: the mixed gradient was not finite
    out = df.groupby("tensor", sort=False).agg(
        numel=("numel", "first"), steps=("step", "nunique"), median_rel_error=("rel_error", "median"),
        max_rel_error=("rel_error", "max"), min_cosine=("cosine", "min"), meaningful=("meaningful", "mean"),
    ).reset_index()
    out["meaningful"] = out["meaningful"] > 0.5
    return out.sort_values(["meaningful", "median_rel_error"], ascending=False, kind="stable")[columns].reset_index(drop=True)


def update_shares(updates: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """From ``Store.update_stats``: (per tensor, per step) shares of updated values (finite non-zero gradient)
    that were below the format's resolution and that left the weight unchanged; NaN where none updated."""
    def shares(groups) -> pd.DataFrame:
        sums = groups[["updated", "below_resolution", "unchanged"]].sum()
        denom = sums["updated"].astype(float).replace(0, np.nan)
        return sums.assign(below_resolution_share=sums["below_resolution"] / denom,
                           unchanged_share=sums["unchanged"] / denom).reset_index()

    per_tensor = shares(updates.groupby("tensor", sort=False)).sort_values("below_resolution_share", ascending=False)
    return per_tensor.reset_index(drop=True), shares(updates.groupby("step"))


def nonfinite_losses(steps: pd.DataFrame) -> int:
    """Steps whose recorded loss was NaN or infinite."""
    return int((~np.isfinite(steps["loss"].to_numpy(dtype=float))).sum())


def scale_at_step(steps: pd.DataFrame, step: int) -> float:
    """The loss scale a step used (1.0 when the step is not recorded, e.g. no scaler)."""
    return float(steps.set_index("step")["loss_scale"].get(step, 1.0)) if len(steps) else 1.0


def exact_shares(at_step: pd.Series, fmt: str, at_scale: bool) -> dict[str, tuple[int, int]]:
    """One tensor at one step (a Store.tensor_stats row): per category (underflow, subnormal, overflow) the exact
    count of values that fell in it when cast to ``fmt`` (of S·g with ``at_scale``), and the denominator (finite
    non-zero values)."""
    denom = int(nonzero_finite(at_step))  # on the row itself: a one-row frame of it cost ~1 ms a tensor
    suffix = "_at_scale" if at_scale else ""
    return {cat: (int(at_step[f"{fmt}_{cat}{suffix}"]), denom) for cat in ("underflow", "subnormal", "overflow")}


def cast_shares(at_step: pd.Series, hist: np.ndarray, fmt: str, log2_multiplier: float,
                scale: float) -> dict[str, tuple[float, float, bool]]:
    """One tensor at one step: per category (underflow, subnormal, overflow) the share of its finite non-zero
    values that fall in it when its unscaled gradient g, multiplied by 2**log2_multiplier, is cast to ``fmt``,
    as (lower, upper, exact). The Gradients page's tiles and its what-if both read this, so they agree wherever
    both are shown: at a multiplier of 2^0 it is the exact count of g cast (``at_step``, a Store.tensor_stats
    row), at the step's own loss scale ``scale`` (a power of two, or any scale when ``log2_multiplier`` is
    log2 of it) the exact count of S·g as recorded; elsewhere it is derived from the exponent histogram
    ``hist`` of g (:func:`whatif_shares`: a range where a bin straddles a rounding edge). NaN when the tensor
    had no finite non-zero value."""
    own = float(scale) == 2.0**log2_multiplier if not math.isnan(log2_multiplier) else False
    if log2_multiplier == 0 or own:
        counts = exact_shares(at_step, fmt, at_scale=log2_multiplier != 0)
        return {cat: (n / d, n / d, True) if d else (math.nan, math.nan, True) for cat, (n, d) in counts.items()}
    bounds = whatif_shares(hist, int(log2_multiplier), LOW_PRECISION[fmt])
    return {cat: (lo, hi, False) for cat, (lo, hi) in bounds.items()}


def share_text(share: tuple[float, float, bool]) -> str:
    """A :func:`cast_shares` entry as the page says it: "12.500%", a range "0.061% – 0.122%", or "n/a" when
    the tensor had no finite non-zero value (never "nan%")."""
    lo, hi = share[0], share[1]
    if math.isnan(lo):
        return "n/a"
    return f"{lo:.3%}" if lo == hi else f"{lo:.3%} – {hi:.3%}"


def whatif_underflow_by_tensor(index: pd.DataFrame, counts: np.ndarray, log2_scale: int,
                               fmt: Format = FP16) -> dict[str, tuple[float, float]]:
    """Per tensor, bounds on its ``fmt`` underflow share were its unscaled gradient multiplied by 2**log2_scale
    (:func:`whatif_shares`); ``index``/``counts``: every tensor's histogram at one step (Store.histogram_matrix)."""
    return {t: whatif_shares(h, log2_scale, fmt)["underflow"] for t, h in zip(index["tensor"], counts, strict=True)}


def significant(value, digits: int = 4) -> str:
    """A number in ``digits`` significant digits; "NaN" (or "inf") when it is missing or not finite, never blank."""
    if value is None or pd.isna(value):
        return "NaN"
    return f"{float(value):.{digits}g}"


def health(severities: list[str], status: str = "finished", skipped: int = 0) -> str:
    """A run's health badge from the severities of its findings: its errors and warnings counted; without
    any, "healthy" only for a finished run (a failed or crashed one "did not finish", a stopped one "stopped", a
    live one "no findings yet"), with the steps GradScaler skipped (``skipped``) too few for a finding beside it:
    a run with a NaN loss and a skipped step read "healthy" alone. Words only: emoji render as empty boxes where
    no emoji font is installed (headless Chromium)."""
    errors, warnings = severities.count("error"), severities.count("warning")
    if not errors and not warnings:
        if status == "finished" and skipped:
            return f"healthy, {skipped:,} skip{'s' if skipped > 1 else ''}"
        return {"finished": "healthy", "failed": "did not finish", "crashed": "did not finish",
                "stopped": "stopped"}.get(
            status, "no findings yet")
    return ", ".join(f"{n} {what}{'s' if n > 1 else ''}" for n, what in ((errors, "error"), (warnings, "warning")) if n)


def _scale_text(scale) -> str:
    """A loss scale as the runs table shows it: blank when the run has none (not "None"), else as
    :func:`mpdiag.options.scale_text` says it: 2^35 (its 34,359,738,368 was cut in the column to "3.435973837e+1")."""
    return "" if scale is None or pd.isna(scale) else scale_text(scale)


def stall_text(run: pd.Series) -> str:
    """Why a run reads stalled: how long since its last step (or since it started, before its first), in words."""
    quiet = (pd.Timestamp.now(tz="UTC") - run["heartbeat_at"]).total_seconds()
    since = f"{quiet / 60:,.1f} min" if quiet >= 120 else f"{quiet:,.0f} s"
    done = int(run["steps_done"])
    last = f"since its last stored step ({done - 1:,})" if done else "and has stored no step yet"
    median = run.get("median_step_time_s")
    pace = f"; its median step takes {median:,.2f} s" if isinstance(median, float) and math.isfinite(median) else ""
    return (f"Run #{int(run['run_id'])} is still running but has recorded nothing for {since}, {last}{pace}. "
            "Its training loop may be stuck (a data loader, a collective waiting on another rank, input) or in a "
            "long pause of its own (evaluation, a checkpoint).")


def run_progress(run: pd.Series) -> tuple[float | None, str]:
    """A running run's progress: the share of its planned steps done, or None where the script decides how
    many steps there are (``mpdiag watch``, the Recorder in a user's own loop: no total is stored), and the
    words for it: a count of steps recorded, never "step N" (steps are numbered from 0, so "step 2" beside a loss
    curve ending at step 1 read as two different positions of one run)."""
    done = int(run["steps_done"]) if pd.notna(run["steps_done"]) else 0
    total = run["steps"]
    if pd.notna(total) and int(total) > 0:
        return min(1.0, done / int(total)), f"{done:,} of {int(total):,} steps recorded"
    return None, f"{done:,} step{'' if done == 1 else 's'} recorded (its script decides how many)"


def runs_table(runs: pd.DataFrame, severities: list[list[str]]) -> pd.DataFrame:
    """The home page's table of runs (Store.runs, newest first): one row per run, its health badge (from
    ``severities``: per run, its findings' severities), links to the run's Findings, Gradients and Loss scale
    pages (relative URLs with ``run=ID``), then its settings: what triage needs comes first, so at 1,280 px with
    the sidebar open it is on screen through the Gradients link and the columns after it scroll sideways (the page
    pins the run and its name when the rest scrolls)."""
    done = runs["steps_done"].fillna(0).astype(int)
    ids = runs["run_id"].astype(int).astype(str)
    return pd.DataFrame({
        "run": runs["run_id"],
        "name": runs["name"],
        "status": runs["status"],
        "health": [health(s, status, int(skipped)) for s, status, skipped in
                   zip(severities, runs["status"], runs["skipped_steps"].fillna(0), strict=True)],
        "opt level": runs["opt_level"],
        "final loss": runs["final_loss"].map(significant),
        "steps": [f"{d} / {int(n)}" if pd.notna(n) else str(d) for d, n in zip(done, runs["steps"], strict=True)],
        "findings": "/Findings?run=" + ids,
        "gradients": "/Gradients?run=" + ids,
        "loss scale": "/Loss_scale?run=" + ids,
        "skipped": runs["skipped_steps"].fillna(0).astype(int).astype(str) + " of " + done.astype(str),
        "script": script_names(runs).to_numpy(),
        "scaling": runs["scaling"],
        "init scale": runs["init_scale"].map(_scale_text),
        "static scale": runs["loss_scale"].map(_scale_text),
        "step ms (median)": (runs["median_step_time_s"] * 1e3).map(lambda v: f"{v:,.1f}" if pd.notna(v) else ""),
        "device": runs["device"],
        "ranks": runs["world_size"].map(lambda v: f"{int(v)}" if pd.notna(v) else ""),
        "related": [related_runs(run) for _, run in runs.iterrows()],
        "started (UTC)": runs["started_at"].dt.tz_convert(None).dt.strftime("%Y-%m-%d %H:%M:%S"),
    })


def related_runs(run: pd.Series) -> str:
    """How a run relates to others, in words: an FP32 twin is the twin *of* its mixed-precision run (both carry
    each other's id as pair_run_id), a run with a twin names it, a rerun names its parent."""
    said = []
    twin = run.get("pair_run_id")
    if pd.notna(twin):
        said.append(f"FP32 twin of #{int(twin)}" if run["opt_level"] == "O0" else f"its FP32 twin: #{int(twin)}")
    parent = run.get("parent_run_id")
    if pd.notna(parent):
        said.append(f"rerun of #{int(parent)}")
    return "; ".join(said)


#: how the runs table renders its link columns (st.column_config.LinkColumn display text per column)
RUN_LINKS = {"findings": "Findings", "gradients": "Gradients", "loss scale": "Loss scale"}


def worst_tensors(shares: pd.DataFrame, n: int = 12) -> pd.DataFrame:
    """Rows of ``shares`` (tensor rankings of several runs, concatenated) for the ``n`` tensors with the highest
    underflow share in any run."""
    worst = shares.groupby("tensor")["underflow_share"].max().nlargest(n).index
    return shares[shares["tensor"].isin(worst)]
