"""Comparing a mixed-precision run with its FP32 reference: pure functions over Store DataFrames.

The reference of a run is its ``--pair`` twin when it has one, else the most recent finished O0 run of the
same training: the same script source (hash) and seed, which had identical initial weights and batches; for a
watched script (``mpdiag watch``, an upload), which seeds itself, the same command (script, arguments and folder).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from mpdiag.analysis.summaries import FP16_LEVELS, flushed_to_zero, judged_level, tensor_ranking
from mpdiag.numerics.formats import EXP_MIN
from mpdiag.options import applies, recorded_by, scale_text, watch_settings
from mpdiag.recording.retention import DENSE_START_STEPS, THIN_EVERY

#: Losses diverge at the first step where |loss - loss_ref| > DIVERGENCE_RTOL * |loss_ref|, or where exactly
#: one of the two is non-finite.
DIVERGENCE_RTOL = 0.05


def reference_run(runs: pd.DataFrame, run_id: int, prefer: list[int] | None = None) -> int | None:
    """The FP32 (O0) run that ``run_id`` should be compared with, or None (see module docstring).

    Only finished O0 runs of the same training (:func:`training_of`) qualify; among them the ``--pair`` twin wins,
    then the newest of ``prefer`` (e.g. the runs a user selected), then the newest overall.
    """
    by_id = runs.set_index("run_id")
    if run_id not in by_id.index or by_id.loc[run_id, "opt_level"] == "O0":
        return None
    run = by_id.loc[run_id]
    trained = training_of(run)
    if trained is None:
        return None
    finished_fp32 = runs[(runs["opt_level"] == "O0") & (runs["status"] == "finished")]  # then the few left, by row
    same = pd.Series([training_of(other) == trained for _, other in finished_fp32.iterrows()],
                     index=finished_fp32.index, dtype=bool)
    candidates = finished_fp32.loc[same, "run_id"].astype(int)
    if candidates.empty:
        return None
    if pd.notna(run["pair_run_id"]) and int(run["pair_run_id"]) in set(candidates):
        return int(run["pair_run_id"])
    preferred = [c for c in candidates if c in set(prefer or [])]
    return max(preferred) if preferred else int(candidates.max())


def fp32_twin_row(runs: pd.DataFrame, run: pd.Series) -> pd.Series | None:
    """The FP32 run an FP16 run's flushed values are estimated against (its "FP32 twin"): the ``--pair`` twin
    recorded with it, else its finished FP32 reference (:func:`reference_run`: for a watched script, an O0 run of
    the same command, what watch records in place of a twin: the Compare page's underflow bars showed the O0 run's
    hypothetical FP16 underflow beside no bar at all for the watched FP16 run it was the reference of), when it
    took as many steps (the estimate compares the two runs' zero shares over all their steps, as a twin's are over
    the same steps). None for a run not judged in FP16 or without either. ``runs``: Store.runs, already read
    (looked up, not read again)."""
    if judged_level(run) not in FP16_LEVELS:
        return None
    if pd.notna(run.get("pair_run_id")):
        match = runs[runs["run_id"] == int(run["pair_run_id"])]
        return None if match.empty else match.iloc[0]
    reference = reference_run(runs, int(run["run_id"]))
    match = runs[(runs["run_id"] == reference) & (runs["steps_done"] == run["steps_done"])]
    return None if reference is None or match.empty else match.iloc[0]


def twin_parted_at(steps: pd.DataFrame, twin_steps: pd.DataFrame) -> int | None:
    """The first step where an FP16 run's loss and its FP32 twin's part (:func:`first_divergence`; ``steps``,
    ``twin_steps``: their Store.steps), None while they track. The twin starts from the same weights and batches,
    but once their losses part their weights differ, and its zeros no longer tell which of the run's zeros FP16
    flushed: a user's watched run read 3 % "flushed" against an O0 run it had parted from at step 3 (dead ReLUs
    on another path), where FP32 gradients at the run's own weights lost 0.001 %. The flushed share is not
    estimated against such a twin (:func:`~mpdiag.analysis.summaries.flushed_text` says why)."""
    return first_divergence(loss_comparison(twin_steps, steps))


def training_of(run: pd.Series) -> tuple | None:
    """What makes two runs the same training, so an O0 one is the other's FP32 reference: a watched script's
    command (its target, arguments and folder, or the uploaded code's bundle: the script seeds itself, and its hash and seed are not stored, so
    no O0 rerun of a watched run was ever found and its fix could not be checked against FP32); else the script's
    source hash and seed. None: nothing to match on."""
    watched = watch_settings(run["config"])
    if watched is not None:
        return ("watch", tuple(watched.get("argv") or ()), watched.get("module"), watched.get("cwd"),
                watched.get("bundle"))
    if pd.isna(run["script_sha256"]) or pd.isna(run["seed"]):
        return None
    return ("script", run["script_sha256"], int(run["seed"]))


def reference_hint(run: pd.Series) -> str:
    """How to record the FP32 reference a run lacks: a watched script has no twin (watch runs the script once), an
    O0 rerun of its command is one; a Recorder's loop is the user's to run again in FP32."""
    how = recorded_by(run["config"])
    if how == "watch":
        return (f"rerun it at O0: the Runs page's rerun form, or python -m mpdiag rerun {int(run['run_id'])} "
                "--opt-level O0")
    if how == "recorder":
        return "record your loop again in FP32, without autocast, on the same seed and batches"
    return "start runs with 'Also run an FP32 twin', or --pair"


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


#: the Compare page's x axes: the step, or the wall time since the run's Recorder started (Store.steps' wall_time_s)
X_AXES = {"step": "step", "wall time (s)": "wall_time_s"}


def ema_debiased(values, weight: float) -> np.ndarray:
    """TensorBoard's scalar smoothing: an exponential moving average with weight ``weight`` (0: none; 0.99:
    heavy), debiased so it does not start at 0 (divided by 1 - weight**n after n points). A non-finite value
    is passed through as itself and left out of the average (as TensorBoard does), and a series whose values are
    all equal is returned as it is."""
    v = np.asarray(values, dtype=float)
    out = v.copy()
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    if v.size == 0 or weight == 0.0 or (v == v[0]).all():
        return out
    last, n = 0.0, 0
    for i, x in enumerate(v):
        if not math.isfinite(x):
            continue
        last = last * weight + (1.0 - weight) * x
        n += 1
        out[i] = last / (1.0 - weight**n)
    return out


def smoothed(df: pd.DataFrame, y: str, weight: float) -> pd.DataFrame:
    """``df`` (rows of one or more runs, column ``run``, in step order within each) with ``{y}_smoothed``: each
    run's :func:`ema_debiased` of ``y``."""
    out = df.copy()
    out[f"{y}_smoothed"] = np.nan
    for _, rows in df.groupby("run", sort=False):
        out.loc[rows.index, f"{y}_smoothed"] = ema_debiased(rows[y].to_numpy(dtype=float), weight)
    return out


def distinct_digits(values, least: int = 4, most: int = 17) -> int:
    """The fewest significant digits (at least ``least``) at which the different finite ``values`` are all
    written differently: final losses are never rounded into being the same."""
    finite = sorted({float(v) for v in values if v is not None and math.isfinite(float(v))})
    for digits in range(least, most + 1):
        if len({f"{v:.{digits}g}" for v in finite}) == len(finite):
            return digits
    return most


def number_text(value, digits: int = 4, unit: str = "") -> str:
    """A number for a table: thousands separators, ``digits`` significant digits, its unit; "n/a" when missing,
    "NaN"/"inf" when it is not finite (never "None" or "nan")."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or pd.isna(value):
        return "n/a"
    value = float(value)
    if not math.isfinite(value):
        return "inf" if value > 0 else "-inf"
    if abs(value) >= 10**digits:
        text = f"{value:,.0f}"
    elif value == 0 or abs(value) >= 1e-4:
        decimals = max(0, digits - 1 - math.floor(math.log10(abs(value)))) if value else 0
        text = f"{value:,.{decimals}f}"
    else:
        text = f"{value:.{digits}g}"
    return f"{text} {unit}".strip()


def loss_text(value, digits: int) -> str:
    """A recorded loss: "NaN" when the last step's loss was NaN (or missing), else ``digits`` significant digits."""
    if value is None or pd.isna(value):
        return "NaN"
    return f"{float(value):.{digits}g}"


def cost_table(chosen: pd.DataFrame, labels: list[str], digits: int | None = None) -> pd.DataFrame:
    """What each chosen run cost, one row per run (``labels`` name them), as the page shows it (text, with
    thousands separators and units): median step time (after the warm-up step 0), throughput (batch size /
    median step time), peak memory, the bytes of model state (weights, gradients, master weights, optimizer
    state; the ``params`` count excluded), skipped steps, and the final loss to as many significant digits as
    tell the runs apart (or ``digits``: those that tell the whole store's runs apart, as the other pages write it)."""
    digits = distinct_digits(chosen["final_loss"]) if digits is None else digits
    state = [sum(v for k, v in s.items() if k != "params") / 2**20 if isinstance(s, dict) and s else None
             for s in chosen["model_state"]]
    return pd.DataFrame({
        "run": labels,
        "median step time": [number_text(t * 1e3, 4, "ms") if pd.notna(t) else "n/a"
                             for t in chosen["median_step_time_s"]],
        "throughput": [number_text(b / t, 4, "samples/s") if pd.notna(b) and pd.notna(t) and t > 0 else "n/a"
                       for b, t in zip(chosen["batch_size"], chosen["median_step_time_s"], strict=True)],
        "peak memory": [number_text(m / 2**20, 4, "MiB") if pd.notna(m) else "n/a" for m in chosen["peak_mem_bytes"]],
        "model state": [number_text(m, 3, "MiB") for m in state],
        "skipped steps": [f"{int(k):,} of {int(n):,}" if pd.notna(k) and pd.notna(n) else "n/a"
                          for k, n in zip(chosen["skipped_steps"], chosen["steps_done"], strict=True)],
        "final loss": [loss_text(v, digits) for v in chosen["final_loss"]],
    })


#: a step after the warm-up taking more than this many times its run's 90th percentile step time is an outlier
#: (a stall: a later compilation, a checkpoint, the machine busy): the step-time chart leaves it out, as its axis
#: would be scaled to it, and the page lists it. Against the percentile, not the median, so a run whose steps
#: alternate between two speeds keeps both in the chart.
STEP_TIME_OUTLIER = 5.0


def step_time_outliers(steps: pd.DataFrame) -> pd.Series:
    """Which rows of ``steps`` (steps after the warm-up step 0 of one or more runs, column ``run``) took more
    than STEP_TIME_OUTLIER times their run's 90th percentile step time."""
    typical = steps.groupby("run")["step_time_s"].transform(lambda t: t.quantile(0.9))
    return steps["step_time_s"] > STEP_TIME_OUTLIER * typical


#: the two parts of a tensor's FP16 underflow on Compare: what an FP16 run's backward pass already flushed to
#: zero, and what would underflow were the recorded gradient at its run's loss scale cast to FP16
FLUSHED_PART = "flushed to zero in the FP16 backward pass (estimated)"
COUNTED_PART = "would underflow if cast to FP16 (counted)"


def fp16_underflow_parts(totals: pd.DataFrame, twin_totals: pd.DataFrame | None, opt_level: str,
                         label: str) -> pd.DataFrame:
    """Per tensor of one run, its FP16 underflow as shares of all its values (tensor, run, part, share): the
    values its FP16 backward pass flushed to zero before they were recorded (FP16 levels with an FP32 twin:
    :func:`~mpdiag.analysis.summaries.flushed_to_zero`), and those of the recorded gradient at the run's loss
    scale that would underflow if cast to FP16 (the exact counts). An FP16 run's flushed values are zeros in
    its record, so its counted part alone would read as healthy beside its FP32 twin, whose counted part is
    what FP16 would have lost."""
    counted = totals["fp16_underflow_at_scale"] / totals["numel"].where(totals["numel"] > 0)
    parts = [pd.DataFrame({"tensor": totals["tensor"], "part": COUNTED_PART, "share": counted.to_numpy()})]
    if opt_level in FP16_LEVELS and twin_totals is not None:
        flushed = flushed_to_zero(totals, twin_totals)
        parts.append(pd.DataFrame({"tensor": flushed.index, "part": FLUSHED_PART, "share": flushed.to_numpy()}))
    return pd.concat(parts, ignore_index=True).assign(run=label).dropna(subset=["share"])


NONFINITE_PART = "inf or NaN when recorded"
OVERFLOW_PART = "would overflow if cast to FP16 (counted)"


def fp16_overflow_parts(totals: pd.DataFrame, label: str) -> pd.DataFrame:
    """Per tensor of one run, its FP16 overflow as shares of all its values (tensor, run, part, share): the values
    already inf or NaN when recorded, and the finite ones at its loss scale above FP16's largest value (the exact
    counts, what a cast to FP16 would make inf). An FP16 run's backward made its overflowing values inf before they
    were recorded, so no finite value of it is above 65,504: the count alone read 0 for the run that overflowed,
    beside an FP32 run's bars."""
    numel = totals["numel"].where(totals["numel"] > 0)
    nonfinite = (totals["nan"] + totals["posinf"] + totals["neginf"]) / numel
    return pd.concat([
        pd.DataFrame({"tensor": totals["tensor"], "part": NONFINITE_PART, "share": nonfinite.to_numpy()}),
        pd.DataFrame({"tensor": totals["tensor"], "part": OVERFLOW_PART,
                      "share": (totals["fp16_overflow_at_scale"] / numel).to_numpy()}),
    ], ignore_index=True).assign(run=label).dropna(subset=["share"])


def worst_by_total(shares: pd.DataFrame, value: str = "share", n: int = 12) -> pd.DataFrame:
    """Rows of ``shares`` (tensor, run, ``value``[, part]) for the ``n`` tensors whose largest per-run total is
    highest, leaving out tensors at 0 in every run."""
    total = shares.groupby(["tensor", "run"])[value].sum().groupby("tensor").max()
    worst = total[total > 0].nlargest(n).index
    return shares[shares["tensor"].isin(worst)]


#: run settings the Compare page lays side by side: columns of Store.runs, then (CONFIG_EXTRAS) settings kept only
#: in the run's ``config`` (its "run" or "watch" part), then the runs it is linked to (LINK_FIELDS)
CONFIG_FIELDS = ["opt_level", "scaling", "init_scale", "loss_scale", "growth_factor", "backoff_factor",
                 "growth_interval", "min_scale", "max_scale", "seed", "steps", "every", "device", "gpu_name",
                 "torch_version", "script_sha256", "batch_size", "params", "update_format", "world_size", "backend",
                 "status"]
CONFIG_EXTRAS = ["shadow_every", "trace_modules", "optimizer", "fp8", "fp8_recipe", "fp8_bf16_modules", "fp8_modules",
                 "moment_format"]
#: launcher options a run has only where they apply (options.applies): an FP8 recipe at fp8-sim or with --fp8
_APPLYING_EXTRAS = {"fp8_recipe", "fp8_bf16_modules", "fp8_modules"}
#: a run's links to other runs, by the name its row has in the table
LINK_FIELDS = {"parent_run_id": "rerun of", "pair_run_id": "paired with (--pair twin)"}
#: settings that are loss scales: a power of two is written 2^k
SCALE_FIELDS = {"init_scale", "loss_scale", "min_scale", "max_scale"}
#: settings that are counts: whole numbers with thousands separators
COUNT_FIELDS = {"growth_interval", "seed", "steps", "every", "batch_size", "params", "world_size", "shadow_every"}
#: how the page names a setting (others: the field's name in words, "init_scale" -> "init scale")
SETTING_LABELS = {"script_sha256": "script (sha256)", "gpu_name": "GPU", "params": "parameters",
                  "world_size": "ranks", "update_format": "format of the updated weights", "every": "statistics every",
                  "shadow_every": "FP32 shadow every", "torch_version": "torch", "fp8": "FP8 statistics (--fp8)",
                  "fp8_recipe": "FP8 recipe", "fp8_bf16_modules": "Linears left in BF16 (fp8-sim)",
                  "fp8_modules": "a recipe per Linear (fp8-sim)",
                  "moment_format": "optimizer state held in (--moment-format)"}


def setting_label(field: str) -> str:
    """A config table row's name as the page shows it."""
    return SETTING_LABELS.get(field, field.replace("_", " "))


#: how the table writes a setting a run does not have (missing is a value: a setting only some runs have differs)
MISSING = "—"
#: how the table writes ``every`` of a run recorded at the default retention (stored as none: --every not given)
DEFAULT_RETENTION = f"every step to {DENSE_START_STEPS - 1:,}, then every {THIN_EVERY}th (the default)"


def _missing(value) -> bool:
    if value is None or isinstance(value, (dict, list)):
        return value is None
    try:
        return bool(pd.isna(value)) or (isinstance(value, str) and value.strip() in ("", "None", "nan", "<NA>"))
    except (TypeError, ValueError):
        return False


def setting_text(field: str, value) -> str:
    """One setting of one run as the Configuration table writes it: MISSING when the run has none (never "nan" or
    "None"), a scale as 2^k, a count with separators, a run link as #id, yes/no for a switch."""
    if _missing(value):
        return DEFAULT_RETENTION if field == "every" else MISSING
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if field in LINK_FIELDS:
        return f"#{int(value)}"
    if isinstance(value, str):
        return value
    if field in SCALE_FIELDS:
        return scale_text(value, digits=True)
    if field in COUNT_FIELDS and float(value) == int(value):
        text = f"{int(value):,}"
        return f"{text} (off)" if field == "shadow_every" and int(value) == 0 else text
    if isinstance(value, (int, float, np.integer, np.floating)):
        return f"{float(value):,.10g}" if abs(float(value)) >= 1e4 else f"{float(value):.10g}"
    return str(value)


def _config_extra(config, field: str):
    """A setting kept only in a run's ``config`` (the launcher's "run" part, or a watched run's "watch" part)."""
    if not isinstance(config, dict):
        return None
    if field == "optimizer":
        return (config.get("optimizer") or {}).get("class")
    # a launched run's FP8 options and moments' format ("" unset; a watched run keeps its FP8 settings otherwise)
    if field.startswith("fp8") or field == "moment_format":
        run = config.get("run")
        if not isinstance(run, dict) or field not in run:
            return None
        if field in _APPLYING_EXTRAS and not applies(field, str(run.get("opt_level")), bool(run.get("fp8"))):
            return None
        return run[field] if run[field] != "" else None
    for part in ("run", "watch"):
        if isinstance(config.get(part), dict) and field in config[part]:
            return config[part][field]
    return None


def config_table(chosen: pd.DataFrame, labels: list[str], only_differences: bool) -> pd.DataFrame:
    """Settings (rows, as text: :func:`setting_text`) by run (columns named by ``labels``); with
    ``only_differences`` only the settings on which the runs disagree, a setting one run has and another lacks
    (MISSING) included; ``every`` at the default retention is DEFAULT_RETENTION, and a run that planned no number
    of steps (a loop of your own, a watched script) says how many it recorded (``steps_done``). Rows: CONFIG_FIELDS
    the store has, CONFIG_EXTRAS some run's config holds, and the runs' links (LINK_FIELDS): "paired with" is also
    set on the twin whose pair among ``chosen`` names it."""
    rows: dict[str, list[str]] = {}
    for field in CONFIG_FIELDS:
        if field in chosen:
            rows[field] = [setting_text(field, v) for v in chosen[field]]
    if "steps" in rows and "steps_done" in chosen:  # a loop of your own plans no count: the steps it recorded
        rows["steps"] = [f"{int(done):,} recorded (none planned)" if text == MISSING else text
                         for text, done in zip(rows["steps"], chosen["steps_done"], strict=True)]
    if "config" in chosen:
        for field in CONFIG_EXTRAS:
            values = [_config_extra(c, field) for c in chosen["config"]]
            if any(not _missing(v) for v in values):
                rows[field] = [setting_text(field, v) for v in values]
    ids = chosen["run_id"].astype(int).tolist() if "run_id" in chosen else []
    if "parent_run_id" in chosen:
        rows[LINK_FIELDS["parent_run_id"]] = [setting_text("parent_run_id", v) for v in chosen["parent_run_id"]]
    if "pair_run_id" in chosen and ids:
        pairs = [None if _missing(v) else int(v) for v in chosen["pair_run_id"]]
        # the twin's own row names no pair (only the run launched with --pair does): name it from that run
        named_by = {p: run for run, p in zip(ids, pairs, strict=True) if p is not None}
        rows[LINK_FIELDS["pair_run_id"]] = [setting_text("pair_run_id", p if p is not None else named_by.get(run))
                                            for run, p in zip(ids, pairs, strict=True)]
    config = pd.DataFrame.from_dict(rows, orient="index", columns=pd.Index(labels))
    return config[config.nunique(axis=1) > 1] if only_differences else config


# -- gradient histograms of the compared runs, overlaid ----------------------------------------------------------

def histogram_tensors(totals: list[pd.DataFrame]) -> list[str]:
    """The tensor names the overlaid histograms offer: every tensor any run recorded (``totals``: each run's
    Store.tensor_totals, in the runs' order), those of the first run with statistics first, worst FP16 underflow
    of its unscaled gradient first (:func:`~mpdiag.analysis.summaries.tensor_ranking`), then the other runs' own
    tensors in their order."""
    names: list[str] = []
    recorded = [t for t in totals if len(t)]
    if recorded:
        names += tensor_ranking(recorded[0], "fp16")["tensor"].tolist()
    for t in recorded[1:]:
        names += [n for n in t["tensor"] if n not in set(names)]
    return names


def histogram_steps(logged: list[list[int]]) -> tuple[list[int], int | None]:
    """(the steps the step slider offers: those any run logged, in order; the default: the last step every run
    with statistics logged, else the last offered, None when no run logged any). ``logged``: each run's
    Store.logged_steps."""
    recorded = [set(steps) for steps in logged if steps]
    offered = sorted(set().union(*recorded)) if recorded else []
    common = set.intersection(*recorded) if recorded else set()
    return offered, (max(common) if common else offered[-1] if offered else None)


#: why a run has no line in the overlaid histograms (the ``missing`` column of :func:`overlaid_histograms`)
NO_TENSOR = "did not record this tensor"
NO_STEP = "did not log this step"
NO_VALUES = "held no finite non-zero value of it"
NO_SCALE = "kept no loss scale for this step"  # S·g only: a run killed before its last step's row was written


def counted_text(signals: pd.Series) -> str:
    """One tensor's signals at one step (a Store.step_signals_at row), in words: what a run that kept no histogram
    there counted all the same (its inf/NaN values, and those overflowing and underflowing FP16 at its scale)."""
    nonfinite = int(signals["nan"] + signals["posinf"] + signals["neginf"])
    return (f"{nonfinite:,} inf/NaN, {int(signals['fp16_overflow_at_scale']):,} overflowing and "
            f"{int(signals['fp16_underflow_at_scale']):,} underflowing FP16 at its loss scale")


def overlaid_histograms(records: dict[str, tuple[pd.DataFrame, pd.DataFrame | None, pd.DataFrame, np.ndarray]],
                        tensor: str, step: int | None,
                        scales: dict[str, np.ndarray] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One tensor's exponent histogram in each run, of its unscaled gradient g or (``scales``) of S·g, the gradient
    at the run's own loss scale as the backward pass held it, at one logged ``step`` or summed over every logged
    step (``step`` None), as shares of that run's finite non-zero values of the tensor, so runs with different
    numbers of logged steps compare.

    ``records``: per run label, (Store.tensor_totals, Store.tensor_stats of every tensor at ``step`` (None when
    summing), and the tensor's histogram rows as index and counts: Store.histogram_matrix's rows of the tensor,
    over every logged step or, enough, its row at ``step`` or its Store.histogram_totals row when summing; for S·g
    summed, Store.histogram_columns split where the scale changes, each column of one scale). ``scales``: per run
    label, the loss scale of each of those rows (at its first step): each row is moved by log2 of its scale before
    it is taken (:func:`scaled_histogram`); None: g.

    Returns (bins, runs). ``bins``, tidy, one row per drawn run and bin: run, log2 (the bin holds
    2^log2 <= |x| < 2^(log2+1); a whole e for g and for S·g at a power-of-two scale, e + log2 S at another scale,
    where S·g's bin edges are S·2^e), count (exact), share (count / the run's finite non-zero values), rounded
    (True where a sum over steps whose scales were not all one power of two apart was placed on the bins of the
    nearest power of two of each: approximate); every run spans the same bins, one empty bin below the lowest
    occupied bin of any run to one above the highest, empty ones at 0, so its step-line starts and ends at 0.
    ``runs``, one row per run in ``records``' order: run, numel (values of the tensor over the steps taken),
    finite_nonzero, zeros, zero_share (of numel: an FP16 run's values flushed to zero in its backward pass are
    exact zeros in its record, in no bin), nonfinite (NaN and inf), missing (why the run has no line: NO_TENSOR,
    NO_STEP, NO_VALUES, NO_SCALE; None when drawn)."""
    rows, per_bin = [], {}
    for label, record in records.items():
        row, hist = _run_of_tensor(label, record, tensor, step, None if scales is None else scales.get(label))
        rows.append(row)
        if row["missing"] is None:
            per_bin[label] = hist
    runs = pd.DataFrame(rows, columns=["run", "numel", "finite_nonzero", "zeros", "zero_share", "nonfinite",
                                       "missing"])
    runs["missing"] = pd.Series([r["missing"] for r in rows], dtype=object)  # None where drawn, never NaN
    return _shared_bins(per_bin), runs


#: one run's histogram as :func:`overlaid_histograms` draws it: counts of the bins from exponent ``low`` on, each
#: moved by ``fraction`` (log2 of a scale that is no power of two), and whether a sum was rounded to whole powers
Shifted = tuple[np.ndarray, int, float, bool]


def scaled_histogram(counts: np.ndarray, scales: np.ndarray | None) -> Shifted:
    """Rows of exponent histograms of g (bin b: 2^(EXP_MIN + b) <= |g| < 2^(EXP_MIN + b + 1)) summed as the
    histogram of S·g, each row at its own loss scale ``scales`` (None: each 1, g itself). Multiplying by 2^k moves
    every value exactly k bins; by a scale S that is not a power of two, the bin [2^e, 2^(e+1)) becomes [S·2^e,
    S·2^(e+1)), exactly: the bins move by log2 S, a fraction of a bin too. Rows whose fractions differ (a sum over
    steps at scales not a power of two apart) cannot share bins: each is moved by the nearest whole power of two
    instead, and the result says it was rounded. A row at a scale of 0 (or not finite) holds no finite non-zero
    S·g and is left out."""
    counts = np.atleast_2d(np.asarray(counts, dtype=np.int64))
    log2 = np.zeros(len(counts)) if scales is None else np.log2(np.where(
        np.asarray(scales, dtype=float) > 0, np.asarray(scales, dtype=float), np.nan))
    kept = np.isfinite(log2)
    counts, log2 = counts[kept], log2[kept]
    n_bins = counts.shape[1]
    if not len(counts):
        return np.zeros(n_bins, dtype=np.int64), EXP_MIN, 0.0, False
    whole = np.floor(log2)
    fractions = log2 - whole
    rounded = bool(np.ptp(fractions) > 1e-9)  # log2 3 - 1 and log2 6 - 2 differ in the last bit
    if rounded:
        whole, fraction = np.round(log2), 0.0
    else:
        fraction = float(fractions[0])
    shift = whole.astype(np.int64)
    low = int(shift.min())
    out = np.zeros(n_bins + int(shift.max()) - low, dtype=np.int64)
    for row, k in zip(counts, shift, strict=True):
        out[k - low:k - low + n_bins] += row
    return out, EXP_MIN + low, fraction, rounded


def _run_of_tensor(label: str, record: tuple, tensor: str, step: int | None,
                   scales: np.ndarray | None) -> tuple[dict, Shifted | None]:
    """One run's row of :func:`overlaid_histograms`' ``runs`` and the tensor's histogram (None where missing)."""
    totals, at_step, index, counts = record
    row = {"run": label, "numel": 0, "finite_nonzero": 0, "zeros": 0, "zero_share": np.nan, "nonfinite": 0,
           "missing": None}
    if tensor not in set(totals["tensor"]):
        row["missing"] = NO_TENSOR
        return row, None
    if step is None:
        stats = totals[totals["tensor"] == tensor]
        rows = np.arange(len(counts))
    else:
        stats = at_step[at_step["tensor"] == tensor] if at_step is not None else at_step
        rows = np.flatnonzero(index["step"].to_numpy() == step)[:1]
    rows_scales = None if scales is None else np.asarray(scales, dtype=float)[rows]
    hist = scaled_histogram(counts[rows], rows_scales) if len(rows) else None
    if stats is None or stats.empty or hist is None:
        row["missing"] = NO_STEP
        return row, None
    s = stats.iloc[0]
    nonzero = int(hist[0].sum())
    row.update(numel=int(s["numel"]), finite_nonzero=nonzero, zeros=int(s["zeros"]),
               zero_share=int(s["zeros"]) / int(s["numel"]) if int(s["numel"]) else np.nan,
               nonfinite=int(s["nan"] + s["posinf"] + s["neginf"]))
    if rows_scales is not None and np.isnan(rows_scales).all():  # S·g of unknown scale: no line, not g's
        row["missing"] = NO_SCALE
    elif nonzero == 0:
        row["missing"] = NO_VALUES
    return row, hist


def _shared_bins(per_bin: dict[str, Shifted]) -> pd.DataFrame:
    """The drawn runs' histograms over one span of bins (an empty bin each side of every run's occupied ones)."""
    if not per_bin:
        return pd.DataFrame({"run": pd.Series(dtype=str), "log2": pd.Series(dtype=int),
                             "count": pd.Series(dtype="int64"), "share": pd.Series(dtype=float),
                             "rounded": pd.Series(dtype=bool)})
    occupied = [low + np.flatnonzero(hist > 0) for hist, low, _, _ in per_bin.values()]
    span = np.arange(min(o[0] for o in occupied) - 1, max(o[-1] for o in occupied) + 2)  # whole exponents
    frames = []
    for label, (hist, low, fraction, rounded) in per_bin.items():
        at = span - low
        inside = (at >= 0) & (at < len(hist))
        count = np.zeros(len(span), dtype=np.int64)
        count[inside] = hist[at[inside]]
        frames.append(pd.DataFrame({"run": label, "log2": span + fraction if fraction else span, "count": count,
                                    "share": count / int(hist.sum()), "rounded": rounded}))
    return pd.concat(frames, ignore_index=True)
