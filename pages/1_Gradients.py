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

    # FP16 leaves the values it flushed as exact zeros, invisible to the exact counts: state that share beside them,
    # and rank such a run by it (against its FP32 twin) or, without a twin, by its zeros
    states_flushed = fmt == "fp16" and run["opt_level"] in summaries.FP16_LEVELS
    twin_id = summaries.fp32_twin(run)
    twin = reads.twin_totals(store, twin_id)
    ranking, ranked_by = summaries.gradient_ranking(totals, fmt, at_scale, states_flushed, twin)
    # Plain names as options: the URL (?tensor=...) then stays valid while shares change during a run.
    tensor = st.selectbox("Tensor (worst first; type to search)", ranking["tensor"].tolist(), key="tensor",
                          bind="query-params", help=ranked_by)
    chosen = ranking[ranking["tensor"] == tensor].iloc[0]
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
    what = "S·g" if at_scale else "g"
    clicked = None
    if len(cells):
        drawn, extent, off = summaries.heatmap_view(cells, lines)
        clicked = ui.show_chart(charts.exponent_heatmap(cells, drawn, (logged[0], logged[-1] + 1),
                                                          f"{tensor}: |{what}| per step (click a column to see its "
                                                          "step below)", extent),
                                  width="stretch", on_select="rerun", selection_mode=charts.PICKED_STEP, key="heatmap")
        if off:
            st.caption(plain("Not drawn, to keep the data readable: " + "; ".join(off) + "."))
        blank = summaries.blank_steps(index, counts, steps, reads.tensor_over_steps(store, run_id, tensor, final),
                                      at_scale=at_scale)
        if len(blank):
            st.caption(plain(summaries.blank_steps_text(blank, len(logged))))
    else:
        st.info(plain(f"{tensor}: no finite non-zero value of |{what}| at any logged step (every value was 0, "
                      f"NaN or inf{', or the loss scale was 0' if at_scale else ''}), so there is nothing to place "
                      "on the exponent axis. The counts below say what it held."))
    # the slider's value lives in the session (no default beside it: Streamlit warns of both); a new click on
    # the heatmap moves it to the clicked column's first logged step, once per click
    picked = None if clicked is None else summaries.picked_step(clicked.selection.get(charts.PICKED_STEP, []), logged)
    if picked is not None and st.session_state.get("step_clicked") != picked:
        st.session_state["step"] = st.session_state["step_clicked"] = picked
    if st.session_state.get("step") not in logged:
        st.session_state["step"] = logged[-1]
    step = st.select_slider("Step", logged, key="step")
    scale = summaries.scale_at_step(steps, step)
    row = np.flatnonzero(index["step"].to_numpy() == step)
    at_step = reads.tensor_at_step(store, run_id, tensor, step, final)
    hist = counts[row[0]] if len(row) else np.zeros(counts.shape[1], dtype=np.int64)
    # the multiplier the shown view applies to g: 1, or the step's loss scale (log2 of 0 is -inf: S·g all 0)
    with np.errstate(divide="ignore"):
        own = float(np.log2(scale)) if at_scale and np.isfinite(scale) else 0.0
    specials = {SPECIALS[k]: int(at_step[k]) for k in SPECIALS}
    if np.isfinite(own):
        bars = summaries.step_histogram(hist, specials, LOW_PRECISION[fmt], own)
        ui.show_chart(charts.step_histogram(bars, f"step {step:,}, loss scale {summaries.scale_text(scale)}"),
                        width="stretch")
    else:
        st.info(f"At step {step:,} the loss scale was 0: S·g is 0 everywhere, so there is no exponent to histogram "
                "(the unscaled view shows g).")
    # The tiles count S·g at this step's own loss scale, the what-if starts there: one function (cast_shares)
    # gives both, so they agree; g itself (2^0) is stated beside them, also exact.
    with np.errstate(divide="ignore"):
        run_own = float(np.log2(scale)) if np.isfinite(scale) else 0.0
    st.markdown(f"**At step {step:,}: S·g at this step's loss scale {plain(summaries.scale_text(scale))}, cast to "
                f"{fmt} (exact counts)**")
    tiles = summaries.cast_shares(at_step, hist, fmt, run_own, scale)
    unscaled = summaries.cast_shares(at_step, hist, fmt, 0, scale)
    denom = int(summaries.nonzero_finite(at_step.to_frame().T).iloc[0])
    # two rows of three, lined up with the what-if's three below: the same column, the same category
    m = [*st.columns(3), *st.columns(3)]
    for col, cat in zip(m, ("underflow", "subnormal", "overflow"), strict=False):
        col.metric(f"{fmt} {cat}", summaries.share_text(tiles[cat]),
                   help=f"Of the {denom:,} finite non-zero values, counted by casting each one to {fmt}.")
    if scale != 1:
        st.caption(f"The unscaled gradient g (2^0) cast to {fmt}, also exact: " + ", ".join(
            f"{cat} {summaries.share_text(unscaled[cat])}" for cat in ("underflow", "subnormal", "overflow")) + ".")
    m[3].metric("zeros", f"{int(at_step['zeros']):,}", help=f"Of {int(at_step['numel']):,} values.")
    m[4].metric("NaN / inf", f"{int(at_step['nan'] + at_step['posinf'] + at_step['neginf']):,}")
    if states_flushed:
        twin_step = reads.twin_at_step(store, twin_id, tensor, step)
        share = None if twin_step is None else float(
            summaries.flushed_to_zero(at_step.to_frame().T, twin_step.to_frame().T).iloc[0])
        m[5].metric(f"{fmt} flushed to zero", "unknown" if share is None or np.isnan(share) else f"{share:.3%}",
                    help=f"At step {step}: " + summaries.flushed_text(share, shadow_steps))

    st.subheader("What if the loss scale were different?")
    # The offered powers include every scale the run used, so the default is always one of them.
    exponents = summaries.whatif_exponents(steps)
    used = summaries.log2_exponent(scale)
    k = st.select_slider("Multiply the unscaled gradient g by", exponents, value=0 if used is None else used,
                         format_func=lambda e: f"2^{e}", key="whatif")
    shares = summaries.cast_shares(at_step, hist, fmt, k, scale)
    w = st.columns(3)
    for col, cat in zip(w, ("underflow", "subnormal", "overflow"), strict=True):
        col.metric(f"{fmt} {cat} at 2^{k}", summaries.share_text(shares[cat]),
                   help="exact: counted by casting" if shares[cat][2] else "from the exponent histogram")
    exact_at = ([f"At 2^{used}, this step's loss scale, these are the tiles' exact counts of S·g"]
                if used is not None and 2.0**used == scale and used != 0 else []) + ["at 2^0 the exact counts of g"]
    st.caption(
        f"{'; '.join(exact_at).capitalize() if len(exact_at) == 1 else '; '.join(exact_at)}. At any other power they "
        "are derived from the stored exponent histogram of g: multiplying by "
        "2^k moves every value exactly k bins; values in the three bins that straddle a rounding edge can go "
        "either way, so a range is shown where they matter."
    )

    st.subheader(f"All tensors, worst first ({what}, all logged steps)")
    at_step_all = reads.tensors_at_step(store, run_id, step, final).set_index("tensor")
    h_index, h_counts = reads.histograms_at_step(store, run_id, step, final)
    hists = dict(zip(h_index["tensor"], h_counts, strict=True))
    whatif_column = f"{fmt} underflow at 2^{k}, step {step:,}"

    def underflow_at_k(name: str) -> str:
        if name not in at_step_all.index:
            return "not logged"
        hist_t = hists.get(name, np.zeros(h_counts.shape[1] if len(h_counts) else 1, dtype=np.int64))
        return summaries.share_text(summaries.cast_shares(at_step_all.loc[name], hist_t, fmt, k, scale)["underflow"])

    show_flushed = states_flushed and twin is not None
    table, config = ranking_table(ranking, fmt, what, show_flushed)
    # beside the underflow over all steps it answers for one step: at 1,280 px a last column is off screen
    table.insert(table.columns.get_loc(f"{fmt} underflow (%)") + 1, whatif_column,
                 ranking["tensor"].map(underflow_at_k).to_numpy())
    config[whatif_column] = st.column_config.TextColumn(
        whatif_column, help=f"Of its finite non-zero values at step {step:,}, the share that would underflow in {fmt} "
                            f"were g multiplied by 2^{k} (the what-if above); a range where a bin straddles the edge.")
    st.dataframe(table, hide_index=True, width="stretch", column_config=config)
    st.caption(ranked_by + " Shares of finite non-zero values unless the column says otherwise; n/a: the tensor had "
               f"no finite non-zero value (every value 0, NaN or inf). Exponent bins start at 2^{EXP_MIN}.")

    histogram_grid(ranking, h_index, h_counts, fmt, at_scale, scale, step, what)


def ranking_table(ranking: pd.DataFrame, fmt: str, what: str, show_flushed: bool) -> tuple[pd.DataFrame, dict]:
    """The ranking (summaries.gradient_ranking) as the table shows it: shares as percentages (n/a where a tensor
    had no finite non-zero value), counts with thousands separators, each column named with its unit and
    explained in its help; the flushed share only where it is known (an FP16 run with an FP32 twin)."""
    def percent(values: pd.Series) -> pd.Series:
        return values.map(lambda v: "n/a" if pd.isna(v) else f"{v:.2%}")

    columns = {
        "tensor": ("tensor", None, "The parameter, as the model names it."),
        **({"flushed_share": ("flushed to 0 vs FP32 twin (% of values)", percent,
                              "Share of all values, over all logged steps: the zeros beyond the FP32 twin's, values non-zero in FP32 that "
                              "FP16 flushed to zero before they were recorded.")} if show_flushed else {}),
        "underflow_share": (f"{fmt} underflow (%)", percent,
                            f"Share of the recorded finite non-zero values of {what} that are too small for {fmt} (become 0), "
                            "exact counts over all logged steps."),
        "subnormal_share": (f"{fmt} subnormal (%)", percent,
                            f"Share of the recorded finite non-zero values of {what} kept only as {fmt} subnormals (fewer "
                            "significant bits)."),
        "overflow_share": (f"{fmt} overflow (%)", percent,
                           f"Share of the recorded finite non-zero values of {what} too large for {fmt} (become inf)."),
        "zero_share": ("zeros (% of values)", percent,
                       "Exact zeros in the record, over all logged steps (in an FP16 run: genuine zeros and the "
                       "values FP16 flushed)."),
        "numel": ("values per step", None, "Number of elements of the gradient tensor."),
        "nonfinite": ("NaN / inf (values)", None, "NaN, +inf and -inf values, summed over steps."),
    }
    table = pd.DataFrame({label: (ranking[c] if f is None else f(ranking[c])) for c, (label, f, _) in columns.items()})
    config = {label: (st.column_config.NumberColumn(label, help=help_, format="%,d") if c in ("numel", "nonfinite")
                      else st.column_config.TextColumn(label, help=help_, pinned=c == "tensor"))
              for c, (label, _, help_) in columns.items()}
    return table, config


#: the small multiples draw this many tensors until "show all" is ticked
GRID_FIRST = 12


def histogram_grid(ranking: pd.DataFrame, h_index: pd.DataFrame, h_counts: np.ndarray,
                   fmt: str, at_scale: bool, scale: float, step: int, what: str) -> None:
    """Every tensor's exponent histogram at the chosen step as small multiples, worst first (the ranking's order),
    the first GRID_FIRST unless all are asked for."""
    st.subheader(f"Every tensor's exponent histogram at step {step:,} ({what})")
    if len(h_index) == 0:
        st.info(f"No tensor recorded an exponent histogram at step {step:,}, so there is nothing to draw.")
        return
    total = len(h_index)
    everything = total <= GRID_FIRST or st.checkbox(f"Show all {total:,} tensors (the first {GRID_FIRST} are shown)",
                                                    key="grid_all")
    with np.errstate(divide="ignore"):
        shift = (float(np.log2(scale)) if scale > 0 else -np.inf) if at_scale else 0.0
    bars, drawn, empty = summaries.histogram_grid(h_index, h_counts, ranking["tensor"].tolist(), fmt, shift,
                                                  limit=None if everything else GRID_FIRST)
    shown = len(drawn) + len(empty)
    said = (f"Step {step:,} (the step chosen above), {shown:,} of {total:,} tensors, worst first as in the table; "
            f"bin e holds |{what}| from 2^e to 2^(e+1).")
    if drawn:
        lines, extent, off = summaries.heatmap_view(bars, summaries.format_lines((fmt,)))
        ui.show_chart(charts.histogram_grid(bars, drawn, lines, extent,
                                            f"share of each tensor's finite non-zero |{what}| per exponent bin, "
                                            f"coloured by {fmt} region"), key="histogram_grid")
        rules = {"min subnormal": "dotted", "min normal": "dashed", "max": "long-dashed"}
        said += "".join(f" {rules[r.kind].capitalize()} rule: {r.limit}." for r in lines.itertuples())
        if off:
            said += " Not drawn, to keep the data readable: " + "; ".join(off) + "."
    if empty:
        why = "the loss scale was 0 (S·g holds no finite non-zero value)" if at_scale and not np.isfinite(shift) \
            else "every value was 0, NaN or inf"
        said += (f" Nothing to draw for {len(empty):,}: " + ", ".join(empty[:20])
                 + (f" and {len(empty) - 20:,} more" if len(empty) > 20 else "") + f" ({why}).")
    st.caption(plain(said))


ui.single_run_page("Gradients", gradients_view)
