"""mpdiag home: every run with its status and live progress; start a run or rerun one with other settings.

Start with ``streamlit run app.py``. Other pages (Gradients, Loss scale, Compare) live in ``pages/``.
"""

from __future__ import annotations

import re

import pandas as pd
import streamlit as st
import torch

from mpdiag import charts, ui
from mpdiag.examples import bundled_scripts
from mpdiag.launch import launch, rerun_command, run_command
from mpdiag.policies import POLICIES, ConfigError
from mpdiag.runner import RunConfig
from mpdiag.store import StoreWriter

FIRST_EXAMPLE = "mlp_digits.py"


def start(command: list[str], what: str) -> None:
    st.session_state.setdefault("launched", []).append((launch(command), what))
    st.toast(f"Started {what}")


def launched_panel(runs: pd.DataFrame) -> None:
    """Processes this session started: those without a run row yet are starting, or failed to start."""
    pids = set(runs["pid"].dropna().astype(int)) if len(runs) else set()
    for proc, what in st.session_state.get("launched", []):
        if proc.pid in pids:
            continue
        if proc.is_alive():
            st.info(f"Starting {what} (pid {proc.pid})…")
        else:
            st.error(f"{what} exited before recording a run. Its output:\n\n```\n{proc.log_tail()}\n```")


@st.fragment(run_every=ui.LIVE_REFRESH_S)
def runs_panel(store) -> None:
    runs = store.runs()
    launched_panel(runs)
    if runs.empty:
        st.info(f"No runs in {store.path} yet.")
        if st.button(f"▶ Run the bundled example {FIRST_EXAMPLE} (O1 with its FP32 twin, 200 steps)", type="primary"):
            script = str(bundled_scripts()[FIRST_EXAMPLE])
            start(run_command(store.path, script, {"opt_level": "O1", "steps": 200, "pair": True}), FIRST_EXAMPLE)
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


def _scaling_options(prefix: str) -> dict:
    """Loss-scale widgets; returns the CLI options they set (an empty dict keeps the level's default)."""
    mode = st.radio("Loss scaling", ["level default", "dynamic", "static"], horizontal=True, key=f"{prefix}_mode")
    options: dict = {}
    if mode == "static":
        options["loss_scale"] = 2.0 ** st.select_slider("Static scale (power of two)", list(range(0, 25)), value=7,
                                                        key=f"{prefix}_static", format_func=lambda k: f"2^{k}")
    else:
        if mode == "dynamic":
            options["loss_scale"] = "dynamic"
        options["init_scale"] = 2.0 ** st.select_slider("Initial scale (dynamic)", list(range(0, 25)), value=16,
                                                        key=f"{prefix}_init", format_func=lambda k: f"2^{k}")
        options["growth_interval"] = st.number_input("Growth interval (clean steps before ×2)", 1, 100_000, 2000,
                                                     key=f"{prefix}_growth")
    return options


def _device_choices() -> list[str]:
    return ["auto", "cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _safe_filename(name: str) -> str:
    """A display name for an uploaded file: its base name only, limited characters, ending in .py."""
    base = re.sub(r"[^A-Za-z0-9._-]", "_", name.replace("\\", "/").rsplit("/", 1)[-1])[:80] or "uploaded"
    return base if base.endswith(".py") else base + ".py"


def new_run_form(store) -> None:
    source = st.radio("Script", ["bundled example", "upload a script"], horizontal=True, key="new_source")
    if source == "bundled example":
        scripts = bundled_scripts()
        chosen = st.selectbox("Bundled script", list(scripts), key="new_script")
        script = str(scripts[chosen])
    else:
        st.warning("Uploading a script means running it: it executes as Python, in a child process, on this machine.")
        upload = st.file_uploader("Model script (.py defining build(device))", type=["py"], key="new_upload")
        if upload is None:
            return
        filename = _safe_filename(upload.name)
        try:
            source_text = upload.getvalue().decode("utf-8")
        except UnicodeDecodeError:
            st.error(f"{filename} is not UTF-8 text.")
            return
        writer = StoreWriter(store.path)
        try:
            script, chosen = "sha256:" + writer.add_script(filename, source_text), filename
        finally:
            writer.close()
    cols = st.columns(4)
    level = cols[0].selectbox("Opt level", list(POLICIES), index=1, key="new_level",
                              help="\n".join(f"{k}: {v.summary}" for k, v in POLICIES.items()))
    steps = cols[1].number_input("Steps", 1, 1_000_000, 200, key="new_steps")
    seed = cols[2].number_input("Seed", 0, 2**31 - 1, 0, key="new_seed")
    device = cols[3].selectbox("Device", _device_choices(), key="new_device")
    options = {"opt_level": level, "steps": int(steps), "seed": int(seed), "device": device}
    if POLICIES[level].default_scaling is not None:
        options.update(_scaling_options("new"))
    options["pair"] = st.checkbox("Also run an FP32 (O0) twin on identical weights and batches", key="new_pair",
                                  disabled=level == "O0") and level != "O0"
    options["name"] = st.text_input("Run name (optional)", key="new_name") or None
    if st.button("Start run", type="primary", key="new_start"):
        try:
            RunConfig().with_options(**{k: v for k, v in options.items() if k != "pair"}).validate()
        except ConfigError as exc:
            st.error(str(exc))
            return
        start(run_command(store.path, script, options), f"{chosen} at {level}")


def rerun_form(store, runs: pd.DataFrame) -> None:
    rerunnable = runs[runs["config"].map(lambda c: "run" in c)]
    if rerunnable.empty:
        st.caption("Runs recorded by a Recorder in your own loop cannot be rerun from here.")
        return
    parent_id = ui.pick_run(rerunnable, key="rerun_of", label="Rerun")
    parent = rerunnable.set_index("run_id").loc[parent_id]
    cols = st.columns(3)
    levels = list(POLICIES)
    level = cols[0].selectbox("Opt level", levels, index=levels.index(parent["opt_level"]), key="rerun_level")
    steps = cols[1].number_input("Steps", 1, 1_000_000, int(parent["steps"]), key="rerun_steps")
    seed = cols[2].number_input("Seed", 0, 2**31 - 1, int(parent["seed"]), key="rerun_seed")
    options = {"opt_level": level, "steps": int(steps), "seed": int(seed)}
    if POLICIES[level].default_scaling is not None:
        options.update(_scaling_options("rerun"))
    st.caption(f"Reruns the script source stored with run #{parent_id} (not the file as it is now).")
    if st.button("Rerun", type="primary", key="rerun_start"):
        start(rerun_command(store.path, parent_id, options), f"rerun of #{parent_id} at {level}")


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
