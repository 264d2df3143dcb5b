"""Anomaly-preserving retention: which steps' per-tensor statistics the Recorder stores, and why.

The Recorder hands here each step's gradient counts the rules read (non-finite values, FP16/BF16 underflow and
overflow at the loss scale; :mod:`mpdiag.numerics.gradstats`) with each completed step row: the full statistics
at the multiples of ``every``; between them (:meth:`Retention.holds`), on the CPU, only those counts, with a
copy of the gradients from which the full statistics are computed if the step is kept. A step's tensor rows
(histograms, counts, reductions) are kept when it is a multiple of ``every`` (reason ``every``) or when something happened at it or next to it:

* ``start``: the default retention (no ``--every`` given: ``every`` None) keeps every step below
  :data:`DENSE_START_STEPS` (a short diagnostic run is stored whole), then the multiples of :data:`THIN_EVERY`
  (reason ``every``) and the anomalies below; an explicit ``every`` (1 included) means exactly that from step 0;

* ``nonfinite``: a gradient holds inf/NaN, or the loss is inf/NaN, where the step before held none;
* ``skipped``: the optimizer step was skipped (the loss scaler backed off), the first of a streak;
* ``scale-change``: the loss scale after the step's update differs from the scale it ran at, the first of a streak;
* ``overflow``: a tensor's values that overflow FP16 or BF16 at the loss scale in use went from none to some for
  the first time in the run, or their share of the tensor rose by :data:`SHARE_JUMP` or more (and
  :data:`MIN_JUMP_VALUES` values) since the step before. A tensor at the edge of a format's range flickers between
  none and a few values: counting every return kept 17% of the steps of a synthetic 500-tensor run past its start
  (bench/store_scale.py), and each step's counts are in its signals anyway;
* ``underflow``: the share of a tensor's values that underflow FP16 or BF16 at that scale rose by :data:`SHARE_JUMP`
  or more (and :data:`MIN_JUMP_VALUES` values) since the step before;
* ``loss-spike``, ``grad-norm-spike``: the spike events of :mod:`mpdiag.recording.events` (their thresholds);
* ``before``, ``after``: the :data:`AROUND` step(s) before and after a step kept for one of the reasons above.

The counts the rules read are also stored for every step, kept or not (the store's step_signals, handed to the
writer by the Recorder), so a per-step line and the findings never depend on a dropped step's full statistics.

A step's neighbours are known one step later, so a step's statistics (or its held copy) are held on the host,
never converted into rows, until the next step's row and statistics have arrived; the Recorder
builds rows only for the steps :meth:`Retention.decide` returns. "Where the step before held none" makes a lasting
state (a diverged run's NaN at every step, a streak of skips) keep its first step, not all of them.

Owns the rules and their thresholds (quoted by docs/events.md); must not read tensors, build rows or write the store.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mpdiag.recording.events import GRAD_NORM_SPIKE, LOSS_SPIKE

START, EVERY, NONFINITE, SKIPPED, SCALE_CHANGE, OVERFLOW, UNDERFLOW, BEFORE, AFTER = (
    "start", "every", "nonfinite", "skipped", "scale-change", "overflow", "underflow", "before", "after")
#: the default retention (no --every given) keeps every step of a run's start whole: a short diagnostic run, and
#: the start of a long one, where most problems show ...
DENSE_START_STEPS = 1000
#: ... then every THIN_EVERY-th step (plus the anomalies and their neighbours), so that a 100,000-step x 500-tensor
#: run stays under 2 GB (bench/store_scale.py); the per-step signals (mpdiag.store step_signals) cover every step
THIN_EVERY = 50
#: an overflow or underflow share (of a tensor's values, in FP16 or BF16 at the loss scale in use) that rose by
#: this much (absolute: 0.01 is one percentage point) since the step before is a jump ...
SHARE_JUMP = 0.01
#: ... when at least this many more values moved there (one value of a 4-element bias is no jump)
MIN_JUMP_VALUES = 64
#: steps kept on each side of a step kept for an anomaly
AROUND = 1
#: the formats whose overflow and underflow shares are watched (FP8's underflow moves with every step); the light
#: pass of the steps between multiples counts these (mpdiag.numerics.formats.SIGNAL_FORMATS)
WATCHED_FORMATS = ("fp16", "bf16")

# StepRow fields, by position (as mpdiag.recording.events reads them)
_STEP, _LOSS, _SCALE, _SKIPPED, _SCALE_AFTER = 0, 1, 2, 3, 5


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


class Retention:
    """The retention of one run's steps. ``every``: the run's --every (None: the default, dense start then
    thinned). ``numel``: each recorded tensor's size, by tensor id. ``anomalies`` False keeps only the regular
    steps (:meth:`regular`; and then only those need statistics: :meth:`computes`)."""

    def __init__(self, every: int | None, numel: list[int], anomalies: bool = True) -> None:
        self.every, self.start = (THIN_EVERY, DENSE_START_STEPS) if every is None else (every, 0)
        self.anomalies = anomalies
        self._numel = np.maximum(np.asarray(numel, dtype=np.float64), 1.0)
        self._own: dict[int, set[str]] = {}  # the anomaly reasons found at a step, until its neighbours are decided
        self._held: dict[int, Any] = {}  # a step's statistics, until decided
        # the step before's state, for "where the step before held none" and the share jumps
        self._row_state = (False, False, False)  # non-finite loss, skipped, scale changed
        self._nonfinite_grads = False
        # NaN until a tensor's first statistics: a run's first step has no step before to jump from
        shape = (len(WATCHED_FORMATS), len(numel))
        self._overflow, self._underflow = np.full(shape, np.nan), np.full(shape, np.nan)
        self._overflowed = np.zeros(shape, dtype=bool)  # whether each tensor has overflowed yet

    def regular(self, step: int) -> bool:
        """Whether ``step`` is kept whatever happens: in the dense start, or a multiple of ``every``."""
        return step < self.start or step % self.every == 0

    def computes(self, step: int) -> bool:
        """Whether ``step``'s statistics are needed (every step, while anomalies are watched)."""
        return self.anomalies or self.regular(step)

    def holds(self, step: int) -> bool:
        """Whether ``step`` is kept only if something happens at it or next to it: its statistics may wait until
        :meth:`decide` keeps it (what :meth:`see_stats` reads is all the rules need before)."""
        return self.anomalies and not self.regular(step)

    def see_row(self, row, events: list[str]) -> None:
        """A completed step row (a StepRow or a tuple in its order) and the kinds of the events it raised."""
        if not self.anomalies:
            return
        scale, after = row[_SCALE], row[_SCALE_AFTER]
        state = (not _finite(row[_LOSS]), row[_SKIPPED] == 1, _finite(scale) and _finite(after) and scale != after)
        found = {reason for reason, now, before in zip((NONFINITE, SKIPPED, SCALE_CHANGE), state, self._row_state,
                                                        strict=True) if now and not before}
        found |= {kind for kind in events if kind in (LOSS_SPIKE, GRAD_NORM_SPIKE)}
        self._row_state = state
        self._add(row[_STEP], found)

    def see_stats(self, step: int, tensor_ids: np.ndarray, counts: dict[str, np.ndarray], held: Any) -> None:
        """``step``'s statistics: ``counts`` (StepGradStats.counts, rows ``tensor_ids``) for the rules, ``held``
        (what the caller builds rows from, should the step be kept) until :meth:`decide` returns it."""
        self._held[step] = held
        if not self.anomalies:
            return
        found = set()
        nonfinite = bool((counts["nan"] + counts["posinf"] + counts["neginf"]).any())
        if nonfinite and not self._nonfinite_grads:
            found.add(NONFINITE)
        self._nonfinite_grads = nonfinite
        size = self._numel[tensor_ids]
        for f, fmt in enumerate(WATCHED_FORMATS):
            over, under = counts[f"{fmt}_overflow_at_scale"], counts[f"{fmt}_underflow_at_scale"]
            over_share, under_share = over / size, under / size
            before_over, before_under = self._overflow[f, tensor_ids], self._underflow[f, tensor_ids]
            first = (over > 0) & (before_over == 0) & ~self._overflowed[f, tensor_ids]  # none before, never yet
            if (first | self._jumped(over_share - before_over, size)).any():
                found.add(OVERFLOW)
            self._overflowed[f, tensor_ids] |= over > 0
            if self._jumped(under_share - before_under, size).any():
                found.add(UNDERFLOW)
            self._overflow[f, tensor_ids], self._underflow[f, tensor_ids] = over_share, under_share
        self._add(step, found)

    @staticmethod
    def _jumped(rise: np.ndarray, size: np.ndarray) -> np.ndarray:
        return (rise >= SHARE_JUMP) & (rise * size >= MIN_JUMP_VALUES)

    def _add(self, step: int, found: set[str]) -> None:
        if found:
            self._own.setdefault(step, set()).update(found)

    def decide(self, through: int | None) -> list[tuple[int, Any, list[str]]]:
        """(step, held, reasons) of the held steps now decided and kept, in step order; the others are dropped.
        ``through``: the last step whose row and statistics have both arrived (a step is decided once the AROUND
        steps after it have); None: the run ended, decide every held step."""
        kept = []
        for step in sorted(s for s in self._held if through is None or s + AROUND <= through):
            held = self._held.pop(step)
            reasons = self.reasons(step)
            if reasons:
                kept.append((step, held, reasons))
        first = min(self._held, default=through)
        if first is not None:  # a step's reasons are needed until both its neighbours are decided
            self._own = {s: r for s, r in self._own.items() if s >= first - AROUND}
        return kept

    def reasons(self, step: int) -> list[str]:
        """Why ``step`` is kept, once its neighbours are known (empty: dropped)."""
        reasons = [START] if step < self.start else [EVERY] if step % self.every == 0 else []
        reasons += sorted(self._own.get(step, ()))
        if any(self._own.get(step + k) for k in range(1, AROUND + 1)):
            reasons.append(BEFORE)
        if any(self._own.get(step - k) for k in range(1, AROUND + 1)):
            reasons.append(AFTER)
        return reasons
