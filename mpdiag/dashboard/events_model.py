"""The events banner's view-model: which of a store's runs raised events while training
(:mod:`mpdiag.recording.events`), each event in one line with the link to its evidence (the page and step where it
shows), as typed values for the Runs page and for a run's own pages (mpdiag.dashboard.frame). No widgets, no
drawing. Texts are unescaped (a run's name is the user's): the page passes them through ``plain``; links are built
from integers and page names only.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from mpdiag.analysis.summaries import run_label
from mpdiag.store import Store

#: the page that shows each kind's evidence (its URL path, its name)
EVIDENCE_PAGE = {"nonfinite": ("Loss_scale", "Loss scale"), "skips": ("Loss_scale", "Loss scale"),
                 "scale-collapse": ("Loss_scale", "Loss scale"), "loss-spike": ("Loss_scale", "Loss scale"),
                 "grad-norm-spike": ("Gradients", "Gradients")}
#: runs the Runs page's banner lists (newest first), and events per run listed before "and N more"
BANNER_RUNS = 5
LINES_PER_RUN = 3


@dataclass(frozen=True)
class EventLine:
    """One event: its step, kind, what the rule found (``summary``) and the link to the evidence."""

    step: int
    kind: str
    summary: str
    page: str
    link: str


@dataclass(frozen=True)
class Banner:
    """A run's events: ``lines`` shown, ``more`` not shown; ``stopped_by``: the ``--stop-on`` option that ended
    the run at the first of them (its error's first part), None when the run was not stopped."""

    run_id: int
    label: str
    lines: list[EventLine]
    more: int
    stopped_by: str | None = None

    @property
    def heading(self) -> str:
        count = len(self.lines) + self.more
        said = f"{self.label}: {count} event{'s' if count > 1 else ''} while training"
        return said if self.stopped_by is None else f"{said}; stopped by {self.stopped_by}"


def _line(run_id: int, event: pd.Series) -> EventLine:
    path, page = EVIDENCE_PAGE.get(event["kind"], ("Loss_scale", "Loss scale"))
    step = int(event["step"])
    return EventLine(step, str(event["kind"]), str(event["evidence"].get("summary", "")), page,
                     f"/{path}?run={int(run_id)}&step={step}")


def _banner(run: pd.Series, events: pd.DataFrame, lines: int | None) -> Banner:
    run_id = int(run["run_id"])
    shown = events if lines is None else events.head(lines)
    stopped = run["status"] == "stopped" and isinstance(run["error"], str)
    return Banner(run_id, run_label(run), [_line(run_id, e) for _, e in shown.iterrows()], len(events) - len(shown),
                  run["error"].partition(":")[0].strip() if stopped else None)


def runs_banners(store: Store, runs: pd.DataFrame) -> list[Banner]:
    """The Runs page's banner: the newest BANNER_RUNS runs (of ``runs``, newest first) that raised events, each
    with its first LINES_PER_RUN events."""
    events = store.events()
    if events.empty:
        return []
    by_run = dict(tuple(events.groupby("run_id")))
    with_events = runs[runs["run_id"].astype(int).isin(by_run)].head(BANNER_RUNS)
    return [_banner(run, by_run[int(run["run_id"])], LINES_PER_RUN) for _, run in with_events.iterrows()]


def run_banner(store: Store, run: pd.Series) -> Banner | None:
    """A run's own pages' banner: every event it raised (at most a few per kind are stored), or None."""
    events = store.events(int(run["run_id"]))
    return None if events.empty else _banner(run, events, None)
