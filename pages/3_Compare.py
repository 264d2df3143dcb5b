"""Compare: 2-4 runs side by side (FP32 versus mixed, opt levels, scales), each in a fixed colour.

Reads widgets, calls mpdiag.analysis.compare / summaries and the chart layer, renders; no store queries, no
torch. Run names are the user's: they reach Markdown only through ``plain``.
"""

import numpy as np
import pandas as pd
import streamlit as st

from mpdiag.analysis import summaries
from mpdiag.analysis.compare import (
    DIVERGENCE_RTOL,
    config_table,
    cost_table,
    default_selection,
    first_divergence,
    loss_comparison,
    reference_run,
)
from mpdiag.dashboard import charts, reads
from mpdiag.dashboard import frame as ui
from mpdiag.dashboard.untrusted import plain


def compare_view(store, chosen: pd.DataFrame, all_runs: pd.DataFrame) -> None:
    labels = [ui.run_label(r) for _, r in chosen.iterrows()]
    steps = {lab: summaries.thin_steps(reads.steps(store, int(r["run_id"]), reads.is_final(r))).assign(run=lab)
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
        comparison = loss_comparison(reads.steps(store, ref_id, final=True), steps[lab]).assign(run=lab)
        step = first_divergence(comparison)
        firsts.append(step)
        where = (f"stays within {DIVERGENCE_RTOL:.0%}" if step is None else
                 f"first differs by more than {DIVERGENCE_RTOL:.0%} (or turns non-finite) at step {step}")
        notes.append(f"**{plain(lab)}** versus its FP32 reference {plain(ui.run_label(ref))}: {where}.")
        diffs.append(comparison)
    # loss, its difference to FP32 and the loss scale on one step axis: zooming one zooms all
    panels = [charts.runs_overlay(everything, "loss", "loss", labels)]
    if diffs:
        first = min((s for s in firsts if s is not None), default=None)
        panels.append(charts.loss_difference(pd.concat(diffs), first, labels, DIVERGENCE_RTOL))
    panels.append(charts.runs_overlay(everything, "loss_scale", "loss scale", labels, log=True))
    st.altair_chart(charts.stacked_over_steps(*panels), width="stretch")
    st.caption("Drag or scroll on any of these panels to pan or zoom the steps of them all.")
    st.markdown("  \n".join(notes))

    left, right = st.columns(2)
    # step 0 holds the warm-up (allocation, kernel selection, compilation): drawn apart, out of the medians
    left.altair_chart(charts.runs_overlay(everything[everything["step"] > 0], "step_time_s",
                                           "step time (s), from step 1", labels), width="stretch")
    right.altair_chart(charts.runs_overlay(everything.assign(peak_mem_mb=everything["peak_mem_bytes"] / 2**20),
                                           "peak_mem_mb", "peak memory so far (MB)", labels), width="stretch")
    warmups = everything[everything["step"] == 0]
    if len(warmups):
        left.caption("Step 0 (warm-up, not in the chart or the medians): " + "; ".join(
            f"{plain(run)} {seconds:.3g} s" for run, seconds in zip(warmups["run"], warmups["step_time_s"], strict=True)))
    st.dataframe(cost_table(chosen, labels), hide_index=True, width="stretch")
    st.caption("Peak memory is the CUDA allocator's peak on a GPU and the process's peak RSS on a CPU; model state "
               "is the bytes allocated for weights, gradients, master weights and optimizer state.")

    st.subheader("FP16 shares per tensor (gradient at the loss scale, all logged steps)")
    shares, unknown_flushed = [], []
    for lab, (_, r) in zip(labels, chosen.iterrows(), strict=True):
        totals = reads.tensor_totals(store, int(r["run_id"]), reads.is_final(r))
        if len(totals):
            twin = reads.twin_totals(store, summaries.fp32_twin(r))
            ranking = summaries.tensor_ranking(totals, "fp16", at_scale=True)
            flushed = np.nan if twin is None else ranking["tensor"].map(summaries.flushed_to_zero(totals, twin))
            shares.append(ranking.assign(run=lab, flushed_share=flushed))
            if twin is None and r["opt_level"] in summaries.FP16_LEVELS:
                unknown_flushed.append(lab)
    if shares:
        top = summaries.worst_tensors(pd.concat(shares, ignore_index=True))
        st.altair_chart(charts.runs_bars(top, "tensor", "underflow_share", "FP16 underflow share", labels), width="stretch")
        flushed = top.dropna(subset=["flushed_share"])
        if len(flushed):
            st.altair_chart(charts.runs_bars(flushed, "tensor", "flushed_share",
                                             f"FP16 {summaries.FLUSHED_LABEL}, share of all values", labels),
                            width="stretch")
        for lab in unknown_flushed:
            st.caption(f"{plain(lab)}: {summaries.flushed_text(None)}")
        if flushed.empty and not unknown_flushed:
            st.caption(f"FP16 {summaries.FLUSHED_LABEL}: none of these runs has an FP32 twin to estimate it from.")
        st.altair_chart(charts.runs_bars(top, "tensor", "overflow_share", "FP16 overflow share", labels), width="stretch")
    else:
        st.info("None of these runs has gradient statistics yet.")

    st.subheader("Configuration")
    only_diff = st.checkbox("Only settings that differ", value=True, key="only_diff")
    st.dataframe(config_table(chosen, labels, only_diff), width="stretch")


store = ui.frame("Compare")
if store is None:
    st.stop()
runs = store.runs()
if len(runs) < 2:
    st.info("Comparing needs at least two runs. Start runs on the Runs page (tick 'Also run an FP32 twin').")
    st.stop()
selected = ui.pick_runs(runs, default=default_selection(runs), label="Runs to compare (2 to 4, colours fixed by order)")
if len(selected) < 2:
    st.info("Choose at least two runs.")
    st.stop()
chosen = runs.set_index("run_id").loc[selected].reset_index()
live = not chosen["status"].isin(reads.FINAL_STATUSES).all()
st.fragment(compare_view, run_every=ui.LIVE_REFRESH_S if live else None)(store, chosen, runs)
