"""mpdiag home: every run with its status and live progress; start a run or rerun one with other settings.

Start with ``streamlit run app.py``. The other pages (Gradients, Loss scale, Compare, Upload, Findings) live in
``pages/``. This page reads widgets, calls the analysis, chart and action layers, and renders; it must not
query the store directly, import torch, or start anything without a confirmed click (mpdiag.dashboard.actions).
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from mpdiag.analysis.summaries import RUN_LINKS, nonfinite_losses, run_progress, runs_table
from mpdiag.dashboard import actions, charts, reads
from mpdiag.dashboard import frame as ui
from mpdiag.dashboard.untrusted import plain
from mpdiag.examples import bundled_scripts
from mpdiag.training.config import UNSET

FIRST_EXAMPLE = "mlp_digits.py"


@st.fragment(run_every=ui.LIVE_REFRESH_S)
def runs_panel(store) -> None:
    runs = store.runs()
    ui.launched_runs(store, runs)
    if runs.empty:
        st.info(f"No runs in {plain(store.path)} yet.")
        script = bundled_scripts()[FIRST_EXAMPLE]
        options = {"opt_level": "O1", "steps": 200, "pair": True}
        action = actions.pending(f"Run the bundled example {FIRST_EXAMPLE}", FIRST_EXAMPLE,
                                 actions.script_sha256(script), options)
        if actions.confirmed(f"▶ Run the bundled example {FIRST_EXAMPLE} (O1 with its FP32 twin, 200 steps)",
                             "first_example", action, type="primary"):
            actions.start_run(store, str(script), options, FIRST_EXAMPLE)
            st.rerun(scope="fragment")
        return
    for _, run in runs[runs["status"] == "running"].iterrows():
        with st.container(border=True):
            fraction, words = run_progress(run)
            text = plain(f"{ui.run_label(run)}: {words}")
            if fraction is None:
                st.caption(text)
            else:
                st.progress(fraction, text=text)
            steps = reads.live_steps(store, int(run["run_id"]))
            if nonfinite_losses(steps) < len(steps):
                st.altair_chart(charts.live_loss(steps), width="stretch")
            else:
                st.caption("No finite loss recorded yet." if len(steps) else "No step recorded yet.")
    version = reads.findings_version(store, runs)
    table = runs_table(runs, [reads.finding_severities(store, run, version) for _, run in runs.iterrows()])
    filters = st.columns(3)
    for col, (column, label) in zip(filters, {"status": "Status", "opt level": "Level", "script": "Script"}.items(),
                                    strict=True):
        keep = col.multiselect(label, sorted(table[column].dropna().unique()), key=f"filter_{column}",
                               placeholder="all")
        table = table[table[column].isin(keep)] if keep else table
    st.dataframe(table, hide_index=True, width="stretch", column_config={
        column: st.column_config.LinkColumn(text, display_text=text) for column, text in RUN_LINKS.items()})
    for _, run in runs[runs["status"].isin(["failed", "crashed"])].head(3).iterrows():
        ui.explain_run_state(run)


def new_run_form(store) -> None:
    scripts = {f"bundled: {name}": (name, str(path), actions.script_sha256(path))
               for name, path in bundled_scripts().items()}
    bundled = {sha for _, _, sha in scripts.values()}
    scripts |= {f"stored: {r.filename} ({r.sha256[:10]})": (r.filename, f"sha256:{r.sha256}", r.sha256)
                for r in store.scripts().itertuples() if r.sha256 not in bundled}  # a bundled copy: listed once
    chosen = st.selectbox("Script", list(scripts), key="new_script",
                          help="Bundled examples, and scripts uploaded on the Upload page (runnable here once "
                               "they passed their check in this session).")
    st.caption("To use your own script, upload it on the Upload page: it is checked before it can run. "
               + plain(actions.limits_text()))
    options = ui.run_options_form("new")
    name, script, sha = scripts[chosen]
    blocked = None
    if sha not in bundled:
        report = actions.check_verdict(store, sha)
        if report is None:
            blocked = f"{name} has not been checked in this session: check it on the Upload page first."
        elif not report.ready:
            blocked = f"{name} failed its check: see what the check found on the Upload page."
        if blocked:
            st.warning(plain(blocked))
            st.page_link("pages/4_Upload.py", label="Open it on the Upload page", query_params={"script": sha})
    action = actions.pending(f"Start a run of {name}", name, sha, options)
    if actions.confirmed("Start run", "new_start", action, type="primary", disabled=not options or bool(blocked),
                         help=blocked):
        actions.start_run(store, script, options, f"{name} at {options['opt_level']}")
        st.success(f"Started {plain(name)}: its progress and links to its pages are at the top of this page.")


def rerun_form(store, runs: pd.DataFrame) -> None:
    rerunnable = runs[runs["config"].map(lambda c: "run" in c or "watch" in c)]
    if rerunnable.empty:
        st.caption("Runs recorded by a Recorder in your own loop cannot be rerun from here.")
        return
    parent_id = ui.pick_run(rerunnable, key="rerun_of", label="Rerun",
                            default=lambda: ui.default_run(store, runs, among=rerunnable))
    parent = rerunnable.set_index("run_id").loc[parent_id]
    watched = parent["config"].get("watch")
    if watched:
        options = ui.watch_options_form("rerun", parent)
        where = ("the training code uploaded with it" if watched.get("bundle") else
                 f"the script as it is now, from {watched['cwd']}")
        st.caption(plain(f"Repeats the watched command (python {' '.join(watched['argv'])}) on {where}."))
        level = options["opt_level"] if options["opt_level"] not in (None, UNSET) else "its own settings"
    else:
        options = ui.run_options_form("rerun", parent)
        st.caption(f"Reruns the script source stored with run #{parent_id} (not the file as it is now).")
        level = options.get("opt_level")
    action = actions.pending(f"Rerun #{parent_id}", parent["script_path"] or parent["name"],
                             parent["script_sha256"] or (watched or {}).get("bundle") or "none: the file as it is now", options)
    if actions.confirmed("Rerun", "rerun_start", action, type="primary", disabled=not options):
        actions.start_rerun(store, parent_id, options, f"rerun of #{parent_id} at {level}")
        st.success(f"Started a rerun of #{parent_id}: its progress and links to its pages are at the top of this "
                   "page.")


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
st.caption("Deep links: `?run=3` on the Gradients or Loss scale page opens run 3; `?runs=3&runs=4` on Compare. "
           "A link only selects what is shown: nothing starts until you click for it here.")
