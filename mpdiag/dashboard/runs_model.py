"""The Runs page's view-model: what app.py shows of the store's runs (each live run's progress and loss so far,
the runs table with each run's health, tags and the first line of its note, the management panel's run), as typed
values built from one read of the runs table and the cached reads (reads.py). No widgets and no drawing here. Texts are unescaped: the page
passes them through ``plain`` (run names and notes are the user's).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from mpdiag.analysis.run_choice import LIVE_STATUSES
from mpdiag.analysis.summaries import nonfinite_losses, run_label, run_progress, runs_table
from mpdiag.dashboard import reads
from mpdiag.store import Store

#: how much of a note the runs table shows
NOTE_PREVIEW_CHARS = 60


@dataclass(frozen=True)
class LiveRun:
    """A running run's progress bar (``fraction`` None: its script decides how many steps) and its losses."""
    run_id: int
    text: str
    fraction: float | None
    steps: pd.DataFrame

    @property
    def loss_drawable(self) -> bool:
        return nonfinite_losses(self.steps) < len(self.steps)

    @property
    def no_loss(self) -> str:
        return "No finite loss recorded yet." if len(self.steps) else "No step recorded yet."


def live_runs(store: Store, runs: pd.DataFrame) -> list[LiveRun]:
    """The runs still running, newest first, with their steps so far."""
    live = []
    for _, run in runs[runs["status"] == "running"].iterrows():
        fraction, words = run_progress(run)
        live.append(LiveRun(int(run["run_id"]), f"{run_label(run)}: {words}", fraction,
                            reads.live_steps(store, int(run["run_id"]))))
    return live


def table(store: Store, runs: pd.DataFrame, shown: pd.DataFrame) -> pd.DataFrame:
    """The runs table of ``shown`` (the runs the filters keep), each run's health from its findings (cached
    for final runs while nothing they depend on changes), its tags beside the loss scale and its note's
    first line."""
    version = reads.findings_version(store, runs)
    table = runs_table(shown, [reads.finding_severities(store, run, version) for _, run in shown.iterrows()])
    table.insert(table.columns.get_loc("loss scale") + 1, "tags", shown["tags"].map(", ".join).to_numpy())
    table["note"] = shown["user_note"].map(note_preview).to_numpy()
    return table


def note_preview(note) -> str:
    """A note's first line, shortened for the runs table ("" for none)."""
    if not isinstance(note, str) or not note:
        return ""
    first = note.splitlines()[0]
    return first[:NOTE_PREVIEW_CHARS] + ("…" if len(first) > NOTE_PREVIEW_CHARS or "\n" in note else "")


@dataclass(frozen=True)
class ManagedRun:
    """The management panel's run: what its name, tags and note widgets start from, the tags known in the
    store (to pick from), and whether it can be deleted: ``delete_refused`` says why not (its process may still
    write), ``delete_summary`` what a confirmed delete removes."""
    run_id: int
    name: str
    tags: list[str]
    known_tags: list[str]
    note: str
    delete_refused: str | None
    delete_summary: str


def managed_run(runs: pd.DataFrame, run_id: int) -> ManagedRun:
    """Run ``run_id``'s row of ``runs`` (Store.runs) as the management panel shows it."""
    run = runs.set_index("run_id").loc[run_id]
    refused = (f"Run #{run_id} is {run['status']}: it cannot be deleted while its process may still write to the "
               "store. Wait until it ends (or stop it), then delete it.") if run["status"] in LIVE_STATUSES else None
    twin = run["opt_level"] == "O0" and pd.notna(run["pair_run_id"])
    return ManagedRun(
        run_id=run_id, name=run["name"] or "", tags=list(run["tags"]),
        known_tags=sorted({t for held in runs["tags"] for t in held}),
        note=run["user_note"] if isinstance(run["user_note"], str) else "",
        delete_refused=refused,
        delete_summary=(f"#{run_id} · {run['name']} · {run['opt_level']} · {run['status']}, "
                        f"{int(run['steps_done'])} steps" + (f" · FP32 twin of #{run['pair_run_id']}" if twin else "")),
    )
