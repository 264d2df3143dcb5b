"""Events while training: the at-the-step signals a Recorder raises from the step rows it already completes.

This module owns the event rules (one small class per kind, all with the same two hooks: ``see(row)`` returns the
event the row raises or None; ``stops(stop_on)`` says whether ``--stop-on`` ends training on it), their thresholds
(module constants, quoted by docs/events.md), and :class:`EventLog`, which feeds each completed
:class:`~mpdiag.store.StepRow` to every rule in step order, keeps the events until the Recorder's next flush
hands them to the writer, announces each one (``watch`` prints a line to stderr) and says when ``--stop-on`` asks
the training to end.

The rules read only what a step row holds once complete (the loss, the scale and whether the optimizer step ran,
which arrive from the scaler's state at the next ``record``, and the unscaled gradient norm): they add no device
synchronisation, and a healthy step costs a few comparisons and one running mean and variance per spike rule.
Must not read tensors, the store, or decide how training ends (the runner and ``watch`` do).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpdiag.options import StopOn, scale_text

NONFINITE, SKIPS, SCALE_COLLAPSE, LOSS_SPIKE, GRAD_NORM_SPIKE = (
    "nonfinite", "skips", "scale-collapse", "loss-spike", "grad-norm-spike")
KINDS = (NONFINITE, SKIPS, SCALE_COLLAPSE, LOSS_SPIKE, GRAD_NORM_SPIKE)

#: skipped optimizer steps in a row that make a ``skips`` event (``--stop-on skips:N`` sets N instead); the same
#: streak the ``scale-collapse`` finding calls too long
SKIP_STREAK = 5
#: a dynamic scale below this after its update is a ``scale-collapse`` event (GradScaler starts at 2^16)
SCALE_FLOOR = 1.0
#: the spike rules: a value above mean + SPIKE_SIGMAS standard deviations of the last SPIKE_WINDOW finite values
#: (OLMo-core's rule), once at least SPIKE_MIN_VALUES are known, and at least SPIKE_MIN_RISE (relative) above
#: their mean, so a flat series' tiny noise is no spike
SPIKE_WINDOW = 128
SPIKE_SIGMAS = 6.0
SPIKE_MIN_VALUES = 32
SPIKE_MIN_RISE = 0.1
#: events of one kind stored per run at most; later ones are counted, not stored (a run that diverges for good
#: would otherwise raise a spike at every step)
MAX_PER_KIND = 20

# StepRow fields, by position (rows are plain tuples here: no attribute lookups on the step path)
_STEP, _LOSS, _SCALE, _SKIPPED, _SCALE_AFTER, _GRAD_NORM = 0, 1, 2, 3, 5, 10


@dataclass(frozen=True)
class Event:
    """One event: the step it happened at, its kind (one of :data:`KINDS`), and its evidence (JSON-able: the
    values the rule read and the rule itself, in words)."""

    step: int
    kind: str
    evidence: dict[str, Any]

    def line(self) -> str:
        """The event in one line, as ``watch`` prints it."""
        return f"mpdiag: event at step {self.step}: {self.kind}: {self.evidence.get('summary', '')}"

    def row(self) -> tuple:
        """(step, kind, evidence as JSON text, created_at) as the writer's ``add_events`` takes it."""
        return (self.step, self.kind, json.dumps(self.evidence), time.time())


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


class NonfiniteRule:
    """The first step whose loss is inf/NaN, or whose gradients are and were applied (the optimizer step ran:
    with a loss scaler, an overflowed step is skipped, which is the scaler doing its job, not this event). A loss
    that is NaN while the gradients are finite and no loss was ever finite is a loop that gives no loss (``watch``
    where no backward was seen), not an event. Once per run."""

    kind = NONFINITE

    def __init__(self, grads_read: bool = True) -> None:
        self.fired = False
        self.finite_loss_seen = False
        self.grads_read = grads_read  # False: this process reads no gradient norm (its rows hold NaN)

    def see(self, row) -> Event | None:
        if self.fired:
            return None
        loss, norm, skipped = row[_LOSS], row[_GRAD_NORM], row[_SKIPPED]
        loss_ok = _finite(loss)
        norm_ok = norm is not None and math.isfinite(norm)
        if loss_ok:
            self.finite_loss_seen = True
        bad_loss = not loss_ok and (self.finite_loss_seen or not norm_ok)
        bad_grads = self.grads_read and not norm_ok and norm is not None and skipped == 0
        if not (bad_loss or bad_grads):
            return None
        self.fired = True
        # an inf norm with no NaN: the gradients hold an inf, or finite values whose squares pass the norm's range
        # (a diverging BF16 run's 1e20s; a float64 model's 1e300s), which the row alone cannot tell apart
        what = ("loss" if bad_loss else "gradient norm (applied: the optimizer step ran; the gradients hold an inf, "
                "or values too large to square)" if norm is not None and math.isinf(norm) else
                "gradients (applied: the optimizer step ran)")
        return Event(row[_STEP], self.kind, {
            "summary": f"first non-finite {what}: loss {loss}, gradient norm {norm}",
            "loss": _json(loss), "grad_norm": _json(norm), "skipped": skipped, "scale": _json(row[_SCALE]),
            "rule": "the first step whose loss is inf/NaN, or whose inf/NaN gradients the optimizer applied"})

    def stops(self, stop_on: StopOn) -> bool:
        return stop_on.nonfinite


class SkipStreakRule:
    """``streak`` skipped optimizer steps in a row: an event at the step that makes the streak that long, again
    for a later streak once steps ran in between."""

    kind = SKIPS

    def __init__(self, streak: int = SKIP_STREAK) -> None:
        self.streak = streak
        self.run = 0

    def see(self, row) -> Event | None:
        if row[_SKIPPED] != 1:
            self.run = 0
            return None
        self.run += 1
        if self.run != self.streak:
            return None
        step = row[_STEP]
        return Event(step, self.kind, {
            # said when the streak reaches ``streak`` steps: it may go on (the run's finding counts the longest)
            "summary": f"{self.streak} optimizer steps skipped in a row (steps {step - self.streak + 1}-{step}, "
                       f"so far); scale now {scale_text(row[_SCALE_AFTER])}",
            "first_step": step - self.streak + 1, "streak": self.streak, "scale_after": _json(row[_SCALE_AFTER]),
            "rule": f"{self.streak} skipped optimizer steps in a row"})

    def stops(self, stop_on: StopOn) -> bool:
        return stop_on.skips is not None


class ScaleCollapseRule:
    """The first step after which the dynamic loss scale is below :data:`SCALE_FLOOR`. Once per run."""

    kind = SCALE_COLLAPSE

    def __init__(self) -> None:
        self.fired = False

    def see(self, row) -> Event | None:
        after = row[_SCALE_AFTER]
        if self.fired or after is None or not after < SCALE_FLOOR:
            return None
        self.fired = True
        return Event(row[_STEP], self.kind, {
            "summary": f"the loss scale fell to {scale_text(after)} (from {scale_text(row[_SCALE])} at this step)",
            "scale": _json(row[_SCALE]), "scale_after": _json(after), "skipped": row[_SKIPPED],
            "rule": f"the dynamic loss scale below {SCALE_FLOOR:g} after its update"})

    def stops(self, stop_on: StopOn) -> bool:
        return False


class SpikeRule:
    """A value (the loss, or the gradient norm) above mean + SPIKE_SIGMAS sigma of the last SPIKE_WINDOW finite
    values before it, with SPIKE_MIN_VALUES of them at least and SPIKE_MIN_RISE above their mean. One event per
    episode: a value above the rule right after one that was (the damaged weights' next step) raises none. Every
    finite value enters the window, the spike's too (a lasting level shift widens the window's spread and stops
    raising events). The window's sums are kept running: O(1) per step."""

    def __init__(self, kind: str, field: int, name: str) -> None:
        self.kind, self.field, self.name = kind, field, name
        self.window: deque[float] = deque()
        self.total = self.total_sq = 0.0
        self.pushed = 0
        self.above = False  # the previous finite value was above the rule: an episode is under way

    def see(self, row) -> Event | None:
        value = row[self.field]
        if value is None or not math.isfinite(value):
            return None
        event = None
        n = len(self.window)
        if n >= SPIKE_MIN_VALUES:
            mean = self.total / n
            sigma = math.sqrt(max(self.total_sq / n - mean * mean, 0.0))
            threshold = mean + SPIKE_SIGMAS * sigma
            above = value > threshold and value - mean > SPIKE_MIN_RISE * abs(mean)
            if above and not self.above:
                event = Event(row[_STEP], self.kind, {
                    "summary": f"{self.name} {value:.6g} above mean {mean:.6g} + {SPIKE_SIGMAS:g} sigma "
                               f"({sigma:.3g}) of the last {n} values",
                    "value": value, "mean": mean, "sigma": sigma, "threshold": threshold, "window": n,
                    "rule": f"above mean + {SPIKE_SIGMAS:g} sigma of the last {SPIKE_WINDOW} finite values"})
            self.above = above
        self._push(value)
        return event

    def _push(self, value: float) -> None:
        self.window.append(value)
        self.total += value
        self.total_sq += value * value
        if len(self.window) > SPIKE_WINDOW:
            old = self.window.popleft()
            self.total -= old
            self.total_sq -= old * old
        self.pushed += 1
        if self.pushed % SPIKE_WINDOW == 0:  # running sums drift: recomputed exactly once per window
            self.total = math.fsum(self.window)
            self.total_sq = math.fsum(v * v for v in self.window)

    def stops(self, stop_on: StopOn) -> bool:
        return stop_on.spike


def _json(value):
    """A float as JSON keeps it: NaN and inf as their names (JSON has no literal for them)."""
    if value is None or not isinstance(value, float) or math.isfinite(value):
        return value
    return str(value)


class EventLog:
    """Every rule over a run's completed step rows. ``stop_on`` (``--stop-on``) names the events that end the
    training: :attr:`stop_reason` is set at the first of them. ``announce`` is called with each event (``watch``:
    a line on stderr)."""

    def __init__(self, stop_on: StopOn | None = None, announce: Callable[[Event], None] | None = None,
                 grads_read: bool = True) -> None:
        self.stop_on = stop_on or StopOn()
        self.announce = announce
        self.grads_read = grads_read
        skips = self.stop_on.skips if self.stop_on.skips is not None else SKIP_STREAK
        self.rules = [NonfiniteRule(grads_read), SkipStreakRule(skips), ScaleCollapseRule(),
                      SpikeRule(LOSS_SPIKE, _LOSS, "loss"), SpikeRule(GRAD_NORM_SPIKE, _GRAD_NORM, "gradient norm")]
        self.pending: list[Event] = []  # raised, not yet handed to the writer
        self.counts: dict[str, int] = {}
        self.stop_reason: str | None = None
        self.stopped_at: int | None = None  # the step training stops at (recorded; its update not applied)

    def configure(self, stop_on: StopOn | str | None = None,
                  announce: Callable[[Event], None] | bool | None = None) -> None:
        """Set ``--stop-on`` (a StopOn, or its text) and the announcement (True: :func:`print_event`, a line on
        stderr) before the first step; the runner and ``watch`` call this on the Recorder they built."""
        if isinstance(stop_on, str):
            stop_on = StopOn.parse(stop_on)
        if announce is True:
            announce = print_event
        self.__init__(stop_on if stop_on is not None else self.stop_on, announce or self.announce, self.grads_read)

    def see(self, row) -> list[str]:
        """Feed one completed step row (a StepRow or a tuple in its order) to every rule; returns the kinds of the
        events it raised (stored or only counted), which the Recorder's retention keeps the step for."""
        raised = []
        for rule in self.rules:
            event = rule.see(row)
            if event is not None:
                self._raise(rule, event)
                raised.append(event.kind)
        return raised

    def _raise(self, rule, event: Event) -> None:
        count = self.counts[event.kind] = self.counts.get(event.kind, 0) + 1
        if count <= MAX_PER_KIND:
            self.pending.append(event)
            if self.announce is not None:
                self.announce(event)
        if self.stop_reason is None and rule.stops(self.stop_on):
            self.stop_reason = (f"--stop-on {self.stop_on.text}: {event.kind} at step {event.step}: "
                                f"{event.evidence['summary']}")

    def stop_at(self, step: int) -> None:
        """The training stops at ``step``, recorded but not stepped, once :attr:`stop_reason` is set: the reason
        says so, since the event's step (a step row completes at the next record, on a GPU possibly later) is
        earlier than the last step the run shows."""
        if self.stop_reason is not None and self.stopped_at is None:
            self.stopped_at = step
            self.stop_reason += f"; training stopped at step {step} (recorded, its update not applied)"

    def take(self) -> list[tuple]:
        """The events raised since the last call, as the writer's rows."""
        events, self.pending = self.pending, []
        return [event.row() for event in events]


def print_event(event: Event) -> None:
    """Announce ``event`` in one line on stderr (``mpdiag watch`` and ``mpdiag run``)."""
    print(event.line(), file=sys.stderr, flush=True)
