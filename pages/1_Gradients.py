"""Gradients: where each tensor's gradient magnitudes sit relative to FP16/BF16 limits, over steps.

Reads widgets, asks mpdiag.dashboard.gradients_model for what to show and draws it with the chart layer; no store
queries, no torch. Tensor names come from the user's model: they reach Markdown only through ``plain``.
"""

import pandas as pd
import streamlit as st

from mpdiag.analysis import summaries
from mpdiag.dashboard import charts, gradients_model
from mpdiag.dashboard import frame as ui
from mpdiag.dashboard.gradients_model import CATEGORIES, GRID_FIRST, Ranking, StepView, TensorView
from mpdiag.dashboard.untrusted import plain, url_count
from mpdiag.numerics.formats import EXP_MIN
from mpdiag.options import scale_text


def gradients_view(store, run: pd.Series, final: bool, runs: pd.DataFrame) -> None:
    model = gradients_model.gradients(store, run, final, runs)
    if not model.logged:
        (st.info if run["status"] == "running" else st.warning)(model.nothing_logged)
        return
    fmt, at_scale, show_bf16 = controls(model)
    ranking = model.ranking(fmt, at_scale)
    # Plain names as options: the URL (?tensor=...) then stays valid while shares change during a run.
    tensor = st.selectbox("Tensor (worst first; type to search)", ranking.tensors, key="tensor",
                          bind="query-params", help=ranking.ranked_by)
    shown = model.tensor(ranking, tensor, show_bf16)
    st.caption(f"{plain(tensor)}: {shown.summary}")
    at = model.at_step(ranking, shown, step_slider(heatmap(shown, model.logged), model.logged))
    step_tiles(ranking, at)
    k = whatif(model, ranking, at)
    st.subheader(f"All tensors, worst first ({ranking.fmt}, {ranking.what}, all logged steps)")
    ui.table(*model.table(ranking, at, k))
    st.caption(ranking.ranked_by + " Shares of finite non-zero values unless a column's tooltip says otherwise; n/a: the "
               "tensor had no finite non-zero value (every value 0, NaN or inf). Exponent bins start at "
               f"2^{EXP_MIN}.")
    histogram_grid(model, ranking, at)


def controls(model: gradients_model.GradientsRun) -> tuple[str, bool, bool]:
    """The format, whether the view is S·g (else g), and whether BF16's limits are drawn too."""
    c1, c2, c3 = st.columns([2, 1, 1])
    # a loss-scaled run opens on S·g, what its FP16 backward held: its g's FP16 underflow (76 % where S·g had none)
    # made the fixed run of a pair look worse than the broken one
    scaled = model.run["scaling"] in summaries.LOSS_SCALED
    view = c1.radio("Gradient", ["unscaled g", "at the loss scale (S·g)"], index=int(scaled), horizontal=True,
                    key="view", bind="query-params",
                    help="S·g is the gradient as it existed in the backward pass, which is what FP16 had to hold.")
    fmt = c2.radio("Format", model.formats, index=model.formats.index(model.default_format), horizontal=True,
                   key="fmt", bind="query-params", help=model.format_help)
    show_bf16 = c3.checkbox("Draw BF16 limits too", key="bf16_lines", value=False)
    return fmt, view != "unscaled g", show_bf16


def heatmap(shown: TensorView, logged: list[int]):
    """The tensor's exponents over the logged steps; returns the chart's selection (None when nothing is drawn)."""
    if shown.empty is not None:
        st.info(plain(shown.empty))
        return None
    clicked = ui.show_chart(charts.exponent_heatmap(shown.cells, shown.drawn, (logged[0], logged[-1] + 1),
                                                    shown.title, shown.extent),
                            width="stretch", on_select="rerun", selection_mode=charts.PICKED_STEP, key="heatmap")
    if shown.off:
        st.caption(plain("Not drawn, to keep the data readable: " + "; ".join(shown.off) + "."))
    if shown.blank is not None:
        st.caption(plain(shown.blank))
    if shown.kept is not None:
        st.caption(plain(shown.kept))
    return clicked


def step_slider(clicked, logged: list[int]) -> int:
    """The step slider (:func:`ui.step_slider`: at the last logged step, following the newest while the run goes
    on); a new click on the heatmap moves it to the clicked column's first logged step, once per click, and an
    event's evidence link (?step=N) to the logged step nearest N, once per link."""
    picked = None if clicked is None else summaries.picked_step(clicked.selection.get(charts.PICKED_STEP, []), logged)
    if picked is not None and st.session_state.get("step_clicked") != picked:
        st.session_state["step"] = st.session_state["step_clicked"] = picked
    linked = url_count(st.query_params.get("step"))
    if linked is not None and st.session_state.get("step_linked") != linked:
        st.session_state["step_linked"] = linked
        st.session_state["step"] = min(logged, key=lambda s: abs(s - linked))
    return ui.step_slider("Step", logged, "step")


def step_tiles(ranking: Ranking, at: StepView) -> None:
    """The step's histogram and its exact shares as tiles, both of the view chosen (g, or S·g at the step's own
    loss scale, where the what-if starts), the other view's shares beneath them; two rows of three, lined up with
    the what-if's three below. (The tiles always showed S·g: under the default view, g's histogram coloured most
    bars as underflow above tiles saying 0% underflow.)"""
    fmt, step, scale = ranking.fmt, at.step, at.scale
    scaled = f"S·g at this step's loss scale {scale_text(scale)}"
    shown, other = (scaled, "the unscaled gradient g (2^0)") if ranking.at_scale else ("g, unscaled", scaled)
    if at.bars is not None:
        ui.show_chart(charts.step_histogram(at.bars, f"step {step:,}: {shown}, coloured by {fmt} region"),
                      width="stretch")
    else:
        st.info(f"At step {step:,} the loss scale was 0: S·g is 0 everywhere, so there is no exponent to histogram "
                "(the unscaled view shows g).")
    st.markdown(f"**At step {step:,}: {shown}, cast to {fmt} (exact counts)**")  # mpdiag's words and numbers
    tiles, beneath = (at.tiles, at.unscaled) if ranking.at_scale else (at.unscaled, at.tiles)
    m = [*st.columns(3), *st.columns(3)]
    for col, cat in zip(m, CATEGORIES, strict=False):
        col.metric(f"{fmt} {cat}", summaries.share_text(tiles[cat]),
                   help=f"Of the {at.denom:,} finite non-zero values, counted by casting each one to {fmt}.")
    if scale != 1:
        st.caption(f"{other[0].upper()}{other[1:]} cast to {fmt}, also exact: " + ", ".join(
            f"{cat} {summaries.share_text(beneath[cat])}" for cat in CATEGORIES) + ".")
    m[3].metric("zeros", f"{int(at.at_step['zeros']):,}", help=f"Of {int(at.at_step['numel']):,} values.")
    m[4].metric("NaN / inf", f"{int(at.at_step['nan'] + at.at_step['posinf'] + at.at_step['neginf']):,}")
    if ranking.states_flushed:
        m[5].metric(f"{fmt} flushed to zero", "unknown" if pd.isna(at.flushed) else f"{at.flushed:.3%}",
                    help=at.flushed_said)


def whatif(model: gradients_model.GradientsRun, ranking: Ranking, at: StepView) -> int:
    """The what-if: the tensor's shares were g multiplied by another power of two; returns that power."""
    st.subheader("What if the loss scale were different?")
    # The offered powers include every scale the run used, so the default is always one of them.
    used = summaries.log2_exponent(at.scale)
    k = st.select_slider("Multiply the unscaled gradient g by", model.whatif_exponents,
                         value=0 if used is None else used, format_func=lambda e: f"2^{e}", key="whatif")
    shares = model.whatif(ranking, at, k)
    for col, cat in zip(st.columns(3), CATEGORIES, strict=True):
        col.metric(f"{ranking.fmt} {cat} at 2^{k}", summaries.share_text(shares[cat]),
                   help="exact: counted by casting" if shares[cat][2] else "from the exponent histogram")
    exact_at = ([f"At 2^{used}, this step's loss scale, these are the exact counts of S·g"]
                if used is not None and 2.0**used == at.scale and used != 0 else []) + ["at 2^0 the exact counts of g"]
    st.caption(
        f"{'; '.join(exact_at).capitalize() if len(exact_at) == 1 else '; '.join(exact_at)}. At any other power they "
        "are derived from the stored exponent histogram of g: multiplying by "
        "2^k moves every value exactly k bins; values in the three bins that straddle a rounding edge can go "
        "either way, so a range is shown where they matter."
    )
    return k


def histogram_grid(model: gradients_model.GradientsRun, ranking: Ranking, at: StepView) -> None:
    """Every tensor's exponent histogram at the chosen step as small multiples, worst first (the ranking's order),
    the first GRID_FIRST unless all are asked for."""
    st.subheader(f"Every tensor's exponent histogram at step {at.step:,} ({ranking.what})")
    total = len(at.h_index)
    if total == 0:
        st.info(f"No tensor recorded an exponent histogram at step {at.step:,}, so there is nothing to draw.")
        return
    everything = total <= GRID_FIRST or st.checkbox(f"Show all {total:,} tensors (the first {GRID_FIRST} are shown)",
                                                    key="grid_all")
    grid = model.grid(ranking, at, everything)
    if grid.drawn:
        ui.show_chart(charts.histogram_grid(grid.bars, grid.drawn, grid.lines, grid.extent,
                                            f"share of each tensor's finite non-zero |{ranking.what}| per exponent "
                                            f"bin, coloured by {ranking.fmt} region"), key="histogram_grid")
    st.caption(plain(grid.said))


ui.single_run_page("Gradients", gradients_view)
