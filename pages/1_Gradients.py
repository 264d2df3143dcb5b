"""Gradients: where each tensor's gradient magnitudes sit relative to FP16/BF16 limits, over steps.

Reads widgets, calls mpdiag.analysis.summaries and the chart layer, renders; no store queries, no torch.
Tensor names come from the user's model: they reach Markdown only through ``plain``.
"""

import numpy as np
import pandas as pd
import streamlit as st

from mpdiag.analysis import summaries
from mpdiag.dashboard import charts, reads
from mpdiag.dashboard import frame as ui
from mpdiag.dashboard.untrusted import plain
from mpdiag.numerics.formats import EXP_MIN, LOW_PRECISION

SPECIALS = {"zeros": "zero", "nan": "NaN", "posinf": "+inf", "neginf": "-inf"}


def pct(bounds: tuple[float, float]) -> str:
    lo, hi = bounds
    if np.isnan(lo):
        return "n/a"
    return f"{lo:.3%}" if lo == hi else f"{lo:.3%} – {hi:.3%}"


def gradients_view(store, run: pd.Series, final: bool) -> None:
    run_id = int(run["run_id"])
    logged = reads.logged_steps(store, run_id, final)
    if not logged:
        if run["status"] == "running":
            st.info("No gradient statistics recorded yet; this view updates as the run records its first step.")
        else:
            st.warning(f"Run #{run_id} recorded no gradient statistics (it stopped before its first step completed).")
        return
    c1, c2, c3 = st.columns([2, 1, 1])
    view = c1.radio("Gradient", ["unscaled g", "at the loss scale (S·g)"], horizontal=True, key="view", bind="query-params",
                    help="S·g is the gradient as it existed in the backward pass, which is what FP16 had to hold.")
    at_scale = view != "unscaled g"
    totals = reads.tensor_totals(store, run_id, final)
    formats = summaries.recorded_formats(totals)
    fmt = c2.radio("Format", formats, horizontal=True, key="fmt", bind="query-params",
                   help="FP8 (E4M3, E5M2) as a plain cast, without a per-tensor scale; what FP8 recipes' scaled casts do "
                        "to each Linear's tensors is on the FP8 page" + ("" if len(formats) == len(LOW_PRECISION) else
                        ". This run was recorded before FP8 counts existed; rerun it to get them."))
    show_bf16 = c3.checkbox("Draw BF16 limits too", key="bf16_lines", value=False)

    ranking = summaries.tensor_ranking(totals, fmt, at_scale)
    # Plain names as options: the URL (?tensor=...) then stays valid while shares change during a run.
    tensor = st.selectbox("Tensor (worst first; type to search)", ranking["tensor"].tolist(), key="tensor",
                          bind="query-params")
    chosen = ranking[ranking["tensor"] == tensor].iloc[0]
    # FP16 leaves the values it flushed as exact zeros, invisible to the exact counts: state that share beside them.
    states_flushed = fmt == "fp16" and run["opt_level"] in summaries.FP16_LEVELS
    twin_id = summaries.fp32_twin(run)
    twin = reads.twin_totals(store, twin_id)
    shadow_steps = int(reads.shadow_stats(store, run_id, final)["step"].nunique())
    flushed = None if twin is None else float(summaries.flushed_to_zero(totals, twin).get(tensor, np.nan))
    line = summaries.tensor_summary_line(chosen, fmt)
    if states_flushed:
        line += " " + summaries.flushed_text(flushed, shadow_steps)
    st.caption(f"{plain(tensor)}: {line}")
    steps = reads.steps(store, run_id, final)
    index, counts = reads.tensor_histograms(store, run_id, tensor, final)
    cells = summaries.heatmap_cells(index, counts, steps, at_scale=at_scale)
    lines = summaries.format_lines(("fp16", "bf16") if show_bf16 else (fmt,))
    clicked = st.altair_chart(charts.exponent_heatmap(cells, lines, (logged[0], logged[-1] + 1),
                                                      f"{tensor}: |{'S·g' if at_scale else 'g'}| per step "
                                                      "(click a column to see its step below)"),
                              width="stretch", on_select="rerun", selection_mode=charts.PICKED_STEP, key="heatmap")
    # the slider's value lives in the session (no default beside it: Streamlit warns of both); a new click on
    # the heatmap moves it to the clicked column's first logged step, once per click
    picked = summaries.picked_step(clicked.selection.get(charts.PICKED_STEP, []), logged)
    if picked is not None and st.session_state.get("step_clicked") != picked:
        st.session_state["step"] = st.session_state["step_clicked"] = picked
    if st.session_state.get("step") not in logged:
        st.session_state["step"] = logged[-1]
    step = st.select_slider("Step", logged, key="step")
    scale = summaries.scale_at_step(steps, step)
    row = np.flatnonzero(index["step"].to_numpy() == step)
    at_step = reads.tensor_at_step(store, run_id, tensor, step, final)
    hist = counts[row[0]] if len(row) else np.zeros(counts.shape[1], dtype=np.int64)
    shift = float(np.log2(scale)) if at_scale else 0.0
    bars = summaries.step_histogram(hist, {SPECIALS[k]: int(at_step[k]) for k in SPECIALS}, LOW_PRECISION[fmt], shift)
    st.altair_chart(charts.step_histogram(bars, f"step {step}, loss scale {scale:g}"), width="stretch")
    m = st.columns(6 if states_flushed else 5)
    for col, (cat, (n, denom)) in zip(m, summaries.exact_shares(at_step, fmt, at_scale).items(), strict=False):
        col.metric(f"{fmt} {cat} (exact)", f"{n / denom:.3%}" if denom else "n/a",
                   help=f"{n} of {denom} finite non-zero values, counted by casting")
    m[3].metric("zeros", int(at_step["zeros"]))
    m[4].metric("NaN / inf", int(at_step["nan"] + at_step["posinf"] + at_step["neginf"]))
    if states_flushed:
        twin_step = reads.twin_at_step(store, twin_id, tensor, step)
        share = None if twin_step is None else float(
            summaries.flushed_to_zero(at_step.to_frame().T, twin_step.to_frame().T).iloc[0])
        m[5].metric(f"fp16 {summaries.FLUSHED_LABEL}", "unknown" if share is None else f"{share:.3%}",
                    help=f"At step {step}: " + summaries.flushed_text(share, shadow_steps))

    st.subheader("What if the loss scale were different?")
    # The offered powers include every scale the run used, so the default is always one of them.
    exponents = summaries.whatif_exponents(steps)
    used = summaries.log2_exponent(scale)
    k = st.select_slider("Scale the unscaled gradient by", exponents, value=0 if used is None else used,
                         format_func=lambda e: f"2^{e}", key="whatif")
    shares = summaries.whatif_shares(hist, k, LOW_PRECISION[fmt])
    w = st.columns(3)
    for col, cat in zip(w, ("underflow", "subnormal", "overflow"), strict=True):
        col.metric(f"{fmt} {cat} at 2^{k}", pct(shares[cat]))
    st.caption(
        "Derived from the stored exponent histogram: multiplying by 2^k moves every value exactly k bins. Values in "
        "the three bins that straddle a rounding edge can go either way, so a range is shown where they matter; "
        "the exact counts above are for the scale the run actually used."
    )

    st.subheader(f"All tensors ranked by {fmt} underflow, then overflow ({'S·g' if at_scale else 'g'}, all logged steps)")
    whatif = summaries.whatif_underflow_by_tensor(*reads.histograms_at_step(store, run_id, step, final), k,
                                                  LOW_PRECISION[fmt])
    table = ranking.assign(**{f"underflow at 2^{k}, step {step}": ranking["tensor"].map(lambda t: pct(whatif.get(t, (np.nan, np.nan))))})
    st.dataframe(
        table, hide_index=True, width="stretch",
        column_config={c: st.column_config.NumberColumn(format="percent") for c in
                       ("underflow_share", "subnormal_share", "overflow_share", "zero_share")},
    )
    st.caption(f"Shares are of finite non-zero values. Exponent bins start at 2^{EXP_MIN}.")


ui.single_run_page("Gradients", gradients_view)
