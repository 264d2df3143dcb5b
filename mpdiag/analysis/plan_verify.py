"""Verifying a precision plan: rerun the run's script with the plan as planned (:meth:`Plan.rerun_options
<mpdiag.analysis.plan.Plan.rerun_options>`: ``fp8-sim``, or ``fp8-sim-fp16`` with a GradScaler from the planned
loss scale, a recipe per Linear, the moments held in their planned format) beside its FP32 reference, judge
whether the loss tracks FP32, and when it does not, promote one Linear to BF16 and rerun, at most
:data:`mpdiag.analysis.plan.MAX_ROUNDS` rounds.

Owns the loop of rounds, each round's options and its predicted-against-measured row; the plan, the tracking
rule and the promotion rule are :mod:`mpdiag.analysis.plan`'s. Each round is a normal rerun of the source run
(linked to it as its parent, visible on Compare, with its own findings), run by the caller's ``rerun``: in this
process (:func:`mpdiag.training.runner.rerun`, the command line) or as a supervised child (the Plan page's
background verification, :mod:`mpdiag.dashboard.verify_job`). The FP32 reference is the run itself when it is
O0, else the reference Compare would pick (:func:`mpdiag.analysis.compare.reference_run`), else an O0 rerun made
first. Nothing about the verification is stored besides those runs: the Plan page derives the rounds from the
source's reruns that carry ``--fp8-modules``. The runner (and torch) is imported only when a round runs in this
process, so the dashboard can use this module without it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpdiag.analysis.compare import reference_run
from mpdiag.analysis.plan import LABELS, MAX_ROUNDS, TRACK_RTOL, Plan, as_ran, next_promotion, plan_run, tracks
from mpdiag.options import RERUN_MARK
from mpdiag.store import Store

if TYPE_CHECKING:
    from mpdiag.training.runner import ProgressFn

#: how a verify round's run is named, after its source's name (the Plan page reads the round from it)
ROUND_LABEL = "plan round"
#: ``rerun(source run id, run options) -> the new run's id``: how a round (or the FP32 reference) is run
RerunFn = Callable[[int, dict], int]
#: why the bytes a plan saves are predicted only: the simulation does not hold its weights in their formats
BYTES_UNMEASURED = ("predicted only: fp8-sim keeps FP32 weights and masters and computes each GEMM in FP32 from "
                    "quantized operands, so a round's memory and GEMM bytes are not the plan's")
MB = 1e6  # the unit of the bytes the rounds and the Plan page show


@dataclass
class Round:
    """One verify round: its run, the plan it ran, whether it tracked FP32 and the words of the judgement."""

    run_id: int
    plan: Plan
    tracked: bool
    rel_diff: float
    said: str
    promoted: str | None = None  # the Linear this round's failure promoted for the next


#: the FP32 reference's options, when one has to be run first
REFERENCE_OPTIONS = {"opt_level": "O0", "fp8": False}


def round_options(plan: Plan, source_name: str, number: int) -> dict:
    """The rerun options of verify round ``number`` of ``plan``: the plan as planned, without FP8 statistics or
    another recipe option of the source's, named ``SOURCE ↻ plan round N``."""
    base = source_name.split(RERUN_MARK)[0]
    return {"fp8": False, "fp8_recipe": "delayed", "fp8_bf16_modules": "", **plan.rerun_options(),
            "name": f"{base}{RERUN_MARK}{ROUND_LABEL} {number}"}


def round_row(number: int, run_id: int, plan: Plan, rel: float, said: str) -> dict:
    """A round as the Plan page's table and ``mpdiag plan --verify`` show it: what the plan predicted (the loss
    tracks FP32 within TRACK_RTOL; the MB its 16Ψ and GEMM accounts save against FP32) against what was measured
    (the loss difference; the bytes are predicted only, BYTES_UNMEASURED), what the round ran and the verdict."""
    memory, gemm = plan.memory.get("bytes", {}), plan.gemm
    return {"round": number, "run": int(run_id),
            "loss predicted": f"tracks FP32 within {TRACK_RTOL:.0%}", "loss measured": rel,
            "memory saved (MB)": (memory.get("fp32", 0.0) - memory.get("plan", 0.0)) / MB,
            "GEMM saved per step (MB)": (gemm.get("fp32", 0.0) - gemm.get("plan", 0.0)) / MB,
            "bytes measured": "no: predicted only", "ran": describe_options(plan), "verdict": said}


def round_lines(row: dict, promoted: str | None) -> list[str]:
    """A :func:`round_row` in words, a line for each of: the verdict (and the Linear it promoted for the next
    round), what ran, what was predicted, what was measured."""
    then = f"; promoted {promoted} to BF16 for the next round" if promoted else ""
    rel = row["loss measured"]
    measured = f"{rel:.2%} from FP32's" if math.isfinite(rel) else "not compared (the verdict says why)"
    return [f"round {row['round']}: run {row['run']} {row['verdict']}{then}", f"ran: {row['ran']}",
            f"predicted: the loss {row['loss predicted']}; saves {row['memory saved (MB)']:,.3f} MB of model state "
            f"(16Ψ) and {row['GEMM saved per step (MB)']:,.3f} MB of GEMM operands per step against FP32",
            f"measured: the loss {measured}; the bytes {BYTES_UNMEASURED}"]


def describe_options(plan: Plan) -> str:
    """What a round runs, in words: the run's precision and loss scale, the Linears per choice, the moments."""
    scale = plan.loss_scale_log2
    run = LABELS[plan.run_precision] + (f", loss scale from 2^{scale}" if scale is not None else "")
    counts: dict[str, int] = {}
    for layer in plan.layers:
        counts[LABELS[layer.choice]] = counts.get(LABELS[layer.choice], 0) + 1
    moments = plan.rerun_options()["moment_format"]
    return (f"run {run}; Linears: {', '.join(f'{n} {label}' for label, n in counts.items())}; moments "
            f"{LABELS[moments] if moments else 'as kept'}")


def fp32_reference(store: Store, run_id: int, rerun: RerunFn) -> int:
    """The FP32 run a plan of ``run_id`` is judged against: itself at O0, else Compare's reference, else a new
    O0 rerun of it (without FP8 statistics)."""
    run = store.run(run_id)
    if run["opt_level"] == "O0":
        return int(run_id)
    found = reference_run(store.runs(), int(run_id))
    if found is not None:
        return found
    return rerun(int(run_id), dict(REFERENCE_OPTIONS))


def in_process(store_path: str | os.PathLike, progress: ProgressFn | None = None) -> RerunFn:
    """A RerunFn that trains each rerun in this process (the command line)."""
    from mpdiag.training.runner import rerun

    return lambda run_id, options: rerun(store_path, run_id, progress=progress, **options)


def verify(store_path: str | os.PathLike, run_id: int, rounds: int = MAX_ROUNDS,
           progress: ProgressFn | None = None, rerun: RerunFn | None = None, first: int = 1,
           first_modules: str = "") -> tuple[int, list[Round]]:
    """(FP32 reference id, the rounds run) of verifying ``run_id``'s plan: each round reruns the source with the
    plan as planned (:func:`round_options`), for the source's steps and seed, through ``rerun`` (default: in
    this process). ``first``: the number of the first round to run, where earlier ones were run before (the Plan
    page goes on from the rounds it found), whose plan ran ``first_modules`` (its promotions: :func:`as_ran`);
    rounds up to ``rounds`` in all."""
    store = Store(store_path, create=False)
    rerun = rerun or in_process(store.path, progress)
    plan = as_ran(plan_run(store, run_id), first_modules)
    reference = fp32_reference(store, run_id, rerun)
    name = str(store.run(run_id)["name"])
    done: list[Round] = []
    for number in range(first, rounds + 1):
        new = rerun(int(run_id), round_options(plan, name, number))
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
