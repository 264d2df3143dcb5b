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

import functools
import math
import os
import time
from pathlib import Path

import pandas as pd
import streamlit as st

from mpdiag.analysis.findings import diagnose
from mpdiag.analysis.run_choice import LIVE_STATUSES, likely_run
from mpdiag.analysis.summaries import run_label, run_progress, stall_text
from mpdiag.dashboard import actions, events_model
from mpdiag.dashboard.chart_files import show_chart, show_chart_in  # noqa: F401 - the pages draw charts as ui.show_chart
from mpdiag.dashboard.reads import (
    finding_severities,
    findings_version,
    held_step_summaries,
    is_final,
    live_findings,
    steps,
    store_key,
)
from mpdiag.dashboard.tables import Column
from mpdiag.dashboard.untrusted import ALLOWED_HOSTS_ENV, host_allowed, plain, terminal_text, url_count
from mpdiag.options import (
    COMMAND_OPTIONS,
    LEVELS,
    OPTIONS,
    UNSET,
    WATCH_OPTIONS,
    ConfigError,
    Option,
    RunConfig,
    StopOn,
    rerun_name,
    watch_settings,
)
from mpdiag.recording.events import SKIP_STREAK
from mpdiag.store import DEFAULT_STORE, SCHEMA_VERSION, RunTextRefused, Store, StoreError, clean_name
from mpdiag.store.export import export_zip
from mpdiag.store.schema import older_version

LIVE_REFRESH_S = 1.0  # live parts re-read the store this often (rows are committed every 0.5 s)
#: Compare redraws up to four runs' eight panels (~1 s on 2 cores): refreshed every second it would never rest
COMPARE_REFRESH_S = 3.0


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


#: Streamlit names the home page after its file (app.py: "app") and renaming needs st.navigation, which this app
#: does not use (pages/ is discovered): the sidebar's first entry is shown as "Runs", the home page's title
HOME_LABEL_CSS = """<style>
[data-testid="stSidebarNavItems"] > li:first-child [data-testid="stSidebarNavLink"] p { font-size: 0; }
[data-testid="stSidebarNavItems"] > li:first-child [data-testid="stSidebarNavLink"] p::after {
  content: "Runs"; font-size: 0.875rem; }
</style>"""


_STORE_ERROR_SAID = "store_error_said"  # session key: the store error this page run has said (reset by frame)


def guarded(render, fragment: bool = False):
    """``render`` with a store that fails while it is read (damaged after it was opened) said in mpdiag's one line, as the CLI says it, instead of a traceback: the rest of the page and
    the server go on. Every page body and every live fragment runs through it (:func:`live`). A page says one
    error once; a ``fragment`` says it in its own place on each of its re-runs (they redraw only themselves)."""
    @functools.wraps(render)
    def run(*args, **kwargs):
        try:
            return render(*args, **kwargs)
        except StoreError as exc:
            if fragment or st.session_state.get(_STORE_ERROR_SAID) != str(exc):
                st.error(plain(exc))
            st.session_state[_STORE_ERROR_SAID] = str(exc)
            return None
    return run


def live(render, every: float | None):
    """``render`` as a fragment re-run every ``every`` seconds (None: only with the page), :func:`guarded`."""
    return st.fragment(guarded(render, fragment=True), run_every=every)


def frame(title: str) -> Store | None:
    """Page config, the Host check, title and the sidebar store picker. Returns the store, or None after
    explaining why it cannot be opened (missing file, not SQLite, not an mpdiag store)."""
    st.set_page_config(page_title=f"mpdiag · {title}", page_icon="🧮", layout="wide")
    st.html(HOME_LABEL_CSS)
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
    st.session_state.pop(_STORE_ERROR_SAID, None)  # a new run of the page: nothing said yet
    try:
        # The configured store is created on first use so a fresh machine opens on something; another must exist.
        # A file that is there but empty is not created into: it is not an mpdiag store, and a page writes nothing.
        create = path == configured and not path.exists()
        old = older_version(path) if path.exists() else None
        if old is None:
            return Store(path, create=create, held_summaries=held_step_summaries())
        started = time.monotonic()
        with st.spinner(f"Upgrading the store {path.name} from schema {old} to {SCHEMA_VERSION}: once, in place, "
                        "every run kept. A store of hundreds of MB takes a minute or more."):
            store = Store(path, create=create, held_summaries=held_step_summaries())
        st.caption(f"The store {plain(path.name)} was upgraded from schema {old} to {SCHEMA_VERSION} in "
                   f"{time.monotonic() - started:,.1f} s.")
        return store
    except StoreError as exc:
        st.error(plain(exc))
        st.info("Pick another store file in the sidebar.")
        return None


#: st.dataframe's row and header heights (px) at the default row height
ROW_PX, HEADER_PX = 35, 38


def table_height(rows: int, most: int) -> int:
    """A st.dataframe height that shows ``rows`` rows without an inner scrollbar, up to ``most`` of them."""
    return HEADER_PX + ROW_PX * max(1, min(rows, most)) + 2


#: the st.column_config class of each tables.Column kind
_COLUMN_KINDS = {"text": st.column_config.TextColumn, "number": st.column_config.NumberColumn,
                 "link": st.column_config.LinkColumn, "checkbox": st.column_config.CheckboxColumn}


def column_config(columns: dict[str, Column]) -> dict:
    """A view model's column specs (mpdiag.dashboard.tables) as st.dataframe's ``column_config``."""
    config = {}
    for name, column in columns.items():
        options = {"help": column.help, "width": column.width, "pinned": column.pinned}
        if column.kind == "number" and column.format:
            options["format"] = column.format
        if column.kind == "link" and column.display_text:
            options["display_text"] = column.display_text
        config[name] = _COLUMN_KINDS[column.kind](column.label, **options)
    return config


def table(frame: pd.DataFrame, columns: dict[str, Column], **kwargs) -> None:
    """``frame`` as a table of ``columns`` (those of its columns, in that order), each as its spec says; text
    cells are drawn as text (never Markdown or HTML)."""
    st.dataframe(frame[list(columns)], hide_index=True, width="stretch", column_config=column_config(columns),
                 **kwargs)


def _seed_from_url(key: str, runs: pd.DataFrame, fallback) -> None:
    """Before the widget exists: its value from ``?run=3`` (or ``?runs=3&runs=5``) when those ids exist, else
    ``fallback`` (a value, or a function giving it, called only then); set once per session, through Session
    State only (a widget default as well would draw a Streamlit warning)."""
    if key in st.session_state:
        return
    known = set(runs["run_id"].astype(int))
    raw = st.query_params.get_all(key)
    ids = [i for i in map(url_count, raw) if i in known]
    st.session_state[key] = ids or (fallback() if callable(fallback) else fallback)


def default_run(store: Store, runs: pd.DataFrame, among: pd.DataFrame | None = None) -> int | None:
    """The run a page opens on when the URL names none: :func:`mpdiag.analysis.run_choice.likely_run` of
    ``among`` (default: every run in ``runs``, all the store's runs): not an FP32 reference, the newest with
    findings; findings read through the cache the runs table uses."""
    version = findings_version(store, runs)
    by_id = runs.set_index("run_id", drop=False)
    return likely_run(runs if among is None else among, lambda run_id: any(
        s in ("error", "warning") for s in finding_severities(store, by_id.loc[run_id], version, runs)))


def pick_run(runs: pd.DataFrame, key: str = "run", label: str = "Run", default=None) -> int | None:
    """A run selector, newest first, whose run is always in the URL (``?run=ID``), which also chooses it.
    Without one (and no choice made in this session): ``default`` (an id, or a function giving it; else the
    newest run)."""
    labels = {int(r["run_id"]): run_label(r) for _, r in runs.iterrows()}

    def fallback() -> int:
        chosen = default() if callable(default) else default
        return chosen if chosen in labels else next(iter(labels))

    _seed_from_url(key, runs, fallback)
    if isinstance(st.session_state[key], list):  # seeded as a list (the URL may repeat the key): one run here
        st.session_state[key] = st.session_state[key][0]
    if st.session_state[key] not in labels:  # the run was in another store file, or was deleted
        st.session_state[key] = fallback()
    run_id = st.selectbox(label, list(labels), format_func=labels.get, key=key)
    st.query_params[key] = str(run_id)  # the URL names the run shown, the default included
    return run_id


def pick_runs(runs: pd.DataFrame, key: str = "runs", label: str = "Runs", default: list[int] | None = None) -> list[int]:
    """A multi-run selector (up to 4) whose runs are always in the URL (``?runs=A&runs=B``), which also
    chooses them."""
    labels = {int(r["run_id"]): run_label(r) for _, r in runs.iterrows()}
    _seed_from_url(key, runs, list(default or []))
    st.session_state[key] = [i for i in st.session_state[key] if i in labels][:4]
    chosen = st.multiselect(label, list(labels), format_func=labels.get, key=key, max_selections=4)
    st.query_params[key] = [str(i) for i in chosen]
    return chosen


def step_slider(label: str, steps: list[int], key: str, **kwargs) -> int:
    """A slider over ``steps`` (logged steps, which grow while a run goes on) that returns the chosen one, kept in
    ``st.session_state[key]``: a page moves it by setting that key first (a click, a link); a step not offered
    reads as the nearest offered one before it (the last one, past the end), and a choice at the last step follows
    the newest while steps are added.

    The widget is the page's view of that key, not its owner: it is made anew (another widget key) whenever the
    steps or the choice change, with the choice as its value, and a move of the user's reaches the key by its
    callback. Keyed once, the browser's slider fell back to its first option (step 0) when a live refresh added
    steps, and sent that back, while the page said another step. Whether the choice follows the newest step is
    kept beside it (``{key}_follow``), set by a move to the end of the slider the user moved: read as "the choice
    equals the last step of the previous render", a move back followed the newest again when a render had read
    an older list of steps (a cached read), whose end the moved-back step then was (CI, 2 of 3 local runs)."""
    asked, follow = st.session_state.get(key), st.session_state.get(f"{key}_follow", True)
    if asked is not None and asked != st.session_state.get(f"{key}_shown"):  # set by the page since the last render
        follow = asked >= steps[-1]
    if follow or asked is None:
        chosen = steps[-1]
    else:  # a step not offered (past the end of an older read, or thinned away): the nearest offered before it
        chosen = asked if asked in steps else max((s for s in steps if s <= asked), default=steps[0])
    kept = chosen if follow or asked is None else asked  # the user's choice outlives a read that lacks it
    st.session_state[key] = st.session_state[f"{key}_shown"] = kept
    st.session_state[f"{key}_follow"] = follow
    widget = f"{key}_at_{len(steps)}_{steps[-1]}_{chosen}"
    st.session_state[widget] = chosen  # set, not a default: the browser shows a value it is sent as set

    def moved(given: int = chosen, end: int = steps[-1]) -> None:
        # the browser reports earlier widgets' values again, as they were given: only another value is a move (and
        # a move made as a refresh replaced the widget reaches the page through the one the user moved, whose end
        # is the end the user saw)
        value = st.session_state.get(widget)
        if value != given:
            st.session_state[key] = st.session_state[f"{key}_shown"] = value
            st.session_state[f"{key}_follow"] = value == end

    return st.select_slider(label, steps, key=widget, on_change=moved, **kwargs)


def explain_run_state(run: pd.Series, store: Store | None = None, events_shown: bool = False) -> None:
    """Say what a failed or crashed run reported (its error as text), why a stalled one reads so (with its last
    line of output, when ``store`` is given and the app started it), why a run was stopped (by a signal, or at an
    event unless ``events_shown``: its events banner names the --stop-on option), any note mpdiag stored with it, and the
    tags and note a person gave it (as text)."""
    if run["status"] in ("failed", "crashed") and isinstance(run["error"], str):
        st.error(f"Run #{int(run['run_id'])} {run['status']}; what it reported:")
        st.code(run["error"].strip()[-3000:], language=None, wrap_lines=True)  # unwrapped: cut at 1,280 px
    if run["status"] == "stopped" and isinstance(run["error"], str) and not events_shown:  # else the banner says it
        st.warning(f"Run #{int(run['run_id'])} was stopped; why:")
        st.code(run["error"].strip()[-3000:], language=None, wrap_lines=True)  # unwrapped: cut at 1,280 px
    if run["status"] == "stalled":
        st.warning(stall_text(run))
        line = None if store is None else actions.last_output_line(store.path, int(run["run_id"]))
        if line is not None:
            st.caption("Its last line of output:")
            st.code(line, language=None)
    if isinstance(run.get("note"), str):
        st.info(plain(run["note"]))
    tags, note = run.get("tags") or [], run.get("user_note")
    if tags or (isinstance(note, str) and note):
        st.caption(plain("  ·  ".join(([f"Tags: {', '.join(tags)}"] if tags else [])
                                     + ([f"Note: {note}"] if isinstance(note, str) and note else []))))


def no_output_reason(run: pd.Series) -> str:
    """Why a run has no console output kept with it, in one sentence."""
    config = run["config"] if isinstance(run["config"], dict) else {}
    if not config.get("run") and watch_settings(config) is None:
        return ("Recorded by your own Recorder loop: mpdiag did not start this process, so it has no console "
                "output.")
    if run["status"] == "queued":
        return "No console output yet: the run is queued and its process has not started."
    if run["status"] in LIVE_STATUSES:
        return "No console output yet: the run has printed nothing so far, or it is about to be kept (every few seconds)."
    return ("No console output was kept: the run was recorded before mpdiag kept console output, or by a process that "
            "ended before its output could be written (e.g. torchrun's other ranks, or a run of several processes).")


def console_output(store: Store, run: pd.Series) -> None:
    """The console output kept with a run (what its process printed, stdout and stderr as printed), as text in
    ``st.code``, with how much was kept; a run without any says why."""
    kept = store.run_output(int(run["run_id"]))
    if kept is None:
        st.caption(no_output_reason(run))
        return
    if not kept["text"]:
        st.caption("The run's process printed nothing.")
        return
    shown = len(kept["text"].encode("utf-8", "replace"))
    cut = "" if shown >= kept["bytes_total"] else " (the middle cut, as the line in it says)"
    st.caption(f"What the run's process printed: {kept['bytes_total']:,} bytes in all{cut}; kept "
               f"{kept['updated_at']:%Y-%m-%d %H:%M:%S} UTC"
               + (", refreshed every few seconds while the run goes." if run["status"] in LIVE_STATUSES else "."))
    st.code(terminal_text(kept["text"]), language=None, height=420 if kept["text"].count("\n") > 25 else "content")


def choose_run(store: Store, shows: str | None = None) -> tuple[pd.Series, bool, pd.DataFrame] | None:
    """The run picker every single-run page starts with: (run row, final, the runs table it was picked from) or
    None when there are no runs. Reports a failed or crashed run's error above the page. ``shows``: the data the
    page is about (a key of ``Store.RUN_DATA``): without a run named, it opens on a run that recorded it, if any
    did (the FP8 page opened on the newest run and said it had no FP8 statistics, though another run had)."""
    runs = store.runs()
    if runs.empty:
        st.info("No runs in this store yet. Start one on the Runs page (the home page).")
        return None

    def default() -> int | None:
        having = store.runs_with(shows) if shows is not None else set()
        among = runs[runs["run_id"].isin(having)] if having else None
        return default_run(store, runs, among)

    run_id = pick_run(runs, default=default)
    run = runs[runs["run_id"] == run_id].iloc[0]
    banner = events_model.run_banner(store, run)
    explain_run_state(run, store, events_shown=banner is not None)
    if banner is not None:
        events_banner(banner)
    return run, is_final(run), runs


def events_banner(banner: events_model.Banner) -> None:
    """A run's events while training (mpdiag.recording.events), each as text with a link to its evidence."""
    with st.container(border=True, key=f"events_{banner.run_id}"):
        st.warning(plain(banner.heading))
        for line in banner.lines:  # the link: page names and integers only (events_model builds it)
            st.markdown(f"{plain(f'Step {line.step}: {line.kind}: {line.summary}')} · "
                        f"[{line.page} at step {line.step}]({line.link})")
        if banner.more:
            st.caption(f"and {banner.more} more on the run's own pages")


def findings_shown_here(store: Store, run: pd.Series, page: str, runs: pd.DataFrame) -> str:
    """The run's findings whose evidence link opens ``page``, said at its top as Findings says them, so what
    a link promises is on the page it opens. Returns what was said, so the page does not say it twice.
    ``runs``: the runs table the page read; a final run's findings are diagnosed against it, not a second read.
    A live run's view refreshes without the page, so its ``runs`` is as the page read it: its findings read the
    table afresh, as they did before pages passed it, held while nothing they read changed (reads.live_findings)."""
    said, run_id = [], int(run["run_id"])
    # a final run's steps as the page read them (a cache hit), not a second read of its 100k rows
    found = diagnose(store, run_id, runs, steps(store, run_id, True)) if is_final(run) else live_findings(store, run)
    for finding in found:
        if finding.page == page:
            say = st.error if finding.severity == "error" else st.warning
            said.append(f"{finding.title}. {finding.evidence}")
            say(plain(said[-1]))
    return "\n".join(said)


def launched_runs(store: Store, runs: pd.DataFrame) -> None:
    """What this browser session started (runs, reruns, fixes): a process still starting, one that ended
    before recording a run (with its output), or each run it recorded with its status, progress and links
    to its pages; a Stop button under each one still going."""
    for proc, what in actions.launched():
        rows = runs[runs["run_id"].isin(proc.run_ids())] if len(runs) else runs
        if rows.empty:
            if proc.is_alive():
                st.info(f"Starting {plain(what)}…")
                _stop_button(proc)
            else:
                st.error(f"{plain(what)} ended before recording a run: "
                         f"{plain(proc.ending() or 'the supervisor stopped')}. Its output:")
                st.code(proc.log_tail(), language=None)
            continue
        for _, run in rows.iterrows():
            run_id = int(run["run_id"])
            fraction, words = run_progress(run)
            links = " · ".join(f"[{label}](/{page}?run={run_id})" for page, label in
                               (("Findings", "Findings"), ("Gradients", "Gradients"), ("Loss_scale", "Loss scale")))
            st.markdown(plain(f"You started {what}: {run_label(run)}, {run['status']}, {words}.") + f" {links}")
            if run["status"] == "running" and fraction is not None:
                st.progress(fraction)
        _stop_button(proc)


def _stop_button(proc) -> None:
    """Stop for a process still going (acts on a click only); once clicked, says it is stopping until it has."""
    if not proc.is_alive():
        return
    if not proc.stop_requested():
        if not st.button("Stop", key=f"stop_{proc.pid}", help="End this run now; what it recorded so far stays."):
            return
        actions.stop(proc)
    st.caption(f"Stopping: the run is sent SIGTERM to end itself (its rows kept), and SIGKILL "
               f"{actions.STOP_GRACE_S:g} s later if it is still there.")


def launched_panel(store: Store) -> None:
    """:func:`launched_runs` on a page other than home, live while anything started is still going; nothing
    when this session started nothing."""
    started = actions.launched()
    if started:
        going = any(proc.is_alive() for proc, _ in started)
        live(lambda: _launched_live(store), LIVE_REFRESH_S if going else None)()


_LAUNCHED_SEEN = "launched_seen"  # session key: what the launched panel last saw of this session's processes


def _launched_live(store: Store) -> None:
    """The panel's refresh; when a started process records its run or ends, the page around it (an upload's
    run count, the run picker, the charts of a finished run) is stale, so the whole page is read again, once
    per such change."""
    launched_runs(store, store.runs())
    seen = tuple((tuple(proc.run_ids()), proc.is_alive()) for proc, _ in actions.launched())
    changed = st.session_state.get(_LAUNCHED_SEEN, seen) != seen
    st.session_state[_LAUNCHED_SEEN] = seen
    if changed:
        st.rerun(scope="app")


def single_run_page(title: str, view, shows: str | None = None) -> None:
    """The whole frame of a page about one run: store, run picker, then ``view(store, run, final, runs)``, live
    (re-run every LIVE_REFRESH_S) while the run is still going. ``runs`` is the runs table the picker read, the
    page's one read of it: a view finds other runs' rows (an FP32 twin) there instead of reading it again.
    ``shows``: see :func:`choose_run`."""
    store = frame(title)
    if store is not None:
        guarded(_single_run)(store, view, shows)


def _single_run(store: Store, view, shows: str | None) -> None:
    chosen = choose_run(store, shows)
    if chosen is None:
        return
    run, final, runs = chosen
    launched_panel(store)
    download_section(store, run)
    live(view, None if final else LIVE_REFRESH_S)(store, run, final, runs)


def download_section(store: Store, run: pd.Series) -> None:
    """In the sidebar: the run's data as `mpdiag export` writes it (every table, Parquet and CSV), zipped when
    asked for (a click; a running run's data as of that moment), then offered as a download."""
    run_id = int(run["run_id"])
    key = f"download:{store_key(store)}:{run_id}"  # not a zip of a store this file replaced
    st.sidebar.divider()
    if st.sidebar.button(f"Prepare run #{run_id}'s data", key="download_prepare",
                         help="Every table of this run as Parquet and CSV in one zip, as `mpdiag export` writes them"
                              + ("; a running run's rows as of the click" if run["status"] == "running" else "")):
        st.session_state[key] = export_zip(store, run_id)
    if key in st.session_state:
        st.sidebar.download_button(f"Download run #{run_id} (zip)", st.session_state[key],
                                   file_name=f"mpdiag_run{run_id}.zip", mime="application/zip", key="download_zip")


#: the widget (key after the form's prefix; in the watch form after ``PREFIX_watch_``) that sets each option; an
#: option missing here says why in its table entry (mpdiag.options.OPTIONS[name].no_widget, or its watch entry's)
FORM_KEYS = {"opt_level": "level", "steps": "steps", "seed": "seed", "device": "device", "shadow_every": "shadow",
             "loss_scale": "mode", "init_scale": "init", "growth_interval": "growth", "growth_factor": "growth_factor",
             "backoff_factor": "backoff", "min_scale": "min_scale", "max_scale": "max_scale", "every": "every",
             "trace_modules": "trace", "fp8": "fp8", "name": "name", "nproc": "nproc", "parallel": "parallel",
             "stop_on": "stop_on"}


AS_RECORDED = "as the script sets it"


def watch_options_form(prefix: str, parent: pd.Series | None = None) -> dict:
    """Widgets for what ``mpdiag watch`` can change in an unmodified script: one per option of
    :data:`mpdiag.options.WATCH_OPTIONS` that has a widget, built from its entry (label, help, bounds), defaults
    the parent's when rerunning a watched run, else the table's. Returns the options for
    :func:`mpdiag.sandbox.launch.watch_job` / ``rerun_job``: ``opt_level`` (None or "default": the script's own
    autocast and GradScaler), ``init_scale`` (None or "default": the script's), ``every``, ``shadow_every``,
    ``trace_modules``."""
    base = watch_settings(parent["config"]) if parent is not None else {}
    shown = {name: spec for name, spec in WATCH_OPTIONS.items() if spec.no_widget is None}
    # two a row: the form also stands in the Runs page's half-width rerun panel, where six in a row broke their
    # labels into syllables
    names, chosen = list(shown), {}
    for row in range(0, len(names), 2):
        for column, name in zip(st.columns(2), names[row:row + 2], strict=False):
            chosen[name] = option_widget(column, shown[name], base.get(name, shown[name].default),
                                         f"{prefix}_watch_{FORM_KEYS[name]}")
    # an optional option left empty: "default" tells a rerun to clear the parent's value, None keeps the script's
    return {name: (UNSET if base.get(name) is not None else None) if value is None else value
            for name, value in chosen.items()}


def option_widget(container, spec: Option, value, key: str, disabled: str = ""):
    """The widget of one option in either form (``spec`` as its mode reads it, :meth:`Option.in_mode`), by its
    kind, labelled and bounded by the table's widget hints; returns its value (None: an optional option left unset;
    under watch, a level left to the script; a text as typed). ``disabled``: why it does nothing here; it then
    shows and returns the table's default under a key of its own (what was set before stays for when it is
    enabled again), unless its hints say it keeps its value."""
    hints = dict(spec.widget)
    label, help_text = hints.pop("label"), _disabled_help(hints.pop("help", spec.help), disabled)
    keeps_value = hints.pop("keeps_value_disabled", False)
    if disabled and not keeps_value:
        key, value = f"{key}_off", spec.default
    if spec.kind == "level":
        # an optional level (watch's) may be left to the script
        levels = [*([AS_RECORDED] if spec.default is None else []), *spec.choices]
        level = container.selectbox(label, levels, index=levels.index(value or AS_RECORDED), key=key, help=help_text)
        return None if level == AS_RECORDED else level
    if "choices" in hints:  # a device, or a text picked among choices
        offered = [*hints["choices"], *([value] if value not in hints["choices"] else [])]  # a rerun's cuda:1 too
        return container.selectbox(label, offered, index=offered.index(value), key=key, help=help_text,
                                   disabled=bool(disabled))
    if spec.kind == "text":
        return container.text_input(label, value or "", key=key, help=help_text, disabled=bool(disabled), **hints)
    if spec.kind == "loss_scale":
        return loss_scale_widget(container, value, key, label, help_text, hints)
    if hints.pop("powers_of_two", False):
        return scale_picker(container, label, value, key, help_text)
    if spec.kind == "flag":
        return container.checkbox(label, bool(value), key=key, help=help_text, disabled=bool(disabled))
    if spec.kind == "int":  # an optional one (default None) may be left empty: its placeholder says what then
        number = container.number_input(label, spec.minimum, hints.get("max_value", spec.maximum),
                                        None if value is None else int(value), step=1, key=key, help=help_text,
                                        disabled=bool(disabled), placeholder=hints.get("placeholder"))
        return None if number is None else int(number)
    if spec.kind == "events":
        return stop_on_widget(container, value, key, label, help_text, disabled=bool(disabled))
    number = container.number_input(label, value=None if value is None else float(value), format="%g", key=key,
                                    help=help_text, disabled=bool(disabled), **hints)
    return None if number is None else float(number)


def _disabled_help(help_text: str, disabled: str) -> str:
    """A widget's help, ended as a sentence and followed by why it is disabled (when it is)."""
    if not disabled:
        return help_text
    sentence = help_text if not help_text or help_text.endswith(".") else help_text + "."
    return f"{sentence} Disabled: {disabled}".lstrip()


#: how the run form offers ``loss_scale``: the level's own scaling (None), dynamic, or a static scale
SCALING_MODES = ("level default", "dynamic", "static")


def loss_scale_widget(container, value, key: str, label: str, help_text: str, hints: dict) -> str | float | None:
    """``--loss-scale`` as the run form sets it: a mode, and the scale when static (its picker labelled and
    started as the table's hints say); returns None (the level's own), "dynamic" or the static scale."""
    current = 0 if value is None else 1 if value == "dynamic" else 2
    mode = container.radio(label, SCALING_MODES, index=current, horizontal=True, key=key, help=help_text)
    if mode == "static":
        static = value if current == 2 else hints["static_value"]
        # the mode radio already holds ``key``: the static value needs a key of its own
        return scale_picker(container, hints["static_label"], static, f"{key}_static", help_text)
    return "dynamic" if mode == "dynamic" else None


def scale_picker(container, label: str, value: float, key: str, help_text: str) -> float:
    """A loss scale among the powers of two 2^0..2^24, and ``value`` when it is not one (a value is never changed
    by not touching it)."""
    choices = sorted({2.0**k for k in range(25)} | {float(value)})
    return container.select_slider(label, choices, value=float(value), key=key, help=help_text,
                                   format_func=lambda v: f"2^{math.log2(v):g}" if math.log2(v).is_integer()
                                   else f"{v:g}")


#: the events --stop-on names, as a form offers them
STOP_EVENTS = {"nonfinite": "a non-finite loss or gradient", "spike": "a loss or gradient-norm spike",
               "skips": "skipped steps in a row"}


def stop_on_widget(container, value: str, key: str, label: str, help_text: str, disabled: bool = False) -> str:
    """``--stop-on`` as a form sets it: the events that end the training, and how many skipped steps in a row
    when skips is one; returns its text (:class:`mpdiag.options.StopOn`)."""
    stop = StopOn.parse(value)
    picked = container.multiselect(label, list(STOP_EVENTS), [name for name in STOP_EVENTS if getattr(stop, name)
                                                              not in (False, None)],
                                   format_func=STOP_EVENTS.get, key=key, help=help_text, disabled=disabled,
                                   placeholder="never")
    if disabled:
        return ""
    words = [name for name in picked if name != "skips"]
    if "skips" in picked:
        streak = container.number_input("Skipped steps in a row", 1, 1_000_000, stop.skips or SKIP_STREAK,
                                        key=f"{key}_skips", help="How many skipped optimizer steps in a row stop it.")
        words.append(f"skips:{int(streak)}")
    return ",".join(words)


def run_options_form(prefix: str, parent: pd.Series | None = None) -> dict:
    """Widgets for every run option (defaults: the parent run's options when rerunning, else RunConfig's).

    Returns the options for the command line (mpdiag.sandbox.launch): ``opt_level``, every option that
    differs from those defaults (an optional option cleared as ``"default"``), and ``pair`` when ticked. They
    are validated here, without torch, so a bad combination is refused before any process starts (the error
    is shown and {} returned). Whether a CUDA device exists is known only in the run's process."""
    try:
        base = RunConfig.from_dict(parent["config"].get("run", {})) if parent is not None else RunConfig()
    except ConfigError as exc:
        st.error(f"The stored options of this run cannot be read: {exc}")
        return {}
    key = {name: f"{prefix}_{suffix}" for name, suffix in FORM_KEYS.items()}
    # widgets that would do nothing are disabled, their help saying why (the processes are chosen further down:
    # their widget's value is read ahead from the session)
    several = int(st.session_state.get(key["nproc"], base.nproc)) > 1
    chosen = _level_and_length(key, base)
    chosen["shadow_every"] = _widget("shadow_every", key, base, disabled=ONE_PROCESS if several else "")
    if LEVELS[chosen["opt_level"]].scales_loss:
        chosen.update(_scaling_options(key, base, chosen["opt_level"]))
    else:
        st.caption(f"Loss scaling: not used at {chosen['opt_level']} ({LEVELS[chosen['opt_level']].summary}), so its "
                   "settings are not shown.")
    with st.expander("More options"):
        more = _more_options(key, base, several, parent, chosen)
    if more is None:
        return {}
    chosen.update(more)
    pair = _pair_choice(prefix, chosen["opt_level"])
    return _validated(base, chosen, pair, parent)


#: why a widget is disabled while several processes train
ONE_PROCESS = "it records one process's tensors; set Processes back to 1."


def _widget(name: str, key: dict[str, str], base: RunConfig, container=st, disabled: str = ""):
    """Option ``name``'s widget in the run form (:func:`option_widget`), its value ``base``'s."""
    return option_widget(container, OPTIONS[name], getattr(base, name), key[name], disabled)


def _level_and_length(key: dict[str, str], base: RunConfig) -> dict:
    """The first row: opt level, steps, seed and device."""
    names = ("opt_level", "steps", "seed", "device")
    return {name: _widget(name, key, base, column) for name, column in zip(names, st.columns(4), strict=True)}


def _more_options(key: dict[str, str], base: RunConfig, several: bool, parent: pd.Series | None,
                  chosen: dict) -> dict | None:
    """The "More options" expander: statistics period, module trace, FP8, processes and parallelism, and the
    run's name (None, after saying why, when the typed name is refused)."""
    more = {name: _widget(name, key, base) for name in ("every", "trace_modules")}
    more["fp8"] = _widget("fp8", key, base, disabled=ONE_PROCESS if several else "")
    more["nproc"] = _widget("nproc", key, base)
    more["parallel"] = _widget("parallel", key, base, disabled="one process has nothing to parallelize; set "
                                                                "Processes above 1." if more["nproc"] == 1 else "")
    more["stop_on"] = _widget("stop_on", key, base, disabled="every process would have to stop at the same step; "
                                                              "set Processes back to 1." if several else "")
    # a rerun's name is never its parent's: left empty, it is the parent's and what changed (said below)
    typed = option_widget(st, OPTIONS["name"], None if parent is not None else base.name, key["name"])
    try:
        more["name"] = clean_name(typed) if typed.strip() else None
    except RunTextRefused as exc:
        st.error(str(exc))
        return None
    if parent is not None and more["name"] is None:  # the name the rerun will get, shown and confirmed
        try:
            more["name"] = rerun_name(parent["name"], base.to_dict(),
                                      base.with_options(**{**chosen, **more, "name": None}).to_dict())
        except ConfigError:
            pass  # a bad combination: refused below with its message
        st.caption(plain(f"Empty: this rerun is named “{more['name'] or parent['name']}”."))
    return more


def _pair_choice(prefix: str, level: str) -> bool:
    """Whether to run an FP32 twin too (offered disabled at O0, which is the FP32 run itself)."""
    pair = COMMAND_OPTIONS["pair"]
    return option_widget(st, pair, pair.default, f"{prefix}_pair",
                         disabled="" if level in pair.levels else f"{level} is the FP32 run itself.")


def _validated(base: RunConfig, chosen: dict, pair: bool, parent: pd.Series | None) -> dict:
    """The command line's options for ``chosen`` (what differs from ``base``), or {} after showing why the
    combination is refused."""
    try:
        config = base.with_options(**chosen)
        config.validate()
        if pair:
            config.fp32_twin()
    except ConfigError as exc:
        st.error(str(exc))
        return {}
    options = {"opt_level": config.opt_level}
    for name, value in chosen.items():
        if value is None and name == "name":
            continue  # no name typed: the run's own default name
        if value != getattr(base, name) or (name == "name" and parent is not None):  # a rerun's name, always
            options[name] = UNSET if value is None else value
    return options | ({"pair": True} if pair else {})


def _scaling_options(key: dict[str, str], base: RunConfig, level: str) -> dict:
    """Loss-scale widgets, defaults from ``base``; returns the options they set: the scaling, and the dynamic
    scaler's settings unless the scale is static (given, or the level's own)."""
    scale = _widget("loss_scale", key, base)
    options = {"loss_scale": scale}
    if scale not in (None, "dynamic") or (scale is None and LEVELS[level].default_scaling != "dynamic"):
        return options  # a static scale: no dynamic settings to show
    names = ("growth_interval", "growth_factor", "backoff_factor", "min_scale", "max_scale")
    options["init_scale"] = _widget("init_scale", key, base)
    options.update({name: _widget(name, key, base, column) for name, column in zip(names, st.columns(5), strict=True)})
    return options
