"""Typed store reads for the pages: one function per thing a page shows, cached once the run is final.

A run that is ``final`` (finished, failed, crashed) can no longer change, so its reads are cached by
``st.cache_data`` under the store's path and file identity (a replaced store file is not served from the cache).
Reads of a live run go to the store each time; :func:`live_steps` reads only the rows added since the session's
previous call. This module owns caching and nothing else: no SQL (the Store has it), no shaping (analysis has
it), no widgets.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from mpdiag.analysis.findings import diagnose
from mpdiag.store import Store

FINAL_STATUSES = ("finished", "failed", "crashed")


def is_final(run: pd.Series) -> bool:
    """Whether a run row can no longer change (its reads may be cached)."""
    return run["status"] in FINAL_STATUSES


def _identity(path: Path) -> tuple[int, int]:
    """Changes when the store file is replaced, so cached reads of a deleted store are not reused."""
    stat = path.stat()
    return stat.st_ino, stat.st_dev


def _key(store: Store) -> tuple[str, tuple[int, int]]:
    return str(store.path), _identity(store.path)


@st.cache_data(show_spinner=False, max_entries=64)
def _steps(key: tuple, run_id: int) -> pd.DataFrame:
    return Store(key[0], create=False).steps(run_id)


@st.cache_data(show_spinner=False, max_entries=64)
def _logged_steps(key: tuple, run_id: int) -> list[int]:
    return Store(key[0], create=False).logged_steps(run_id)


@st.cache_data(show_spinner=False, max_entries=64)
def _tensor_totals(key: tuple, run_id: int) -> pd.DataFrame:
    return Store(key[0], create=False).tensor_totals(run_id)


@st.cache_data(show_spinner=False, max_entries=128)
def _tensor_at_step(key: tuple, run_id: int, tensor: str, step: int) -> pd.Series:
    return Store(key[0], create=False).tensor_stats(run_id, tensor, step=step).iloc[0]


@st.cache_data(show_spinner=False, max_entries=64)
def _tensor_histograms(key: tuple, run_id: int, tensor: str) -> tuple[pd.DataFrame, np.ndarray]:
    return Store(key[0], create=False).histogram_matrix(run_id, tensor)


@st.cache_data(show_spinner=False, max_entries=64)
def _histograms_at_step(key: tuple, run_id: int, step: int) -> tuple[pd.DataFrame, np.ndarray]:
    return Store(key[0], create=False).histogram_matrix(run_id, step=step)


@st.cache_data(show_spinner=False, max_entries=64)
def _shadow_stats(key: tuple, run_id: int) -> pd.DataFrame:
    return Store(key[0], create=False).shadow_stats(run_id)


@st.cache_data(show_spinner=False, max_entries=64)
def _update_stats(key: tuple, run_id: int) -> pd.DataFrame:
    return Store(key[0], create=False).update_stats(run_id)


@st.cache_data(show_spinner=False, max_entries=64)
def _rank_steps(key: tuple, run_id: int) -> pd.DataFrame:
    return Store(key[0], create=False).rank_steps(run_id)


@st.cache_data(show_spinner=False, max_entries=256)
def _severities(key: tuple, run_id: int, version: tuple) -> list[str]:
    return [f.severity for f in diagnose(Store(key[0], create=False), run_id)]


def findings_version(store: Store, runs: pd.DataFrame) -> tuple:
    """What a final run's findings depend on beyond its own rows: the other runs and their statuses (its FP32
    twin or a rerun finishing) and the probes stored (a scale-linearity probe adds a finding)."""
    return tuple(zip(runs["run_id"].astype(int), runs["status"], strict=True)), store.probes_version()


def finding_severities(store: Store, run: pd.Series, version: tuple) -> list[str]:
    """The severity of each of a run's findings (mpdiag.analysis.findings.diagnose), cached once it is final
    for as long as ``version`` (:func:`findings_version`) stays the same."""
    run_id = int(run["run_id"])
    if is_final(run):
        return _severities(_key(store), run_id, version)
    return [f.severity for f in diagnose(store, run_id)]


def steps(store: Store, run_id: int, final: bool) -> pd.DataFrame:
    """Every recorded step of the run (Store.steps): cached when final, else read incrementally."""
    return _steps(_key(store), int(run_id)) if final else live_steps(store, run_id)


def rank_steps(store: Store, run_id: int, final: bool) -> pd.DataFrame:
    """Per step and rank of a distributed run (Store.rank_steps): cached when final. Empty for one process."""
    return _rank_steps(_key(store), int(run_id)) if final else store.rank_steps(run_id)


def logged_steps(store: Store, run_id: int, final: bool) -> list[int]:
    """Steps at which tensor statistics were recorded."""
    return _logged_steps(_key(store), int(run_id)) if final else store.logged_steps(int(run_id))


def tensor_totals(store: Store, run_id: int, final: bool) -> pd.DataFrame:
    """Per tensor, counts summed over every logged step (Store.tensor_totals)."""
    return _tensor_totals(_key(store), int(run_id)) if final else store.tensor_totals(int(run_id))


def tensor_at_step(store: Store, run_id: int, tensor: str, step: int, final: bool) -> pd.Series:
    """One tensor's statistics row at one logged step."""
    if final:
        return _tensor_at_step(_key(store), int(run_id), tensor, int(step))
    return store.tensor_stats(int(run_id), tensor, step=int(step)).iloc[0]


@st.cache_data(max_entries=64, show_spinner=False)
def _tensor_over_steps(key: tuple, run_id: int, tensor: str) -> pd.DataFrame:
    return Store(key[0], create=False).tensor_stats(run_id, tensor)


def tensor_over_steps(store: Store, run_id: int, tensor: str, final: bool) -> pd.DataFrame:
    """One tensor's statistics rows at every logged step (Store.tensor_stats): cached when final; for a live run,
    only the steps logged since this session's previous read are read."""
    if final:
        return _tensor_over_steps(_key(store), int(run_id), tensor)
    key = f"stats:{store.path}:{run_id}:{tensor}"
    cached = st.session_state.get(key)
    since = int(cached["step"].max()) if cached is not None and len(cached) else -1
    fresh = store.tensor_stats(int(run_id), tensor, since_step=since)
    stats = fresh if cached is None or not len(cached) else pd.concat([cached, fresh], ignore_index=True) \
        if len(fresh) else cached
    st.session_state[key] = stats
    return stats


@st.cache_data(max_entries=64, show_spinner=False)
def _tensors_at_step(key: tuple, run_id: int, step: int) -> pd.DataFrame:
    return Store(key[0], create=False).tensor_stats(run_id, step=step)


def tensors_at_step(store: Store, run_id: int, step: int, final: bool) -> pd.DataFrame:
    """Every tensor's statistics row at one logged step (Store.tensor_stats)."""
    if final:
        return _tensors_at_step(_key(store), int(run_id), int(step))
    return store.tensor_stats(int(run_id), step=int(step))


def tensor_histograms(store: Store, run_id: int, tensor: str, final: bool) -> tuple[pd.DataFrame, np.ndarray]:
    """(index, counts) of one tensor's exponent histograms over every logged step (Store.histogram_matrix):
    cached when final; for a live run, only the steps logged since this session's previous read are read."""
    if final:
        return _tensor_histograms(_key(store), int(run_id), tensor)
    key = f"hists:{store.path}:{run_id}:{tensor}"
    cached = st.session_state.get(key)
    since = int(cached[0]["step"].max()) if cached is not None and len(cached[0]) else -1
    index, counts = store.histogram_matrix(int(run_id), tensor, since_step=since)
    if cached is not None and len(cached[0]):
        index = pd.concat([cached[0], index], ignore_index=True)
        counts = np.concatenate([cached[1], counts]) if len(counts) else cached[1]
    st.session_state[key] = (index, counts)
    return index, counts


def histograms_at_step(store: Store, run_id: int, step: int, final: bool) -> tuple[pd.DataFrame, np.ndarray]:
    """(index, counts) of every tensor's exponent histogram at one logged step."""
    if final:
        return _histograms_at_step(_key(store), int(run_id), int(step))
    return store.histogram_matrix(int(run_id), step=int(step))


def twin_totals(store: Store, twin_id: int | None) -> pd.DataFrame | None:
    """The FP32 twin's per-tensor totals (:func:`tensor_totals`), cached once the twin is final; None without a
    twin."""
    return None if twin_id is None else tensor_totals(store, twin_id, is_final(store.run(twin_id)))


def twin_at_step(store: Store, twin_id: int | None, tensor: str, step: int) -> pd.Series | None:
    """The FP32 twin's row for one tensor at one step (:func:`tensor_at_step`), None without a twin or when the
    twin did not log that step."""
    if twin_id is None or step not in logged_steps(store, twin_id, final := is_final(store.run(twin_id))):
        return None
    return tensor_at_step(store, twin_id, tensor, step, final)


def shadow_stats(store: Store, run_id: int, final: bool) -> pd.DataFrame:
    """Gradients against the FP32 shadow (Store.shadow_stats)."""
    return _shadow_stats(_key(store), int(run_id)) if final else store.shadow_stats(int(run_id))


def update_stats(store: Store, run_id: int, final: bool) -> pd.DataFrame:
    """Optimizer updates against the weight format (Store.update_stats)."""
    return _update_stats(_key(store), int(run_id)) if final else store.update_stats(int(run_id))


def live_steps(store: Store, run_id: int) -> pd.DataFrame:
    """The run's steps, reading only rows added since the previous call in this session."""
    key = f"steps:{store.path}:{run_id}"
    cached = st.session_state.get(key)
    since = int(cached["step"].max()) if cached is not None and len(cached) else -1
    fresh = store.steps(int(run_id), since_step=since)
    steps = fresh if cached is None else pd.concat([cached, fresh], ignore_index=True) if len(fresh) else cached
    st.session_state[key] = steps
    return steps


@st.cache_data(show_spinner=False, max_entries=32)
def _fp8(key: tuple, run_id: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    store = Store(key[0], create=False)
    return store.fp8(run_id), store.fp8_histograms(run_id)


def fp8(store: Store, run_id: int, final: bool) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A run's FP8 records and histograms (Store.fp8, Store.fp8_histograms): cached when final."""
    return _fp8(_key(store), int(run_id)) if final else (store.fp8(run_id), store.fp8_histograms(run_id))


@st.cache_data(show_spinner=False, max_entries=32)
def _module_stats(key: tuple, run_id: int) -> pd.DataFrame:
    return Store(key[0], create=False).module_stats(run_id)


def module_stats(store: Store, run_id: int, final: bool) -> pd.DataFrame:
    """A --trace-modules run's per-module magnitudes (Store.module_stats): cached when final."""
    return _module_stats(_key(store), int(run_id)) if final else store.module_stats(int(run_id))
