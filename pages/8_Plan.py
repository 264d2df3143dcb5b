"""Plan: the cheapest precision each Linear of a run can take, the run's and the moments' precision, each with its
evidence and predicted savings, the config to take, and its verification: reruns of the plan beside the FP32
reference, predicted against measured, the loss curves overlaid.

Reads widgets, asks mpdiag.dashboard.plan_model for what to show, draws it with the chart layer and starts what
mpdiag.dashboard.actions starts; no store queries, no torch. Verifying reruns the run's stored script, so it needs
a confirmed click: one click starts every remaining round in the background (mpdiag.dashboard.verify_job), and
the Verify section is live while it runs; opening the page starts nothing. Linear and run names are the user's:
they reach Markdown only through ``plain``, and the table and the config are shown as data and code.
"""

import pandas as pd
import streamlit as st

from mpdiag.dashboard import actions, charts, plan_model
from mpdiag.dashboard import frame as ui
from mpdiag.dashboard.untrusted import plain
from mpdiag.options import command_flags


def verify_section(store, run: pd.Series, plan) -> None:
    """The Verify section, live while a verification this session started runs (its rounds fill the table)."""
    job = actions.verification(int(run["run_id"]))
    going = job is not None and job.is_alive()
    ui.live(lambda: verify_body(store, run, plan, job), ui.LIVE_REFRESH_S if going else None)()


def verify_body(store, run: pd.Series, plan, job) -> None:
    view = plan_model.verify_view(store, run, store.runs(), plan)
    st.subheader("Verify")
    running = job is not None and job.is_alive()
    if running:
        st.progress(view.fraction or 0.0, text=plain(f"Verifying in the background: {view.going}."
                                                     if view.going else "Verifying in the background: starting…"))
    elif job is not None and job.ending():
        st.caption(plain(f"The verification you started ended: {job.ending()}."))
    if not view.rounds.empty:
        ui.table(view.rounds, plan_model.ROUND_COLUMNS)
        for sentence in view.said:  # each round in full: what ran, predicted, measured and the verdict
            st.markdown(plain(sentence))
    if len(view.curves):
        st.caption("The loss of the FP32 reference and of each verify round (dashed where they coincide).")
        # on a log axis where the losses span more than 100x (a diverged round's 1.8e8 put the rest on 0: a user's trial)
        ui.show_chart(charts.runs_overlay(view.curves, "loss", "loss", view.domain,
                                          log=charts.losses_far_apart(view.curves["loss"]), log_base=10),
                      width="stretch")
    if not running:
        next_round(store, run, view)


def next_round(store, run: pd.Series, view) -> None:
    """How the verification stands, and the confirmed click that runs its remaining rounds in the background."""
    run_id = int(run["run_id"])
    if view.refused is not None:
        st.caption(plain(f"No verification offered: {view.refused}"))
        return
    if view.next_options is None:
        st.caption("Verified: the last round tracks FP32." if view.verified else
                   "No further round: the rounds are spent or one is still going.")
        return
    st.caption(plain(f"{view.next_what}: in the background, each round a normal rerun of run #{run_id}, listed on "
                     "Compare and judged on its own Findings page; nothing starts before you confirm."))
    action = actions.rerun_pending(f"{view.next_what} of run #{run_id}", run, view.next_options)
    if actions.confirmed("Verify the plan", f"plan_verify_{run_id}", action, type="primary"):
        actions.start_verify(store, run_id, view.next_round, view.next_modules,
                             f"the verification of run #{run_id}'s plan")
        st.rerun()


def record_section(store, run: pd.Series, view: plan_model.PlanView) -> None:
    """A run without FP8 statistics: why there is no plan, and the rerun that records them, on a confirmed click."""
    run_id = int(run["run_id"])
    st.info(plain(f"No plan for run #{run_id}: a plan is made from the FP8 statistics of every Linear, and this run "
                  "recorded none. Rerun it in FP32 (O0, its own FP32 reference) recording them under every recipe a "
                  "Linear can be planned in (current and delayed scaling, MXFP8, NVFP4), then open this page on the "
                  "rerun."))
    if view.record_refused:
        st.caption(plain(f"{view.record_refused} Why: {view.missing}."))
        return
    st.caption(plain(f"The same from a shell: python -m mpdiag rerun {run_id} "
                     f"{command_flags(view.record_options)}. Why: {view.missing}."))
    what = "Rerun with FP8 statistics"
    action = actions.rerun_pending(f"{what} of run #{run_id}", run, view.record_options)
    if actions.confirmed(what, f"plan_record_{run_id}", action, type="primary"):
        actions.start_rerun(store, run_id, view.record_options, f"{what} (run #{run_id})")
        st.rerun()


def plan_page(store, run: pd.Series, final: bool, runs: pd.DataFrame) -> None:
    view = plan_model.plan_view(store, run, runs)
    if view.plan is None:
        record_section(store, run, view)
        return
    st.markdown(plain(view.run_said()))
    st.markdown(plain(view.moments_said()))
    for note in view.plan.notes:
        st.caption(plain(f"Not recorded: {note}."))
    st.subheader("Linears")
    ui.table(view.table, plan_model.LINEAR_COLUMNS)
    with st.expander("Why each Linear got its choice: its evidence and the cheaper choices rejected",
                     expanded=view.evidence_expanded):
        for line in view.evidence_lines():
            st.markdown(plain(line))
    left, right = st.columns(2)
    ui.show_chart_in(left, charts.plan_bytes(view.memory, "model state, 16Ψ account (MB)"), width="stretch")
    ui.show_chart_in(right, charts.plan_bytes(view.gemm, "Linear GEMM operands per step (MB)"), width="stretch")
    st.caption("Take it: the rerun's flags and a Transformer-Engine-style recipe per Linear.")
    st.code(view.plan.config_text(), language="text")
    verify_section(store, run, view.plan)


ui.single_run_page("Plan", plan_page, shows="fp8")
