"""The shared Streamlit frame every page calls, plus cached store reads and run pickers.

Pages stay thin: ``store = frame("Gradients")`` sets up the page and sidebar and returns an open
:class:`Store` (or None after telling the user what is wrong with the chosen file); reads go through
:func:`read`, cached for runs that can no longer change.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pandas as pd
import streamlit as st
import torch

from mpdiag.store import DEFAULT_STORE, Store, StoreError
from mpdiag.training.policies import POLICIES, ConfigError
from mpdiag.training.runner import RunConfig

FINAL_STATUSES = ("finished", "failed", "crashed")
LIVE_REFRESH_S = 1.0  # live parts re-read the store this often (rows are committed every 0.5 s)


def default_store_path() -> str:
    return os.environ.get("MPDIAG_STORE") or DEFAULT_STORE


def frame(title: str) -> Store | None:
    """Page config, title and the sidebar store picker. Returns the store, or None after explaining why
    it cannot be opened (missing file, not SQLite, not an mpdiag store)."""
    st.set_page_config(page_title=f"mpdiag · {title}", page_icon="🧮", layout="wide")
    default = default_store_path()
    with st.sidebar:
        path = st.text_input(
            "Store file", value=default, key="store", bind="query-params",
            help="The SQLite file runs are recorded into (MPDIAG_STORE, else ./mpdiag_runs.db).",
        ).strip() or default
        st.caption("Runs start in child processes; uploaded scripts never run inside this server.")
    st.title(title)
    try:
        # The default store is created on first use so a fresh machine opens on something; another path must exist.
        return Store(path, create=Path(path) == Path(default))
    except StoreError as exc:
        st.error(str(exc))
        st.info("Pick another store file in the sidebar, or clear the field to return to the default store.")
        return None


def _identity(path: Path) -> tuple[int, int]:
    """Changes when the store file is replaced, so cached reads of a deleted store are not reused."""
    stat = path.stat()
    return stat.st_ino, stat.st_dev


@st.cache_data(show_spinner=False, max_entries=256)
def _cached_read(path: str, identity: tuple[int, int], method: str, run_id: int, args: tuple):
    return getattr(Store(path, create=False), method)(run_id, *args)


def read(store: Store, method: str, run_id: int, *args, final: bool):
    """``store.<method>(run_id, *args)``, cached when the run is ``final`` (it can no longer change)."""
    if final:
        return _cached_read(str(store.path), _identity(store.path), method, int(run_id), tuple(args))
    return getattr(store, method)(int(run_id), *args)


def live_steps(store: Store, run_id: int) -> pd.DataFrame:
    """The run's steps, reading only rows added since the previous call in this session."""
    key = f"steps:{store.path}:{run_id}"
    cached = st.session_state.get(key)
    since = int(cached["step"].max()) if cached is not None and len(cached) else -1
    fresh = store.steps(run_id, since_step=since)
    steps = fresh if cached is None else pd.concat([cached, fresh], ignore_index=True) if len(fresh) else cached
    st.session_state[key] = steps
    return steps


def run_label(run: pd.Series) -> str:
    return f"#{run['run_id']} · {run['name']} · {run['opt_level']}"


def _seed_from_plain_id(key: str, runs: pd.DataFrame, multi: bool) -> None:
    """Accept ``?run=3`` (or ``?runs=3&runs=5``) deep links as well as the labels the widget writes."""
    raw = st.query_params.get_all(key)
    if not raw or key in st.session_state or not all(v.isdigit() for v in raw):
        return
    ids = [int(v) for v in raw if int(v) in set(runs["run_id"])]
    if ids:
        del st.query_params[key]
        st.session_state[key] = ids if multi else ids[0]


def pick_run(runs: pd.DataFrame, key: str = "run", label: str = "Run") -> int | None:
    """A run selector bound to the URL (``?run=…``), newest first."""
    labels = {int(r["run_id"]): run_label(r) for _, r in runs.iterrows()}
    _seed_from_plain_id(key, runs, multi=False)
    return st.selectbox(label, list(labels), format_func=labels.get, key=key, bind="query-params")


def pick_runs(runs: pd.DataFrame, key: str = "runs", label: str = "Runs", default: list[int] | None = None) -> list[int]:
    """A multi-run selector (up to 4) bound to the URL (``?runs=…``)."""
    labels = {int(r["run_id"]): run_label(r) for _, r in runs.iterrows()}
    _seed_from_plain_id(key, runs, multi=True)
    return st.multiselect(label, list(labels), default=default, format_func=labels.get, key=key,
                          bind="query-params", max_selections=4)


def explain_run_state(run: pd.Series) -> None:
    """Say what a failed or crashed run reported, or that a run is still starting."""
    if run["status"] in ("failed", "crashed") and isinstance(run["error"], str):
        st.error(f"Run #{run['run_id']} {run['status']}:\n\n```\n{run['error'].strip()[-3000:]}\n```")
    if isinstance(run.get("note"), str):
        st.info(run["note"])


def choose_run(store: Store) -> tuple[pd.Series, bool] | None:
    """The run picker every single-run page starts with: (run row, final) or None when there are no runs.
    Reports a failed or crashed run's error above the page."""
    runs = store.runs()
    if runs.empty:
        st.info("No runs in this store yet. Start one on the Runs page (the home page).")
        return None
    run_id = pick_run(runs)
    run = runs[runs["run_id"] == run_id].iloc[0]
    explain_run_state(run)
    return run, run["status"] in FINAL_STATUSES


def single_run_page(title: str, view) -> None:
    """The whole frame of a page about one run: store, run picker, then ``view(store, run, final)``, live
    (re-run every LIVE_REFRESH_S) while the run is still going."""
    store = frame(title)
    if store is None:
        return
    chosen = choose_run(store)
    if chosen is None:
        return
    run, final = chosen
    st.fragment(view, run_every=None if final else LIVE_REFRESH_S)(store, run, final)


def run_options_form(prefix: str, parent: pd.Series | None = None) -> dict:
    """Widgets for a run's options (defaults from ``parent`` when rerunning); returns CLI options, validated
    here so a bad combination is refused before any process starts (an error is shown and {} returned)."""
    levels = list(POLICIES)
    cols = st.columns(4)
    level = cols[0].selectbox("Opt level", levels, key=f"{prefix}_level",
                              index=levels.index(parent["opt_level"]) if parent is not None else levels.index("O1"),
                              help="\n".join(f"{k}: {v.summary}" for k, v in POLICIES.items()))
    steps = cols[1].number_input("Steps", 1, 1_000_000, int(parent["steps"]) if parent is not None else 200,
                                 key=f"{prefix}_steps")
    seed = cols[2].number_input("Seed", 0, 2**31 - 1, int(parent["seed"]) if parent is not None else 0,
                                key=f"{prefix}_seed")
    devices = ["auto", "cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    device = cols[3].selectbox("Device", devices, key=f"{prefix}_device")
    options = {"opt_level": level, "steps": int(steps), "seed": int(seed), "device": device}
    parent_shadow = parent["config"].get("run", {}).get("shadow_every", 0) if parent is not None else 0
    options["shadow_every"] = int(st.number_input(
        "FP32 shadow every N steps (0: off)", 0, 1_000_000, int(parent_shadow), key=f"{prefix}_shadow",
        help="Every N steps, recompute the gradients in FP32 on the same weights and batch and store each tensor's "
             "relative error and cosine (Findings page). Costs one FP32 forward and backward per shadow step."))
    if POLICIES[level].default_scaling is not None:
        options.update(_scaling_options(prefix))
    options["pair"] = level != "O0" and st.checkbox(
        "Also run an FP32 (O0) twin on identical weights and batches", key=f"{prefix}_pair", disabled=level == "O0")
    if parent is None:
        options["name"] = st.text_input("Run name (optional)", key=f"{prefix}_name") or None
    try:
        RunConfig().with_options(**{k: v for k, v in options.items() if k != "pair"}).validate()
    except ConfigError as exc:
        st.error(str(exc))
        return {}
    return options


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


def safe_filename(name: str) -> str:
    """A display name for an uploaded file: its base name only, limited characters, ending in .py."""
    base = re.sub(r"[^A-Za-z0-9._-]", "_", name.replace("\\", "/").rsplit("/", 1)[-1])[:80] or "uploaded"
    return base if base.endswith(".py") else base + ".py"


