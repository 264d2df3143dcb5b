"""Typed store reads for the pages: one function per thing a page shows, cached once the run is final.

A run that is ``final`` (finished, failed, crashed) can no longer change, so its reads are cached by
``st.cache_data`` under the store's path and file identity (a replaced store file is not served from the cache):
each read is written once, for the store, and :func:`cached_when_final` gives it its cache. Reads of a live run go
to the store each time; the steps read only the rows added since the session's previous call, and a tensor's
histograms over steps are read as a bounded number of columns (the writer's bucket sums), from the last one held on;
what a live page derives from them is held by the session while the run's data stays the same (:func:`while_unchanged`,
keyed by :func:`data_version`, or by :func:`view_version` for a view of several runs or of the runs table). The runs
table's step summaries of live runs are held by the session too (:func:`held_step_summaries`). This module owns caching and nothing else: no SQL (the Store has it), no shaping (analysis has it),
no widgets.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable

import numpy as np
import pandas as pd
import streamlit as st

from mpdiag.analysis.findings import diagnose
from mpdiag.analysis.summaries import SIGNAL_POINTS
from mpdiag.store import Store

FINAL_STATUSES = ("finished", "failed", "crashed", "stopped")


def is_final(run: pd.Series) -> bool:
    """Whether a run row can no longer change (its reads may be cached)."""
    return run["status"] in FINAL_STATUSES


def store_key(store: Store) -> tuple[str, tuple[int, int, float | None]]:
    """What cached reads and session-kept values of ``store`` are keyed by: its path and identity (a store
    replaced at that path is another, :meth:`Store.identity`)."""
    return str(store.path), store.identity()


@st.cache_data(show_spinner=False, max_entries=256)
def _severities(key: tuple, run_id: int, version: tuple, _runs: pd.DataFrame) -> list[str]:
    # _runs, the page's runs table, is not hashed (its leading underscore): ``version`` is what of it the findings
    # of a final run read. Read here instead, a fresh Store summed each live run's steps again (0.2 s at 100k).
    return [f.severity for f in diagnose(Store(key[0], create=False), run_id, _runs)]


def data_version(store: Store, run: pd.Series) -> tuple:
    """What changes whenever the stored data of ``run`` (a runs-table row) or of its pair (its FP32 twin, or the
    run it is the twin of) does (Store.data_version): one indexed read each, to learn that a live view has
    nothing new to show."""
    pair = run.get("pair_run_id")
    return store.data_version(int(run["run_id"])), None if pd.isna(pair) else store.data_version(int(pair))


def table_version(runs: pd.DataFrame) -> str:
    """The content of the runs table ``runs`` (Store.runs) as one digest of every value's text (a float's
    shortest exact repr, a NaN as nan, dicts and lists as written): equal for two reads of a table that holds the
    same."""
    return hashlib.blake2b(str(runs.to_numpy().tolist()).encode()).hexdigest()


def view_version(store: Store, runs: pd.DataFrame, *shown: pd.Series) -> tuple:
    """What a view of the runs ``shown`` (rows of ``runs``, the runs table the page read) depends on: their stored
    data and their pairs' (:func:`data_version`) and the runs table (:func:`table_version`: where the view finds
    an FP32 reference or a twin, a run's name, its status)."""
    return (*(data_version(store, run) for run in shown), table_version(runs))


#: how many values :func:`while_unchanged` holds per session; a live page holds a few, each replaced when its
#: run's data changes
HELD_UNCHANGED = 32


def while_unchanged(what: str, version: tuple, build: Callable, *key):
    """``build()``, or the value it gave this session for the same ``what`` and ``key`` while ``version``
    (:func:`data_version`) has stayed the same: a live page's refresh that finds no new rows does no work."""
    held = st.session_state.setdefault("_while_unchanged", {})
    name = (what, *key)
    if name in held and held[name][0] == version:
        return held[name][1]
    held.pop(name, None)
    while len(held) >= HELD_UNCHANGED:  # the oldest first (dicts keep insertion order)
        del held[next(iter(held))]
    value = build()
    held[name] = (version, value)
    return value


def held_step_summaries() -> dict:
    """Where the session's Store objects hold its live runs' step summaries (Store's ``held_summaries``), so that
    a page and each refresh of it read only the steps a live run added since the session's previous read."""
    return st.session_state.setdefault("_held_step_summaries", {})


def findings_version(store: Store, runs: pd.DataFrame) -> tuple:
    """What a final run's findings depend on beyond its own rows: the other runs and their statuses (its FP32
    twin or a rerun finishing) and the probes stored (a scale-linearity probe adds a finding)."""
    return tuple(zip(runs["run_id"].astype(int), runs["status"], strict=True)), store.probes_version()


def finding_severities(store: Store, run: pd.Series, version: tuple, runs: pd.DataFrame) -> list[str]:
    """The severity of each of a run's findings (mpdiag.analysis.findings.diagnose), cached once it is final
    for as long as ``version`` (:func:`findings_version` of ``runs``, the page's runs table) stays the same; a
    live run's held by the session (:func:`live_findings`)."""
    if is_final(run):
        return _severities(store_key(store), int(run["run_id"]), version, runs)
    return [f.severity for f in live_findings(store, run, version)]


def live_findings(store: Store, run: pd.Series, version: tuple = ()) -> list:
    """A live run's findings (diagnose, reading the runs table afresh), held by the session while what they read
    stays the same: the run's data and its pair's (:func:`data_version`), the events (written beside the batches)
    and the probes stored, and ``version``."""
    run_id = int(run["run_id"])
    # its steps as this session holds them (live_steps: only the rows added since its last read are read)
    return while_unchanged("findings", (version, data_version(store, run), store.events_version(),
                                        store.probes_version()),
                           lambda: diagnose(store, run_id, steps=live_steps(store, run_id)), str(store.path), run_id)


def cached_when_final(max_entries: int = 64, live: Callable | None = None):
    """Decorator for a read ``read(store, run_id, *args)``: the pages call ``read(store, run_id, *args, final)``
    and get it from ``st.cache_data`` when ``final``, else from ``live`` (default: the read itself). Streamlit
    keys a cache by the function's qualified name and source, so each read's cached form gets the read's name
    (nested functions of one source would share a cache: streamlit/streamlit#11157)."""
    def wrap(read: Callable) -> Callable:
        def from_store(key: tuple, run_id: int, *args):
            return read(Store(key[0], create=False), run_id, *args)

        from_store.__qualname__ = f"{read.__qualname__}.final"
        cached = st.cache_data(show_spinner=False, max_entries=max_entries)(from_store)

        @functools.wraps(read)
        def serve(store: Store, run_id: int, *args_then_final):
            *args, final = args_then_final
            return cached(store_key(store), int(run_id), *args) if final else (live or read)(store, int(run_id), *args)
        return serve
    return wrap


def _since_last_read(store: Store, what: str, run_id: int, read_since: Callable, merge: Callable, *args):
    """A live run's rows: those this session read before (session state) and the ones added since, read by
    ``read_since(since_step)`` and joined by ``merge(before, new)``; None before means nothing read yet. Keyed by
    the store's identity too: a store made again at the same path numbers its runs from 1 again, and its run 1
    must not continue the rows read of the old one."""
    key = f"{what}:{store_key(store)}:{run_id}:{args}"
    before = st.session_state.get(key)
    since = int(before["step"].max()) if before is not None and len(before) else -1
    new = read_since(since)
    rows = new if before is None or not len(before) else merge(before, new)
    st.session_state[key] = rows
    return rows


def live_steps(store: Store, run_id: int) -> pd.DataFrame:
    """The run's steps, reading only rows added since the previous call in this session."""
    return _since_last_read(store, "steps", run_id, lambda since: store.steps(int(run_id), since_step=since),
                            lambda before, new: pd.concat([before, new], ignore_index=True) if len(new) else before)


def live_step_signal_totals(store: Store, run_id: int) -> pd.DataFrame:
    """The run's per-step signal totals, reading only rows added since the previous call in this session."""
    return _since_last_read(store, "signals", run_id,
                            lambda since: store.step_signal_totals(int(run_id), since_step=since),
                            lambda before, new: pd.concat([before, new], ignore_index=True) if len(new) else before)


@cached_when_final(live=live_steps)
def steps(store: Store, run_id: int) -> pd.DataFrame:
    """Every recorded step of the run (Store.steps): cached when final, else read incrementally."""
    return store.steps(run_id)


@cached_when_final(live=live_step_signal_totals)
def step_signal_totals(store: Store, run_id: int) -> pd.DataFrame:
    """Every counted step's inf/NaN and FP16/BF16 under/overflow at the scale, summed over tensors, kept or not
    (Store.step_signal_totals), in at most SIGNAL_POINTS ranges of steps (each count's largest in its range)."""
    return store.step_signal_totals(run_id, max_rows=SIGNAL_POINTS)


@cached_when_final()
def rank_steps(store: Store, run_id: int) -> pd.DataFrame:
    """Per step and rank of a distributed run (Store.rank_steps). Empty for one process."""
    return store.rank_steps(run_id)


@cached_when_final()
def logged_steps(store: Store, run_id: int) -> list[int]:
    """Steps at which tensor statistics were recorded."""
    return store.logged_steps(run_id)


@cached_when_final()
def kept_steps(store: Store, run_id: int) -> pd.DataFrame:
    """Why each logged step's statistics were kept (Store.kept_steps)."""
    return store.kept_steps(run_id)


@cached_when_final()
def tensor_totals(store: Store, run_id: int) -> pd.DataFrame:
    """Per tensor, counts summed over every logged step (Store.tensor_totals)."""
    return store.tensor_totals(run_id)


@cached_when_final(max_entries=128)
def tensor_at_step(store: Store, run_id: int, tensor: str, step: int) -> pd.Series:
    """One tensor's statistics row at one logged step."""
    return store.tensor_stats(run_id, tensor, step=int(step)).iloc[0]


@cached_when_final()
def tensors_at_step(store: Store, run_id: int, step: int) -> pd.DataFrame:
    """Every tensor's statistics row at one logged step (Store.tensor_stats)."""
    return store.tensor_stats(run_id, step=int(step))


@cached_when_final()
def signals_at_step(store: Store, run_id: int, step: int) -> pd.DataFrame:
    """Every tensor's signals at one step, kept in full or not (Store.step_signals_at)."""
    return store.step_signals_at(run_id, int(step))


def _live_tensor_columns(store: Store, run_id: int, tensor: str, max_columns: int,
                         split_at: tuple[int, ...]) -> tuple[pd.DataFrame, np.ndarray]:
    """A live run's columns: those this session read before up to its last bucket, and the store's from there on
    (that bucket may have grown); all of them again when the run has grown past the level read before."""
    # not keyed by max_columns (it moves as the run's bins fill): a level that no longer fits is read again below
    key = f"columns:{store_key(store)}:{run_id}:{tensor}:{hash(split_at)}"
    before = st.session_state.get(key)
    if before is None or not len(before[0]):
        st.session_state[key] = store.histogram_columns(run_id, tensor, max_columns, split_at)
        return st.session_state[key]
    index, counts = before
    level, last = index.attrs["bucket_steps"], int(index["step"].iloc[-1])
    start = last + 1 if level == 1 else last // level * level  # an exact row never changes; a bucket may grow
    new_index, new_counts = store.histogram_columns(run_id, tensor, max_columns, split_at, from_step=start)
    if new_index.attrs["bucket_steps"] != level:
        new_index, new_counts = store.histogram_columns(run_id, tensor, max_columns, split_at)
    else:
        held = (index["step"] < start).to_numpy()
        new_index, new_counts = (pd.concat([index[held], new_index], ignore_index=True),
                                 np.concatenate([counts[held], new_counts]))
        new_index.attrs["bucket_steps"] = level
    st.session_state[key] = (new_index, new_counts)
    return new_index, new_counts


@cached_when_final(live=_live_tensor_columns)
def tensor_columns(store: Store, run_id: int, tensor: str, max_columns: int,
                   split_at: tuple[int, ...]) -> tuple[pd.DataFrame, np.ndarray]:
    """(index, counts) of one tensor's histograms in at most about ``max_columns`` step columns
    (Store.histogram_columns: exact rows or the writer's bucket sums); for a live run, only its last bucket and
    the ones after it are read again."""
    return store.histogram_columns(run_id, tensor, max_columns, split_at)


@cached_when_final()
def histogram_totals(store: Store, run_id: int) -> tuple[list[str], np.ndarray]:
    """(tensor names, counts): each tensor's histograms summed over every logged step (Store.histogram_totals)."""
    return store.histogram_totals(run_id)


@cached_when_final()
def histograms_at_step(store: Store, run_id: int, step: int) -> tuple[pd.DataFrame, np.ndarray]:
    """(index, counts) of every tensor's exponent histogram at one logged step."""
    return store.histogram_matrix(run_id, step=int(step))


@cached_when_final()
def shadow_stats(store: Store, run_id: int) -> pd.DataFrame:
    """Gradients against the FP32 shadow (Store.shadow_stats)."""
    return store.shadow_stats(run_id)


@cached_when_final()
def update_stats(store: Store, run_id: int) -> pd.DataFrame:
    """Optimizer updates against the weight format (Store.update_stats)."""
    return store.update_stats(run_id)


@cached_when_final(max_entries=32)
def fp8(store: Store, run_id: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A run's FP8 records and histograms (Store.fp8, Store.fp8_histograms)."""
    return store.fp8(run_id), store.fp8_histograms(run_id)


@cached_when_final(max_entries=32)
def fp8_blocks(store: Store, run_id: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A run's block-scaled FP8 blocks and block scales (Store.fp8_blocks, Store.fp8_block_scales)."""
    return store.fp8_blocks(run_id), store.fp8_block_scales(run_id)


@cached_when_final(max_entries=32)
def replay(store: Store, run_id: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A run's replayed step and its module rows (Store.replays, Store.replay_modules)."""
    return store.replays(run_id), store.replay_modules(run_id)


@cached_when_final(max_entries=32)
def module_stats(store: Store, run_id: int) -> pd.DataFrame:
    """A --trace-modules run's per-module magnitudes (Store.module_stats)."""
    return store.module_stats(run_id)


def twin_totals(store: Store, twin: pd.Series | None) -> pd.DataFrame | None:
    """The FP32 twin's per-tensor totals (:func:`tensor_totals`), cached once the twin is final; None without a
    twin. ``twin``: its row of the runs table the page read (compare.fp32_twin_row), not read again here."""
    return None if twin is None else tensor_totals(store, int(twin["run_id"]), is_final(twin))


def twin_at_step(store: Store, twin: pd.Series | None, tensor: str, step: int) -> pd.Series | None:
    """The FP32 twin's row for one tensor at one step (:func:`tensor_at_step`), None without a twin or when the
    twin did not log that step. ``twin`` as for :func:`twin_totals`."""
    if twin is None or step not in logged_steps(store, twin_id := int(twin["run_id"]), final := is_final(twin)):
        return None
    return tensor_at_step(store, twin_id, tensor, step, final)
