"""Upload: bring your own model script, check it safely in a child process, then run it.

Reads widgets, calls mpdiag.dashboard.actions (store the upload; check and run only on a confirmed click),
renders; no store writes of its own, no torch. Opening this page, with any query parameters, executes nothing.
File names, the script's own name and the check's problem text are the user's: rendered as text.
"""

import pandas as pd
import streamlit as st

from mpdiag.dashboard import actions
from mpdiag.dashboard import frame as ui
from mpdiag.dashboard.untrusted import plain


def show_report(report) -> None:
    if report.ready:
        st.success(f"{plain(report.filename)}: ready")
        st.dataframe(pd.DataFrame({"": list(report.summary), "value": [str(v) for v in report.summary.values()]}),
                     hide_index=True)
    if report.problems:
        st.error(f"{plain(report.filename)}: not ready. The check found:")
        st.code("\n\n".join(report.problems), language=None)
    for warning in report.warnings:
        st.warning(plain(f"{report.filename}, {warning}"))


store = ui.frame("Upload a script")
if store is None:
    st.stop()
st.warning(
    "**Uploading a script means running it.** Checking or running it executes it as Python with your permissions "
    "on the machine that serves this page, in a child process with time and memory limits, never inside the "
    "server itself, and only when you click for it. Only upload code you trust."
)
st.caption("A model script defines build(device) returning model, optimizer, batches and loss_fn (see the README).")
upload = st.file_uploader("Model script (.py)", type=["py"], key="upload")
if upload is not None:
    try:
        _, sha = actions.store_upload(store, upload.name, upload.getvalue())
    except actions.UploadRefused as exc:
        st.error(plain(exc))
    else:
        if st.session_state.get("uploaded_sha") != sha:
            st.session_state["uploaded_sha"] = sha
            st.session_state["script"] = sha

stored = store.scripts()
if stored.empty:
    st.info("No scripts stored yet: upload one above.")
    st.stop()
labels = {r.sha256: f"{r.filename} · {r.sha256[:10]} · {r.runs} run(s)" for r in stored.itertuples()}
sha = st.selectbox("Stored script", list(labels), format_func=labels.get, key="script", bind="query-params")
filename, source = store.script_source(sha)
with st.expander("Source", expanded=False):
    st.code(source, language="python", line_numbers=True)

checked = actions.check_verdict(store, sha) is not None
check = actions.pending(f"Check {filename}: import it, build(device), one forward/backward step", filename, sha)
if actions.confirmed("Check again" if checked else "Check it", "check", check,
                     type="secondary" if checked else "primary"):
    with st.spinner(f"Checking {plain(filename)} in a child process (imports, build, one forward/backward step)…"):
        actions.remember_check(store, sha, actions.check_upload(filename, source))
report = actions.check_verdict(store, sha)
if report is None:
    st.info("Not checked in this session yet: 'Check it' runs the script's build and one training step in a child "
            "process.")
    st.stop()
show_report(report)

if report.ready:
    st.subheader("Run it")
    options = ui.run_options_form("upload")
    action = actions.pending(f"Start a run of {filename}", filename, sha, options)
    if actions.confirmed("Start run", "upload_start", action, type="primary", disabled=not options):
        actions.start_run(store, f"sha256:{sha}", options, f"{filename} at {options['opt_level']}")
        st.success(f"Started {plain(filename)} at {options['opt_level']}: its progress and links to its pages follow.")
ui.launched_panel(store)
