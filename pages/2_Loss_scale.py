"""Loss scale: the scale per step (log2), skipped steps, the growth tracker, and the loss, learning rate and global
gradient norm beneath; each step's over/underflow counts, kept or not.

Asks mpdiag.dashboard.loss_scale_model for what to show and draws it with the chart layer; no store queries, no
torch.
"""

import pandas as pd
import streamlit as st

from mpdiag.dashboard import charts, loss_scale_model
from mpdiag.dashboard import frame as ui
from mpdiag.dashboard.untrusted import plain, url_count
from mpdiag.options import scale_text


def loss_scale_view(store, run: pd.Series, final: bool, runs: pd.DataFrame) -> None:
    run_id = int(run["run_id"])
    model = loss_scale_model.loss_scale(store, run, final)
    steps, events = model.steps, model.events
    if steps.empty:
        st.info("No steps recorded yet." if run["status"] == "running" else f"Run #{run_id} recorded no steps.")
        return
    ui.findings_shown_here(store, run, "Loss_scale", runs)
    m = st.columns(6)
    m[0].metric("steps", f"{len(steps):,}")
    m[1].metric(f"skipped ({events['skips'] / len(steps):.1%})", f"{events['skips']:,}")
    m[2].metric("backoffs", f"{events['backoffs']:,}")
    m[3].metric("growths", f"{events['growths']:,}")
    m[4].metric("lowest scale", scale_text(events["min_scale"]))
    m[5].metric("loss NaN/inf", f"{model.nonfinite_losses:,} step{'' if model.nonfinite_losses == 1 else 's'}")
    if run["scaling"] == "none":
        st.info(f"{plain(run['opt_level'])} does not scale the loss: the scale is 1 at every step.")
    elif run["scaling"] == "static":
        st.info(f"Static loss scale {run['loss_scale']:g}: it never changes; steps with inf/NaN gradients are still skipped.")
    linked = url_count(st.query_params.get("step"))  # an event's evidence link (?step=N): marked on every panel
    marked = linked if linked is not None and linked in set(steps["step"]) else None
    if marked is not None:
        st.caption(f"The dashed line marks step {marked:,}, the step the link you followed names.")
    ui.show_chart(charts.loss_scale_panel(model.drawn_steps, marked), width="stretch")
    for note in model.notes:
        st.caption(plain(note))
    st.caption("The loss scale drawn is the one each step ran at (GradScaler's scale before that step's update(); "
               "the tooltip also gives the scale after it, which the events quote); skips and the growth tracker "
               "are GradScaler's own state after each update(), as recorded. The learning rate and the gradient norm (of all gradients, unscaled, before any clipping: what "
               "clip_grad_norm_ returns) are recorded at every step, logged or not.")
    if not model.signals.empty:
        ui.show_chart(charts.signal_lines(model.signals), width="stretch")
    st.caption(plain(model.signal_note))
    if model.ranks is not None:
        ranks_view(run, model.ranks)


def ranks_view(run: pd.Series, ranks: loss_scale_model.Ranks) -> None:
    """A distributed run: each rank's local loss and local inf/NaN count, and the rank-nonfinite finding."""
    st.subheader(f"Per rank ({int(run['world_size'])} ranks, {plain(run['backend'])})")
    if ranks.rows.empty:
        st.info("No per-rank rows recorded yet.")
        return
    if ranks.finding is not None:
        st.warning(plain(f"{ranks.finding.title}. {ranks.finding.evidence}"))
    ui.show_chart(charts.rank_panel(ranks.rows, ranks.first), width="stretch")
    if ranks.rows["nonfinite"].isna().all():
        st.caption("Local inf/NaN counts are recorded under DDP only; this run's ranks have losses alone.")
    st.caption("The run's loss above is the mean of the ranks' local losses.")


ui.single_run_page("Loss scale", loss_scale_view)
