"""The Modules page's view-model: what pages/7_Modules.py shows of a --trace-modules run (every module's
magnitudes per step as a heatmap, where the first inf/NaN appeared, one module's lines, the table), as typed values
built from the cached reads (reads.py) and mpdiag.analysis.module_trace. No widgets and no drawing here, so every
part is testable without Streamlit. Texts are unescaped: the page passes them through ``plain`` (module names
are the user's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from mpdiag.analysis import module_trace
from mpdiag.analysis.findings import SPIKE_TRIGGER
from mpdiag.analysis.module_trace import module_said
from mpdiag.dashboard import reads
from mpdiag.recording.spike_rule import SPIKE_FACTOR, call_rises
from mpdiag.store import Store

#: the replay strip's states, as the chart colours them
REPLAY_STATES = ("finite", "above FP16's max", "inf/NaN", "first offender")


@dataclass(frozen=True)
class ReplayStrip:
    """The replay of the run's first non-finite step (mpdiag.recording.replay): ``rows`` every module call,
    forward then backward, each in execution order (``pos`` along the strip), with its ``state`` (one of
    :data:`REPLAY_STATES`); the first offender, its phase, and whether the replay reproduced the event;
    ``spike``: the replay of a loss spike (forward only, beside the previous step's batch), ``note`` what it found."""
    step: int
    rows: pd.DataFrame
    first_module: str | None
    first_phase: str | None
    reproduced: bool
    spike: bool = False
    note: str | None = None
    #: a loss spike's replay: per forward call (``pos`` as in ``rows``), how many times its output's and its inputs'
    #: absmax were the same call's on the previous step's batch (``out_rise``, ``in_rise``; NaN: not comparable);
    #: ``offender``: it meets the spike rule, ``first``: it is the first offender the replay names
    rises: pd.DataFrame | None = None

    def said(self) -> str:
        if self.spike:
            return (f"Step {self.step}'s loss spike replayed module by module, forward only ({len(self.rows):,} calls), "
                    f"and step {self.step - 1}'s batch on the same copy: {self.note or 'nothing was found'}.")
        where = (f"the first offender is {module_said(self.first_module)} ({self.first_phase})" if self.first_module
                 else "no module's output or gradient went inf/NaN")
        verdict = ("reproduced the event: numerics" if self.reproduced else
                   "did not reproduce it: non-determinism, hardware, or outside the model")
        phases = ("the forward then the backward" if (self.rows["phase"] == "backward").any() else
                  "the forward only: it went bad there, so the backward was not replayed")
        return f"Step {self.step} replayed module by module ({len(self.rows):,} calls, {phases}): {where}; the replay {verdict}."

    def undrawn_said(self) -> str:
        """A spike replay's forward calls its chart leaves out, and why ("" when it draws every one): calls only
        the spike step's batch made (data-dependent control flow: nothing to compare them with), and calls whose
        rise is not a finite positive number (an output of 0, or no floating-point output)."""
        if self.rises is None:
            return ""
        only = self.rises[self.rises["absmax_before"].isna()]
        rise = self.rises["out_rise"].astype(float)
        other = self.rises[self.rises["absmax_before"].notna() & ~(np.isfinite(rise) & (rise > 0))]
        said = []
        if len(only):
            said.append(f"{_calls(len(only))} ran only on step {self.step}'s batch, not on step {self.step - 1}'s, "
                        f"so {'it has' if len(only) == 1 else 'they have'} no rise to draw: {_names(only['call'])}")
        if len(other):
            said.append(f"{_calls(len(other))} with no finite rise (an output of 0, or none in floating point) "
                        f"{'is' if len(other) == 1 else 'are'} not drawn: {_names(other['call'])}")
        return "; ".join(said) + "." if said else ""


def _calls(n: int) -> str:
    return f"{n:,} call" + ("" if n == 1 else "s")


def _names(calls: pd.Series, most: int = 8) -> str:
    """At most ``most`` call names, and how many more."""
    names = list(calls)
    return ", ".join(names[:most]) + (f" and {len(names) - most:,} more" if len(names) > most else "")


def call_names(rows: pd.DataFrame) -> pd.Series:
    """Each module call's name as the replay shows it: "module (Type)", and where the module ran more than once in
    its phase (a shared activation), which of its calls: "act (GELU), call 7 of 12"."""
    named = rows["module"] + " (" + rows["type"] + ")"
    by = [rows["phase"], rows["module"]]
    nth = rows.groupby(by, sort=False).cumcount() + 1
    calls = rows.groupby(by, sort=False)["module"].transform("size")
    return named.where(calls <= 1, named + ", call " + nth.astype(str) + " of " + calls.astype(str))


def replay_strip(replays: pd.DataFrame, modules: pd.DataFrame, step: int | None = None) -> ReplayStrip | None:
    """The strip of the run's replayed step ``step`` (a link's ``?replay=``), else of its first replayed step;
    None when no step was replayed."""
    if replays.empty:
        return None
    named = replays[replays["step"] == step]
    replay = named.iloc[0] if len(named) else replays.iloc[0]
    step = int(replay["step"])
    limit = replay["format_max"] if pd.notna(replay["format_max"]) else None
    rows = modules[modules["step"] == step].reset_index(drop=True)
    rows = rows.assign(pos=range(len(rows)), call=call_names(rows))
    above = rows["absmax"].gt(limit) if limit is not None else pd.Series(False, index=rows.index)
    state = pd.Series("finite", index=rows.index)
    state[above.fillna(False)] = REPLAY_STATES[1]
    state[rows["nonfinite"] > 0] = REPLAY_STATES[2]
    first = replay["first_module"] if isinstance(replay["first_module"], str) else None
    phase = replay["first_phase"] if isinstance(replay["first_phase"], str) else None
    hit = rows.index[(rows["module"] == first) & (rows["phase"] == phase)]
    if len(hit):
        state[hit[0]] = REPLAY_STATES[3]
    spike = replay["trigger"] == SPIKE_TRIGGER
    return ReplayStrip(step, rows.assign(state=state), first, phase, bool(replay["reproduced"]), spike,
                       replay["note"] if isinstance(replay["note"], str) else None,
                       _rises(rows, modules[modules["step"] == step - 1], first) if spike else None)


def _rises(rows: pd.DataFrame, previous: pd.DataFrame, first: str | None) -> pd.DataFrame:
    """A spike replay's forward calls (``rows``) against the previous batch's (``previous``), matched as the spike
    rule matched them (:func:`mpdiag.recording.spike_rule.call_rises`); ``offender``: the rule's threshold is met;
    ``first``: the first call of module ``first`` (the replay's first offender) that meets it, the one the rule
    named (the modules holding it, or after it, that also meet it are not)."""
    forward, before = rows[rows["phase"] == "forward"], previous[previous["phase"] == "forward"].sort_values("ord")
    rises = call_rises(list(before[["module", "absmax", "in_absmax"]].itertuples(index=False)),
                       list(forward[["module", "absmax", "in_absmax"]].itertuples(index=False)))
    table = pd.DataFrame(rises, columns=["module", "absmax", "absmax_before", "in_absmax", "in_absmax_before",
                                         "out_rise", "in_rise"]).astype({"out_rise": float, "in_rise": float})
    table.insert(0, "pos", forward["pos"].to_numpy())
    table.insert(1, "call", forward["call"].to_numpy())
    offender = (table["out_rise"] >= SPIKE_FACTOR) & ~(table["in_rise"] >= SPIKE_FACTOR)
    named = offender & (table["module"] == first)
    return table.assign(offender=offender, first=named & (named.cumsum() == 1))


@dataclass(frozen=True)
class ModulesRun:
    """A run's module trace (empty: none recorded), in forward order, the heatmap's merged cells, the module
    offered first (the first to go inf/NaN, else the first in forward order) and each module's type."""
    modules: pd.DataFrame
    order: list[str]
    cells: pd.DataFrame | None
    width: int | None
    default: str | None
    types: dict[str, str]
    magnitudes: pd.DataFrame | None
    #: the replay of the run's first non-finite step, traced or not (None: none)
    replay: ReplayStrip | None = None

    def said(self, shown: str) -> str:
        """How much was traced and where the first inf/NaN appeared, unless ``shown`` (the findings said at the
        page's top) already says it."""
        located = module_trace.first_nonfinite(self.modules).strip()
        where = "" if located and located in shown else (located or "Every forward output and gradient stayed finite.")
        first = int(self.modules["step"].min())
        # under watch the Recorder starts at the first optimizer step, after step 0's forward ran untraced
        began = f" from step {first:,} (the steps before it ran before the trace began)" if first > 0 else ""
        return (f"{self.modules['module'].nunique():,} modules traced over {self.modules['step'].nunique():,} "
                f"steps{began}. " + where)

    def drawable(self, module: str) -> bool:
        return module_trace.drawable_magnitudes(self.magnitudes, module)

    @property
    def table(self) -> pd.DataFrame:
        return module_trace.module_table(self.modules)


def modules(store: Store, run: pd.Series, final: bool, replay_step: int | None = None) -> ModulesRun:
    """The Modules page's view of ``run``, its replay strip that of ``replay_step`` where it was replayed."""
    traced = reads.module_stats(store, int(run["run_id"]), final)
    replay = replay_strip(*reads.replay(store, int(run["run_id"]), final), step=replay_step)
    if traced.empty:
        return ModulesRun(traced, [], None, None, None, {}, None, replay)
    order = module_trace.module_order(traced)
    magnitudes = module_trace.magnitude_cells(traced)
    cells, width = module_trace.merge_steps(magnitudes)
    first = module_trace.first_nonfinite_modules(traced)
    return ModulesRun(traced, order, cells, width, next(iter(first.values()))["module"] if first else order[0],
                      dict(zip(traced["module"], traced["type"], strict=True)), magnitudes, replay)
