"""Which runs a person means: the run a page opens on when no run is named, and the runs a filter keeps.

Owns the rule for the default run (:func:`likely_run`) and the run filters shared by the Runs page and
``mpdiag runs`` (:func:`select_runs`), over rows of :meth:`mpdiag.store.Store.runs`. Pure functions of those
rows: no store access, no widgets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import pandas as pd

from mpdiag.options import watch_settings

#: how many of the newest candidate runs are asked whether they have findings before settling on the newest
FINDINGS_LOOKBACK = 20
LIVE_STATUSES = ("running", "queued", "stalled")


def is_reference(run: pd.Series) -> bool:
    """Whether a run is an FP32 reference rather than a run someone is diagnosing: an O0 run (the FP32 twin
    recorded with ``--pair`` is one)."""
    return run["opt_level"] == "O0"


def likely_run(runs: pd.DataFrame, has_findings: Callable[[int], bool]) -> int | None:
    """The run a page about one run opens on when neither the URL nor the user chose one. ``runs``: Store.runs
    rows, newest first; ``has_findings(run_id)``: whether that run has an error or warning finding.

    FP32 references (:func:`is_reference`) are skipped unless every run is one. Of the others: the newest when
    it is still going (the run being watched); else the newest with findings among the FINDINGS_LOOKBACK newest
    (after the Quick start: the failing run, not its FP32 twin recorded after it); else the newest. None when
    ``runs`` is empty."""
    if runs.empty:
        return None
    candidates = runs[~runs.apply(is_reference, axis=1)]
    if candidates.empty:
        return int(runs.iloc[0]["run_id"])
    newest = candidates.iloc[0]
    if newest["status"] in LIVE_STATUSES:
        return int(newest["run_id"])
    for run_id in candidates["run_id"].head(FINDINGS_LOOKBACK).astype(int):
        if has_findings(run_id):
            return run_id
    return int(newest["run_id"])


def script_name(run: pd.Series) -> str:
    """The script a run ran, as the runs table shows and filters it (a Store.runs row): its file name; for a
    watched module ``-m name``; for training code uploaded in the app, its entry point with "(uploaded)";
    "" for a run that names none (a user's own Recorder loop)."""
    path = run.get("script_path")
    if isinstance(path, str) and path:
        return Path(path).name
    watched = watch_settings(run.get("config"))
    argv = watched.get("argv") if watched is not None else None
    if not argv:
        return ""
    entry = f"-m {argv[1]}" if argv[0] == "-m" and len(argv) > 1 else Path(str(argv[0])).name
    return f"{entry} (uploaded)" if watched.get("bundle") else entry


def script_names(runs: pd.DataFrame) -> pd.Series:
    """:func:`script_name` of every row of ``runs`` (Store.runs), on its index."""
    return pd.Series([script_name(run) for _, run in runs.iterrows()], index=runs.index, dtype=object)


def select_runs(runs: pd.DataFrame, tags: Iterable[str] = (), statuses: Iterable[str] = (),
                scripts: Iterable[str] = ()) -> pd.DataFrame:
    """The rows of ``runs`` (Store.runs) that carry any of ``tags``, have any of ``statuses`` (as the store
    reports them: crashed and stalled included) and ran any of ``scripts`` (as :func:`script_name`
    gives them). An empty filter keeps every run."""
    tags, statuses, scripts = set(tags), set(statuses), set(scripts)
    keep = pd.Series(True, index=runs.index)
    if tags:
        keep &= runs["tags"].map(lambda held: bool(tags & set(held)))
    if statuses:
        keep &= runs["status"].isin(statuses)
    if scripts:
        keep &= script_names(runs).isin(scripts)
    return runs[keep]
