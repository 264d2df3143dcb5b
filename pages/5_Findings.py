"""Findings: what is wrong with a run, where, what to change, and a rerun that checks the fix.

Reads widgets, asks mpdiag.dashboard.findings_model for what to show, draws it with the chart layer and starts
what mpdiag.dashboard.actions starts; no store queries, no torch. The scale-linearity probe and fix reruns execute the run's stored script, so each
needs a confirmed click; opening the page (with any query parameters) starts nothing. Findings quote tensor and
run names from the user's script: they reach Markdown only through ``plain``.
"""

import pandas as pd
import streamlit as st

from mpdiag.analysis.findings import EVIDENCE_SECTIONS, GRADIENT_REL_ERROR, record_again_with
from mpdiag.dashboard import actions, charts, findings_model
from mpdiag.dashboard import frame as ui
from mpdiag.dashboard.findings_model import Card, FindingsRun
from mpdiag.dashboard.untrusted import plain
from mpdiag.options import recorded_by
from mpdiag.sandbox.probe import KIND as PROBE_KIND

BADGES = {"error": "Error", "warning": "Warning", "info": "Note"}


def probe_section(store, run: pd.Series) -> None:
    """Offer the scale-linearity probe (it reruns one batch of the stored script in a child) when it applies
    and has not been stored for this run."""
    run_id = int(run["run_id"])
    if run["scaling"] == "none" or not run["config"].get("run") or store.probe(run_id, PROBE_KIND) is not None:
        return
    st.caption("Not probed yet: the scale-linearity probe recomputes one batch at two loss scales and finds "
               "gradients that ignore the scale (a custom backward that drops grad_output).")
    action = actions.pending(f"Probe run #{run_id}: recompute one batch at two loss scales",
                             run["script_path"] or run["name"], run["script_sha256"])
    if actions.confirmed("Probe whether every gradient scales with the loss scale", f"probe_{run_id}", action):
        with st.spinner("Probing: recomputing one batch at two loss scales in a child process…"):
            actions.probe(store, run_id)


def reruns_table(model: FindingsRun) -> None:
    """Reruns of this run: did each finding go away, and how does the loss compare to FP32?"""
    if model.reruns.empty:
        return
    st.subheader("Reruns of this run")
    st.caption("The first row is this run itself: each rerun's loss is read against it and against FP32.")
    ui.table(model.reruns, model.rerun_columns)
    if model.no_reference:
        st.caption(plain(model.no_reference))


def shadow_section(shadow: findings_model.Shadow | None, run: pd.Series) -> None:
    """Gradients against the FP32 shadow (--shadow-every), tensors ranked by lost precision."""
    if shadow is None:
        how = recorded_by(run["config"])
        again = record_again_with(how, "shadow_every") + ("" if how == "recorder" else " (the run form's 'FP32 "
                                                                                      "shadow every')")
        st.caption(f"No FP32 shadow for this run. {again} to rank tensors by the precision their gradients lose.")
        return
    error = "‖g − g_fp32‖ / ‖g_fp32‖ at a shadow step: the gradient's error against FP32, relative to its size"
    st.dataframe(shadow.ranking.rename(columns={"meaningful": "reference not negligible"}), hide_index=True,
                 width="stretch", column_config={
                     "numel": st.column_config.NumberColumn("values", format="%,d", help="Elements of the tensor."),
                     "steps": st.column_config.NumberColumn("shadow steps", format="%,d",
                                                            help="Steps compared with an FP32 computation."),
                     "median_rel_error": st.column_config.NumberColumn("median relative error", format="%.3g",
                                                                       help=error + ", median over the shadow steps."),
                     "max_rel_error": st.column_config.NumberColumn("largest relative error", format="%.3g",
                                                                    help=error + ", largest over the shadow steps."),
                     "min_cosine": st.column_config.NumberColumn(
                         "lowest cosine", format="%.3f",
                         help="Cosine similarity of g and g_fp32 (1: same direction), lowest over the shadow steps."),
                     "reference not negligible": st.column_config.CheckboxColumn(
                         help="The FP32 gradient is large enough for a relative error to mean something; only "
                              "these tensors are charted and can raise the finding.")})
    if shadow.drawable:
        ui.show_chart(charts.shadow_error_lines(shadow.stats, shadow.top, GRADIENT_REL_ERROR), width="stretch")
    elif shadow.exact:
        st.caption("Every gradient equals its FP32 shadow exactly (error 0 at every shadow step, as in a run "
                   "computed in FP32), so there is no error to chart on a log axis.")
    else:
        st.caption("No finite, non-zero gradient error against the FP32 shadow among the tensors whose reference "
                   "gradient is not negligible, so there is nothing to chart on a log axis.")


def updates_section(model: FindingsRun) -> None:
    """Optimizer updates against the weight format's resolution (recorded at O2, O3 and bf16-pure)."""
    if model.updates is None:
        st.caption("Updates are checked against FP16/BF16 resolution at O2, O3 and bf16-pure; "
                   "this run has no such record.")
        return
    per_tensor, per_step = model.updates
    ui.show_chart(charts.update_share_lines(per_step, model.run["update_format"]), width="stretch")
    st.dataframe(per_tensor, hide_index=True, width="stretch",
                 column_config={c: st.column_config.NumberColumn(format="percent")
                                for c in ("below_resolution_share", "unchanged_share")})


def finding_card(store, run: pd.Series, i: int, card: Card) -> None:
    run_id, finding = int(run["run_id"]), card.finding
    with st.container(border=True):
        st.markdown(f"**{BADGES[finding.severity]} · {plain(finding.title)}**  \n`{finding.rule}`")
        st.markdown(f"**Evidence.** {plain(finding.evidence)}")
        if finding.tensors:
            st.caption(plain("Tensors: " + ", ".join(finding.tensors[:12]) + (" …" if len(finding.tensors) > 12 else "")))
        st.markdown(f"**What to change.** {plain(finding.recommendation)}")
        st.markdown(f"[See the evidence {card.where}]({card.link})")  # a percent-encoded URL
        if card.blocked:
            st.caption(plain(card.blocked))
        elif card.options is not None:
            action = actions.rerun_pending(f"Rerun #{run_id} with the fix for {finding.rule}", run, card.options)
            # the settings as a caption, which wraps: inside the button's label they were cut to "current scali…"
            st.caption(plain(f"The rerun's settings: {card.described}."))
            if actions.confirmed("Rerun with this fix", f"fix_{run_id}_{i}", action):
                actions.start_rerun(store, run_id, card.options,
                                    f"the fix of {finding.rule} on #{run_id} ({card.described})")
                st.rerun()  # the whole page: its top says what started, with its progress and links
        if card.in_code:
            st.caption(plain(f"In the script itself: {card.in_code}."))


def findings_view(store, run: pd.Series, final: bool, runs: pd.DataFrame) -> None:
    if final:
        probe_section(store, run)
    model = findings_model.findings(store, run, final, runs)
    if not final:
        st.info("The run is still going: these findings cover the steps recorded so far.")
    if not model.cards:  # a run that ended early: no success, just no findings in what it recorded
        good, said = model.none_said(ui.run_label(run))
        (st.success if good else st.info)(plain(said))
    for i, card in enumerate(model.cards):
        finding_card(store, run, i, card)
    reruns_table(model)
    st.subheader("Gradients against the FP32 shadow", anchor=EVIDENCE_SECTIONS["gradient-error"])
    shadow_section(model.shadow, model.run)
    st.subheader("Optimizer updates against the weight format", anchor=EVIDENCE_SECTIONS["update-swamping"])
    updates_section(model)
    with st.expander("Console output", expanded=False):  # what the run's process printed, as text
        ui.console_output(store, run)


ui.single_run_page("Findings", findings_view)
