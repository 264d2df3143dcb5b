"""Upload: bring your own model script, check it safely in a child process, then run it."""

import pandas as pd
import streamlit as st

from mpdiag.dashboard import frame as ui
from mpdiag.sandbox.check import check_script
from mpdiag.sandbox.launch import launch, run_command
from mpdiag.store import StoreWriter

MAX_BYTES = 1_000_000  # also server.maxUploadSize in .streamlit/config.toml


def store_upload(store, upload) -> str | None:
    """Keep an uploaded script in the store under its content hash; returns the hash, or None after an error."""
    filename = ui.safe_filename(upload.name)
    data = upload.getvalue()
    if not upload.name.endswith(".py"):
        st.error(f"{filename}: only .py files are accepted.")
        return None
    if len(data) > MAX_BYTES:
        st.error(f"{filename} is {len(data):,} bytes; the limit is {MAX_BYTES:,}.")
        return None
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError:
        st.error(f"{filename} is not UTF-8 text.")
        return None
    with StoreWriter(store.path) as writer:
        return writer.add_script(filename, source)


def show_report(report) -> None:
    if report.ready:
        st.success(f"{report.filename}: ready")
        st.table(pd.DataFrame({"": list(report.summary), "value": [str(v) for v in report.summary.values()]}))
    for problem in report.problems:
        st.error(f"```\n{problem}\n```")
    for warning in report.warnings:
        st.warning(f"{report.filename}, {warning}")


store = ui.frame("Upload a script")
if store is None:
    st.stop()
st.warning(
    "**Uploading a script means running it.** It executes as Python with your permissions on the machine that "
    "serves this page, in a child process with time and memory limits, never inside the server itself. "
    "Only upload code you trust."
)
st.caption("A model script defines build(device) returning model, optimizer, batches and loss_fn (see the README).")
upload = st.file_uploader("Model script (.py)", type=["py"], key="upload")
if upload is not None:
    sha = store_upload(store, upload)
    if sha is not None and st.session_state.get("uploaded_sha") != sha:
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

key = f"check:{store.path}:{sha}"
if key not in st.session_state or st.button("Check again", key="recheck"):
    with st.spinner(f"Checking {filename} in a child process (imports, build, one forward/backward step)…"):
        st.session_state[key] = check_script(filename, source, device="auto")
report = st.session_state[key]
show_report(report)

if report.ready:
    st.subheader("Run it")
    options = ui.run_options_form("upload")
    if st.button("Start run", type="primary", key="upload_start", disabled=not options):
        proc = launch(run_command(store.path, f"sha256:{sha}", options), store.path)
        st.session_state.setdefault("launched", []).append((proc, f"{filename} at {options['opt_level']}"))
        st.success(f"Started {filename} at {options['opt_level']}: follow it on the Runs page.")
