"""The Plan page's view-model: what pages/8_Plan.py shows of a run's precision plan (mpdiag.analysis.plan): the
per-Linear table with its evidence and savings, the run's and the moments' choices, the predicted bytes, the
config to take, and the verify rounds found among the run's reruns (each against the FP32 reference: predicted
against measured, the loss curves overlaid), and what one click verifies next (every remaining round, in the
background: mpdiag.dashboard.verify_job). No widgets and no drawing here.
Texts are unescaped: the page passes them through ``plain`` or shows them as code (Linear names are the user's).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from mpdiag.analysis.compare import reference_run
from mpdiag.analysis.findings import fix_not_rerunnable, fp8_record_again
from mpdiag.analysis.plan import (
    LABELS,
    MAX_ROUNDS,
    Plan,
    after_round,
    as_ran,
    plan_run,
    tracks,
)
from mpdiag.analysis.plan_verify import BYTES_UNMEASURED as BYTES_UNMEASURED  # the page's table says it
from mpdiag.analysis.plan_verify import MB, round_lines, round_options, round_row
from mpdiag.analysis.summaries import run_progress
from mpdiag.dashboard import reads
from mpdiag.dashboard.tables import RUN_PX, Column
from mpdiag.options import FP8_SIM_LEVELS
from mpdiag.store import Store

#: the rerun that records what a plan is made from: FP8 statistics under every recipe a Linear can be planned in, at
#: O0 (as docs/plan.md records a run: its own FP32 reference, and any level's run, fp8-sim's too, can rerun at it)
RECORD_EVERY_RECIPE = {"opt_level": "O0", "fp8": True, "fp8_recipe": "both", "fp8_blocks": "mxfp8,nvfp4"}


@dataclass(frozen=True)
class VerifyView:
    """The Verify section: the rounds found among the run's reruns against the FP32 reference, and what one click
    runs next (the whole verification from round ``next_round``, whose plan runs ``next_modules``, after an FP32
    reference when there is none); ``next_options`` None when the plan is verified, the rounds are spent or a
    round is still going, or when mpdiag cannot rerun the run (``refused`` says why: a watched run, a Recorder's)."""

    rounds: pd.DataFrame  # one row per verify round found: predicted against measured
    said: list[str]  # each round in words: verdict and promotion, what ran, predicted, measured
    curves: pd.DataFrame  # run (label), step, loss: the FP32 reference and every round
    domain: list[str]
    reference_id: int | None
    next_options: dict | None  # the first rerun's options, as the confirmation names them
    next_what: str
    next_round: int | None = None
    next_modules: str = ""
    verified: bool = False  # the last round finished and tracks FP32
    #: the round still queued or running, in words (its number, run and step), with the share of its steps done
    going: str = ""
    fraction: float | None = None
    refused: str | None = None


@dataclass(frozen=True)
class PlanView:
    """A run's plan as the page shows it; ``plan`` None with ``missing`` saying why (no FP8 statistics),
    ``record_options`` the rerun that records what the plan needs and ``record_refused`` why mpdiag cannot start it
    (a run from the user's own loop, a watched run), else None."""

    plan: Plan | None
    missing: str | None
    table: pd.DataFrame
    memory: pd.DataFrame  # configuration, MB: the 16Ψ account
    gemm: pd.DataFrame  # configuration, MB: one step's Linear GEMM operands
    verify: VerifyView | None
    record_options: dict | None = None
    record_refused: str | None = None

    @property
    def evidence_expanded(self) -> bool:
        """Each Linear's evidence shows open under the table for a few Linears (folded for many: a page of them)."""
        return len(self.table) <= EVIDENCE_OPEN_LINEARS

    def evidence_lines(self) -> list[str]:
        """Each Linear's choice with its evidence and the cheaper choices rejected, a sentence each (the table's
        cells cut them at 1,280 px: they are said here, not in the table)."""
        return [f"{row['layer']}: {row['choice']}. {row['evidence'].rstrip('.')}."
                + (f" Rejected: {row['rejected']}." if row.get("rejected") else "")
                for row in self.table.to_dict("records")]

    def run_said(self) -> str:
        plan = self.plan
        scale = f", dynamic loss scaling from 2^{plan.loss_scale_log2}" if plan.loss_scale_log2 is not None else ""
        return f"Run: {LABELS[plan.run_precision]}{scale}. Evidence: {plan.run_evidence}."

    def moments_said(self) -> str:
        plan = self.plan
        fmt = LABELS[plan.moment_format] if plan.moment_format else "no format to choose"
        return f"Optimizer moments: {fmt}. Evidence: {plan.moment_evidence}."


#: the Linears' table at 1,280 px: the choice and its savings; its evidence, sentences too long for a cell, is
#: said beneath it (PlanView.evidence_lines), open for up to this many Linears
EVIDENCE_OPEN_LINEARS = 8
LINEAR_COLUMNS = {
    "layer": Column(width=220, help="The Linear, as the model names it (hover a cell for a long name)."),
    "choice": Column(width=150, help="The cheapest precision whose evidence holds; why: beneath the table."),
    "memory saved (bytes)": Column("memory saved (bytes)", width=170, kind="number", format="%,d",
                                   help="Model state against FP32, by the 16Ψ account."),
    "GEMM bytes saved per step": Column("GEMM saved per step (bytes)", width=200, kind="number", format="%,d",
                                        help="Linear GEMM operand bytes against FP32."),
}
#: the verify rounds' table at 1,280 px: what each round measured beside what the plan saves; what it ran, what was
#: predicted and the verdict in full are the sentences beneath it (VerifyView.said)
ROUND_COLUMNS = {
    "round": Column(width=60, kind="number"),
    "run": Column(width=RUN_PX, kind="number"),
    "status": Column(width=75),
    "loss measured": Column("loss vs FP32", width=100, kind="number", format="percent",
                            help="Measured: the mean loss over the last quarter of the steps, relative to the FP32 "
                                 "reference's. The plan predicts it tracks FP32 (the sentence beneath says within "
                                 "how much)."),
    "memory saved (MB)": Column("memory saved", width=110, kind="number", format="%.3f MB",
                                help=f"Predicted: model state against FP32, by the 16Ψ account; {BYTES_UNMEASURED}."),
    "GEMM saved per step (MB)": Column("GEMM saved/step", width=125, kind="number", format="%.3f MB",
                                       help=f"Predicted: Linear GEMM operand bytes against FP32; {BYTES_UNMEASURED}."),
    "verdict": Column(width=300, help="Whether the round's loss tracks FP32; in full in the sentence beneath."),
}


def _bytes(parts: dict[str, float], names: dict[str, str]) -> pd.DataFrame:
    return pd.DataFrame({"configuration": list(names.values()), "MB": [parts[k] / MB for k in names]})


def verify_rounds(runs: pd.DataFrame, source: int) -> pd.DataFrame:
    """The source's reruns that ran a plan (fp8-sim or fp8-sim-fp16 with ``--fp8-modules``), oldest first."""
    ran = runs["config"].map(lambda c: ((c or {}).get("run") or {}).get("fp8_modules") or "")
    mine = runs[(runs["parent_run_id"] == source) & runs["opt_level"].isin(FP8_SIM_LEVELS) & (ran != "")]
    return mine.assign(fp8_modules=ran[mine.index]).sort_values("run_id")


def plan_view(store: Store, run: pd.Series, runs: pd.DataFrame) -> PlanView:
    try:
        plan = plan_run(store, int(run["run_id"]))
    except ValueError as exc:
        empty = pd.DataFrame()
        config = run["config"] if isinstance(run["config"], dict) else {}
        again, rerunnable = fp8_record_again(int(run["run_id"]), config, RECORD_EVERY_RECIPE)
        return PlanView(None, str(exc), empty, empty, empty, None, dict(RECORD_EVERY_RECIPE),
                        None if rerunnable else f"mpdiag cannot rerun this run with them: {again}.")
    table = plan.table().assign(rejected=["; ".join(f"not {LABELS[k]}: {v}" for k, v in layer.rejected.items())
                                          for layer in plan.layers])
    table["memory saved (bytes)"] = table["memory saved (bytes)"].round().astype(int)
    table["GEMM bytes saved per step"] = table["GEMM bytes saved per step"].round().astype(int)
    table = table[["layer", "choice", "memory saved (bytes)", "GEMM bytes saved per step", "evidence", "rejected"]]
    memory = _bytes(plan.memory["bytes"], {"fp32": "FP32", "mixed": "mixed precision (16Ψ)", "plan": "plan"})
    gemm = _bytes(plan.gemm, {"fp32": "FP32", "bf16": "BF16", "plan": "plan"})
    return PlanView(plan, None, table, memory, gemm, verify_view(store, run, runs, plan))


def verify_view(store: Store, run: pd.Series, runs: pd.DataFrame, plan: Plan) -> VerifyView:
    """The Verify section of ``run``'s ``plan`` from the runs table (re-read while a verification goes on)."""
    run_id = int(run["run_id"])
    reference = run_id if run["opt_level"] == "O0" else reference_run(runs, run_id)
    rows, said_rounds, curves, domain = [], [], [], []
    if reference is not None:
        reference_run_row = runs[runs["run_id"] == reference].iloc[0]
        reference_steps = reads.steps(store, reference, reads.is_final(reference_run_row))
        domain.append(f"#{reference} FP32 reference")
        curves.append(reference_steps[["step", "loss"]].assign(run=domain[-1]))
    next_plan, going, fraction = plan, "", None
    for number, (_, done) in enumerate(verify_rounds(runs, run_id).iterrows(), 1):
        steps = reads.steps(store, int(done["run_id"]), reads.is_final(done))
        tracked, rel, said = tracks(curves[0], steps) if curves else (False, float("nan"), "no FP32 reference")
        finished = done["status"] == "finished"
        if done["status"] in ("queued", "running"):
            fraction, words = run_progress(done)
            going = f"round {number} (run #{int(done['run_id'])}) is {done['status']}: {words}"
        verdict = said if finished else f"{done['status']}: {said}"
        ran = as_ran(plan, done["fp8_modules"])
        rows.append({**round_row(number, int(done["run_id"]), ran, rel, verdict), "status": done["status"]})
        if len(domain) < 4:  # the chart layer's four run colours: the reference and three rounds
            domain.append(f"#{int(done['run_id'])} round {number}")
            curves.append(steps[["step", "loss"]].assign(run=domain[-1]))
        next_plan = after_round(plan, done["fp8_modules"], tracked) if finished else None
        promoted = [] if next_plan is None else [one.layer for one, then in zip(ran.layers, next_plan.layers,
                                                                                 strict=True) if one.choice != then.choice]
        lines = round_lines(rows[-1], ", ".join(promoted) or None)
        said_rounds.append(". ".join(line[0].upper() + line[1:] for line in lines) + ".")
        if next_plan is None:
            break
    count = len(rows)
    verified = bool(rows) and rows[-1]["status"] == "finished" and rows[-1]["verdict"].startswith("tracks")
    found = dict(rounds=pd.DataFrame(rows), said=said_rounds, curves=pd.concat(curves, ignore_index=True) if curves else pd.DataFrame(),
                 domain=domain, reference_id=reference, verified=verified, going=going, fraction=fraction)
    if next_plan is None or count >= MAX_ROUNDS:
        return VerifyView(next_options=None, next_what="", **found)
    first = f"rounds {count + 1} to {MAX_ROUNDS}" if count + 1 < MAX_ROUNDS else f"round {MAX_ROUNDS}"
    what = (f"Verify the plan ({first} at most, a promotion after each round that does not track FP32"
            + (", after an FP32 reference: an O0 rerun)" if reference is None else ")"))
    options = round_options(next_plan, str(run["name"]), count + 1)
    # a round sets per-Linear FP8 recipes, which only mpdiag run applies (a watched run's Verify was offered, and
    # its job failed)
    refused = fix_not_rerunnable(run["config"] if isinstance(run["config"], dict) else {},
                                 {k: v for k, v in options.items() if k != "name"})
    if refused is not None:
        return VerifyView(next_options=None, next_what="", refused=refused, **found)
    return VerifyView(next_options=options, next_what=what, next_round=count + 1,
                      next_modules=next_plan.module_flag(), **found)
