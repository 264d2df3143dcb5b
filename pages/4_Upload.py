"""Upload: bring your own code, check it safely in a child process, then run it.

Two kinds of upload: a model script (the build(device) contract, trained by ``mpdiag run``), or training code as
it is (a script with the files it imports, or a .zip), run unmodified through ``mpdiag watch``. Reads widgets,
calls mpdiag.dashboard.actions (store the upload; check and run only on a confirmed click), renders; no store
writes of its own, no torch. Opening this page, with any query parameters, executes nothing. File names, the
script's own name, its arguments and the check's problem text are the user's: rendered as text.
"""

import shlex

import pandas as pd
import streamlit as st

from mpdiag.dashboard import actions
from mpdiag.dashboard import frame as ui
from mpdiag.dashboard.untrusted import plain
from mpdiag.sandbox.bundle import MAX_BUNDLE_BYTES, command_line, module_name

MODEL_SCRIPT = "A model script (build(device))"
TRAINING_CODE = "Training code as it is (mpdiag watch)"


def show_report(report) -> None:
    if report.ready:
        st.success(f"{plain(report.filename)}: ready")
        st.dataframe(pd.DataFrame({"": list(report.summary), "value": [str(v) for v in report.summary.values()]}),
                     hide_index=True)
    if report.problems:
        st.error(f"{plain(report.filename)}: not ready. The check found:")
        st.code("\n\n".join(report.problems), language=None)
    for warning in report.warnings:
        st.warning(plain(str(warning)))


def take_upload(store_it, seen_key: str, select_key: str) -> None:
    """Store what was uploaded and select it, once per new upload (later the selectbox keeps the user's choice).
    ``store_it`` returns the stored sha256 or raises the refusal that names what is wrong."""
    try:
        sha = store_it()
    except (actions.UploadRefused, actions.BundleRefused) as exc:
        st.error(plain(exc))
        return
    if st.session_state.get(seen_key) != sha:
        st.session_state[seen_key] = sha
        st.session_state[select_key] = sha


def pick_stored(stored, name: str, label: str, key: str, empty: str) -> str | None:
    """A selectbox over stored uploads (their name column, hash and run count), bound to the URL; its sha256."""
    if stored.empty:
        st.info(empty)
        return None
    labels = {r.sha256: f"{getattr(r, name)} · {r.sha256[:10]} · {r.runs} run(s)" for r in stored.itertuples()}
    return st.selectbox(label, list(labels), format_func=labels.get, key=key, bind="query-params")


def checked(store, subject: str, action, key: str, spinner: str, check, not_checked: str):
    """The check button (a confirmed click runs ``check()`` in a child), then its verdict; the report when it
    is ready, else None."""
    done = actions.check_verdict(store, subject) is not None
    if actions.confirmed("Check again" if done else "Check it", key, action, type="secondary" if done else "primary"):
        with st.spinner(spinner):
            actions.remember_check(store, subject, check())
    report = actions.check_verdict(store, subject)
    if report is None:
        st.info(not_checked)
        return None
    show_report(report)
    return report if report.ready else None


def model_script(store) -> None:
    st.caption("A model script defines build(device), returning a dict with the model, a function making its "
               "optimizer from the parameters, a function giving step N's batch, and loss_fn(model, batch); mpdiag "
               "trains it at any opt level, O2 and O3 included.")
    upload = st.file_uploader("Model script (.py)", type=["py"], key="upload")
    if upload is not None:
        take_upload(lambda: actions.store_upload(store, upload.name, upload.getvalue())[1], "uploaded_sha", "script")

    sha = pick_stored(store.scripts(), "filename", "Stored script", "script", "No scripts stored yet: upload one above.")
    if sha is None:
        return
    filename, source = store.script_source(sha)
    with st.expander("Source", expanded=False):
        st.code(source, language="python", line_numbers=True)

    report = checked(
        store, sha, actions.pending(f"Check {filename}: import it, build(device), one forward/backward step",
                                    filename, sha),
        "check", f"Checking {plain(filename)} in a child process (imports, build, one forward/backward step)…",
        lambda: actions.check_upload(filename, source),
        "Not checked in this session yet: 'Check it' runs the script's build and one training step in a child process.")
    if report is not None:
        st.subheader("Run it")
        options = ui.run_options_form("upload")
        action = actions.pending(f"Start a run of {filename}", filename, sha, options)
        if actions.confirmed("Start run", "upload_start", action, type="primary", disabled=not options):
            actions.start_run(store, f"sha256:{sha}", options, f"{filename} at {options['opt_level']}")
            st.success(f"Started {plain(filename)} at {options['opt_level']}: its progress and links to its pages "
                       "follow.")


def training_code(store) -> None:
    st.caption("Your training script as it is, with the files it imports (several files, or one .zip of its "
               "folder), run unmodified as `python SCRIPT ARGS` from the folder's root and recorded by mpdiag watch: "
               "one step per optimizer step, the gradients before clipping, the GradScaler's own scale and skips.")
    uploads = st.file_uploader(f"Training code: its files, or one .zip of its folder ({MAX_BUNDLE_BYTES // 2**20} MB "
                               "at most, all files together once unpacked)",
                               accept_multiple_files=True, key="code_upload")
    if uploads:
        take_upload(lambda: actions.store_code(store, [(f.name, f.getvalue()) for f in uploads])[1],
                    "uploaded_code", "code")
    chosen = stored_code(store)
    if chosen is not None:
        sha, bundle = chosen
        command = command_form(sha, bundle)
        if command is not None:
            check_then_run(store, sha, bundle, *command)


def stored_code(store):
    """The stored training code chosen, with its files listed: (sha256, bundle), or None (none stored, or the
    stored one is refused: said here)."""
    sha = pick_stored(store.bundles(), "name", "Stored code", "code",
                      "No training code uploaded yet: upload it above (the runs' own scripts are kept with each run).")
    if sha is None:
        return None
    try:
        bundle = actions.stored_code(store, sha)
    except actions.BundleRefused as exc:
        st.error(plain(exc))
        return None
    with st.expander(f"Files ({len(bundle.files)})", expanded=False):
        st.dataframe(pd.DataFrame({"file": [p for p, _ in bundle.files], "bytes": [len(d) for _, d in bundle.files]}),
                     hide_index=True)
    return sha, bundle


def command_form(sha: str, bundle) -> tuple[str, list[str], bool] | None:
    """Entry point, module mode and arguments, with the command they make shown: (entry, args, as module), or
    None when the arguments cannot be split as a shell would (said here)."""
    cols = st.columns([2, 1])
    entry = cols[0].selectbox("Entry point", bundle.entry_points(), key=f"entry_{sha}",
                              help="The script to run; files with an `if __name__ == \"__main__\"` block come first.")
    as_module = cols[1].checkbox("Run it as a module (python -m)", key=f"module_{sha}",
                                 help=f"python -m {module_name(entry)}: for code that imports its own package "
                                      "relative to the root.")
    text = st.text_input("Arguments", key=f"args_{sha}", placeholder="--batch_size=8 --max_iters=20",
                         help="As on a command line (quoted as a shell would quote them); they belong to the script.")
    try:
        args = shlex.split(text)
    except ValueError as exc:
        st.error(f"The arguments cannot be split as a shell would: {exc}.")
        return None
    st.code(command_line(entry, args, as_module), language=None)
    return entry, args, as_module


def check_then_run(store, sha: str, bundle, entry: str, args: list[str], as_module: bool) -> None:
    """The check of this command (on a click), then, once it passed in this session, the watched run's options
    and its start (on a confirmed click)."""
    command = command_line(entry, args, as_module)
    subject = "\0".join([sha, entry, str(as_module), *args])
    report = checked(
        store, subject, actions.pending(f"Check {bundle.name}: compile every Python file, read {entry}", bundle.name,
                                        sha, {"command": command}, runs_code=False),
        "code_check", f"Checking {plain(bundle.name)} in a child process (compiles every file, runs nothing)…",
        lambda: actions.check_code(bundle, entry, args, as_module),
        "Not checked in this session yet: 'Check it' compiles every Python file and reads the entry point in a "
        "child process (nothing of it runs).")
    if report is None:
        return
    st.subheader("Run it")
    options = ui.watch_options_form("code")
    level = options["opt_level"] or "its own settings"
    action = actions.pending(f"Start a watched run: {command}", bundle.name, sha, options)
    if actions.confirmed("Start run", "code_start", action, type="primary"):
        actions.start_watch(store, sha, entry, args, as_module, options, f"{command} at {level}")
        st.success(f"Started {plain(command)} at {plain(level)}: its progress and links to its pages follow.")


def upload_page(store) -> None:
    st.warning(
        "**Uploading code means running it.** Checking or running it executes it as Python with your permissions "
        "on the machine that serves this page, in a child process with time and memory limits, never inside the "
        "server itself, and only when you click for it. Only upload code you trust."
    )
    # a link to a stored model script (?script=…, from the Runs page) opens that kind
    kind = st.radio("What to upload", [TRAINING_CODE, MODEL_SCRIPT], index=1 if "script" in st.query_params else 0,
                    horizontal=True, key="kind", bind="query-params")
    if kind == MODEL_SCRIPT:
        model_script(store)
    else:
        training_code(store)
    ui.launched_panel(store)


store = ui.frame("Upload code")
if store is not None:
    ui.guarded(upload_page)(store)
