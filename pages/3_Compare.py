"""Compare: 2-4 runs side by side (FP32 versus mixed, opt levels, scales), each in a fixed colour.

Reads widgets, calls mpdiag.analysis.compare / summaries and the chart layer, renders; no store queries, no
torch. Run names are the user's: they reach Markdown only through ``plain``.
"""

import numpy as np
import pandas as pd
import streamlit as st

from mpdiag.analysis import summaries
from mpdiag.analysis.compare import (
    COUNTED_PART,
    DIVERGENCE_RTOL,
    FLUSHED_PART,
    NO_STEP,
    NO_TENSOR,
    NO_VALUES,
    STEP_TIME_OUTLIER,
    X_AXES,
    config_table,
    cost_table,
    default_selection,
    first_divergence,
    fp16_underflow_parts,
    histogram_steps,
    histogram_tensors,
    loss_comparison,
    overlaid_histograms,
    reference_run,
    setting_label,
    smoothed,
    step_time_outliers,
    worst_by_total,
)
from mpdiag.dashboard import charts, reads
from mpdiag.dashboard import frame as ui
from mpdiag.dashboard.untrusted import plain

#: the run column of Compare's tables: a run's whole label is as wide as the table at 1,280 px and pushed the
#: numbers off screen; shortened (hover for the whole label; the "#N" starts it) and kept in view when scrolled
RUN_COLUMN = st.column_config.TextColumn("run", width="medium", pinned=True, help="Hover a cell for the whole label.")
#: the cost table's columns, what tells the runs apart first (at 1,280 px the last ones are scrolled off)
COST_ORDER = ["run", "final loss", "skipped steps", "median step time", "throughput", "peak memory", "model state"]


def curve_controls() -> tuple[float, bool, str]:
    """TensorBoard's controls over the curves: smoothing weight, log y for the loss, the x axis."""
    left, middle, right = st.columns([2, 1, 2])
    weight = left.slider("Smoothing", min_value=0.0, max_value=0.99, value=0.0, step=0.01, key="smoothing",
                         help="TensorBoard's debiased exponential moving average of the loss and the gradient norm "
                              "(0: none). The raw curve stays drawn, faint, behind the smoothed one.")
    log_loss = middle.toggle("Log loss axis", value=False, key="loss_log")
    x_label = right.radio("x axis", list(X_AXES), horizontal=True, key="x_axis",
                          help="Wall time: seconds since each run's recording started, at the end of each step.")
    return weight, log_loss, X_AXES[x_label]


def with_smoothing(df: pd.DataFrame, weight: float) -> pd.DataFrame:
    """One run's steps with the loss and gradient norm smoothed (before thinning: the average sees every step)."""
    return smoothed(smoothed(df, "loss", weight), "grad_norm", weight) if weight > 0 else df


def compare_view(store, chosen: pd.DataFrame, all_runs: pd.DataFrame) -> None:
    labels = [ui.run_label(r) for _, r in chosen.iterrows()]
    weight, log_loss, x = curve_controls()
    steps = {lab: summaries.thin_steps(with_smoothing(
                 reads.steps(store, int(r["run_id"]), reads.is_final(r)).assign(run=lab), weight))
             for lab, (_, r) in zip(labels, chosen.iterrows(), strict=True)}
    everything = pd.concat(steps.values(), ignore_index=True)

    selected = chosen["run_id"].astype(int).tolist()
    diffs, notes, firsts = [], [], []
    for lab, (_, r) in zip(labels, chosen.iterrows(), strict=True):
        ref_id = reference_run(all_runs, int(r["run_id"]), prefer=selected)
        if ref_id is None:
            if r["opt_level"] != "O0":
                notes.append(f"**{plain(lab)}**: no finished FP32 (O0) run of the same script and seed to compare "
                             "with (start runs with 'Also run an FP32 twin').")
            continue
        ref = all_runs[all_runs["run_id"] == ref_id].iloc[0]
        comparison = loss_comparison(reads.steps(store, ref_id, True), steps[lab]).assign(run=lab)
        step = first_divergence(comparison)
        firsts.append(step)
        where = (f"stays within {DIVERGENCE_RTOL:.0%}" if step is None else
                 f"first differs by more than {DIVERGENCE_RTOL:.0%} (or turns non-finite) at step {step}")
        notes.append(f"**{plain(lab)}** versus its FP32 reference {plain(ui.run_label(ref))}: {where}.")
        diffs.append(comparison)
    # loss, its difference to FP32, the loss scale, the learning rate and the gradient norm on one x axis:
    # zooming one zooms all
    curves, said = everything, []
    if x == "wall_time_s":
        untimed = [lab for lab in labels if steps[lab]["wall_time_s"].isna().all()]
        curves = everything[everything["wall_time_s"].notna()]
        if untimed:
            said.append("Not on the wall-time axis (recorded before mpdiag kept a wall time per step): "
                        + "; ".join(plain(lab) for lab in untimed) + ".")
    if curves.empty:
        st.info("None of these runs recorded a wall time per step: choose the step axis.")
        return
    smooth = weight > 0
    panels = [charts.runs_overlay(curves, "loss", "loss", labels, log=log_loss, log_base=10, x=x, smooth=smooth)]
    if diffs and x == "step":
        first = min((s for s in firsts if s is not None), default=None)
        panels.append(charts.loss_difference(pd.concat(diffs), first, labels, DIVERGENCE_RTOL))
    elif diffs:
        said.append("The difference to the FP32 reference is drawn over steps only: choose the step axis to see it.")
    # a run without loss scaling (O0, bf16: no GradScaler) has scale 1 at every step: drawn, its line at 2^0 would
    # cover a static scale of 1 and read as a scale it never had; it is named instead
    unscaled = [lab for lab, scaling in zip(labels, chosen["scaling"], strict=True) if scaling == "none"]
    scaled = curves[~curves["run"].isin(unscaled)]
    if len(scaled):
        panels.append(charts.runs_overlay(scaled, "loss_scale", "loss scale", labels, log=True, x=x))
    unscaled_shown = [lab for lab in unscaled if lab in set(curves["run"])]
    if unscaled_shown:
        said.append("Not in the loss-scale panel (no loss scaling: no GradScaler, the loss is used as it is): "
                    + "; ".join(plain(lab) for lab in unscaled_shown) + ".")
    with_lr = curves.groupby("run")["lr"].transform(lambda v: np.isfinite(v.astype(float)).any())
    if with_lr.any():
        panels.append(charts.runs_overlay(curves[with_lr], "lr", "learning rate", labels, height=180, x=x,
                                          zero=True))
    normed = curves[summaries.recorded_norms(curves)]
    if len(normed) and (normed["grad_norm"].astype(float) != 0).any():
        panels.append(charts.runs_overlay(normed, "grad_norm", "gradient norm (unscaled, before clipping)", labels,
                                          log=True, log_base=10, height=200, x=x, smooth=smooth))
    shown = [lab for lab in labels if lab in set(curves["run"])]
    missing_lr = [lab for lab in shown if not with_lr[curves["run"] == lab].any()]
    missing_norm = [lab for lab in shown if lab not in set(normed["run"])]
    if missing_lr:
        said.append("No learning rate recorded (a run recorded before mpdiag kept it, or without a known optimizer): "
                    + "; ".join(plain(lab) for lab in missing_lr) + ".")
    if missing_norm:
        said.append("No gradient norm recorded (a run recorded before mpdiag kept it): "
                    + "; ".join(plain(lab) for lab in missing_norm) + ".")
    ui.show_chart(charts.stacked_over_steps(*panels), width="stretch")
    st.caption("Drag or scroll on any of these panels to pan or zoom the steps of them all."
               + (f" Smoothing {weight:.2f}: the faint lines are the recorded values." if smooth else ""))
    for sentence in said:
        st.caption(sentence)
    st.markdown("  \n".join(notes))

    # one above the other, each the page's width: side by side each was too narrow for its legend and buttons
    costs = st.container()
    # step 0 holds the warm-up (allocation, kernel selection, compilation): drawn apart, out of the medians;
    # a later step far above its run's median (a stall) is listed, not drawn: the axis would be scaled to it
    timed = everything[(everything["step"] > 0) & np.isfinite(everything["step_time_s"].astype(float))]
    outliers = step_time_outliers(timed)
    if len(timed[~outliers]):
        ui.show_chart_in(costs, charts.runs_overlay(timed[~outliers], "step_time_s", "step time (s), from step 1", labels),
                          width="stretch")
    else:
        costs.caption("Step time: no step after the warm-up step 0 was recorded, so there is nothing to chart.")
    warmups = everything[everything["step"] == 0]
    if len(warmups):
        costs.caption("Step 0 (warm-up, not in the chart or the medians): " + "; ".join(
            f"{plain(run)} {seconds:,.3g} s" for run, seconds in zip(warmups["run"], warmups["step_time_s"], strict=True)))
    if outliers.any():
        far = timed[outliers]
        listed = "; ".join(f"{plain(run)} step {int(step):,} {seconds:,.3g} s" for run, step, seconds in
                           zip(far["run"].head(5), far["step"].head(5), far["step_time_s"].head(5), strict=True))
        more = f"; and {len(far) - 5:,} more" if len(far) > 5 else ""
        costs.caption(f"Not in the chart (over {STEP_TIME_OUTLIER:g}× their run's 90th percentile step time; in "
                     f"the medians): {listed}{more}.")
    memory = everything.assign(peak_mem_mb=everything["peak_mem_bytes"] / 2**20)
    if np.isfinite(memory["peak_mem_mb"].astype(float)).any():
        ui.show_chart_in(costs, charts.runs_overlay(memory, "peak_mem_mb", "peak memory so far (MiB)", labels,
                                                   zero=True), width="stretch")
    else:
        costs.caption("Peak memory: none of these runs recorded it.")
    st.dataframe(cost_table(chosen, labels), hide_index=True, width="stretch", column_config={"run": RUN_COLUMN},
                 column_order=COST_ORDER)
    st.caption("Median step time is over the steps after the warm-up step 0. Peak memory is the CUDA allocator's "
               "peak on a GPU and the process's peak RSS on a CPU; model state is the bytes allocated for weights, "
               "gradients, master weights and optimizer state.")
    fp16_shares(store, chosen, labels)
    histograms_overlaid(store, chosen, labels)

    st.subheader("Configuration")
    only_diff = st.checkbox("Only settings that differ", value=True, key="only_diff")
    st.dataframe(config_table(chosen, labels, only_diff).rename(index=setting_label), width="stretch")


def fp16_shares(store, chosen: pd.DataFrame, labels: list[str]) -> None:
    """FP16 underflow and overflow per tensor, each run's bars what is true of that run: an FP16 run's
    flushed values (zeros in its record) beside what would underflow if cast, an FP32 run's only the latter."""
    st.subheader("FP16 underflow and overflow per tensor (all logged steps)")
    parts, overflow, no_stats, no_twin = [], [], [], []
    for lab, (_, r) in zip(labels, chosen.iterrows(), strict=True):
        totals = reads.tensor_totals(store, int(r["run_id"]), reads.is_final(r))
        if totals.empty:
            no_stats.append(lab)
            continue
        twin = reads.twin_totals(store, summaries.fp32_twin(r))
        if twin is None and r["opt_level"] in summaries.FP16_LEVELS:
            no_twin.append(lab)
        parts.append(fp16_underflow_parts(totals, twin, r["opt_level"], lab))
        overflow.append(pd.DataFrame({"tensor": totals["tensor"], "run": lab,
                                      "share": totals["fp16_overflow_at_scale"] / totals["numel"]}))
    if no_stats:
        st.caption("No gradient statistics recorded (yet) for " + "; ".join(plain(lab) for lab in no_stats) + ".")
    if not parts:
        return
    under = worst_by_total(pd.concat(parts, ignore_index=True))
    if len(under):
        drawn = [p for p in (FLUSHED_PART, COUNTED_PART) if p in set(under["part"])]
        ui.show_chart(charts.runs_bars(under, "tensor", "share", "FP16 underflow, share of all values", labels,
                                         parts=drawn), width="stretch")
        st.caption(f"Solid bars, “{FLUSHED_PART}”: the values an FP16 run's backward pass had already made zero "
                   "when they were recorded, estimated as its zeros beyond its FP32 twin's (same weights and "
                   f"batches). Light bars, “{COUNTED_PART}”: the recorded gradient at its run's loss scale, cast "
                   "to FP16 and counted; for a run computed in FP32 or BF16 (O0, bf16) that is what FP16 would "
                   "lose, not a loss the run had.")
    else:
        st.caption("FP16 underflow: no value of any tensor of these runs was flushed to zero or would underflow "
                   "FP16 at its run's loss scale, so there is nothing to chart.")
    for lab in no_twin:
        st.caption(f"{plain(lab)}: {summaries.flushed_text(None)}")
    over = worst_by_total(pd.concat(overflow, ignore_index=True))
    if len(over):
        ui.show_chart(charts.runs_bars(over, "tensor", "share", "FP16 overflow at the loss scale, share of all "
                                         "values", labels), width="stretch")
    else:
        st.caption("FP16 overflow: no recorded gradient value of these runs, at its run's loss scale, is above "
                   "FP16's largest value 65,504, so there is nothing to chart.")


def histograms_overlaid(store, chosen: pd.DataFrame, labels: list[str]) -> None:
    """One tensor's exponent histogram of the unscaled gradient in each run, at one step or summed, overlaid in
    the runs' colours with FP16's limits; each run's zero share beside it, and the runs without a line named."""
    st.subheader("Gradient histograms, overlaid")
    rows = [(lab, int(r["run_id"]), reads.is_final(r)) for lab, (_, r) in zip(labels, chosen.iterrows(), strict=True)]
    totals = {lab: reads.tensor_totals(store, run_id, final) for lab, run_id, final in rows}
    logged = {lab: reads.logged_steps(store, run_id, final) for lab, run_id, final in rows}
    tensors = histogram_tensors(list(totals.values()))
    offered, common = histogram_steps(list(logged.values()))
    if not tensors or not offered:
        st.caption("None of these runs recorded gradient statistics (yet), so there is no histogram to overlay.")
        return
    if st.session_state.get("hist_tensor") not in tensors:
        st.session_state["hist_tensor"] = tensors[0]
    if st.session_state.get("hist_step") not in offered:
        st.session_state["hist_step"] = common
    left, right = st.columns([3, 1])
    tensor = left.selectbox("Tensor (worst FP16 underflow of the first run first; type to search)", tensors,
                            key="hist_tensor")
    summed = right.toggle("All logged steps (summed)", key="hist_summed")
    step = None if summed else st.select_slider(
        "Step (steps any of these runs logged)", offered, key="hist_step",
        help=f"The last step all of them logged is {common:,}.") if len(offered) > 1 else offered[0]
    records = {lab: (totals[lab], None if step is None else reads.tensors_at_step(store, run_id, step, final),
                     *reads.tensor_histograms(store, run_id, tensor, final)) for lab, run_id, final in rows}
    bins, per_run = overlaid_histograms(records, tensor, step)
    when = "all logged steps, summed" if step is None else f"step {step:,}"
    if len(bins):
        ui.show_chart(charts.runs_histograms(bins, summaries.format_lines(("fp16",)), labels,
                                             f"{tensor}: unscaled gradient, {when}"), width="stretch")
    for why, sentence in ((NO_TENSOR, f"No line: these runs did not record the tensor {tensor}"),
                          (NO_STEP, "No line: these runs did not log " + ("any step of it" if step is None else
                                                                           f"step {step:,}")),
                          (NO_VALUES, f"No line: every value of {tensor} at {when} was zero, NaN or inf in")):
        missing = per_run.loc[per_run["missing"] == why, "run"].tolist()
        if missing:
            st.caption(plain(f"{sentence}: " + "; ".join(missing) + "."))
    drawn = per_run[per_run["missing"] != NO_TENSOR]
    drawn = drawn[drawn["missing"] != NO_STEP]
    if len(drawn):
        st.dataframe(pd.DataFrame({
            "run": drawn["run"], "values": drawn["numel"], "finite non-zero (the 100 %)": drawn["finite_nonzero"],
            "zeros": drawn["zero_share"], "NaN / inf": drawn["nonfinite"]}),
            hide_index=True, width="stretch",
            column_config={"run": RUN_COLUMN,
                           "zeros": st.column_config.NumberColumn("zeros (share of values)", format="percent"),
                           **{c: st.column_config.NumberColumn(format="localized")
                              for c in ("values", "finite non-zero (the 100 %)", "NaN / inf")}})
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
