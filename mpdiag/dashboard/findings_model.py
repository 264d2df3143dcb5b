"""The Findings page's view-model: what pages/5_Findings.py shows of one run (its findings with their evidence
links and fix reruns, its reruns' outcomes, its gradients against the FP32 shadow, its optimizer updates), as typed
values built from mpdiag.analysis.findings and the cached reads (reads.py). No widgets, no drawing and nothing
started here (the page asks for a confirmed click before a rerun), so every part is testable without Streamlit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from mpdiag.analysis.findings import (
    Finding,
    diagnose,
    evidence_link,
    fix_not_rerunnable,
    fix_options,
    rerun_outcomes,
)
from mpdiag.analysis.summaries import shadow_ranking, update_shares
from mpdiag.dashboard import reads
from mpdiag.dashboard.tables import RUN_PX, Column, loss_digits, loss_texts
from mpdiag.options import RERUN_MARK, fix_in_code, fix_text, recorded_by, watch_settings
from mpdiag.store import Store


@dataclass(frozen=True)
class Card:
    """One finding as its card shows it: where its evidence is (link and words) and its fix rerun, if any."""
    finding: Finding
    link: str
    where: str
    #: why the fix cannot be rerun (said instead of a button); else the rerun's options and the fix in words,
    #: all None where there is no fix or the run is still going
    blocked: str | None
    options: dict | None
    described: str | None
    #: a watched script's fix as the change to make in its own code (its rerun changes it from outside), else None
    in_code: str | None = None


@dataclass(frozen=True)
class Shadow:
    """Gradients against the FP32 shadow: the tensors ranked by lost precision, the five worst whose reference
    is not negligible, and whether their errors can be drawn on a log axis (else whether they are all 0)."""
    stats: pd.DataFrame
    ranking: pd.DataFrame
    top: list[str]
    drawable: bool
    exact: bool


@dataclass(frozen=True)
class FindingsRun:
    """One run's findings page; ``shadow`` and ``updates`` None where the run recorded neither."""
    run: pd.Series
    cards: list[Card]
    outcomes: pd.DataFrame
    shadow: Shadow | None
    #: (per tensor, per step) shares of updates below the weight format's resolution
    updates: tuple[pd.DataFrame, pd.DataFrame] | None
    #: the reruns table as the page shows it (:func:`reruns_table`) and its columns
    reruns: pd.DataFrame = field(default_factory=pd.DataFrame)
    rerun_columns: dict[str, Column] = field(default_factory=dict)

    @property
    def findings(self) -> list[Finding]:
        return [card.finding for card in self.cards]

    @property
    def no_reference(self) -> str | None:
        """Why the reruns table has no loss against FP32, and how to get one (a user read "None" beside the fix
        that had worked and was not told why), or None where some row has one."""
        if self.reruns.empty or self.reruns["vs FP32"].notna().any():
            return None
        run_id = int(self.run["run_id"])
        how = {"watch": f"an O0 rerun of the same command gives one: python -m mpdiag rerun {run_id} --opt-level O0 "
                        "(mpdiag watch records no FP32 twin)",
               "run": f"an O0 run of the same script and seed gives one: python -m mpdiag rerun {run_id} "
                      "--opt-level O0"}.get(recorded_by(self.run["config"]), "record the same loop in FP32 beside it")
        return f"No FP32 reference for these runs yet, so no loss against FP32: {how}."

    def none_said(self, label: str) -> tuple[bool, str]:
        """Where the run (``label``: its name as the pages write it) has no findings, what the page says: (whether
        it is good news, the words). A run that ended early (failed, crashed, stopped) is no success: its checks
        covered only the steps it recorded, and its box above says why it ended."""
        ended = {"crashed": "it crashed", "failed": "it failed", "stopped": "it was stopped"}.get(self.run["status"])
        if ended is not None:
            steps = int(self.run["steps_done"]) if pd.notna(self.run["steps_done"]) else 0
            return False, (f"No findings for {label} in the {steps:,} step{'' if steps == 1 else 's'} recorded "
                           f"before {ended}: mpdiag's checks found no problem there, and say nothing of the steps "
                           "it did not reach.")
        return True, (f"No findings for {label}: none of mpdiag's checks (gradient underflow and overflow, loss-scale "
                      "collapse and skipped steps, divergence from FP32, optimizer-step and FP8 checks) found a problem.")


#: the reruns table's columns at 1,280 px: what it is for first (the loss against FP32, the findings still there),
#: every column on screen (each finding a column of its own, with its long name, pushed them off)
RERUN_COLUMNS = {
    "run": Column(width=RUN_PX, kind="number", pinned=True),
    "name": Column(width=150, help="This run's name, then each rerun's: what it changed (↻), or the name typed for "
                                   "it. Hover a cell for a long name."),
    "status": Column(width=70),
    "vs FP32": Column(width=80, kind="number", format="%+.3f %%",
                      help="The run's final loss minus its FP32 reference's, in % of the reference's: the first "
                           "row is this run's, to read the reruns' against."),
    "final loss": Column(width=84, help="The run's last step's loss, as every page writes it."),
    "still there": Column(width=160, help="This run's findings (the cards above) that the rerun raises too; none: "
                                          "every one went away. Blank until the rerun has finished, and for this run itself."),
    "gone": Column(width=70, help="How many of this run's findings the rerun no longer raises."),
    "opt level": Column("level", width=58),
    "FP32 final loss": Column("FP32 loss", width=100, help="The final loss of the FP32 run the rerun is compared "
                                                           "with (same script and seed; a watched script: the same command)."),
}


def reruns_table(outcomes: pd.DataFrame, findings: list[Finding], runs: pd.DataFrame) -> tuple[pd.DataFrame,
                                                                                                 dict[str, Column]]:
    """The reruns' outcomes (findings.rerun_outcomes) as the page shows them: the run's own row first, named "this
    run: ...", whose losses the reruns' are read against (a rerun that removed every finding and ended at a worse
    loss read "2 of 2" gone and nothing else); per rerun, the run's findings it still raises and how many went away
    (a column per finding did not fit), its losses as every page writes them (the digits of ``runs``,
    tables.loss_digits); and the columns it has (none about findings for a run without any)."""
    if outcomes.empty:
        return outcomes, {}
    rules = [f.rule for f in findings if f.rule in outcomes.columns]
    judged = outcomes[rules].notna().all(axis=1) if rules else outcomes["status"] == "finished"
    still = [[r for r in rules if row[r] == "still there"] for _, row in outcomes.iterrows()]
    digits = loss_digits(runs)
    missing = pd.Series(np.nan, index=outcomes.index)
    reference = outcomes.get("FP32 final loss", missing)
    own = outcomes.get("this run", pd.Series(False, index=outcomes.index)).eq(True)  # NaN: a rerun
    table = pd.DataFrame({
        "run": outcomes["run"],
        "name": [_rerun_label(n, mine) for n, mine in zip(outcomes["name"], own, strict=True)],
        "status": outcomes["status"],
        "vs FP32": outcomes.get("vs FP32", missing).astype(float),
        "final loss": loss_texts(outcomes["final loss"], digits),
        "still there": [(", ".join(s) or "none") if j else "" for s, j in zip(still, judged, strict=True)],
        "gone": [f"{len(rules) - len(s)} of {len(rules)}" if j else "" for s, j in zip(still, judged, strict=True)],
        "opt level": outcomes["opt level"],
        "FP32 final loss": [t if pd.notna(v) else "" for v, t in zip(reference, loss_texts(reference, digits),
                                                                     strict=True)],
    })
    columns = {c: spec for c, spec in RERUN_COLUMNS.items() if rules or c not in ("still there", "gone")}
    return table, columns


def _rerun_label(name: object, this_run: bool) -> str:
    """A row's name in the reruns table: "this run: ..." for the run itself; a rerun named by mpdiag by what it
    changed ("↻ bf16"), which its 150 px showed only after the parent's script name, cut ("x.py ↻" twice)."""
    text = str(name)
    if this_run:
        return f"this run: {text}"
    return RERUN_MARK.lstrip() + text.rsplit(RERUN_MARK, 1)[1] if RERUN_MARK in text else text


def card(run: pd.Series, final: bool, runs: pd.DataFrame, finding: Finding) -> Card:
    """A finding's card; a fix is offered only once the run is final (a rerun reruns the stored script)."""
    run_id = int(run["run_id"])
    where = "below" if finding.page == "Findings" else f"on the {finding.page.replace('_', ' ')} page"
    blocked = fix_not_rerunnable(run["config"], finding.fix, run["world_size"], run["scaling"]) \
        if finding.fix and final else None
    offered = finding.fix and final and not blocked
    in_code = fix_in_code(finding.fix) if finding.fix and watch_settings(run["config"]) is not None else None
    return Card(finding, evidence_link(finding, run_id), where, blocked,
                fix_options(runs, run_id, finding) if offered else None, fix_text(finding.fix) if offered else None,
                in_code)


def shadow(store: Store, run_id: int, final: bool) -> Shadow | None:
    """The run's gradients against the FP32 shadow (--shadow-every), None where it recorded none."""
    stats = reads.shadow_stats(store, run_id, final)
    if stats.empty:
        return None
    ranking = shadow_ranking(stats)
    top = ranking[ranking["meaningful"]]["tensor"].head(5).tolist()
    drawable = stats[stats["tensor"].isin(top) & np.isfinite(stats["rel_error"]) & (stats["rel_error"] > 0)]
    exact = bool(top) and bool((stats.loc[stats["tensor"].isin(top), "rel_error"] == 0).all())
    return Shadow(stats, ranking, top, bool(len(drawable)), exact)


def findings(store: Store, run: pd.Series, final: bool, runs: pd.DataFrame) -> FindingsRun:
    """The Findings page's view of ``run`` (a row of ``runs``, the runs table the page read once: the findings,
    the reruns and the fixes' FP32 references are judged against it, not a second read). Held by the session
    while what it reads stays the same: the run's data and its pair's and the runs table the page read
    (reads.view_version), the events and the probes stored; a live refresh that finds no new rows diagnoses
    nothing (a live run's reruns, read afresh, show with its next batch)."""
    version = (reads.view_version(store, runs, run), store.events_version(), store.probes_version())
    return reads.while_unchanged("findings_view", version, lambda: _findings(store, run, final, runs),
                                 str(store.path), int(run["run_id"]), final)


def _findings(store: Store, run: pd.Series, final: bool, runs: pd.DataFrame) -> FindingsRun:
    run_id = int(run["run_id"])
    # a live run's view refreshes without the page, so ``runs`` is as the page read it: its findings and reruns
    # read the table afresh, as they did before pages passed it (its fixes are offered only once it is final)
    judged = runs if final else None
    found = diagnose(store, run_id, judged)
    updates = reads.update_stats(store, run_id, final)
    outcomes = rerun_outcomes(store, run_id, found, judged)
    return FindingsRun(run, [card(run, final, runs, f) for f in found], outcomes, shadow(store, run_id, final),
                       None if updates.empty else update_shares(updates), *reruns_table(outcomes, found, runs))
