"""A loss spike's replay rule over module calls: which forward call's output rose :data:`SPIKE_FACTOR` times the same
call's on the previous step's batch while its inputs rose less (see :mod:`mpdiag.recording.replay`, which replays
the two forwards and applies it). Owns the rule, its threshold and how calls of two forwards are matched; pure
Python over the stored numbers, without torch, so the Modules page draws the rises the rule read.
"""

from __future__ import annotations

import math

#: a replay's first offender named for what came in: the batch (forward), the loss's gradient (backward)
INPUTS, LOSS = "(inputs)", "(loss)"
#: a loss spike's first offender: the first module call whose output absmax is at least this many times the same
#: call's on the previous step's batch, replayed on the same copy, while what it received rose less than that
SPIKE_FACTOR = 10.0


def ratio(now: float, before: float) -> float:
    """How many times ``before`` ``now`` is; NaN where either is unknown (no floating-point tensor)."""
    if math.isnan(now) or math.isnan(before):
        return math.nan
    return now / before if before > 0 else (math.inf if now > 0 else 1.0)


def call_rises(previous: list[tuple[str, float, float]], current: list[tuple[str, float, float]]) -> list[tuple]:
    """Each call of ``current`` (module name, output absmax, inputs' absmax; completion order) matched with the same
    call on the previous batch (the same module's how-manieth call): (name, absmax, absmax before, inputs' absmax,
    theirs before, output rise, inputs' rise), rises by :func:`ratio`; for a call the previous batch did not make
    (data-dependent control flow) the values before are None and the rises NaN. The spike rule reads these, and
    the Modules page draws them."""
    seen: dict[str, int] = {}
    before = {}
    for name, absmax, in_absmax in previous:
        seen[name] = seen.get(name, 0) + 1
        before[(name, seen[name])] = (absmax, in_absmax)
    seen.clear()
    rises = []
    for name, absmax, in_absmax in current:
        seen[name] = seen.get(name, 0) + 1
        out_before, in_before = before.get((name, seen[name]), (None, None))
        matched = out_before is not None
        rises.append((name, absmax, out_before, in_absmax, in_before,
                      ratio(absmax, out_before) if matched else math.nan,
                      ratio(in_absmax, in_before) if matched else math.nan))
    return rises


def spike_offender(step: int, previous: list[tuple], current: list[tuple], batch_before: float,
                    batch_now: float) -> tuple[str | None, str]:
    """A loss spike's first offender and what was found, in words: ``(inputs)`` when the batch's floating-point
    tensors' absmax is :data:`SPIKE_FACTOR` times the previous step's; else the first module call, in completion
    order, whose output absmax is that many times the same call's on the previous batch (:func:`call_rises`) while
    its inputs' rose less (a batch of integer ids has no magnitude: its embedding is the first module whose inputs
    did not rise); else None, with the largest rise seen."""
    batch = ratio(batch_now, batch_before)
    if batch >= SPIKE_FACTOR:
        return INPUTS, (f"the batch at step {step} was already {batch:.3g}x larger than the step before (absmax "
                        f"{batch_now:.4g} against {batch_before:.4g}), before any module ran")
    # a batch of integer ids has no magnitude: its ratio is unknown, and not said
    batch_said = "" if math.isnan(batch) else f"the batch was {batch:.3g}x"
    largest = (None, math.nan)
    for name, absmax, out_before, _, _, out, inp in call_rises([(r[0], r[2], r[4]) for r in previous],
                                                                [(r[0], r[2], r[4]) for r in current]):
        if out_before is None:
            continue  # a call the previous batch did not make
        if out >= SPIKE_FACTOR and not inp >= SPIKE_FACTOR:
            received = "" if math.isnan(inp) else f" while its inputs were {inp:.3g}x"
            return name, (f"{name}'s output at step {step} was {out:.3g}x its output on step {step - 1}'s batch "
                          f"(absmax {absmax:.4g} against {out_before:.4g}){received}"
                          + (f"; {batch_said}" if batch_said else ""))
        if not out <= largest[1]:
            largest = (name, out)
    seen_said = "; ".join(([f"largest rise: module '{largest[0]}', {largest[1]:.3g}x"] if largest[0] is not None else [])
                          + ([batch_said] if batch_said else []))
    return None, (f"no module's output was {SPIKE_FACTOR:g}x its output on step {step - 1}'s batch while its inputs "
                  f"rose less{f' ({seen_said})' if seen_said else ''}")
