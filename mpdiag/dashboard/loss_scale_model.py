"""The Loss scale page's view-model: what pages/2_Loss_scale.py shows of one run (its steps for the scale panel,
the scale's events, the notes beneath, each step's over/underflow counts whether its full statistics were kept or
not, and a distributed run's per-rank rows with the rank-nonfinite finding), as
typed values built from the cached reads (reads.py) and mpdiag.analysis. No widgets and no drawing here, so every
part is testable without Streamlit; the page draws these.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import pandas as pd

from mpdiag.analysis import summaries
from mpdiag.analysis.finding import Finding
from mpdiag.analysis.findings import lone_rank_steps, named_rank_step, rank_nonfinite
from mpdiag.dashboard import reads
from mpdiag.store import Store


@dataclass(frozen=True)
class Ranks:
    """A distributed run's per-rank rows, its rank-nonfinite finding (None: none) and that finding's first step."""
    rows: pd.DataFrame
    finding: Finding | None
    first: int | None


@dataclass(frozen=True)
class LossScaleRun:
    """One run's loss scale: ``steps`` as drawn (a static scale's growth tracker left out: it has no growth to
    track, so its flat line says nothing and the notes say why), the scale's events counted on the steps as
    recorded, the notes, the per-step signal lines (summaries.signal_lines; empty: nothing to draw) and what they
    show, and the ranks (None for one process)."""
    steps: pd.DataFrame
    events: dict[str, int]
    nonfinite_losses: int
    notes: list[str]
    ranks: Ranks | None
    signals: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)
    signal_note: str = ""

    @functools.cached_property
    def drawn_steps(self) -> pd.DataFrame:
        """The steps the scale panel draws (summaries.thin_steps), once per view."""
        return summaries.thin_steps(self.steps)


def ranks(store: Store, run: pd.Series, steps: pd.DataFrame, final: bool) -> Ranks:
    rows = reads.rank_steps(store, int(run["run_id"]), final)
    finding = None if rows.empty else rank_nonfinite(rows, steps)
    first = None if finding is None else named_rank_step(lone_rank_steps(rows))  # the step the finding names
    return Ranks(rows, finding, first)


def loss_scale(store: Store, run: pd.Series, final: bool) -> LossScaleRun:
    """The Loss scale page's view of ``run``; empty ``steps`` where it recorded none. A live run's view is held
    by the session while its data stays the same (its refresh every second finds nothing new most times)."""
    if final:
        return _loss_scale(store, run, final)
    return reads.while_unchanged("loss_scale", reads.data_version(store, run), lambda: _loss_scale(store, run, final),
                                 str(store.path), int(run["run_id"]))


def _loss_scale(store: Store, run: pd.Series, final: bool) -> LossScaleRun:
    recorded = reads.steps(store, int(run["run_id"]), final)
    if recorded.empty:
        return LossScaleRun(recorded, {}, 0, [], None)
    steps = recorded.assign(growth_tracker=float("nan")) if run["scaling"] == "static" else recorded
    level = summaries.judged_level(run)
    notes = summaries.loss_scale_notes(steps, run["scaling"], level) + summaries.lr_norm_notes(steps)
    signals = reads.step_signal_totals(store, int(run["run_id"]), final)
    return LossScaleRun(steps, summaries.scale_events(recorded), summaries.nonfinite_losses(recorded), notes,
                        ranks(store, run, steps, final) if int(run["world_size"]) > 1 else None,
                        summaries.signal_lines(signals, level),
                        summaries.signal_note(signals, len(reads.logged_steps(store, int(run["run_id"]), final)),
                                              level))
