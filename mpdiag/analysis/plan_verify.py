"""Verifying a precision plan: rerun the run's script with the plan (``fp8-sim`` with ``--fp8-modules``, a recipe
per Linear) beside its FP32 reference, judge whether the loss tracks FP32, and when it does not, promote one
Linear to BF16 and rerun, at most :data:`mpdiag.analysis.plan.MAX_ROUNDS` rounds.

Owns only the loop of rounds; the plan, the tracking rule and the promotion rule are
:mod:`mpdiag.analysis.plan`'s. Each round is a normal rerun of the source run (:func:`mpdiag.training.runner.rerun`:
linked to it as its parent, visible on Compare, with its own findings); the FP32 reference is the run itself
when it is O0, else the reference Compare would pick (:func:`mpdiag.analysis.compare.reference_run`), else an O0
rerun made here. Nothing about the verification is stored besides those runs: the Plan page derives the rounds
from the source's reruns that carry ``--fp8-modules``. The runner (and torch) is imported when a round runs, so
the dashboard can read :data:`ROUND_LABEL` without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpdiag.analysis.compare import reference_run
from mpdiag.analysis.plan import MAX_ROUNDS, Plan, next_promotion, plan_run, tracks
from mpdiag.options import RERUN_MARK
from mpdiag.store import Store

if TYPE_CHECKING:
    from mpdiag.training.runner import ProgressFn

#: how a verify round's run is named, after its source's name (the Plan page reads the round from it)
ROUND_LABEL = "plan round"


@dataclass
class Round:
    """One verify round: its run, the plan it ran, whether it tracked FP32 and the words of the judgement."""

    run_id: int
    plan: Plan
    tracked: bool
    rel_diff: float
    said: str
    promoted: str | None = None  # the Linear this round's failure promoted for the next


def fp32_reference(store: Store, run_id: int, progress: ProgressFn | None = None) -> int:
    """The FP32 run a plan of ``run_id`` is judged against: itself at O0, else Compare's reference, else a new
    O0 rerun of it (without FP8 statistics)."""
    run = store.run(run_id)
    if run["opt_level"] == "O0":
        return int(run_id)
    found = reference_run(store.runs(), int(run_id))
    if found is not None:
        return found
    from mpdiag.training.runner import rerun

    return rerun(store.path, run_id, progress=progress, opt_level="O0", fp8=False)


def verify(store_path: str | os.PathLike, run_id: int, rounds: int = MAX_ROUNDS,
           progress: ProgressFn | None = None) -> tuple[int, list[Round]]:
    """(FP32 reference id, the rounds run) of verifying ``run_id``'s plan: each round reruns the source at
    fp8-sim with the plan's recipe per Linear and no FP8 statistics, for the source's steps and seed."""
    from mpdiag.training.runner import rerun

    store = Store(store_path, create=False)
    plan = plan_run(store, run_id)
    reference = fp32_reference(store, run_id, progress)
    name = str(store.run(run_id)["name"]).split(RERUN_MARK)[0]
    done: list[Round] = []
    for number in range(1, rounds + 1):
        new = rerun(store.path, run_id, progress=progress, opt_level="fp8-sim", fp8=False, fp8_recipe="delayed",
                    fp8_bf16_modules="", fp8_modules=plan.module_flag(),
                    name=f"{name}{RERUN_MARK}{ROUND_LABEL} {number}")
        tracked, rel, said = tracks(store.steps(reference), store.steps(new))
        done.append(Round(new, plan, tracked, rel, said))
        if tracked:
            break
        layer = next_promotion(plan)
        if layer is None:
            break
        done[-1].promoted = layer
        plan = plan.promoted(layer)
    return reference, done
