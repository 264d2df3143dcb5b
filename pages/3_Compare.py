"""Compare: 2-4 runs side by side (FP32 versus mixed, opt levels, scales), each in a fixed colour.

Reads widgets, asks mpdiag.dashboard.compare_model for what to show and draws it with the chart layer; no store
queries, no torch. Run names are the user's: they reach Markdown only through ``plain``.
"""

import pandas as pd
import streamlit as st

from mpdiag.analysis.compare import (
    COUNTED_PART,
    DIVERGENCE_RTOL,
    FLUSHED_PART,
    NO_SCALE,
    NO_STEP,
    NO_TENSOR,
    NO_VALUES,
    NONFINITE_PART,
    OVERFLOW_PART,
    X_AXES,
    default_selection,
)
from mpdiag.dashboard import charts, compare_model, reads
from mpdiag.dashboard import frame as ui
from mpdiag.dashboard.compare_model import CompareRuns, Curves
from mpdiag.dashboard.untrusted import plain

#: the run column of the histogram's table (few columns): room for a rerun's label, whose end tells it apart; hover a
#: cell for the whole label, kept in view when scrolled
WIDE_RUN_COLUMN = st.column_config.TextColumn("run", width="large", pinned=True, help="Hover a cell for the whole label.")

#: the histogram's views: the unscaled gradient, or S·g at each run's loss scale
HIST_VIEWS = ["unscaled g", "at the loss scale (S·g)"]


def curve_controls(store, chosen: pd.DataFrame, all_runs: pd.DataFrame) -> tuple[CompareRuns, Curves, bool, float]:
    """TensorBoard's controls over the curves: smoothing weight, log y for the loss (on at first where the runs'
    drawn losses span more than charts.LOG_LOSS_SPAN: charts.losses_far_apart), the x axis; the runs' view and
    its curves for them, and the smoothing weight."""
    left, middle, right = st.columns([2, 1, 2])
    weight = left.slider("Smoothing", min_value=0.0, max_value=0.99, value=0.0, step=0.01, key="smoothing",
                         help="TensorBoard's debiased exponential moving average of the loss and the gradient norm "
                              "(0: none). The raw curve stays drawn, faint, behind the smoothed one.")
    x_label = right.radio("x axis", list(X_AXES), horizontal=True, key="x_axis",
                          help="Wall time: seconds since each run's recording started, at the end of each step.")
    model = compare_model.compare(store, chosen, all_runs, weight)
    # from every loss drawn, not the final ones: runs ending 3.3x apart after falling 3 decades sat on "0"
    log_loss = middle.toggle("Log loss axis", value=charts.losses_far_apart(model.everything["loss"]),
                             key="loss_log", help="On at first when the losses drawn (all runs, all steps) span "
                                                  f"more than {charts.LOG_LOSS_SPAN}x.")
    return model, model.curves(X_AXES[x_label], smooth=weight > 0), log_loss, weight


def compare_view(store, chosen: pd.DataFrame, all_runs: pd.DataFrame) -> None:
    model, curves, log_loss, weight = curve_controls(store, chosen, all_runs)
    if curves.curves.empty:
        st.info("None of these runs recorded a wall time per step: choose the step axis.")
        return
    # loss, its difference to FP32, the loss scale, the learning rate and the gradient norm on one x axis:
    # zooming one zooms all
    ui.show_chart(charts.stacked_over_steps(*panels(curves, model.labels, log_loss)), width="stretch")
    st.caption("Drag or scroll on any of these panels to pan or zoom the steps of them all."
               + (f" Smoothing {weight:.2f}: the faint lines are the recorded values." if curves.smooth else ""))
    for sentence in curves.said:
        st.caption(sentence)
    st.markdown("  \n".join(curves.notes))
    costs(model)
    fp16_shares(model)
    histograms_overlaid(model)
    st.subheader("Configuration")
    only_diff = st.checkbox("Only settings that differ", value=True, key="only_diff")
    st.dataframe(model.configuration(only_diff), width="stretch",
                 column_config=ui.column_config(model.configuration_columns()))


def panels(curves: Curves, labels: list[str], log_loss: bool) -> list:
    """The stacked panels, each only where some run recorded what it draws."""
    c, x, smooth = curves.curves, curves.x, curves.smooth
    drawn = [charts.runs_overlay(c, "loss", "loss", labels, log=log_loss, log_base=10, x=x, smooth=smooth)]
    if curves.diffs is not None and x == "step":
        drawn.append(charts.loss_difference(curves.diffs, curves.first, labels, DIVERGENCE_RTOL))
    if len(curves.scaled):
        drawn.append(charts.runs_overlay(curves.scaled, "loss_scale", "loss scale", labels, log=True, x=x))
    if len(curves.lr):
        drawn.append(charts.runs_overlay(curves.lr, "lr", "learning rate", labels, height=180, x=x, zero=True))
    if curves.normed is not None:
        drawn.append(charts.runs_overlay(curves.normed, "grad_norm", "gradient norm (unscaled, before clipping)",
                                         labels, log=True, log_base=10, height=200, x=x, smooth=smooth,
                                         axis_title="gradient norm"))  # the whole title ran past the 200 px plot
    return drawn


def costs(model: CompareRuns) -> None:
    """Step time and peak memory one above the other, each the page's width (side by side each was too narrow
    for its legend and buttons), then the cost table."""
    said, labels, box = model.costs(), model.labels, st.container()
    if len(said.timed):
        ui.show_chart_in(box, charts.runs_overlay(said.timed, "step_time_s", "step time (s), from step 1", labels),
                         width="stretch")
    else:
        box.caption("Step time: no step after the warm-up step 0 was recorded, so there is nothing to chart.")
    for sentence in (said.warmups, said.outliers):
        if sentence is not None:
            box.caption(sentence)
    if said.memory is not None:
        ui.show_chart_in(box, charts.runs_overlay(said.memory, "peak_mem_mb", "peak memory so far (MiB)", labels,
                                                  zero=True), width="stretch")
    else:
        box.caption("Peak memory: none of these runs recorded it.")
    ui.table(said.table, compare_model.COST_COLUMNS)
    st.caption("Median step time is over the steps after the warm-up step 0. Peak memory is the CUDA allocator's "
               "peak on a GPU and the process's peak RSS on a CPU; model state is the bytes allocated for weights, "
               "gradients, master weights and optimizer state.")


def fp16_shares(model: CompareRuns) -> None:
    """FP16 underflow and overflow per tensor, each run's bars what is true of that run."""
    st.subheader("FP16 underflow and overflow per tensor (all logged steps)")
    shares, labels = model.fp16_shares(), model.labels
    if shares.no_stats:
        st.caption("No gradient statistics recorded (yet) for " + "; ".join(plain(lab) for lab in shares.no_stats)
                   + ".")
    if shares.under is None:
        return
    if len(shares.under):
        drawn = [p for p in (FLUSHED_PART, COUNTED_PART) if p in set(shares.under["part"])]
        ui.show_chart(charts.runs_bars(shares.under, "tensor", "share", "FP16 underflow, share of all values", labels,
                                       parts=drawn), width="stretch")
        said = {FLUSHED_PART: "the values an FP16 run's backward pass had already made zero when they were "
                              "recorded, estimated as its zeros beyond its FP32 twin's (same weights and batches, while their losses "
                              "track)",
                COUNTED_PART: "the recorded gradient at its run's loss scale, cast to FP16 and counted; for a run "
                              "computed in FP32 or BF16 (O0, bf16) that is what FP16 would lose, not a loss the "
                              "run had"}
        st.caption(f"Solid bars, “{drawn[0]}”: {said[drawn[0]]}. Light bars, “{drawn[1]}”: {said[drawn[1]]}."
                   if len(drawn) > 1 else f"“{drawn[0]}”: {said[drawn[0]]}.")
        for lab, parts in shares.under.groupby("run", sort=False):  # a run drawn at 0 everywhere looked left out
            if (parts["share"] == 0).all():
                what = " or ".join(said_short for part, said_short in ((FLUSHED_PART, "flushed to zero"),
                                                                       (COUNTED_PART, "would underflow FP16"))
                                   if part in set(parts["part"]))
                st.caption(plain(f"{lab}: no value of any tensor {what} (its bars are at 0)."))
    else:  # what an FP16 run without its twin flushed is not known: nothing is said of it here (see below)
        flushed = "" if shares.no_twin else "was flushed to zero or "
        st.caption(f"FP16 underflow: no value of any tensor of these runs {flushed}would underflow FP16 at its run's "
                   "loss scale, so there is nothing to chart.")
    for lab, why in shares.no_twin:
        st.caption(plain(f"{lab}: {why}"))
    if len(shares.over):
        drawn = [p for p in (NONFINITE_PART, OVERFLOW_PART) if p in set(shares.over["part"])]
        ui.show_chart(charts.runs_bars(shares.over, "tensor", "share", "FP16 overflow at the loss scale, share of all "
                                       "values", labels, parts=drawn), width="stretch")
        st.caption(f"Solid bars, “{NONFINITE_PART}”: an FP16 backward pass makes a value that overflows inf "
                   "before it is recorded (a non-finite loss makes them inf or NaN too). Light bars, "
                   f"“{OVERFLOW_PART}”: the recorded finite gradient at its run's "
                   "loss scale above FP16's largest value, 65,504; for a run computed in FP32 or BF16 (O0, bf16) that "
                   "is what FP16 would do, not an overflow the run had.")
    else:
        st.caption("FP16 overflow: no recorded gradient value of these runs was inf or NaN, or at its run's loss "
                   "scale above FP16's largest value 65,504, so there is nothing to chart.")


def histograms_overlaid(model: CompareRuns) -> None:
    """One tensor's exponent histogram in each run, of the unscaled gradient g or of S·g at each run's own loss
    scale (what its FP16 backward held; the view opens there when a run shown ran at a scale other than 1), at one
    step or summed, overlaid in the runs' colours with FP16's limits; each run's zero share beside it, and the
    runs without a line named."""
    st.subheader("Gradient histograms, overlaid")
    tensors, offered, common = model.histogram_choices()
    if not tensors or not offered:
        st.caption("None of these runs recorded gradient statistics (yet), so there is no histogram to overlay.")
        return
    if st.session_state.get("hist_tensor") not in tensors:
        st.session_state["hist_tensor"] = tensors[0]
    if st.session_state.get("hist_step") not in offered:  # at first: the last step all of them logged
        st.session_state["hist_step"] = common
    left, right = st.columns([3, 1])
    tensor = left.selectbox("Tensor (worst FP16 underflow of the first run first; type to search)", tensors,
                            key="hist_tensor")
    summed = right.toggle("All logged steps (summed)", key="hist_summed")
    # on g alone, the fix of a pair (scaled by 2^20) sat left of FP16's 2^-24 line, read as flushing everything,
    # above a table saying 0 % zeros
    view = st.radio("Gradient", HIST_VIEWS, index=int(model.scaled()), horizontal=True, key="hist_view",
                    help="S·g is each run's gradient at the loss scale it ran at, as its backward pass held it: what "
                         "FP16 had to hold, so FP16's limits drawn mean what they say. g is the unscaled gradient.")
    step = None if summed else ui.step_slider(
        "Step (steps any of these runs logged)", offered, "hist_step",
        help=f"The last step all of them logged is {common:,}.") if len(offered) > 1 else offered[0]
    overlay = model.overlay(tensor, step, view != HIST_VIEWS[0])
    if len(overlay.bins):
        ui.show_chart(charts.runs_histograms(overlay.bins, overlay.lines, model.labels,
                                             f"{tensor}: {overlay.what}, {overlay.when}",
                                             "S·g" if view != HIST_VIEWS[0] else "g"), width="stretch")
    if overlay.scale_said is not None:
        st.caption(overlay.scale_said)
    overlay_table(overlay, tensor, step)


def overlay_table(overlay: compare_model.Overlay, tensor: str, step: int | None) -> None:
    """The runs without a line, named with why, and each drawn run's values and zero share."""
    per_run, when = overlay.per_run, overlay.when
    for why, sentence in ((NO_TENSOR, f"No line: these runs did not record the tensor {tensor}"),
                          (NO_STEP, "No line: these runs did not log " + ("any step of it" if step is None else
                                                                           f"step {step:,}")),
                          (NO_VALUES, f"No line: every value of {tensor} at {when} was zero, NaN or inf in"),
                          (NO_SCALE, f"No S·g line: no loss scale was written for {when} (the run ended before its "
                                     "step was), so its g cannot be placed at the scale it ran at, in")):
        missing = per_run.loc[per_run["missing"] == why, "run"].tolist()
        if missing:
            st.caption(plain(f"{sentence}: " + "; ".join(missing) + "."))
    if overlay.counted:
        st.caption(f"Counted at {when} all the same (every step's inf/NaN and FP16 over/underflow are kept, its "
                   "histogram only at the steps kept in full): " + "; ".join(overlay.counted) + ".")
    drawn = per_run[~per_run["missing"].isin([NO_TENSOR, NO_STEP])]
    if len(drawn):
        st.dataframe(pd.DataFrame({
            "run": drawn["run"], "values": drawn["numel"], "finite non-zero": drawn["finite_nonzero"],
            "zeros": drawn["zero_share"], "NaN / inf": drawn["nonfinite"]}),
            hide_index=True, width="stretch",
            column_config={"run": WIDE_RUN_COLUMN,
                           "zeros": st.column_config.NumberColumn("zeros (%)", format="percent",
                                                                  help="Exact zeros, as a share of all values."),
                           "finite non-zero": st.column_config.NumberColumn(
                               format="localized", help="The values the histogram's shares are of (its 100 %)."),
                           **{c: st.column_config.NumberColumn(format="localized") for c in ("values", "NaN / inf")}})
        st.caption("Shares are of each run's finite non-zero values of this tensor, so runs logged at different "
                   "steps compare. A run computed in FP16 records the values its backward pass flushed to zero as "
                   "exact zeros, which no bin holds: its histogram can look healthy while its zero share, beside "
                   "its FP32 twin's, says what it lost.")


def compare_page(store) -> None:
    runs = store.runs()
    if len(runs) < 2:
        st.info("Comparing needs at least two runs. Start runs on the Runs page (tick 'Also run an FP32 twin').")
        return
    selected = ui.pick_runs(runs, default=default_selection(runs),
                            label="Runs to compare (2 to 4, colours fixed by order)")
    if len(selected) < 2:
        st.info("Choose at least two runs.")
        return
    chosen = runs.set_index("run_id").loc[selected].reset_index()
    live = not chosen["status"].isin(reads.FINAL_STATUSES).all()
    ui.live(compare_view, ui.COMPARE_REFRESH_S if live else None)(store, chosen, runs)


store = ui.frame("Compare")
if store is not None:
    ui.guarded(compare_page)(store)
