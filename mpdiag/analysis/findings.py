"""Findings: what is wrong with a recorded run, where, and what to change. Pure functions over Store data.

Every rule below reads only what the run recorded (exact counts, GradScaler's state, losses, the histograms)
and states its threshold as a constant; docs/findings.md lists them. A finding carries its evidence in numbers,
the tensors involved, a recommendation, and ``fix``: run options for a rerun that should remove it.
"""

from __future__ import annotations

import dataclasses
import shlex
from urllib.parse import urlencode

import numpy as np
import pandas as pd

from mpdiag.analysis.compare import (
    DIVERGENCE_RTOL,
    first_divergence,
    fp32_twin_row,
    loss_comparison,
    reference_run,
    twin_parted_at,
)
from mpdiag.analysis.finding import SEVERITY_ORDER, Finding
from mpdiag.analysis.fp8_findings import fp8_findings, recorded_settings
from mpdiag.analysis.module_trace import first_nonfinite, first_nonfinite_modules, module_said
from mpdiag.analysis.summaries import (
    FLUSHED_LABEL,
    FP16_LEVELS,
    flushed_text,
    flushed_to_zero,
    judged_level,
    nonzero_finite,
    overall_flushed,
    shadow_ranking,
    update_shares,
    whatif_shares,
)
from mpdiag.numerics.formats import EXP_MIN, FP16, resolution_log2
from mpdiag.options import (
    FIX,
    command_flags,
    fix_in_code,
    fix_said,
    recorded_by,
    rerunnable_by_watch,
    scale_text,
    torchrun_rerun,
    watch_fix,
    watch_settings,
)
from mpdiag.store import Store

#: gradient values FP16 loses or keeps only as subnormals, at the scale in use, as a share of finite non-zero
#: values over all logged steps: a warning above this, overall or for any tensor holding >= 1 % of the values
LOW_RANGE_SHARE = 0.02
#: a recommended scale must bring that share (upper bound) below this, with no overflow at all
LOW_RANGE_TARGET = 0.001
#: GradScaler's default initial scale, recommended whenever it meets LOW_RANGE_TARGET, and the largest scale
#: ever recommended (2^40: an FP32 loss times it stays far below FP32's max)
GRADSCALER_DEFAULT_LOG2 = 16
MAX_RECOMMENDED_LOG2 = 40
#: skipped steps above this share of all steps, or this many in a row, or a scale below 1: scale collapse
SKIP_SHARE = 0.05
CONSECUTIVE_SKIPS = 5
#: tensors whose gradients span more exponent bins than FP16 holds (2^-24 .. 65504: 40 bins) between their
#: 0.1 % and 99.9 % quantiles cannot fit FP16 at any single scale
RANGE_QUANTILE = 0.001
FP16_SPAN_BINS = FP16.max_exponent - FP16.min_subnormal_exponent + 1
#: updates of values with a finite non-zero gradient that left the weight unchanged (lost), as a share of all
#: such updates over the tracked steps: a warning above this; the same share below the format's resolution
#: but kept (by FP32 master weights) is a note
SWAMPED_SHARE = 0.05
#: a tensor whose gradient's median relative error against the FP32 shadow exceeds this has lost precision
GRADIENT_REL_ERROR = 0.2


def _share(part: float, whole: float) -> float:
    return float(part / whole) if whole else 0.0


def recommended_scale(hist: np.ndarray, complete: bool = True, ceiling: int = MAX_RECOMMENDED_LOG2) -> int | None:
    """log2 of the initial dynamic scale to recommend from a summed histogram of unscaled gradients, among the
    powers of two up to ``ceiling`` at which no recorded value can overflow FP16 (upper bounds).

    ``complete``: the histogram misses nothing (an FP32 run's, e.g. the twin's): GradScaler's standard 2^16 when
    it brings the share of values underflowing or subnormal below LOW_RANGE_TARGET; else the smallest power of
    two that does. Not complete (an FP16 run's own: the values it flushed to zero are missing, all of them below
    the recorded ones): the largest power of two that cannot overflow, the most room for what is missing.
    Either way, when no scale meets the target, the one leaving the smallest share if that share is at most
    LOW_RANGE_SHARE (a rerun at it would not show the finding again); None when none does: the gradients are
    wider than FP16 holds. Dynamic scaling backs off by itself if the recommended scale overflows later."""
    safe = [k for k in range(0, ceiling + 1) if whatif_shares(hist, k)["overflow"][1] == 0]  # a prefix: 0 .. k_max
    if not safe:
        return None

    def low(k: int) -> float:
        shares = whatif_shares(hist, k)
        return shares["underflow"][1] + shares["subnormal"][1]

    best = max(safe)  # the share only falls as the scale grows, up to the first that overflows
    if not complete:
        return best if low(best) <= LOW_RANGE_SHARE else None
    if GRADSCALER_DEFAULT_LOG2 in safe and low(GRADSCALER_DEFAULT_LOG2) <= LOW_RANGE_TARGET:
        return GRADSCALER_DEFAULT_LOG2
    meeting = [k for k in safe if low(k) <= LOW_RANGE_TARGET]
    if meeting:  # below 2^16 only when 2^16 itself would overflow: then the most headroom that fits
        return min(meeting) if min(meeting) > GRADSCALER_DEFAULT_LOG2 else max(meeting)
    return best if low(best) <= LOW_RANGE_SHARE else None


def record_again_with(how: str, option: str) -> str:
    """How to record a run again with ``option`` ("trace_modules" or "shadow_every"), as it was recorded (``how``,
    options.recorded_by): a Recorder in the user's own loop takes no command-line flag."""
    if how == "recorder":
        return {"trace_modules": "Record it again with Recorder(..., trace_modules=True)",
                "shadow_every": "Compare its gradients with FP32 ones at some steps, rec.compare_gradients(fp32_grads) "
                                "after record() (docs/api.md),"}[option]
    return {"trace_modules": "Rerun with --trace-modules", "shadow_every": "Rerun with --shadow-every N"}[option]


def fp8_record_again(run_id: int, run_config: dict, options: dict) -> tuple[str, bool]:
    """How to record a run again with FP8 statistics (``options``: the run options that add them, e.g. ``--fp8
    --fp8-recipe both``), as it was recorded; and whether that is a rerun mpdiag can start itself. A watched run's
    rerun repeats its command with only its level and scale changed, so the FP8 page and the Plan page advised a
    rerun the CLI refuses, and said watch "cannot apply" what a new ``mpdiag watch`` does: the command to watch
    the script again is said instead. A Recorder's loop: its ``fp8=`` argument."""
    how = recorded_by(run_config)
    if how == "recorder":
        blocks = tuple(b for b in str(options.get("fp8_blocks") or "").split(",") if b)
        args = [f'recipe="{options.get("fp8_recipe", "delayed")}"', *([f"block_recipes={blocks!r}"] if blocks else [])]
        return (f"record it again with Recorder(..., fp8=Fp8Settings({', '.join(args)})) in your loop "
                "(mpdiag.numerics.fp8_recipes.Fp8Settings; docs/api.md)", False)
    flags = command_flags(options)
    if how == "watch":
        settings = watch_settings(run_config)
        if settings.get("bundle"):
            return "upload the code again on the Upload page with \"Record FP8 statistics\" ticked", False
        return (f"watch the script again with them, from {settings.get('cwd') or 'its folder'}: python -m mpdiag "
                f"watch {flags} {shlex.join(settings.get('argv') or [])}", False)
    return f"python -m mpdiag rerun {int(run_id)} {flags}", True


def scale_basis(twin_hist: np.ndarray | None, recorded_by: str = "run") -> str:
    """What a recommended scale was computed from, said in the advice, so two runs of one script that get
    different advice say why (``recorded_by``, options.recorded_by: only ``mpdiag run`` records a --pair twin)."""
    if twin_hist is not None:
        return "by the FP32 twin's gradient histograms (nothing flushed)"
    twin = "; a --pair run's FP32 twin measures them" if recorded_by == "run" else ""
    return ("by this run's recorded histograms, the most headroom that cannot overflow (the values FP16 flushed "
            f"to zero are missing from them{twin})")


def low_range(run: pd.Series, totals: pd.DataFrame, hist: np.ndarray, twin_totals: pd.DataFrame | None = None,
              shadow_steps: int = 0, twin_hist: np.ndarray | None = None,
              signals: pd.Series | None = None, tracks_fp32: bool = False,
              twin_parted_at: int | None = None) -> Finding | None:
    """FP16 levels: gradient values lost (underflow) or kept only as subnormals at the scale in use. The values
    FP16 flushed to zero are exact zeros in the record; their share is estimated against the FP32 twin
    (``twin_totals``, its Store.tensor_totals) when there is one, else the evidence says how to get it. The
    recommended scale is read from the twin's summed histogram (``twin_hist``) when there is one: the run's own
    lacks the flushed values, and a scale chosen from it can leave the rerun with the same finding. The shares
    are of the steps whose statistics were kept (the values' total is known there only); where the run counted
    more steps (``signals``: Store.step_signal_sums), the evidence says so and adds the underflow over every step.
    Information, not a warning, when the run already trained at the scale this finding would recommend and its
    loss stays within DIVERGENCE_RTOL of its FP32 reference (``tracks_fp32``): the fix rerun of a run that
    underflowed read as failed, and was sent to BF16, while its loss matched FP32's."""
    if judged_level(run) not in FP16_LEVELS or totals.empty:
        return None
    values = nonzero_finite(totals)
    low = totals["fp16_underflow_at_scale"] + totals["fp16_subnormal_at_scale"]
    overall = _share(low.sum(), values.sum())
    per_tensor = (low / values.replace(0, np.nan)).fillna(0)
    big = values >= 0.01 * values.sum()
    worst = totals.loc[(per_tensor > LOW_RANGE_SHARE) & big, "tensor"].tolist()
    if overall <= LOW_RANGE_SHARE and not worst:
        return None
    advice, fix, settled = _scale_advice(hist, twin_hist, run, tracks_fp32)
    severity, title = "warning", "Gradients vanish or lose precision in FP16 at the loss scale in use"
    if settled:
        severity, title = "info", "Some gradients stay subnormal in FP16 at the largest safe loss scale; the loss tracks FP32"
    tensors = worst or totals.loc[per_tensor.sort_values(ascending=False).index[:5], "tensor"].tolist()
    if twin_totals is None:
        flushed = flushed_text(None, shadow_steps, recorded_by(run["config"]), twin_parted_at)
    else:
        per = flushed_to_zero(totals, twin_totals)
        # a tensor whose values all vanished has none left to count above: the twin shows it lost the most
        lost = [t for t in per.sort_values(ascending=False).index if per[t] > LOW_RANGE_SHARE]
        tensors = list(dict.fromkeys(lost + tensors))[:5]
        flushed = (f"{overall_flushed(totals, per):.2%} of all gradient values {FLUSHED_LABEL}, estimated against "
                   "the FP32 twin (" + ", ".join(f"{t}: {per.get(t, np.nan):.2%}" for t in tensors) + ").")
    return Finding(
        rule="gradient-underflow", severity=severity, title=title,
        evidence=(f"At the scale used, {overall:.2%} of the finite non-zero gradient values recorded "
                  f"{_kept_words(totals, signals)}{_low_range_parts(totals)}; values FP16 already flushed are among "
                  f"the exact zeros in the record ({_share(totals['zeros'].sum(), totals['numel'].sum()):.1%} of all "
                  "values are zeros, true zeros included). "
                  f"{flushed}{_underflow_every_step(totals, signals)}"),
        recommendation=advice,
        tensors=tensors,
        fix=fix,
    )


def _scale_advice(hist: np.ndarray, twin_hist: np.ndarray | None, run: pd.Series,
                  tracks_fp32: bool = False) -> tuple[str, dict, bool]:
    """:func:`low_range`'s advice and fix: dynamic scaling from the scale the histogram recommends (the FP32
    twin's when there is one), or BF16 when no single scale fits, or when the run already trained with dynamic
    scaling from that scale (a rerun at the fix's scale was offered the same fix again); and whether that run's
    loss tracks FP32's all the same (``tracks_fp32``): then nothing needs changing (True)."""
    basis = scale_basis(twin_hist, recorded_by(run["config"]))
    k = recommended_scale(hist if twin_hist is None else twin_hist, complete=twin_hist is not None)
    if k is None:
        return (f"No single loss scale fits these gradients in FP16 ({basis}, every scale that avoids overflow "
                f"leaves more than {LOW_RANGE_SHARE:.0%} of them underflowing or subnormal); use {FIX} "
                "(FP32's range).", {"opt_level": "bf16"}, False)
    if run.get("scaling") == "dynamic" and run.get("init_scale") == float(2**k) and tracks_fp32:
        return (f"Nothing to change for the training: its loss stays within {DIVERGENCE_RTOL:.0%} of its FP32 "
                f"reference's at dynamic loss scaling from 2^{k}, the largest scale its gradients allow without "
                f"overflow, {basis}. The values that stay subnormal in FP16 would be kept by {FIX} (FP32's "
                "range), if they come to matter.", {"opt_level": "bf16"}, True)
    if run.get("scaling") == "dynamic" and run.get("init_scale") == float(2**k):
        return (f"This run already used dynamic loss scaling from 2^{k}, the largest scale its gradients allow "
                f"without overflow, {basis}, and they still underflow or are subnormal in FP16: use {FIX} "
                "(FP32's range).", {"opt_level": "bf16"}, False)
    kept = whatif_shares(hist if twin_hist is None else twin_hist, k)
    # from the run's own histograms the share is of the values recorded: those FP16 flushed are not among them
    of = "the values" if twin_hist is not None else "the values recorded (not those FP16 flushed)"
    return (f"{_never_grew(run)}Use dynamic loss scaling from 2^{k}: {basis}, it leaves at most "
            f"{kept['underflow'][1] + kept['subnormal'][1]:.2%} of {of} underflowing or subnormal, "
            "with no overflow.", {"loss_scale": "dynamic", "init_scale": float(2**k)}, False)


def _never_grew(run: pd.Series) -> str:
    """Why a dynamically scaled run's scale stayed where it started, where its growth interval is longer than the
    run (GradScaler(growth_interval=10**9): told only "use dynamic scaling", its user read that it already did);
    else nothing."""
    interval, steps = run.get("growth_interval"), run.get("steps_done")
    if run.get("scaling") != "dynamic" or pd.isna(interval) or pd.isna(steps) or interval <= steps:
        return ""
    start = "its initial scale" if pd.isna(run.get("init_scale")) else f"its initial {scale_text(run['init_scale'])}"
    return (f"The scale could not grow: its GradScaler's growth_interval, {int(interval):,} steps, is longer than the "
            f"run's {int(steps):,}, so it never rose above {start} (GradScaler's default interval is 2,000). ")


def _counted_beyond_kept(totals: pd.DataFrame, signals: pd.Series | None) -> int:
    """How many steps the run counted (its per-step signals: ``signals``, Store.step_signal_sums) where that is
    more than the steps whose full statistics were kept (``totals``: Store.tensor_totals), else 0: a finding read
    from the kept steps then says so, and adds what the signals counted at every step."""
    counted = 0 if signals is None else int(signals["steps"])
    return counted if len(totals) and counted > int(totals["logged_steps"].max()) else 0


def _kept_words(totals: pd.DataFrame, signals: pd.Series | None) -> str:
    """'at the 1,003 steps kept in full (of 1,100 counted) ' where the run counted more steps than it kept."""
    counted = _counted_beyond_kept(totals, signals)
    return f"at the {int(totals['logged_steps'].max()):,} steps kept in full (of {counted:,} counted) " if counted else ""


def _underflow_every_step(totals: pd.DataFrame, signals: pd.Series | None) -> str:
    """:func:`low_range`'s FP16 underflow over every step the run counted, where it kept fewer in full."""
    counted = _counted_beyond_kept(totals, signals)
    if not counted:
        return ""
    return (f" Counted at every one of the {counted:,} steps, kept in full or not: "
            f"{int(signals['fp16_underflow_at_scale']):,} values would underflow in FP16 at the scale used "
            f"({int(totals['fp16_underflow_at_scale'].sum()):,} of them at the kept steps).")


def _low_range_parts(totals: pd.DataFrame) -> str:
    """What the low-range share is made of, naming only the parts that hold values: 'are subnormal in FP16
    (1,234 values) or would underflow (56)', 'are subnormal in FP16 (1,234 values)', 'would underflow in FP16
    (56 values)'."""
    subnormal, underflow = (int(totals[f"fp16_{kind}_at_scale"].sum()) for kind in ("subnormal", "underflow"))
    if subnormal and underflow:
        return f"are subnormal in FP16 ({subnormal:,} values) or would underflow ({underflow:,})"
    if subnormal:
        return f"are subnormal in FP16 ({subnormal:,} values)"
    return f"would underflow in FP16 ({underflow:,} values)"


#: where weights and optimizer state in a low-precision format break inside the step, the level that keeps
#: them in FP32 (masters and FP32 optimizer state)
FP32_STATE_LEVEL = {"O3": "O2", "bf16-pure": "bf16"}


def nonfinite_step_record(event) -> bool:
    """Whether ``event`` is an optimizer-step record as NonfiniteStepCheck makes it. A run's config may come
    from a child running uploaded code: anything else is ignored rather than trusted."""
    texts = ("optimizer", "weight_dtype")
    return (isinstance(event, dict) and isinstance(event.get("step"), int)
            and all(isinstance(event.get(k), str) for k in texts)
            and isinstance(event.get("state_dtype"), (str, type(None)))
            and all(isinstance(event.get(k), list) and event[k] and all(isinstance(v, str) for v in event[k])
                    for k in ("tensors", "values")))


def optimizer_step_nonfinite(run: pd.Series) -> Finding | None:
    """An optimizer step that made weights or optimizer state inf/NaN while the loss, gradients, weights and
    state it started from were finite: the update itself overflowed (recorded by the runner)."""
    config = run["config"] if isinstance(run["config"], dict) else {}
    event = config.get("optimizer_step_nonfinite")
    if not nonfinite_step_record(event):
        return None
    names = ", ".join(event["values"][:6]) + (" ..." if len(event["values"]) > 6 else "")
    evidence = (f"Step {event['step']}: {event['optimizer']} (weights {event['weight_dtype']}, optimizer state "
                f"{event['state_dtype'] or 'none'}) made {len(event['tensors'])} tensor(s) non-finite: {names}. "
                "The loss, every gradient, weight and state value were finite before that step.")
    target = FP32_STATE_LEVEL.get(run["opt_level"])
    if target is not None:
        recommendation = (f"Keep FP32 master weights and FP32 optimizer state: {FIX}. In "
                          f"{event['state_dtype']} the optimizer's small terms (e.g. Adam's eps=1e-8, squared "
                          "gradients) round to 0 and its update divides by zero.")
    elif "float16" in f"{event['weight_dtype']} {event['state_dtype']}":  # float16 or bfloat16, kept by the loop
        recommendation = (f"The loop keeps the weights ({event['weight_dtype']}) or the optimizer state "
                          f"({event['state_dtype'] or 'none'}) in low precision itself (e.g. model.half()), where the "
                          "optimizer's small terms (Adam's eps=1e-8, squared gradients) round to 0. Keep the weights "
                          "and the optimizer state in FP32 and compute in low precision under torch.autocast (FP16 "
                          "with a GradScaler), or let the optimizer update FP32 master weights (what mpdiag's O2 level "
                          "sets up for a model script).")
    else:
        recommendation = ("The update itself overflows although the optimizer runs in "
                          f"{event['state_dtype'] or event['weight_dtype']}: lower the learning rate or raise "
                          "the optimizer's eps.")
    return Finding(
        rule="optimizer-step-nonfinite", severity="error",
        title="The optimizer step made weights or optimizer state non-finite",
        evidence=evidence, recommendation=recommendation, tensors=list(event["tensors"]),
        fix={"opt_level": target} if target is not None else None, page="Loss_scale",
    )


def scale_collapse(run: pd.Series, steps: pd.DataFrame, hist: np.ndarray,
                   modules: pd.DataFrame | None = None) -> Finding | None:
    """Skipped steps, runs of skips, a scale below 1: overflow that loss scaling keeps backing off from."""
    if steps.empty or run["scaling"] == "none":
        return None
    skipped = steps["skipped"] == 1
    runs_of_skips = (skipped != skipped.shift()).cumsum()[skipped]
    longest = int(runs_of_skips.value_counts().max()) if skipped.any() else 0
    lowest = float(steps["loss_scale"].min())
    if not (skipped.mean() > SKIP_SHARE or longest >= CONSECUTIVE_SKIPS or lowest < 1):
        return None
    nonfinite_loss = ~np.isfinite(steps["loss"])
    forward = bool(skipped.any() and nonfinite_loss[skipped].all())  # "every skipped step" of none says nothing
    # with a trace that found the module, the evidence is shown on the Modules page, opened on that module
    located = first_nonfinite_modules(modules) if modules is not None and len(modules) else {}
    where = located.get("fwd" if forward else "bwd", located.get("fwd"))
    page, focus = ("Modules", {"module": where["module"]}) if where is not None else ("Loss_scale", {})
    evidence = (f"{int(skipped.sum())} of {len(steps)} steps skipped ({skipped.mean():.1%}), longest run {longest}; "
                f"scale fell to {scale_text(lowest)}; loss non-finite at {int(nonfinite_loss.sum())} "
                f"step{'' if int(nonfinite_loss.sum()) == 1 else 's'}."
                + (first_nonfinite(modules) if modules is not None else "")
                + ("" if modules is not None and len(modules) else
                   f" {record_again_with(recorded_by(run.get('config')), 'trace_modules')} to locate the module."))
    if forward:
        return Finding(
            rule="scale-collapse", severity="error",
            title="Overflow in the forward pass: every skipped step had a non-finite loss",
            evidence=evidence + " Backing the scale off cannot help an overflow that happens before the loss.",
            recommendation=f"Run with BF16 (FP32's exponent range, no loss scaling needed): {FIX}. "
                           "Or keep the overflowing op in FP32 (torch.amp.custom_fwd(cast_inputs=torch.float32)).",
            fix={"opt_level": "bf16"}, page=page, focus=focus,
        )
    k = recommended_scale(hist, ceiling=GRADSCALER_DEFAULT_LOG2)  # lower, never above GradScaler's default
    # a scale below 1 that nothing backed off to (a static one, or a custom scaler's) shrinks the gradients
    shrinks = not skipped.any()
    # some skips overflowed before the loss (a user's outlier batches made the loss inf; the card said only that
    # gradients overflow at the scale)
    in_forward = int((nonfinite_loss & skipped).sum())
    if in_forward:
        evidence += (f" {in_forward} of the {int(skipped.sum())} skipped steps had a non-finite loss: those overflowed "
                     "in the forward pass, which backing the scale off cannot help.")
    return Finding(
        rule="scale-collapse", severity="warning",
        title=("The loss scale is below 1: it shrinks gradients toward FP16's underflow instead of lifting them"
               if shrinks else "Gradients overflow FP16 at the loss scale: steps are skipped"
               + (", some after an overflow in the forward pass" if in_forward else "")),
        evidence=evidence,
        recommendation=("Scale up, not down: " if shrinks else "Start the scale lower: ") + FIX if k is not None
        else f"No single scale fits these gradients: {FIX}.",
        fix={"init_scale": float(2**k), "loss_scale": "dynamic"} if k is not None else {"opt_level": "bf16"},
        page=page, focus=focus,
    )


def dead_gradients(run: pd.Series, totals: pd.DataFrame, signals: pd.Series | None = None,
                   underflow: Finding | None = None, twin_totals: pd.DataFrame | None = None) -> Finding | None:
    """Tensors whose gradient was exactly zero at every logged step. Exact zeros are counted at the kept steps
    only: where the run counted more steps (``signals``: Store.step_signal_sums), the evidence says how many. In an
    FP16 run a gradient is all zero too when FP16 flushed every value of it: where the FP32 twin (``twin_totals``)
    has values there, or this run's gradients underflow (``underflow``, its gradient-underflow finding), that fix
    comes first (told to find what blocks the gradient, a user went looking for a detach that was not there)."""
    if totals.empty:
        return None
    dead = totals[(totals["zeros"] == totals["numel"]) & (totals["numel"] > 0)]["tensor"].tolist()
    if not dead:
        return None
    advice = "Find what blocks the gradient upstream of these tensors."
    fix = None
    live_in_fp32 = [] if twin_totals is None else \
        twin_totals[twin_totals["tensor"].isin(dead) & (twin_totals["zeros"] < twin_totals["numel"])]["tensor"].tolist()
    # every gradient zero under a non-zero loss: in FP32 that is next to impossible, in FP16 it is underflow
    all_flushed = len(dead) == int((totals["numel"] > 0).sum()) and np.isfinite(run.get("final_loss", np.nan)) \
        and run.get("final_loss") != 0
    if judged_level(run) in FP16_LEVELS and (live_in_fp32 or underflow is not None or all_flushed):
        said = (f"{', '.join(live_in_fp32[:5])}{' …' if len(live_in_fp32) > 5 else ''} have non-zero gradients in "
                "the FP32 twin, so FP16 flushed them" if live_in_fp32 else
                "This run's gradients underflow FP16 (gradient-underflow), which flushes a small gradient to zero"
                if underflow is not None else
                "Every gradient of this FP16 run is zero while its loss is not: its backward pass flushed them all")
        first = ("apply gradient-underflow's fix first" if underflow is not None else
                 "train in BF16 (FP32's range), or at a far larger loss scale, first")
        advice = (f"{said}: {first}; a tensor whose gradient is still all zero then has it blocked upstream (a "
                  "detach, an unused branch).")
        fix = underflow.fix if underflow is not None else {"opt_level": "bf16"}
    if run["opt_level"] == "O3":
        advice = ("Pure FP16 (O3) also stores normalization statistics in FP16, where a running variance above "
                  "65504 becomes inf and a BatchNorm outputs zeros: keep normalization in FP32 with {FIX}.")
        fix = {"opt_level": "O2"}
    return Finding(
        rule="dead-gradients", severity="warning",
        title=f"{len(dead)} tensor(s) received an all-zero gradient at every logged step",
        evidence=f"{', '.join(dead[:5])}{' …' if len(dead) > 5 else ''}: every value exactly zero at all "
                 f"{int(totals['logged_steps'].max())} logged steps" + _dead_steps_said(totals, signals) + ".",
        recommendation=advice, tensors=dead, fix=fix,
    )


def _dead_steps_said(totals: pd.DataFrame, signals: pd.Series | None) -> str:
    """dead-gradients' note where the run counted more steps than it kept in full: zeros are not counted between."""
    counted = _counted_beyond_kept(totals, signals)
    return (f" (the steps whose full statistics were kept, of {counted:,} counted: exact zeros are counted at kept "
            "steps only)") if counted else ""


def needs_bf16_range(run: pd.Series, tensors: list[str], per_tensor: np.ndarray) -> Finding | None:
    """FP16 levels: tensors whose gradient range is wider than FP16 holds, so no single scale fits.
    ``tensors``/``per_tensor``: each tensor's histogram over all logged steps (Store.histogram_totals)."""
    if judged_level(run) not in FP16_LEVELS:
        return None
    wide = []
    for tensor, hist in zip(tensors, per_tensor, strict=True):
        total = hist.sum()
        if total == 0:
            continue
        cdf = np.cumsum(hist) / total
        lo, hi = int(np.searchsorted(cdf, RANGE_QUANTILE)), int(np.searchsorted(cdf, 1 - RANGE_QUANTILE))
        if hi - lo + 1 > FP16_SPAN_BINS:
            wide.append((tensor, lo + EXP_MIN, hi + EXP_MIN))
    if not wide:
        return None
    return Finding(
        rule="bf16-safer", severity="warning",
        title="Gradient ranges wider than FP16 can hold at any single scale",
        evidence="; ".join(f"{t}: 2^{lo} to 2^{hi}" for t, lo, hi in wide[:5])
                 + f" (99.8 % of values; FP16 spans 2^{FP16.min_subnormal_exponent} to 65504, {FP16_SPAN_BINS} bins).",
        recommendation=f"BF16 has FP32's exponent range: {FIX}.",
        tensors=[t for t, _, _ in wide], fix={"opt_level": "bf16"},
    )


def fp16_overflow(run: pd.Series, store: Store) -> Finding | None:
    """Runs without loss scaling (FP32, BF16, a loop without a GradScaler): gradient values that exceed FP16's
    largest value, counted at every step whether its statistics were kept or not (Store.signal_counts of
    ``fp16_overflow_at_scale``; the scale is 1). The evidence names the first such step, why its statistics were
    kept (Store.kept_steps; with --every N such a step is kept even between two multiples of N) and its tensors
    with their counts, then every step: how many held such values and, per tensor, its values and the step with
    the most, said where that step's full statistics were not kept. With a loss scaler, overflow is the scaler's
    to handle (scale-collapse says when it cannot): nothing is read then (a long scaled run's thousands of
    overflowing steps would be decoded tensor by tensor for nothing)."""
    if run["scaling"] != "none":
        return None
    overflow = store.signal_counts(int(run["run_id"]), "fp16_overflow_at_scale")
    if overflow.empty:
        return None
    kept = store.kept_steps(int(run["run_id"]))
    step = int(overflow["step"].iloc[0])
    why = kept.loc[kept["step"] == step, "reason"].tolist()
    worst = overflow[overflow["step"] == step].sort_values("count", ascending=False, kind="stable")
    per_tensor = _overflow_per_tensor(overflow)
    return Finding(
        rule="fp16-overflow", severity="info",
        title=f"Gradient values exceed FP16's range, first at step {step:,}",
        evidence=(f"At step {step:,}" + (f" (statistics kept: {', '.join(why)})" if why else "") + ", "
                  + "; ".join(f"{t}: {int(n):,} values" for t, n in zip(worst["tensor"][:5], worst["count"][:5],
                                                                          strict=True))
                  + f" cast to inf in FP16 (its largest value is {FP16.max_finite:g}). "
                  + _overflow_over_steps(overflow, per_tensor, set(kept["step"].tolist()))),
        recommendation=("This run would overflow at that step in FP16 without a loss scale below 1; BF16 holds these "
                        "values (FP32's exponent range)."),
        tensors=list(dict.fromkeys(worst["tensor"].tolist() + per_tensor.index.tolist())),
        focus={"step": step},  # the Gradients page opens at that step
    )


def _overflow_per_tensor(overflow: pd.DataFrame) -> pd.DataFrame:
    """Per tensor of Store.signal_counts' rows, most values first: total (summed over the steps), steps (how many
    held any), worst_step and worst (the step with the most, the first of equals, and its count)."""
    worst = overflow.sort_values(["count", "step"], ascending=[False, True], kind="stable").drop_duplicates("tensor")
    worst = worst.set_index("tensor")
    grouped = overflow.groupby("tensor", sort=False)["count"]
    return pd.DataFrame({"total": grouped.sum(), "steps": grouped.size(), "worst_step": worst["step"],
                         "worst": worst["count"]}).sort_values("total", ascending=False, kind="stable")


def _overflow_over_steps(overflow: pd.DataFrame, per_tensor: pd.DataFrame, kept: set[int]) -> str:
    """fp16-overflow's sentence over every step: how many steps held such values (how many of them were not kept
    in full) and, for the five tensors with the most, their values, steps and worst step."""
    steps = overflow["step"].unique()
    if len(steps) == 1:
        return "No other step held such values (every step counted, kept in full or not)."
    dropped = sum(int(s) not in kept for s in steps)
    held = (f"{len(steps):,} steps held such values"
            + (f", {dropped:,} of them with statistics not kept in full (their counts are the per-step signals)"
               if dropped else ""))
    tensors = "; ".join(
        f"{t}: {total:,} values at {n:,} step{'s' if n > 1 else ''}, the most at step {step:,} "
        f"({worst:,}{'' if step in kept else ', statistics not kept'})"
        for t, total, n, step, worst in per_tensor.head(5).astype("int64").itertuples())
    return f"Counted at every step, kept or not: {held}; {tensors}."


def scale_ignored(run: pd.Series, probe: dict | None) -> Finding | None:
    """From the stored scale-linearity probe: tensors whose gradients do not scale with the loss scale."""
    if run["scaling"] == "none" or not probe or not probe.get("ok") or not probe["failing"]:
        return None
    low, high = probe["scales"]
    ratios = ", ".join(f"{t} ×{probe['ratios'][t]:.3g}" for t in probe["failing"][:5])
    functions = probe.get("functions") or []
    where = (f" Custom autograd Function(s) in the graph: {', '.join(functions)}: a backward that ignores "
             "grad_output produces exactly this.") if functions else ""
    return Finding(
        rule="scale-ignored", severity="error",
        title="Gradients do not scale with the loss scale",
        evidence=(f"One batch recomputed at loss scales {low:g} and {high:g}: after unscaling, a correct graph gives "
                  f"the same gradients (ratio 1), but {len(probe['failing'])} tensor(s) changed by "
                  f"{high / low:g}× the other way: {ratios}.{where}"),
        recommendation=("Multiply by grad_output in the Function's backward (and decorate it with "
                        f"torch.amp.custom_fwd/custom_bwd). Until then train without loss scaling: {FIX}."),
        tensors=probe["failing"], fix={"opt_level": "bf16"},
    )


def update_swamping(run: pd.Series, updates: pd.DataFrame) -> Finding | None:
    """Optimizer updates below the weight format's resolution: lost (weights updated in FP16/BF16 directly)
    or kept by FP32 master weights. ``updates``: Store.update_stats (recorded for O2, O3 and bf16-pure)."""
    if updates.empty or not run.get("update_format"):
        return None
    fmt = run["update_format"]
    per_tensor, _ = update_shares(updates)
    updated = int(per_tensor["updated"].sum())
    below, lost = _share(per_tensor["below_resolution"].sum(), updated), _share(per_tensor["unchanged"].sum(), updated)
    rule_text = f"|Δw| < 2^{resolution_log2(fmt)}·|w|"
    tracked = f"over {updates['step'].nunique()} optimizer steps, counting {updated} value updates with a finite non-zero gradient"
    if lost > SWAMPED_SHARE:
        worst = per_tensor[per_tensor["unchanged_share"] > SWAMPED_SHARE]["tensor"].tolist()
        if run["opt_level"] == "custom":  # the script's own loop (watch): no level to rerun it at
            fix, masters = None, ("keep the model in FP32 and cast per op under torch.autocast (BF16, or FP16 with a "
                                  "GradScaler), or give the optimizer FP32 copies of the weights and copy them back "
                                  "after each step.")
        else:
            fix = {"fp16": {"opt_level": "O2"}, "bf16": {"opt_level": "bf16"}}[fmt]
            masters = (f"{FIX} (FP16 model, FP32 masters in the optimizer)." if fmt == "fp16" else
                       f"{FIX} (FP32 weights, BF16 autocast).")
        return Finding(
            rule="update-swamping", severity="warning",
            title=f"Weight updates are lost: too small for {fmt.upper()} weights",
            evidence=(f"{lost:.1%} of updates left the weight unchanged although its gradient was non-zero, and "
                      f"{below:.1%} were below {fmt.upper()}'s resolution ({rule_text}), {tracked}."),
            recommendation="Keep FP32 master weights: " + masters,
            tensors=worst, fix=fix, page="Findings",
        )
    if below > SWAMPED_SHARE:
        return Finding(
            rule="masters-needed", severity="info",
            title=f"Most updates are below {fmt.upper()} resolution; the FP32 master weights keep them",
            evidence=f"{below:.1%} of updates were below {fmt.upper()}'s resolution ({rule_text}), {tracked}; "
                     f"only {lost:.1%} were lost.",
            recommendation=f"Keep the FP32 masters: weights stored in {fmt.upper()} without them (O3) would drop these updates.",
            tensors=per_tensor[per_tensor["below_resolution_share"] > SWAMPED_SHARE]["tensor"].tolist()[:12], page="Findings",
        )
    return None


def gradient_error(run: pd.Series, shadow: pd.DataFrame, underflow: Finding | None) -> Finding | None:
    """From ``--shadow-every``: tensors whose gradients are far from an FP32 computation on the same weights
    and batch. ``underflow``: the run's gradient-underflow finding, when there is one (then the likely cause)."""
    ranking = shadow_ranking(shadow)
    lossy = ranking[ranking["meaningful"] & (ranking["median_rel_error"] > GRADIENT_REL_ERROR)]
    if lossy.empty:
        return None
    level = run["opt_level"]
    if underflow is not None:
        advice = "These gradients underflow: " + underflow.recommendation[0].lower() + underflow.recommendation[1:]
        fix = underflow.fix
    elif level in ("O2", "O3", "bf16-pure", "bf16"):
        advice = ("Run the model under autocast FP16 with FP32 weights, which keeps precision-sensitive ops in FP32: "
                  + FIX + (" (FP16 has 3 more mantissa bits than BF16)." if level.startswith("bf16") else "."))
        fix = {"opt_level": "O1"}
    else:
        advice, fix = ("Keep the modules owning these tensors in FP32: wrap them in torch.autocast(device_type, "
                       "enabled=False) and cast their inputs with .float()."), None
    return Finding(
        rule="gradient-error", severity="warning",
        title=f"{len(lossy)} tensor(s) lose precision: their gradients differ from FP32 by > {GRADIENT_REL_ERROR:.0%}",
        evidence="Against an FP32 computation on the same weights and batch, median over "
                 f"{int(ranking['steps'].max())} shadow steps: "
                 + "; ".join(f"{r.tensor}: relative error {r.median_rel_error:.3g}, cosine ≥ {r.min_cosine:.3f}"
                             for r in lossy.head(5).itertuples()) + ".",
        recommendation=advice, tensors=lossy["tensor"].tolist(), fix=fix, page="Findings",
    )


def fp32_divergence(ref_id: int | None, store: Store, steps: pd.DataFrame, shadow: pd.DataFrame,
                    how: str = "run") -> Finding | None:
    """The loss departs from the FP32 reference run ``ref_id`` (:func:`reference_run`: same script, seed, weights
    and batches). ``steps``: the run's Store.steps, already read; ``shadow``: its Store.shadow_stats, to name the
    tensors whose gradients lose most; ``how``: how the run was recorded (options.recorded_by)."""
    if ref_id is None:
        return None
    comparison = loss_comparison(store.steps(ref_id), steps)
    step = first_divergence(comparison)
    if step is None:
        return None
    final = comparison.iloc[-1]
    ranking = shadow_ranking(shadow)
    ranked = ranking[ranking["meaningful"]].head(3)
    where = (" Tensors whose gradients differ most from the FP32 shadow: "
             + ", ".join(f"{r.tensor} ({r.median_rel_error:.2g})" for r in ranked.itertuples()) + "."
             if len(ranked) else f" {record_again_with(how, 'shadow_every')} to rank the tensors whose gradients lose "
             "precision.")
    return Finding(
        rule="fp32-divergence", severity="warning",
        title=f"The loss departs from FP32 at step {step}",
        evidence=(f"From step {step} the loss differs from FP32 run #{ref_id} by more than {DIVERGENCE_RTOL:.0%} "
                  f"(or only one is finite); at the last common step {int(final['step'])}: {final['loss']:.4g} vs "
                  f"{final['loss_ref']:.4g}.{where}"),
        recommendation="See the other findings for the cause; the Compare page shows both curves.",
        page="Compare",
    )


def lone_rank_steps(rank_steps: pd.DataFrame) -> pd.DataFrame:
    """Per step where some rank's local gradients held inf/NaN before the all-reduce: ``bad``, how many ranks did,
    and ``ranks``, how many reported (``rank_steps``: Store.rank_steps); ``lone`` where not every rank did, and
    ``batch`` where such a rank's own loss was non-finite too while another's was finite: its batch, surely (a lone
    overflow with finite losses is also what a dynamic loss scale's probing does on a batch a little larger)."""
    held = rank_steps.assign(bad=rank_steps["nonfinite"].fillna(0) > 0,
                             finite_loss=np.isfinite(rank_steps["loss"].astype(float)))
    held = held.assign(broke=held["bad"] & ~held["finite_loss"])
    per_step = held.groupby("step").agg(bad=("bad", "sum"), ranks=("rank", "nunique"), broke=("broke", "sum"),
                                        finite=("finite_loss", "sum"))
    per_step = per_step[per_step["bad"] > 0]
    lone = per_step["bad"] < per_step["ranks"]
    # a rank whose own loss was non-finite where another's was finite: its batch broke its forward pass
    return per_step.assign(lone=lone, batch=lone & (per_step["broke"] > 0) & (per_step["finite"] > 0))


def named_rank_step(per_step: pd.DataFrame) -> int | None:
    """The step :func:`rank_nonfinite` names (``per_step``: :func:`lone_rank_steps`): the first whose broken batch
    is sure, else the first where only some ranks held inf/NaN; None when every rank held them at every such step."""
    batch, lone = per_step.index[per_step["batch"]], per_step.index[per_step["lone"]]
    return int(batch.min()) if len(batch) else int(lone.min()) if len(lone) else None


def rank_nonfinite(rank_steps: pd.DataFrame, steps: pd.DataFrame) -> Finding | None:
    """A finding when, at some step, some ranks' local gradients held inf/NaN before the all-reduce and others'
    did not: that rank's batch (one is enough: after the all-reduce every rank holds them and the scaler skips
    the step everywhere). Steps where every rank held them are the model overflowing at its loss scale, not a
    batch (the loss-scale findings): they are counted, never named as a rank's (a step where both ranks of a job
    overflowed at 2^16 was titled "rank 0's batch", and the one step a single rank's batch broke went unnamed).
    The step named is the first where such a rank's own loss was non-finite too (:func:`lone_rank_steps`), else the
    first where only some ranks held them; evidence names each rank that held them there and how the step ended."""
    per_step = lone_rank_steps(rank_steps)
    first_step = named_rank_step(per_step)
    if first_step is None:
        return None
    lone, sure = per_step[per_step["lone"]], bool(per_step.loc[first_step, "batch"])
    at_first = rank_steps[(rank_steps["step"] == first_step) & (rank_steps["nonfinite"].fillna(0) > 0)]
    held = ", ".join(f"rank {int(r.rank)}'s local gradients held {int(r.nonfinite)} inf/NaN"
                     for r in at_first.itertuples())
    skipped = steps.loc[steps["step"] == first_step, "skipped"]
    outcome = {1.0: "every rank skipped the step", 0.0: "the optimizer step ran on every rank"}.get(
        float(skipped.iloc[0]) if len(skipped) else float("nan"), "whether the step ran is not recorded")
    culprits = sorted({int(r) for r in rank_steps.loc[rank_steps["step"].isin(lone.index)
                                                       & (rank_steps["nonfinite"].fillna(0) > 0), "rank"]})
    others = len(lone) - 1
    more = (f" {others} other step(s) had them on some ranks only (ranks {', '.join(map(str, culprits))} in all)."
            if others else "")
    everywhere = int((~per_step["lone"]).sum())
    if everywhere:
        more += (f" At {everywhere} step(s) every rank held them: the model overflowing at its loss scale, not one "
                 "batch (see the loss-scale findings).")
    who = " and ".join(f"rank {int(r)}" for r in at_first["rank"])
    if sure:
        title, why = f"{who}'s batch produced inf/NaN gradients and loss the other ranks' did not", ""
    else:
        title = f"{who}'s gradients held inf/NaN the other ranks' did not"
        why = (" Its loss was finite: at a dynamic loss scale that is often the scale's probing meeting a slightly "
               "larger batch, not a broken one.")
    return Finding(
        rule="rank-nonfinite",
        severity="warning",
        title=title,
        evidence=f"step {first_step}: {held} before the all-reduce; {outcome}.{more}{why}",
        recommendation="Inspect what that rank's data loader gave it at that step (its shard of the data): an "
                       "outlier batch overflows on one rank and costs every rank the step. If it recurs on "
                       "varying ranks, the model itself overflows; see the loss-scale findings.",
        page="Loss_scale",
    )


def _amount(absmax: float, nonfinite: int, limit: float | None) -> str:
    if nonfinite:
        return f"held {int(nonfinite)} inf/NaN value(s)"
    return f"reached {absmax:g}, past FP16's largest finite value {limit:g}"


#: the stored trigger of a loss spike's replay (mpdiag.recording.replay.LOSS_SPIKE_TRIGGER; analysis imports no torch)
SPIKE_TRIGGER = "loss spike"


def nonfinite_origin(replays: pd.DataFrame, modules: pd.DataFrame) -> Finding | None:
    """The replay of the run's first non-finite step (:mod:`mpdiag.recording.replay`): the first module, in
    execution order, whose forward output or backward gradient turned inf/NaN (or past FP16's max under FP16)
    while what it received was not, and whether the replay reproduced the event. An error when it did (numerics:
    the same weights, batch and random state give it again); a warning when it did not (the event came from
    something a replay does not repeat)."""
    replays = replays[replays["trigger"] != SPIKE_TRIGGER]
    if replays.empty:
        return None
    replay = replays.iloc[0]
    step, phase, name = int(replay["step"]), replay["first_phase"], replay["first_module"]
    how = (f"mpdiag replayed step {step} ({replay['trigger']}) on a copy of the model with a hook on every module"
           + (f", under {replay['low_format'].upper()}" if isinstance(replay["low_format"], str) else "") + ": ")
    focus = {"replay": step}
    if not isinstance(name, str):
        note = f" ({replay['note']})" if isinstance(replay["note"], str) else ""
        return Finding(
            rule="nonfinite-origin", severity="warning",
            title=f"step {step}'s inf/NaN did not reproduce in a replay",
            evidence=how + "no module's output or gradient was inf/NaN" + note + ". The event came from something "
                     "the replay does not repeat: non-determinism (atomics, a kernel's race), the hardware, or the loss "
                     "computed outside the model.",
            recommendation="Rerun the same seed: if the event moves or vanishes, suspect the hardware or a "
                           "non-deterministic kernel (torch.use_deterministic_algorithms(True) to tell); if the loss "
                           "function is outside the model, check it for log(0) or a division by zero.",
            page="Modules", focus=focus)
    at_step = modules[(modules["step"] == step) & (modules["module"] == name)]
    rows = at_step[at_step["phase"] == phase]
    label = f" ({rows['type'].iloc[0]})" if len(rows) else ""  # a Sequential's child is named 0, 1, ...
    forward = at_step[at_step["phase"] == "forward"]
    what, advice = _origin_said(replay, rows.iloc[0] if len(rows) else None, label,
                                forward["in_absmax"].iloc[0] if len(forward) else None)
    reproduced = bool(replay["reproduced"])
    verdict = (" The replay reproduced the event: numerics, deterministic given the step's weights, batch and "
               "random state." if reproduced else " The replay met no inf/NaN itself (only a value past the "
               "format's max), so the event may also need what the replay does not repeat.")
    return Finding(
        rule="nonfinite-origin", severity="error" if reproduced else "warning",
        title=f"step {step}: the first inf/NaN was born in {module_said(name)}{label} in the {phase}",
        evidence=how + what + "." + verdict,
        recommendation=advice, page="Modules", focus=focus)


#: a loss spike's rise over the mean of the values before it (the spike rule's window) from which a spike the
#: replay could not localise is a warning: below it (a 6-sigma rise of a flat loss can be 15 %: the Quick start's
#: failing run drifts up so) nothing in it tells the user what to change, and the finding is information
SPIKE_WARNING_RISE = 0.5
#: the spike rule's window (mpdiag.recording.events.SPIKE_WINDOW: the finite values a spike is measured against)
SPIKE_WINDOW = 128


def loss_spike_origin(replays: pd.DataFrame, steps: pd.DataFrame) -> Finding | None:
    """The replay of the run's first loss spike (:mod:`mpdiag.recording.replay`): its step's and the previous
    step's batches run forward on one copy of the model, and what first grew by the replay's factor - the batch
    itself, or a module whose output did while its inputs did not - in the replay's own words and numbers (its
    note), with the spike's rise over the mean of the finite losses before it (``steps``: the run's). A warning
    (a spike is a symptom the training may recover from); information when nothing was localised and the loss
    rose less than :data:`SPIKE_WARNING_RISE`."""
    spikes = replays[replays["trigger"] == SPIKE_TRIGGER]
    if spikes.empty:
        return None
    replay = spikes.iloc[0]
    step, name = int(replay["step"]), replay["first_module"]
    found = replay["note"] if isinstance(replay["note"], str) else "nothing was found"
    rise = _rise_at(steps, step)
    rose = "" if rise is None else f": {rise:.0%} above the mean of up to {SPIKE_WINDOW} finite losses before it"
    severity = "warning"
    if name == "(inputs)":
        title = f"step {step}'s loss spike came in with its batch"
        advice = ("Check what the data loader gave at that step: a corrupted, unnormalised or mislabelled batch. "
                  "Filter or clip such batches before the model sees them.")
    elif isinstance(name, str):
        title = f"step {step}'s loss spike began in {module_said(name)}"
        advice = (f"Look at what '{name}' computes for that batch: a product or an exponential that grows with "
                  "its inputs' scale (normalise before it, clip its output), or weights an earlier step made large.")
    elif rise is not None and rise < SPIKE_WARNING_RISE:
        severity = "info"
        title = f"step {step}'s loss rose {rise:.0%}: no module or batch behind it"
        advice = ("Nothing to change for this rise alone: no module and no batch grew with it. If larger spikes "
                  "follow, check the loss function, the targets and the learning rate at their steps; the other "
                  "findings say what else is wrong with the run.")
    else:
        title = f"step {step}'s loss spike was not localised in the model"
        found += (": the spike came from outside the model (the loss function, the targets) or from a rise spread "
                  "over many modules")
        advice = ("Check the loss function and the targets at that step; a rise spread over many modules points "
                  "at the weights (the learning rate, the previous updates) rather than one module.")
    return Finding(
        rule="loss-spike-origin", severity=severity, title=title,
        evidence=(f"mpdiag replayed the forwards of step {step} (a loss spike{rose}) and of step {step - 1} on one "
                  f"copy of the model with step {step}'s weights: {found}."),
        recommendation=advice, page="Modules", focus={"replay": step})


def _rise_at(steps: pd.DataFrame, step: int) -> float | None:
    """The loss at ``step`` over the mean of the last SPIKE_WINDOW finite losses before it, minus 1 (what the
    spike rule measured); None when the run's steps do not hold them."""
    before = steps.loc[steps["step"] < step, "loss"]
    before = before[np.isfinite(before)].tail(SPIKE_WINDOW)
    at = steps.loc[steps["step"] == step, "loss"]
    if before.empty or at.empty or not np.isfinite(at.iloc[0]) or before.mean() <= 0:
        return None
    return float(at.iloc[0] / before.mean() - 1)


#: a module's forward input from which a gradient born in its backward is said to be its input's doing: a
#: weight's gradient is the output gradient times the input, and FP16 holds at most 65504
LARGE_INPUT_ABSMAX = 2.0**10


def _origin_said(replay: pd.Series, row: pd.Series | None, label: str,
                 forward_input: float | None = None) -> tuple[str, str]:
    """(what the replay found, what to do) for :func:`nonfinite_origin`: the first offender's stored ``row``
    (None for the step's inputs or the loss), ``label`` its module type in brackets, ``forward_input`` the absmax
    of what it received in the replay's forward (a Linear fed an unnormalised batch, ~15,000 after two layers, made
    a weight gradient past FP16's max; the advice looked for a custom autograd Function instead)."""
    phase, name = replay["first_phase"], replay["first_module"]
    limit = replay["format_max"] if pd.notna(replay["format_max"]) else None
    if name == "(inputs)":
        what = "the step's inputs already held inf/NaN (or values past FP16's max) before any module ran"
        advice = "Check what the data loader gave at that step: a corrupted or unnormalised batch."
    elif name == "(loss)":
        what = ("the gradient of the model's output, from the loss computed outside the model, was already "
                "inf/NaN: every module was finite in the forward")
        advice = "Check the loss function for log(0), a division by zero or an overflow in FP16."
    else:
        produced, received = ("output", "inputs") if phase == "forward" else ("gradient", "output gradient")
        amount = _amount(row["absmax"], row["nonfinite"], limit) if row is not None else "went bad"
        was = (f" (absmax {row['in_absmax']:g})" if row is not None and pd.notna(row["in_absmax"]) else "")
        what = (f"{module_said(name)}{label} was the first, in execution order, whose {phase} {produced} {amount} while "
                f"its {received} {'were' if phase == 'forward' else 'was'} finite{was}")
        advice = (f"Look at what '{name}' computes in its forward: keep it in FP32 (autocast(enabled=False) around "
                  "it), scale its inputs down (attention scores: scale q by 1/sqrt(d) before the product), or train "
                  "in BF16 (FP32's range)." if phase == "forward" else
                  f"Its input in the forward reached absmax {forward_input:,.0f}, and a weight's gradient is the output "
                  "gradient times that input: scale the inputs down where they come from (normalise the batch, or "
                  f"the activations before '{name}'), keep '{name}' in FP32, or train in BF16 (FP32's range)."
                  if forward_input is not None and forward_input >= LARGE_INPUT_ABSMAX else
                  f"Look at the backward of '{name}' (a custom autograd Function's in particular): it produces a gradient "
                  "FP16 cannot hold even before any loss scale. Compute it in FP32, or train in BF16 (FP32's range).")
    note = replay["note"] if isinstance(replay["note"], str) else None
    if note is not None and note.startswith("its weights already"):
        what += f" - {note.replace('its weights', 'but its weights')}"
        advice = ("The weights were inf/NaN before this step: an earlier optimizer step broke them (see "
                  "optimizer-step-nonfinite where it was checked); the module itself is not where it began.")
    elif note is not None:
        what += f" ({note})"
    return what, advice


def diagnose(store: Store, run_id: int, runs: pd.DataFrame | None = None,
             steps: pd.DataFrame | None = None) -> list[Finding]:
    """All findings of one run, most severe first. ``runs``: the store's runs table where the caller has read it
    (a dashboard page reads it once per render), else it is read here; ``steps``: the run's Store.steps where
    the caller has read them (a page has its cached read), else they are read here."""
    runs = store.runs() if runs is None else runs
    run = runs[runs["run_id"] == int(run_id)].iloc[0]
    totals = store.tensor_totals(run_id)
    steps = store.steps(run_id) if steps is None else steps
    signals = store.step_signal_sums(run_id)  # every step's counts, kept in full or not
    tensors, per_tensor = store.histogram_totals(run_id)  # each tensor's histogram over all logged steps
    hist = per_tensor.sum(axis=0)
    probe = store.probe(run_id, "scale-linearity")
    ignored = scale_ignored(run, probe)
    # gradients that ignore the scale look like underflow too; the cause is reported instead
    shadow = store.shadow_stats(run_id)
    twin_row = fp32_twin_row(runs, run)
    twin = None if twin_row is None else int(twin_row["run_id"])
    reference = reference_run(runs, int(run_id))  # read once: the divergence and the underflow's severity use it
    divergence = fp32_divergence(reference, store, steps, shadow, recorded_by(run["config"]))
    # the twin's zeros tell the ones FP16 flushed only while the two runs' weights are alike: not once they part
    parted = None if twin is None else twin_parted_at(steps, store.steps(twin))
    twin_totals = None if twin is None or parted is not None else store.tensor_totals(twin)
    underflow = None if ignored else low_range(
        run, totals, hist, twin_totals, int(shadow["step"].nunique()),
        None if twin is None else store.histogram_totals(twin)[1].sum(axis=0), signals,
        tracks_fp32=divergence is None and reference is not None, twin_parted_at=parted)
    collapse = scale_collapse(run, steps, hist, store.module_stats(run_id))
    after_collapse = underflow is not None and collapse is not None and _backed_off_below_one(steps)
    if after_collapse:  # the underflow may be the collapse's doing: said, and listed after it
        underflow = dataclasses.replace(underflow, evidence=underflow.evidence + (
            f" The scale backed off to {scale_text(steps['loss_scale'].min())} after overflows (scale-collapse, "
            "above): below a scale of 1 gradients underflow that would not at the scale the run started at, so fix "
            "the overflow first and read this again."))
    found = [
        optimizer_step_nonfinite(run),  # first: it explains the non-finite losses and skips that follow
        ignored,
        *([collapse] if after_collapse else []),
        underflow,
        gradient_error(run, shadow, underflow),
        update_swamping(run, store.update_stats(run_id)),
        *([] if after_collapse else [collapse]),
        # after it: where the first inf/NaN was born, once scale-collapse has said what to change
        nonfinite_origin(store.replays(run_id), store.replay_modules(run_id)),
        loss_spike_origin(store.replays(run_id), steps),
        dead_gradients(run, totals, signals, underflow, twin_totals),
        needs_bf16_range(run, tensors, per_tensor),
        fp16_overflow(run, store),
        divergence,
        rank_nonfinite(store.rank_steps(run_id), steps),
    ]
    how = recorded_by(run["config"])  # each advice names its fix as this run's way of recording can make it
    findings = [dataclasses.replace(f, recommendation=f.recommendation.replace(FIX, fix_said(f.fix, how)))
                for f in found if f is not None]
    fp8 = recorded_settings(run["config"])
    if fp8 is not None:
        findings += fp8_findings(store.fp8(run_id), fp8)
    return sorted(findings, key=lambda f: SEVERITY_ORDER[f.severity])


def _backed_off_below_one(steps: pd.DataFrame) -> bool:
    """Whether GradScaler backed the scale off below 1 (skipped steps, and a scale under 1 after them): an FP16 run
    whose overflows collapsed its scale then underflows as a consequence (a user read the underflow, listed first,
    as the cause, where 94 % of its subnormal values came from the steps at a scale below 1)."""
    scale = steps["loss_scale"].astype(float)
    return bool((steps["skipped"] == 1).any() and (scale < 1).any() and scale.iloc[0] >= 1)


def finding_resolved(before: Finding, after: list[Finding]) -> bool:
    """Whether a rerun no longer shows the rule a finding came from, other than as information (a rerun whose
    gradients stay partly subnormal while its loss tracks FP32 has fixed what the finding warned of)."""
    return all(f.rule != before.rule or f.severity == "info" for f in after)



def fix_options(runs: pd.DataFrame, run_id: int, finding: Finding) -> dict:
    """Rerun options that apply ``finding``'s fix; with an FP32 twin when no FP32 reference exists to judge the
    rerun's loss against (and the fix is not itself FP32), except for a watched run: watch runs no twin."""
    if watch_settings(runs.set_index("run_id").loc[int(run_id), "config"]) is not None:
        return watch_fix(finding.fix)
    twin = reference_run(runs, int(run_id)) is None and finding.fix.get("opt_level") != "O0"
    return dict(finding.fix, pair=twin)


def fix_not_rerunnable(run_config: dict, fix: dict, world_size=1, scaling: str | None = None) -> str | None:
    """Why a rerun with ``fix`` cannot be started for a run with this stored config (``world_size`` ranks, its
    ``scaling``), or None when it can: a run recorded by a Recorder in the user's own loop has nothing mpdiag can
    rerun; a watched run can be given only what watch imposes on an unmodified script (an initial scale only to the
    script's own GradScalers: a half model trained without one got a rerun that changed nothing), and a watched
    torchrun job is repeated with torchrun (:func:`~mpdiag.options.torchrun_rerun`)."""
    wanted = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in fix.items())
    watched = watch_settings(run_config) is not None
    if watched and "init_scale" in watch_fix(fix) and scaling == "none":
        return (f"The script has no GradScaler for mpdiag watch to start at {wanted}: add one to it "
                "(torch.amp.GradScaler, its scaler.scale(loss).backward(), scaler.step and scaler.update), or train in "
                "BF16, then record it again.")
    if rerunnable_by_watch(run_config, fix):
        refused = torchrun_rerun(run_config, world_size, command_flags(watch_fix(fix)))
        return None if refused is None else f"{refused[0].upper()}{refused[1:]}."
    if "run" in run_config:
        return None
    if watched:
        return (f"mpdiag watch cannot apply {wanted} to an unmodified script (watch sets the script's autocast "
                "dtype, its GradScalers and their initial scale; O2, O3 and the pure levels change how it builds "
                "its model): make the change in the script, or give it the model-script contract and use mpdiag run.")
    in_code = fix_in_code(fix)
    change = in_code if in_code is not None else f"set {wanted} in your loop"
    return f"This run was recorded from your own loop (a Recorder), so mpdiag cannot rerun it: {change}, and record it again."


#: anchors of the Findings page's own evidence sections, for findings whose page is "Findings"
EVIDENCE_SECTIONS = {"gradient-error": "shadow", "update-swamping": "updates", "masters-needed": "updates"}


def evidence_link(finding: Finding, run_id: int) -> str:
    """Where a finding's evidence is shown: an anchor on the Findings page, or a page path with the run (and
    the worst tensor on the Gradients page) as query parameters."""
    if finding.page == "Findings":
        return f"#{EVIDENCE_SECTIONS[finding.rule]}"
    query = {"run": int(run_id)} if finding.page != "Compare" else {"runs": int(run_id)}
    if finding.page == "Gradients" and finding.tensors:
        query["tensor"] = finding.tensors[0]
    query.update(finding.focus)
    return f"/{finding.page}?{urlencode(query)}"


def rerun_outcomes(store: Store, run_id: int, findings: list[Finding], runs: pd.DataFrame | None = None) -> pd.DataFrame:
    """The reruns of a run (its mixed-precision children), one row each after the run's own (``this run`` True),
    whose losses they are read against: run id, status, final loss, and for a finished one its final loss against
    its FP32 reference ("vs FP32": relative difference in percent); for a finished rerun, per finding of the
    parent whether its rule is "gone" or "still there". Empty when the run was never rerun. ``runs`` as for
    :func:`diagnose`."""
    runs = store.runs() if runs is None else runs
    if runs.empty:
        return pd.DataFrame()
    children = runs[(runs["parent_run_id"] == int(run_id)) & (runs["opt_level"] != "O0")]
    if children.empty:
        return pd.DataFrame()
    rows = [{**_loss_outcome(runs, runs.loc[runs["run_id"] == int(run_id)].iloc[0]), "this run": True}]
    for _, child in children.iterrows():
        row = {**_loss_outcome(runs, child), "this run": False}
        if child["status"] == "finished":
            after = diagnose(store, int(child["run_id"]), runs)
            for f in findings:
                row[f.rule] = "gone" if finding_resolved(f, after) else "still there"
        rows.append(row)
    return pd.DataFrame(rows)


def _loss_outcome(runs: pd.DataFrame, run: pd.Series) -> dict:
    """A run's row of :func:`rerun_outcomes` without its findings; a finished one's loss against its FP32
    reference too."""
    row = {"run": int(run["run_id"]), "name": run["name"], "opt level": run["opt_level"], "status": run["status"],
           "final loss": run["final_loss"]}
    ref = reference_run(runs, int(run["run_id"])) if run["status"] == "finished" else None
    if ref is not None:
        ref_loss = float(runs.loc[runs["run_id"] == ref, "final_loss"].iloc[0])
        row["FP32 final loss"] = ref_loss
        row["vs FP32"] = 100 * (run["final_loss"] - ref_loss) / abs(ref_loss) if ref_loss else float("nan")
    return row
