"""mpdiag home: every run with its status and live progress; start a run or rerun one with other settings.

Start with ``streamlit run app.py``. The other pages (Gradients, Loss scale, Compare, Upload, Findings) live in
``pages/``. This page reads widgets, calls the analysis, chart and action layers, and renders; it must not
query the store directly, import torch, or start anything without a confirmed click (mpdiag.dashboard.actions).
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from mpdiag.analysis.run_choice import LIVE_STATUSES, script_names, select_runs
from mpdiag.dashboard import actions, charts, events_model, runs_model
from mpdiag.dashboard import frame as ui
from mpdiag.dashboard.untrusted import plain
from mpdiag.examples import bundled_scripts
from mpdiag.options import UNSET, torchrun_rerun, watch_settings
from mpdiag.store import MAX_NAME_CHARS, MAX_NOTE_CHARS, MAX_TAG_CHARS, MAX_TAGS, RunTextRefused, StoreError
from mpdiag.store.console import OUTPUT_REFRESH_S

FIRST_EXAMPLE = "mlp_digits.py"


def runs_panel(store) -> None:
    runs = store.runs()
    # each part above the table in a container of its own: the table keeps its place on the page as runs start
    # and end (moved, the browser rebuilt it, blank for a moment: ~0.3 s, longer on a busy machine)
    with st.container():
        ui.launched_runs(store, runs)
    if runs.empty:
        first_run_offer(store)
        return
    with st.container():  # live: an event shows at the next refresh
        banners = events_model.runs_banners(store, runs)
        if banners:  # folded unless a run still going raised them: five runs' events hid the runs table below
            going = set(runs.loc[runs["status"].isin(LIVE_STATUSES), "run_id"].astype(int))
            with st.expander(f"Events while training: {len(banners)} of the newest runs raised some",
                             expanded=any(banner.run_id in going for banner in banners)):
                for banner in banners:
                    ui.events_banner(banner)
    with st.container():
        for live in runs_model.live_runs(store, runs):
            with st.container(border=True):
                if live.fraction is None:
                    st.caption(plain(live.text))
                else:
                    st.progress(live.fraction, text=plain(live.text))
                if live.loss_drawable:
                    ui.show_chart(charts.live_loss(live.drawn), f"live_loss_{live.run_id}", width="stretch")
                else:
                    st.caption(live.no_loss)
    table = runs_model.table(store, runs, filtered_runs(runs))
    ui.table(table, runs_model.TABLE_COLUMNS)
    with st.expander("More about each run: settings, timing, tags and notes", expanded=False):
        for title, columns in runs_model.MORE_TABLES.items():
            st.caption(title)
            ui.table(table, columns)
    # why the newest runs that ended early ended (a stopped run's events banner above is folded once it ended)
    explained, more = runs_model.ended_early(runs)
    for _, run in explained.iterrows():
        ui.explain_run_state(run)
    if more is not None:
        st.caption(more)  # run numbers and fixed words only


def first_run_offer(store) -> None:
    """An empty store: the bundled example, with its FP32 twin, one confirmed click away."""
    st.info(f"No runs in {plain(store.path)} yet.")
    script = bundled_scripts()[FIRST_EXAMPLE]
    options = {"opt_level": "O1", "steps": 200, "pair": True}
    action = actions.pending(f"Run the bundled example {FIRST_EXAMPLE}", FIRST_EXAMPLE,
                             actions.script_sha256(script), options)
    if actions.confirmed(f"▶ Run the bundled example {FIRST_EXAMPLE} (O1 with its FP32 twin, 200 steps)",
                         "first_example", action, type="primary"):
        actions.start_run(store, str(script), options, FIRST_EXAMPLE)
        st.rerun(scope="fragment")


def filtered_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs the table's filters keep (every run when none is set): by tag, status, level and script."""
    cols = st.columns(4)
    tags = cols[0].multiselect("Tag", sorted({t for held in runs["tags"] for t in held}), key="filter_tag",
                               placeholder="all", help="Runs carrying any of these tags.")
    statuses = cols[1].multiselect("Status", sorted(runs["status"].unique()), key="filter_status", placeholder="all")
    levels = cols[2].multiselect("Level", sorted(runs["opt_level"].dropna().unique()), key="filter_opt level",
                                 placeholder="all")
    scripts = cols[3].multiselect("Script", sorted(set(script_names(runs)) - {""}),
                                  key="filter_script", placeholder="all")
    shown = select_runs(runs, tags=tags, statuses=statuses, scripts=scripts)
    return shown[shown["opt_level"].isin(levels)] if levels else shown


def manage_panel(store, runs: pd.DataFrame) -> None:
    """Rename a run, set its tags and note, or delete it: each written only on a click here (a delete only on
    a second click confirming it), through the store's rules, with one message for what was refused."""
    labels = {int(r["run_id"]): ui.run_label(r) for _, r in runs.iterrows()}
    if st.session_state.get("manage_run") not in labels:
        st.session_state["manage_run"] = next(iter(labels))
    run_id = st.selectbox("Run", list(labels), format_func=labels.get, key="manage_run")
    run = runs_model.managed_run(runs, run_id)
    done = st.session_state.pop("manage_done", None)
    if done:
        st.success(plain(done))
    name_col, button_col = st.columns([4, 1], vertical_alignment="bottom")
    name = name_col.text_input("Name", run.name, key=f"manage_name_{run_id}", max_chars=MAX_NAME_CHARS)
    if button_col.button("Rename", key="manage_rename", width="stretch"):
        _write(lambda: f"Run #{run_id} is now named “{actions.rename_run(store, run_id, name)}”.")
    tag_col, button_col = st.columns([4, 1], vertical_alignment="bottom")
    tags = tag_col.multiselect("Tags", run.known_tags, default=run.tags, key=f"manage_tags_{run_id}",
                               accept_new_options=True, placeholder="type a tag and press Enter",
                               help=f"Up to {MAX_TAGS} tags of at most {MAX_TAG_CHARS} characters each.")
    if button_col.button("Save tags", key="manage_tag", width="stretch"):
        _write(lambda: f"Run #{run_id}'s tags: {', '.join(actions.set_tags(store, run_id, tags)) or 'none'}.")
    note = st.text_area("Note", run.note, key=f"manage_note_{run_id}", max_chars=MAX_NOTE_CHARS, height=90,
                        help="Yours, kept with the run; empty clears it. What mpdiag itself noted about the run "
                             "is shown beside it, not here.")
    if st.button("Save note", key="manage_note"):
        _write(lambda: f"Run #{run_id}'s note {'saved' if actions.set_note(store, run_id, note) else 'cleared'}.")
    if run.delete_refused:
        st.caption(plain(run.delete_refused))
    if actions.confirmed_delete(f"Delete run #{run_id}…", "manage_delete", run_id, run.delete_summary,
                                disabled=run.delete_refused is not None, help=run.delete_refused):
        def delete() -> str:
            rows = actions.delete_run(store, run_id)
            return (f"Deleted run #{run_id}: {sum(rows.values()):,} rows from "
                    f"{sum(1 for n in rows.values() if n)} tables.")
        _write(delete)


def _write(action) -> None:
    """Do a management action; its message (or the store's one-sentence refusal) is shown after the page
    reruns on the store as it now is."""
    try:
        st.session_state["manage_done"] = action()
    except (RunTextRefused, StoreError) as exc:
        st.error(plain(exc))
        return
    st.rerun()


def output_panel(store, runs: pd.DataFrame) -> None:
    """The console output kept with the chosen run (the newest by default), live while that run goes."""
    labels = {int(r["run_id"]): ui.run_label(r) for _, r in runs.iterrows()}
    if st.session_state.get("output_run") not in labels:
        st.session_state["output_run"] = next(iter(labels))
    run_id = st.selectbox("Run", list(labels), format_func=labels.get, key="output_run")
    run = runs.set_index("run_id").loc[run_id].copy()
    run["run_id"] = run_id
    if run["status"] in LIVE_STATUSES:
        # the kept output changes every OUTPUT_REFRESH_S: re-reading it more often redraws the same text
        ui.live(lambda: ui.console_output(store, store.run(run_id)), OUTPUT_REFRESH_S)()
    else:
        ui.console_output(store, run)


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
    # what mpdiag ran (a stored script's options) or watched (the command to repeat); a user's own loop neither
    rerunnable = runs[runs["config"].map(lambda c: "run" in c or "argv" in (watch_settings(c) or {}))
                      & (runs["script_sha256"].notna() | runs["config"].map(lambda c: watch_settings(c) is not None))]
    if rerunnable.empty:
        st.caption("Runs recorded by a Recorder in your own loop cannot be rerun from here.")
        return
    parent_id = ui.pick_run(rerunnable, key="rerun_of", label="Rerun",
                            default=lambda: ui.default_run(store, runs, among=rerunnable))
    parent = rerunnable.set_index("run_id").loc[parent_id]
    watched = watch_settings(parent["config"])
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
    refused = torchrun_rerun(parent["config"], parent["world_size"])  # one process cannot repeat a torchrun job
    if refused is not None:
        st.caption(plain(f"{refused[0].upper()}{refused[1:]} (with these options as flags)."))
    action = actions.rerun_pending(f"Rerun #{parent_id}", parent, options)
    if actions.confirmed("Rerun", "rerun_start", action, type="primary", disabled=not options or refused is not None):
        actions.start_rerun(store, parent_id, options, f"rerun of #{parent_id} at {level}")
        st.success(f"Started a rerun of #{parent_id}: its progress and links to its pages are at the top of this "
                   "page.")


def home(store) -> None:
    st.caption("Every recorded run. Open a run's gradients, loss scale or comparisons from the pages in the sidebar.")
    ui.live(runs_panel, ui.LIVE_REFRESH_S)(store)
    runs = store.runs()
    left, right = st.columns(2)
    with left, st.expander("Start a new run", expanded=runs.empty):
        new_run_form(store)
    with right, st.expander("Rerun with other settings", expanded=False):
        if runs.empty:
            st.caption("No runs to rerun yet.")
        else:
            rerun_form(store, runs)
    if not runs.empty:
        with st.expander("Rename, tag, note or delete a run", expanded=False):
            manage_panel(store, runs)
        with st.expander("Console output of a run", expanded=False):
            output_panel(store, runs)
    st.caption("Deep links: `?run=3` on the Gradients or Loss scale page opens run 3; `?runs=3&runs=4` on Compare. "
               "A link only selects what is shown: nothing starts until you click for it here.")


store = ui.frame("Runs")
if store is not None:
    ui.guarded(home)(store)
