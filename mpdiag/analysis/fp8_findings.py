"""FP8 findings: which Linear layers an FP8 recipe would hurt, where, and what to change. Pure functions over
the FP8 records (a DataFrame with the columns of ``mpdiag.recording.fp8_capture.RECORD_COLUMNS``, as
``Store.fp8(run_id)`` is to return them).

It reads only the recorded counts and amax series and the recipe's own scale arithmetic
(:mod:`mpdiag.numerics.fp8_recipes`); it does not touch a store or torch. Each finding's ``fix`` holds the
run options of an ``fp8-sim`` rerun that should remove it.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from mpdiag.analysis.finding import Finding
from mpdiag.analysis.fp8_summaries import LOST_SHARE, fmt_label, number, overflows, past_threshold, percent, step_counts
from mpdiag.numerics.fp8_recipes import (
    BLOCK_RECIPES,
    FP8_FORMATS,
    RECIPES,
    Fp8Settings,
    delayed_reference,
    scale_from_reference,
)
from mpdiag.options import ConfigError, RunConfig, watch_settings

#: the largest --fp8-margin the amax-jump finding recommends (past it, only current scaling is advised)
MAX_MARGIN = 64


def _fix(**options) -> dict:
    """An fp8-sim rerun that records FP8 statistics again (--fp8), so its own findings show whether the
    setting removed the lost values."""
    return {"opt_level": "fp8-sim", "fp8": True, **options}


def recorded_settings(config: dict | None) -> Fp8Settings | None:
    """The FP8 recipe a run was recorded with, from its stored configuration: the runner's run options
    (``config["run"]``, with --fp8), a Recorder's ``fp8`` argument (``config["fp8"]``) or watch --fp8's
    (``config["watch"]["fp8"]``); None when the run did not record FP8 statistics."""
    config = config if isinstance(config, dict) else {}
    run = config.get("run")
    if isinstance(run, dict) and run.get("fp8"):
        try:
            return RunConfig.from_dict(run).fp8_settings()
        except ConfigError:  # options this mpdiag does not know: no FP8 reading, rather than no diagnosis
            return None
    watched = watch_settings(config)
    recorded = config.get("fp8") or (watched.get("fp8") if watched is not None else None)
    return Fp8Settings.from_dict(recorded) if isinstance(recorded, dict) else None


def holding_block_recipe(blocks: pd.DataFrame | None) -> str | None:
    """The first recorded block-scaled recipe (BLOCK_RECIPES order: mxfp8, then nvfp4) under which no recorded
    tensor of any Linear, at any recorded step, is past the fp8-lost-values threshold (:func:`past_threshold`,
    the per-tensor recipes' own test); None where none was recorded or none holds. A block recipe is a whole
    run's setting (``fp8-sim --fp8-recipe``), so it must hold everywhere to be offered."""
    if blocks is None or blocks.empty:
        return None
    for recipe in BLOCK_RECIPES:
        rows = blocks[blocks["recipe"] == recipe]
        if len(rows) and not past_threshold(rows).any():
            return recipe
    return None


def lost_values(records: pd.DataFrame, blocks: pd.DataFrame | None = None) -> list[Finding]:
    """Per module, role and recipe: a recorded step where more than LOST_SHARE of the values underflow, or
    any value overflows. The fix: current scaling where only delayed scaling loses them (or the recording
    has no current-scaling rows); else, where a block-scaled recipe was recorded (``blocks``: the mxfp8 / nvfp4
    rows) and holds every tensor (:func:`holding_block_recipe`), an fp8-sim rerun in it; else keeping the layer
    in BF16 (the format cannot hold the tensor at a per-tensor scale)."""
    if records.empty:
        return []
    block = holding_block_recipe(blocks)
    rows = records.assign(share=records["underflow"] / records["numel"].where(records["numel"] > 0))
    bad = rows[past_threshold(records)]
    counts = step_counts(records)
    findings = []
    for (module, role, recipe), hit in bad.groupby(["module", "role", "recipe"], sort=False):
        worst = hit.loc[hit["share"].idxmax()] if hit["overflow"].sum() == 0 else hit.loc[hit["overflow"].idxmax()]
        current = bad[(bad["module"] == module) & (bad["role"] == role) & (bad["recipe"] == "current")]
        recorded_current = ((records["recipe"] == "current") & (records["module"] == module)).any()
        if recipe == "delayed" and current.empty:
            fix = _fix(fp8_recipe="current")
            advice = ("Use current scaling (the scale from this step's own amax)"
                      + (f"; with both recipes recorded, current scaling stays under this finding's threshold here "
                         f"(at most {100 * LOST_SHARE:g} % underflow and no overflow at every recorded step)."
                         if recorded_current else "."))
        elif block is not None:
            fix = _fix(fp8_recipe=block)
            advice = (f"Use the block-scaled {block.upper()} recipe: its per-block scales, recorded beside this "
                      f"recipe, lose no more than {100 * LOST_SHARE:g} % of any recorded tensor to underflow and "
                      f"none to overflow, in every Linear at every recorded step (else keep {module} in BF16).")
        else:
            fix = _fix(fp8_recipe=recipe, fp8_bf16_modules=module)  # one recipe: a recording may hold both
            advice = f"Keep {module} in BF16: its {role} does not fit {worst['fmt']} even at its own amax's scale."
        findings.append(Finding(
            rule="fp8-lost-values", severity="warning", page="FP8",
            title=f"FP8 ({recipe} scaling) loses values of {module}'s {role}",
            evidence=(f"{_of_steps(counts.loc[(module, role, recipe), 'flagged'], counts.loc[(module, role, recipe), 'steps'], 'lose')} "
                      f"more than {100 * LOST_SHARE:g} % of the values to underflow, or any to overflow, in {fmt_label(worst['fmt'])} (the layer "
                      f"table's \"flagged\" steps); worst at step {int(worst['step']):,}: "
                      f"{int(worst['underflow']):,} of {int(worst['numel']):,} underflow ({percent(worst['share'])}), "
                      f"{int(worst['overflow']):,} overflow, at scale {number(worst['scale'])} "
                      f"(amax {number(worst['amax'])})."),
            recommendation=advice, tensors=[f"{module}:{role}"], fix=fix,
            focus={"layer": module, "role": role, "recipe": recipe}))
    return findings


def _of_steps(n: int, of: int, verb: str) -> str:
    """"9 of 60 recorded steps overflow", "1 of 60 recorded steps overflows"."""
    return f"{int(n):,} of {int(of):,} recorded steps {verb}{'s' if n == 1 else ''}"


def _step_list(steps, most: int = 8) -> str:
    shown = ", ".join(f"{int(s):,}" for s in steps[:most])
    return shown + (f" and {len(steps) - most:,} more" if len(steps) > most else "")


def amax_jumps(records: pd.DataFrame, settings: Fp8Settings) -> list[Finding]:
    """Per module and role: the recorded steps whose delayed-scaling cast overflowed (:func:`overflows` on the
    recorded delayed rows: the amax chart's markers, counted the same way), with the worst jump first: the
    step whose amax is the largest multiple of the delayed history's largest (``settings.history`` recorded
    steps before it, :func:`delayed_reference`), and how many values it lost; then the other overflowing
    steps, the small rises past the format's headroom (E4M3 keeps 464 / 448 = 3.6 % above the history's
    largest). The fix: current scaling; the margin that would have absorbed every jump is in the advice."""
    delayed = records[records["recipe"] == "delayed"] if len(records) else records
    if delayed.empty:
        return []
    groups = delayed.sort_values("step", kind="stable").groupby(["module", "role"], sort=False)
    found = (_amax_jump(module, role, one, settings) for (module, role), one in groups)
    return [finding for finding in found if finding is not None]


def _amax_jump(module: str, role: str, one: pd.DataFrame, settings: Fp8Settings) -> Finding | None:
    """:func:`amax_jumps`' finding for one module's role (its delayed rows by step), or None where none overflowed."""
    over = overflows(one).to_numpy()
    if not over.any():
        return None
    fmt = FP8_FORMATS[one["fmt"].iloc[0]]
    amax = one["amax"].to_numpy(np.float32)
    reference = delayed_reference(amax, settings.history)
    jumped = np.flatnonzero(over)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = amax[jumped].astype(np.float64) / reference[jumped]
    worst = int(np.argmax(np.where(np.isfinite(ratios), ratios, -np.inf)))  # the largest finite jump
    steps, lost, numel = (one[column].to_numpy()[jumped] for column in ("step", "overflow", "numel"))
    margin = _absorbing_margin(amax[jumped], reference[jumped], fmt, settings)
    said = (f"Its amax jumps, worst at step {int(steps[worst]):,}: {number(amax[jumped][worst])}, "
            f"{ratios[worst]:.4g} times the largest of the delayed history before it (up to "
            f"{settings.history:,} recorded steps), and {int(lost[worst]):,} of {int(numel[worst]):,} values "
            f"overflowed {fmt_label(fmt.name)}. In all, {_of_steps(len(jumped), len(one), 'overflow')} "
            "(the amax chart's ▲, the layer table's \"overflowing\" steps)")
    others = np.delete(np.arange(len(jumped)), worst)
    if len(others):
        said += _small_rises(others, ratios, steps, lost, fmt)
    return Finding(
        rule="fp8-amax-jump", severity="warning", page="FP8",
        title=f"An amax jump of {module}'s {role} overflows the delayed FP8 scale",
        evidence=said + ".",
        recommendation=("Use current scaling" + (f", or a margin of {margin} (--fp8-margin)" if margin is not None else "")
                        + " so the jump does not saturate."),
        tensors=[f"{module}:{role}"], fix=_fix(fp8_recipe="current"),
        focus={"layer": module, "role": role, "recipe": "delayed"})


def _small_rises(others: np.ndarray, ratios: np.ndarray, steps: np.ndarray, lost: np.ndarray, fmt) -> str:
    """The evidence's clause on the overflowing steps besides the worst: small rises past the format's headroom."""
    finite_others = others[np.isfinite(ratios[others])]
    rise = (f"at most {ratios[finite_others].max():.4g} times the history's largest"
            if len(finite_others) else "at non-finite amaxes")
    return (f": the other {len(others):,} (step{'' if len(others) == 1 else 's'} "
            f"{_step_list(steps[others])}) {'is a small rise' if len(others) == 1 else 'are small rises'} "
            f"to a new largest amax, {rise}, past the "
            f"{100 * (fmt.overflow_threshold / fmt.max_finite - 1):.1f} % headroom {fmt_label(fmt.name)} "
            f"keeps above it ({number(fmt.max_finite)} to {number(fmt.overflow_threshold)}), losing "
            f"{int(lost[others].sum()):,} value{'' if lost[others].sum() == 1 else 's'} in all")


def _absorbing_margin(amax: np.ndarray, reference: np.ndarray, fmt, settings: Fp8Settings) -> int | None:
    """The smallest margin under which none of these (finite) amaxes overflows their delayed scale, if any
    <= MAX_MARGIN."""
    finite = np.isfinite(amax) & np.isfinite(reference)
    amax, reference = amax[finite], reference[finite]
    for margin in range(settings.margin, MAX_MARGIN + 1):
        scale = scale_from_reference(reference, fmt, margin, settings.pow2)
        if not any(fmt.overflows(float(v)) for v in amax * scale):
            return margin
    return None


def fp8_findings(records: pd.DataFrame, settings: Fp8Settings) -> list[Finding]:
    """Every FP8 finding of a run recorded with ``settings``: amax jumps, then lost values, in record order.
    Linear modules the recipe keeps in BF16 or FP32 (``settings.high_precision_modules``) are not cast, so they
    find nothing. The block-scaled recipes' rows (mxfp8, nvfp4) raise no finding of their own: they can only be a lost-values
    finding's fix (:func:`holding_block_recipe`)."""
    blocks = None
    if len(records):
        records = records[~records["module"].isin(settings.high_precision_modules)]
        blocks = records[records["recipe"].isin(BLOCK_RECIPES)]
        records = records[records["recipe"].isin(RECIPES)]
    jumps = amax_jumps(records, settings) if "delayed" in settings.recipes else []  # current scaling has none
    return [*jumps, *lost_values(records, blocks)]


__all__ = ["LOST_SHARE", "amax_jumps", "fp8_findings", "holding_block_recipe", "lost_values", "recorded_settings"]
