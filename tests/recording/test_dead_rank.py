"""Rank 0's naming of a dead rank's step (mpdiag/recording/distributed.py), without a job: the exchange of a
step's losses is played by a thread holding the lock rank 0 holds through it. The jobs themselves, killed under
torchrun: tests/e2e/test_distributed.py."""

from __future__ import annotations

import threading

from mpdiag.recording import distributed
from mpdiag.recording.distributed import RankContext


def _exchange_in_flight(context: RankContext, step: int | None) -> tuple[threading.Event, threading.Event]:
    """A thread in ``context``'s exchange of the step after its last: it ends, noting ``step``, once told to
    (None: it stays blocked, as one a dead peer never joined). Returns (entered, finish)."""
    entered, finish = threading.Event(), threading.Event()

    def exchange():
        with context._exchanging:
            entered.set()
            finish.wait(10)
            if step is not None:
                context.last_exchanged = step

    threading.Thread(target=exchange, daemon=True).start()
    entered.wait(10)
    return entered, finish


def test_a_rank_that_finished_an_exchange_rank_0_is_still_in_died_at_the_step_after_it():
    """The dead rank had sent step 1's loss and died as step 2 began, while rank 0 was still in step 1's exchange:
    the naming waits for that exchange to end and names step 2 (CI named step 1, rank 0's last step noted)."""
    context = RankContext(last_exchanged=0)
    _, finish = _exchange_in_flight(context, step=1)
    threading.Timer(0.1, finish.set).start()
    assert context._unfinished_step() == 2


def test_an_exchange_the_dead_rank_never_joined_is_the_step_named(monkeypatch):
    """Rank 0 blocked in the exchange of step 2, which its dead peer never joined: after EXCHANGE_WAIT_S the naming
    names step 2, the step that exchange was for, without waiting for the collective to fail."""
    monkeypatch.setattr(distributed, "EXCHANGE_WAIT_S", 0.05)
    context = RankContext(last_exchanged=1)
    _, finish = _exchange_in_flight(context, step=None)
    try:
        assert context._unfinished_step() == 2
    finally:
        finish.set()


def test_between_exchanges_the_step_is_the_one_after_the_last():
    assert RankContext(last_exchanged=4)._unfinished_step() == 5
