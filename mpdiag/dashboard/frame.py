"""The shared Streamlit frame every page calls: page setup, the store, run pickers and how a run's state is told.

``store = frame("Gradients")`` sets up the page, refuses a session whose Host is not allowed
(:func:`mpdiag.dashboard.untrusted.host_allowed`), and returns an open :class:`Store` chosen by the server's
configuration (``MPDIAG_STORE``) or, in the sidebar, among the store files in that store's folder, or None after
telling the user what is wrong with it. A URL cannot choose the store. Reads go through
:mod:`mpdiag.dashboard.reads`; actions through :mod:`mpdiag.dashboard.actions`. Every user-supplied string is
rendered through :func:`mpdiag.dashboard.untrusted.plain` or as ``st.code``/``st.text``.
This module must not import torch (the run form imports the runner lazily until the run configuration is
torch-free), run anything, or read SQL.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import streamlit as st

from mpdiag.dashboard.reads import is_final
from mpdiag.dashboard.untrusted import ALLOWED_HOSTS_ENV, host_allowed, plain
from mpdiag.store import DEFAULT_STORE, Store, StoreError

LIVE_REFRESH_S = 1.0  # live parts re-read the store this often (rows are committed every 0.5 s)


def configured_store() -> Path:
    """The store the server was started with: MPDIAG_STORE, else ./mpdiag_runs.db."""
    return Path(os.environ.get("MPDIAG_STORE") or DEFAULT_STORE).absolute()


def store_choices(configured: Path) -> list[Path]:
    """The configured store first, then the other store files (``*.db``) in its folder."""
    others = sorted(p for p in configured.parent.glob("*.db") if p.is_file() and p != configured) \
        if configured.parent.is_dir() else []
    return [configured, *others]


def request_host() -> str | None:
    """The ``Host`` header of this session's request, or None when the session has no request headers."""
    return st.context.headers.get("host")


def frame(title: str) -> Store | None:
    """Page config, the Host check, title and the sidebar store picker. Returns the store, or None after
    explaining why it cannot be opened (missing file, not SQLite, not an mpdiag store)."""
    st.set_page_config(page_title=f"mpdiag · {title}", page_icon="🧮", layout="wide")
    if not host_allowed(request_host()):
        st.error("This dashboard is not served under this host name. It answers on this machine's loopback "
                 f"address, or on the names listed in {ALLOWED_HOSTS_ENV} where the server runs.")
        st.stop()
    configured = configured_store()
    with st.sidebar:
        path = st.selectbox("Store file", store_choices(configured), key="store_file", format_func=lambda p: p.name,
                            help=f"Store files in {plain(configured.parent)}: the server's store (MPDIAG_STORE) "
                                 "and any other .db file beside it.")
        st.caption("Runs start in child processes, only when you click for them; uploaded scripts never run "
                   "inside this server.")
    st.title(title)
    try:
        # The configured store is created on first use so a fresh machine opens on something; another must exist.
        return Store(path, create=path == configured)
    except StoreError as exc:
        st.error(plain(exc))
        st.info("Pick another store file in the sidebar.")
        return None


def run_label(run: pd.Series) -> str:
    """``#id · name · level`` as plain text (for tables, st.text and code); pass it through ``plain`` for Markdown."""
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
    """Say what a failed or crashed run reported (its error as text), and any note stored with it."""
    if run["status"] in ("failed", "crashed") and isinstance(run["error"], str):
        st.error(f"Run #{int(run['run_id'])} {run['status']}; what it reported:")
        st.code(run["error"].strip()[-3000:], language=None)
    if isinstance(run.get("note"), str):
        st.info(plain(run["note"]))


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
    return run, is_final(run)


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
    import torch  # lazily: the torch-free run configuration replaces these three imports

    from mpdiag.training.policies import POLICIES, ConfigError
    from mpdiag.training.runner import RunConfig

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
