"""The Runs page's view-model: what app.py shows of the store's runs (each live run's progress and loss so far,
the runs table with each run's health, tags and the first line of its note, the management panel's run), as typed
values built from one read of the runs table and the cached reads (reads.py). No widgets and no drawing here. Texts are unescaped: the page
passes them through ``plain`` (run names and notes are the user's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from mpdiag.analysis.run_choice import LIVE_STATUSES
from mpdiag.analysis.summaries import RUN_LINKS, nonfinite_losses, run_label, run_progress, runs_table, thin_steps
from mpdiag.dashboard import reads
from mpdiag.dashboard.tables import RUN_PX, Column, loss_digits, loss_texts
from mpdiag.store import Store

#: how much of a note the runs table shows
NOTE_PREVIEW_CHARS = 60


@dataclass(frozen=True)
class LiveRun:
    """A running run's progress bar (``fraction`` None: its script decides how many steps), its losses and the
    ones its loss curve draws (``drawn``: step and loss of at most about 5,000 steps, summaries.thin_steps)."""
    run_id: int
    text: str
    fraction: float | None
    steps: pd.DataFrame
    drawn: pd.DataFrame

    @property
    def loss_drawable(self) -> bool:
        return nonfinite_losses(self.steps) < len(self.steps)

    @property
    def no_loss(self) -> str:
        return "No finite loss recorded yet." if len(self.steps) else "No step recorded yet."


def live_runs(store: Store, runs: pd.DataFrame) -> list[LiveRun]:
    """The runs still running, newest first, with their steps so far."""
    return [live_run(store, run) for _, run in runs[runs["status"] == "running"].iterrows()]


def live_run(store: Store, run: pd.Series) -> LiveRun:
    """A running run's progress and steps; the steps its curve draws are held while the run's data stays the same:
    a refresh with nothing new draws the very chart it drew (its 100k steps thinned once, not shipped whole to be
    hashed and sent again)."""
    fraction, words = run_progress(run)
    run_id = int(run["run_id"])
    steps = reads.live_steps(store, run_id)
    drawn = reads.while_unchanged("live_loss", reads.data_version(store, run),
                                  lambda: thin_steps(steps)[["step", "loss"]], str(store.path), run_id)
    return LiveRun(run_id, f"{run_label(run)}: {words}", fraction, steps, drawn)


def table(store: Store, runs: pd.DataFrame, shown: pd.DataFrame) -> pd.DataFrame:
    """The runs table of ``shown`` (the runs the filters keep), each run's health from its findings (cached
    for final runs while nothing they depend on changes), its final loss as every page writes it (to the digits
    that tell all of ``runs`` apart: tables.loss_digits), its tags beside the loss scale and its note's first
    line. The page shows it in parts (:data:`TABLE_COLUMNS`, :data:`MORE_TABLES`)."""
    version = reads.findings_version(store, runs)
    table = runs_table(shown, [reads.finding_severities(store, run, version, runs) for _, run in shown.iterrows()])
    # blank for a run that recorded no step (one that crashed before its first read "NaN", a loss it never had)
    table["final loss"] = np.where(shown["steps_done"].fillna(0).to_numpy() > 0,
                                   loss_texts(shown["final_loss"], loss_digits(runs)), "")
    table["opt level"] = [level_text(level, ranks) for level, ranks in zip(shown["opt_level"], shown["world_size"],
                                                                          strict=True)]
    table.insert(table.columns.get_loc("loss scale") + 1, "tags", shown["tags"].map(", ".join).to_numpy())
    table["note"] = shown["user_note"].map(note_preview).to_numpy()
    return table


def level_text(level, ranks) -> str:
    """A run's level as the runs table shows it, with its ranks when it is distributed: "O1 ×2"."""
    level = level if isinstance(level, str) else ""
    return f"{level} ×{int(ranks)}" if pd.notna(ranks) and int(ranks) > 1 else level


_RUN = Column(width=RUN_PX, kind="number", pinned=True)
#: the runs table's columns on screen at 1,280 px, what triage needs: which run, how it is, and its pages. The
#: widths leave room for what grows while a run goes (the browser sizes a column once, to what it first showed)
TABLE_COLUMNS = {
    "run": _RUN,
    "name": Column(width=120, pinned=True, help="Rename it below; hover a cell for a long name."),
    "status": Column(width=70),
    # wide enough for "2 errors, 3 warnings" (at 96 px a user read "1 error, 1 warni")
    "health": Column(width=140, help="The run's findings, counted by severity (each explained on its Findings "
                                     "page); hover a cell for the whole count. \"healthy, 1 skip\": no finding, and "
                                     "the steps GradScaler skipped (a non-finite gradient), too few to be one."),
    "opt level": Column("level", width=74, help="The opt level the run trained at (O0: FP32; O1-O3: FP16 "
                                                "mixed precision; bf16...); ×2: a distributed run of 2 ranks."),
    "final loss": Column(width=80, help="The last step's loss, to as many significant digits as tell this store's "
                                        "runs apart (the same on every page)."),
    "steps": Column(width=68, help="Steps recorded of the steps asked for."),
    **{column: Column(text, kind="link", display_text=text, width={"findings": 68, "gradients": 76}.get(column, 78))
       for column, text in RUN_LINKS.items()},
}
#: the rest of the runs table, in two tables that each fit beside the run number in the expander the page folds them
#: in (about 780 px)
MORE_TABLES = {
    "Settings": {
        "run": _RUN,
        "script": Column(width=180, help="The script the run trained (hover a cell for a long name)."),
        "scaling": Column(width=75, help="Loss scaling: dynamic (GradScaler), static, or none."),
        "init scale": Column(width=85, help="A dynamic loss scale's first value."),
        "static scale": Column(width=85, help="A static loss scale's value."),
        "device": Column(width=90),
        "ranks": Column(width=55, help="Processes of a distributed run."),
        "related": Column(width=170, help="Its FP32 twin, or the run it reran."),
    },
    "Timing, tags and notes": {
        "run": _RUN,
        "skipped": Column(width=90, help="Optimizer steps the loss scaler skipped (a non-finite gradient), of "
                                         "the steps recorded."),
        "step ms (median)": Column("step ms", width=70, help="Median milliseconds per step."),
        "started (UTC)": Column(width=140),
        "tags": Column(width=150, help="Set them below."),
        "note": Column(width=230, help="Your note's first line; the whole note is below, under Rename, tag, "
                                       "note or delete a run."),
    },
}


#: how many of the newest runs that ended early (failed, crashed, stopped) the Runs page explains below its table
ENDED_EXPLAINED = 3


def ended_early(runs: pd.DataFrame) -> tuple[pd.DataFrame, str | None]:
    """The newest runs of ``runs`` (Store.runs, newest first) that failed, crashed or were stopped, that the Runs
    page explains below its table (at most :data:`ENDED_EXPLAINED`), and what it says of the others (None: none)."""
    ended = runs[runs["status"].isin(["failed", "crashed", "stopped"])]
    rest = ended.iloc[ENDED_EXPLAINED:]
    if rest.empty:
        return ended, None
    ids = ", ".join(f"#{int(r)}" for r in rest["run_id"].head(12)) + (" …" if len(rest) > 12 else "")
    return ended.head(ENDED_EXPLAINED), (
        f"{len(rest):,} more run{'' if len(rest) == 1 else 's'} ended early ({ids}): why each ended is at the top of "
        "its own pages (its findings link in the table above), and what it printed under Console output of a run "
        "below.")


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
