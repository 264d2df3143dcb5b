"""mpdiag home: every run with its status and live progress; start a run or rerun one with other settings.

Start with ``streamlit run app.py``. The other pages (Gradients, Loss scale, Compare, Upload, Findings) live in
``pages/``.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from mpdiag.dashboard import charts
from mpdiag.dashboard import frame as ui
from mpdiag.examples import bundled_scripts
from mpdiag.sandbox.launch import launch, rerun_job, run_job

FIRST_EXAMPLE = "mlp_digits.py"


def start(store, command: list[str], what: str) -> None:
    st.session_state.setdefault("launched", []).append((launch(command, store.path), what))
    st.toast(f"Started {what}")


def launched_panel(runs: pd.DataFrame) -> None:
    """Processes this session started: those without a run row yet are starting, or failed to start."""
    recorded = set(runs["run_id"]) if len(runs) else set()
    for proc, what in st.session_state.get("launched", []):
        if recorded & set(proc.run_ids()):
            continue
        if proc.is_alive():
            st.info(f"Starting {what}…")
        else:
            st.error(f"{what} ended before recording a run: {proc.ending() or 'the supervisor stopped'}. "
                     f"Its output:\n\n```\n{proc.log_tail()}\n```")


@st.fragment(run_every=ui.LIVE_REFRESH_S)
def runs_panel(store) -> None:
    runs = store.runs()
    launched_panel(runs)
    if runs.empty:
        st.info(f"No runs in {store.path} yet.")
        if st.button(f"▶ Run the bundled example {FIRST_EXAMPLE} (O1 with its FP32 twin, 200 steps)", type="primary"):
            script = str(bundled_scripts()[FIRST_EXAMPLE])
            start(store, run_job(script, {"opt_level": "O1", "steps": 200, "pair": True}), FIRST_EXAMPLE)
            st.rerun(scope="fragment")
        return
    running = runs[runs["status"] == "running"]
    for _, run in running.iterrows():
        with st.container(border=True):
            done = int(run["steps_done"])
            st.progress(min(1.0, done / max(1, int(run["steps"] or 1))),
                        text=f"{ui.run_label(run)}: step {done} of {run['steps']}")
            st.altair_chart(charts.live_loss(ui.live_steps(store, int(run["run_id"]))), width="stretch")
    table = pd.DataFrame({
        "run": runs["run_id"],
        "name": runs["name"],
        "status": runs["status"],
        "opt level": runs["opt_level"],
        "scaling": runs["scaling"],
        "init scale": runs["init_scale"],
        "static scale": runs["loss_scale"],
        "steps": runs["steps_done"].astype(str) + " / " + runs["steps"].astype(str),
        "final loss": runs["final_loss"],
        "skipped": runs["skipped_steps"],
        "step ms (median)": runs["median_step_time_s"] * 1e3,
        "device": runs["device"],
        "parent": runs["parent_run_id"],
        "FP32 twin": runs["pair_run_id"],
        "started": runs["started_at"].dt.tz_convert(None).dt.strftime("%Y-%m-%d %H:%M:%S"),
    })
    st.dataframe(table, hide_index=True, width="stretch")
    for _, run in runs[runs["status"].isin(["failed", "crashed"])].head(3).iterrows():
        ui.explain_run_state(run)


def new_run_form(store) -> None:
    scripts = {f"bundled: {name}": str(path) for name, path in bundled_scripts().items()}
    stored = store.scripts()
    scripts |= {f"stored: {r.filename} ({r.sha256[:10]})": f"sha256:{r.sha256}" for r in stored.itertuples()}
    chosen = st.selectbox("Script", list(scripts), key="new_script",
                          help="Bundled examples, and scripts uploaded (and checked) on the Upload page.")
    st.caption("To use your own script, upload it on the Upload page: it is checked before it can run.")
    options = ui.run_options_form("new")
    if st.button("Start run", type="primary", key="new_start", disabled=not options):
        start(store, run_job(scripts[chosen], options), f"{chosen} at {options['opt_level']}")


def rerun_form(store, runs: pd.DataFrame) -> None:
    rerunnable = runs[runs["config"].map(lambda c: "run" in c)]
    if rerunnable.empty:
        st.caption("Runs recorded by a Recorder in your own loop cannot be rerun from here.")
        return
    parent_id = ui.pick_run(rerunnable, key="rerun_of", label="Rerun")
    parent = rerunnable.set_index("run_id").loc[parent_id]
    options = ui.run_options_form("rerun", parent)
    st.caption(f"Reruns the script source stored with run #{parent_id} (not the file as it is now).")
    if st.button("Rerun", type="primary", key="rerun_start", disabled=not options):
        start(store, rerun_job(parent_id, options), f"rerun of #{parent_id} at {options['opt_level']}")


store = ui.frame("Runs")
if store is None:
    st.stop()
st.caption("Every recorded run. Open a run's gradients, loss scale or comparisons from the pages in the sidebar.")
runs_panel(store)
runs = store.runs()
left, right = st.columns(2)
with left, st.expander("Start a new run", expanded=runs.empty):
    new_run_form(store)
with right, st.expander("Rerun with other settings", expanded=False):
    if runs.empty:
        st.caption("No runs to rerun yet.")
    else:
        rerun_form(store, runs)
st.caption("Deep links: `?run=3` on the Gradients or Loss scale page opens run 3; `?runs=3&runs=4` on Compare.")
