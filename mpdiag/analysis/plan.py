"""A precision plan: the cheapest precision for each Linear, the run and the optimizer state that the recorded
evidence of one run allows, each choice with the counts and named thresholds that decided it and its predicted
saving; and the rules that judge a plan's rerun against FP32 and promote layers when it fails.

Owns the plan's rules and thresholds (docs/plan.md states them with their values), the 16Ψ memory account and
the GEMM operand-byte account. Pure: DataFrames from a :class:`~mpdiag.store.Store` in, a :class:`Plan` out; no
torch. The counts are the store's (``Store.fp8``, exact against casting and torchao's reference casts), the
tests they are judged by are the FP8 findings' own (:func:`mpdiag.analysis.fp8_summaries.past_threshold`). The
plan is derived from the run every time, never stored; its rerun (:mod:`mpdiag.analysis.plan_verify`) is a
normal run whose ``--fp8-modules`` is :meth:`Plan.module_flag`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import pandas as pd

from mpdiag.analysis.compare import DIVERGENCE_RTOL
from mpdiag.analysis.findings import LOW_RANGE_SHARE, LOW_RANGE_TARGET, recommended_scale
from mpdiag.analysis.fp8_summaries import LOST_SHARE, past_threshold
from mpdiag.analysis.summaries import FP16_LEVELS, judged_level
from mpdiag.numerics.formats import BF16, EXP_MIN, FP8_E4M3, FP16, resolution_log2
from mpdiag.numerics.fp8_recipes import BLOCK_RECIPES, RECIPES, ROLES
from mpdiag.options import MOMENT_FORMATS, command_flags

#: a recipe holds a Linear when no role of it, at any recorded step, loses more than this share of its values
#: to underflow or any value to overflow (the fp8-lost-values finding's test, past_threshold)
PLAN_LOST_SHARE = LOST_SHARE
#: a Linear stays in FP32 when more than this share of its weight gradient's recorded values underflow in BF16
BF16_GRAD_LOST_SHARE = LOST_SHARE
#: a moment format fits when, for every tensor, at most this share of the values it averages falls outside it
MOMENT_LOST_SHARE = LOST_SHARE
#: a verify rerun tracks FP32 when its mean loss over the last TRACK_WINDOW of the steps is within TRACK_RTOL
#: (relative) of the FP32 reference's, and its loss is finite wherever the reference's is
TRACK_RTOL = DIVERGENCE_RTOL
TRACK_WINDOW = 0.25
#: verify reruns at most this many rounds (the plan, then one promotion per failed round)
MAX_ROUNDS = 3

#: the Linear choices, cheapest first: a Linear takes the first that holds
LADDER = ("nvfp4", "delayed", "current", "mxfp8", "bf16", "fp32")
#: bytes per element a GEMM operand or a stored weight takes in each choice: NVFP4 half a byte plus an E4M3
#: scale per 16, MXFP8 a byte plus an E8M0 scale per 32 (per-tensor scales: one fp32 per tensor, left out)
ELEMENT_BYTES = {"nvfp4": 0.5 + 1 / 16, "delayed": 1.0, "current": 1.0, "mxfp8": 1 + 1 / 32, "bf16": 2.0,
                 "fp32": 4.0, "fp16": 2.0, "fp8": 1.0}
LABELS = {"nvfp4": "NVFP4", "delayed": "FP8 delayed", "current": "FP8 current", "mxfp8": "MXFP8", "bf16": "BF16",
          "fp32": "FP32", "fp16": "FP16", "fp8": "FP8 (E4M3)"}
#: how Transformer Engine names each choice (``transformer_engine.common.recipe``), for the plan's config
TE_RECIPES = {"nvfp4": "NVFP4BlockScaling()", "delayed": "DelayedScaling()", "current": "Float8CurrentScaling()",
              "mxfp8": "MXFP8BlockScaling()", "bf16": "none: outside fp8_autocast, under BF16 autocast",
              "fp32": "none: outside fp8_autocast and autocast (FP32)"}
#: the moments of the optimizers whose state is known by their class (others: measured from the stored bytes)
MOMENTS_BY_CLASS = {"Adam": 2, "AdamW": 2}
FP8_CLASS = ("nvfp4", "delayed", "current", "mxfp8")
#: bytes per element of an optimizer state dtype as the runner records it (others: taken as FP32)
STATE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class LayerChoice:
    """One Linear's choice: ``choice`` (a LADDER entry), ``evidence`` (what decided it, in words), ``rejected``
    (each cheaper choice and why it did not hold), ``worst_share`` (the largest lost share of any role at any
    recorded step under the chosen recipe: how close it came; 0 for BF16/FP32), and its accounts."""

    layer: str
    choice: str
    evidence: str
    rejected: dict[str, str]
    worst_share: float
    weight_numel: int
    gemm_numel: int  # operand elements of one step's three GEMMs (each operand counted once per GEMM reading it)

    def gemm_bytes(self, choice: str | None = None) -> float:
        return self.gemm_numel * ELEMENT_BYTES[choice or self.choice]


@dataclass
class Plan:
    """A run's plan (see the module docstring); ``notes``: what the plan could not judge because it was not
    recorded. ``memory``: bytes of the 16Ψ account under FP32, mixed precision (BF16/FP16 compute copies, FP32
    masters and moments) and the plan; ``gemm``: operand bytes of one step's Linear GEMMs under FP32, BF16 and
    the plan."""

    run_id: int
    layers: list[LayerChoice]
    run_precision: str
    loss_scale_log2: int | None
    run_evidence: str
    moments: int | None
    moment_format: str | None
    moment_evidence: str
    notes: list[str]
    memory: dict[str, dict[str, float]] = field(default_factory=dict)
    gemm: dict[str, float] = field(default_factory=dict)

    def module_flag(self) -> str:
        """The plan as ``--fp8-modules`` of an fp8-sim rerun: NAME=RECIPE for every Linear."""
        return ",".join(f"{layer.layer}={layer.choice}" for layer in self.layers)

    def rerun_options(self) -> dict:
        """The run options that run the plan as planned: fp8-sim (a BF16 run) or fp8-sim-fp16 with dynamic loss
        scaling from 2^k (an FP16 run), a recipe per Linear, and the moments held in their planned format ("": as
        the optimizer keeps them, FP32, or no moments)."""
        fp16 = self.run_precision == "fp16"
        options = {"opt_level": "fp8-sim-fp16" if fp16 else "fp8-sim", "fp8_modules": self.module_flag(),
                   "moment_format": self.moment_format if self.moment_format in MOMENT_FORMATS else ""}
        if fp16:
            options["init_scale"] = 2.0**self.loss_scale_log2
        return options

    def flags(self) -> str:
        """:meth:`rerun_options` as command-line flags (an unset moments' format left out)."""
        return command_flags({k: v for k, v in self.rerun_options().items() if v != ""})

    def table(self) -> pd.DataFrame:
        """One row per Linear: layer, choice (its label), evidence, predicted memory and GEMM bytes saved
        against FP32 (per step for the GEMMs)."""
        per_layer = self.memory.get("layers", {})
        return pd.DataFrame([{
            "layer": layer.layer, "choice": LABELS[layer.choice], "evidence": layer.evidence,
            "memory saved (bytes)": per_layer.get(layer.layer, 0.0),
            "GEMM bytes saved per step": layer.gemm_bytes("fp32") - layer.gemm_bytes()} for layer in self.layers],
            columns=["layer", "choice", "evidence", "memory saved (bytes)", "GEMM bytes saved per step"])

    def as_dict(self) -> dict:
        return asdict(self)

    def config_text(self) -> str:
        """The plan as a config a user can take: the mpdiag flags of its rerun, then a Transformer-Engine-style
        recipe per module."""
        lines = [f"# mpdiag: rerun it\n{self.flags()}",
                 "# Transformer Engine style: the recipe each Linear runs under"]
        lines += [f"{layer.layer}: {TE_RECIPES[layer.choice]}" for layer in self.layers]
        return "\n".join(lines)

    def promoted(self, layer: str) -> Plan:
        """This plan with ``layer`` moved to BF16 (a verify round broke training), its accounts recomputed."""
        return self.moved(layer, "bf16", "promoted to BF16 by a verify round", 0.0)

    def moved(self, layer: str, choice: str, why: str, worst_share: float) -> Plan:
        """This plan with ``layer`` in ``choice`` for the reason ``why`` (its evidence keeps what it was), with
        ``worst_share`` as its closeness to the threshold, its accounts recomputed."""
        layers = [replace(one, choice=choice, worst_share=worst_share, evidence=f"{why} (was {LABELS[one.choice]}: "
                          f"{one.evidence})") if one.layer == layer else one for one in self.layers]
        return _with_accounts(replace(self, layers=layers), self.memory.get("params", 0))


def linear_choice(layer: str, records: pd.DataFrame, grad_bf16_share: float | None) -> tuple[str, str, dict, float]:
    """(choice, evidence, rejected, worst share) for one Linear from its Store.fp8 rows (every recipe recorded)
    and the share of its weight gradient's values that underflow in BF16 (None: not recorded). A recipe is
    judged only where it was recorded: one that was not is rejected as "not recorded", never assumed."""
    rejected = {}
    for recipe in LADDER[:4]:
        rows = records[records["recipe"] == recipe]
        if rows.empty:
            rejected[recipe] = "not recorded" + (" (--fp8-blocks)" if recipe in BLOCK_RECIPES else
                                                 " (--fp8-recipe both)")
            continue
        share = rows["underflow"] / rows["numel"].where(rows["numel"] > 0)
        bad = rows[past_threshold(rows)]
        steps = rows["step"].nunique()
        worst = float(share.max()) if len(share) else 0.0
        if bad.empty:
            said = (f"{LABELS[recipe]} holds at every one of {steps} recorded steps: worst underflow "
                    f"{worst:.3%} of a role's values (≤ PLAN_LOST_SHARE {PLAN_LOST_SHARE:.0%}), "
                    f"{int(rows['overflow'].sum()):,} overflow")
            return recipe, said, rejected, worst
        top = bad.assign(share=share[bad.index]).sort_values(["overflow", "share"], ascending=False).iloc[0]
        rejected[recipe] = (f"{bad['step'].nunique()} of {steps} recorded steps past PLAN_LOST_SHARE; worst "
                            f"{top['role']} at step {int(top['step'])}: {int(top['underflow']):,} of "
                            f"{int(top['numel']):,} underflow, {int(top['overflow']):,} overflow")
    if grad_bf16_share is None:
        return "bf16", "no FP8 or FP4 recipe holds; its gradient's BF16 fit is not recorded", rejected, 0.0
    if grad_bf16_share > BF16_GRAD_LOST_SHARE:
        return ("fp32", f"no FP8 or FP4 recipe holds, and {grad_bf16_share:.2%} of its weight gradient's values "
                f"underflow in BF16 (> BF16_GRAD_LOST_SHARE {BF16_GRAD_LOST_SHARE:.0%})", rejected, 0.0)
    return ("bf16", f"no FP8 or FP4 recipe holds; {grad_bf16_share:.2%} of its weight gradient's values underflow "
            f"in BF16 (≤ BF16_GRAD_LOST_SHARE {BF16_GRAD_LOST_SHARE:.0%})", rejected, 0.0)


def run_precision(opt_level: str, hist: np.ndarray, activation_max: float | None) -> tuple[str, int | None, str]:
    """(bf16 or fp16, log2 of FP16's initial dynamic loss scale, evidence) from the run's gradient exponent
    histogram summed over tensors and logged steps, and the largest finite module output recorded
    (``--trace-modules``; None: not recorded). FP16 needs both: a scale that fits the gradients
    (findings.recommended_scale, the gradient-underflow finding's rule) and outputs below FP16's largest."""
    if not hist.sum():
        return "bf16", None, "the gradients' histograms are not recorded (no logged step): BF16, FP32's range"
    complete = opt_level not in FP16_LEVELS  # an FP16 run's histograms lack what it flushed to zero
    k = recommended_scale(hist, complete=complete)
    if k is None:
        return "bf16", None, (f"no loss scale fits the gradients in FP16 (every scale that avoids overflow leaves "
                              f"more than {LOW_RANGE_SHARE:.0%} underflowing or subnormal): BF16")
    fits = (f"dynamic loss scaling from 2^{k} fits the gradients in FP16 (underflowing or subnormal at most "
            f"{LOW_RANGE_TARGET:.1%} where a scale gets there, else {LOW_RANGE_SHARE:.0%}; no overflow)")
    if activation_max is None:
        return "bf16", None, (f"{fits}, but the module outputs' range is not recorded (--trace-modules records it): "
                              "BF16, which has FP32's range")
    if activation_max >= FP16.max_finite:
        return "bf16", None, (f"{fits}, but a module output reaches {activation_max:.4g} (≥ FP16's largest "
                              f"{FP16.max_finite:g}): BF16")
    return "fp16", k, f"{fits}, and every module output stays below FP16's largest ({activation_max:.4g} < 65504)"


def moment_format(per_tensor: np.ndarray) -> tuple[str, str]:
    """(cheapest format among fp8, bf16, fp32, evidence) for Adam's moments from each tensor's gradient exponent
    histogram (rows: tensors; column i: binade EXP_MIN + i). The moments are not recorded: m is judged by g's
    binades, v by g²'s (twice the exponent). FP8 (E4M3 at a per-tensor scale) keeps the binades within its span
    below the tensor's largest; BF16 keeps them within its absolute range. The worst tensor decides."""
    totals = per_tensor.sum(axis=1) if per_tensor.size else np.zeros(0)
    if not totals.sum():
        return "fp32", "the moments are not recorded, nor the gradients' histograms they would be judged by: FP32"
    bins = np.arange(per_tensor.shape[1]) + EXP_MIN
    spans = {"fp8": FP8_E4M3.max_exponent - FP8_E4M3.min_subnormal_exponent}

    def lost(fmt: str, power: int) -> float:
        worst = 0.0
        for hist, total in zip(per_tensor, totals, strict=True):
            if not total:
                continue
            exp = bins * power
            if fmt == "fp8":
                top = exp[np.flatnonzero(hist)].max()
                out = exp < top - spans["fp8"]
            else:
                out = (exp < BF16.min_subnormal_exponent) | (exp > BF16.max_exponent)
            worst = max(worst, float(hist[out].sum() / total))
        return worst

    said = []
    for fmt in ("fp8", "bf16"):
        m, v = lost(fmt, 1), lost(fmt, 2)
        said.append(f"{LABELS[fmt]}: m loses at most {m:.2%}, v {v:.2%} of a tensor's values")
        if max(m, v) <= MOMENT_LOST_SHARE:
            return fmt, (f"the moments are not recorded; judged by the gradients they average (m: g's binades, "
                         f"v: g²'s): {'; '.join(said)} (at most {MOMENT_LOST_SHARE:.0%}). Adam's betas "
                         f"are not recorded either: a moment stored in BF16 also needs 1-β ≥ 2^{resolution_log2('bf16')} "
                         "(PyTorch's default β2 = 0.999 does not meet it) or stochastic rounding")
    return "fp32", (f"the moments are not recorded; judged by the gradients they average: {'; '.join(said)} "
                    f"(more than {MOMENT_LOST_SHARE:.0%}): FP32")


def _with_accounts(plan: Plan, params: int) -> Plan:
    """``plan`` with its memory (16Ψ) and GEMM accounts filled in. Per parameter: the compute copy, its gradient,
    an FP32 master where the copy is not FP32, and the moments. An FP8/FP4 Linear keeps its weight in that format
    (TE's FP8 weights), its gradient in BF16; biases and non-Linear parameters stay at the run's precision."""
    n = plan.moments or 0
    moment = ELEMENT_BYTES[plan.moment_format or "fp32"] * n
    run_bytes = ELEMENT_BYTES[plan.run_precision]

    def per_element(copy: float, grad: float) -> float:
        return copy + grad + (0.0 if copy == 4.0 else 4.0) + moment

    fp32 = 4 + 4 + 4 * n
    rest = max(params - sum(one.weight_numel for one in plan.layers), 0)  # biases, every non-Linear parameter
    parts = {"fp32": params * fp32, "mixed": params * (2 + 2 + 4 + 4 * n)}
    planned = rest * per_element(run_bytes, run_bytes)
    saved = {}
    for one in plan.layers:
        mine = one.weight_numel * per_element(ELEMENT_BYTES[one.choice], 4.0 if one.choice == "fp32" else 2.0)
        planned += mine
        saved[one.layer] = one.weight_numel * fp32 - mine
    parts["plan"] = planned
    memory = {"bytes": parts, "layers": saved, "params": params}
    gemm = {kind: sum(one.gemm_bytes(kind) for one in plan.layers) for kind in ("fp32", "bf16")}
    gemm["plan"] = sum(one.gemm_bytes() for one in plan.layers)
    return replace(plan, memory=memory, gemm=gemm)


def build_plan(run: pd.Series, records: pd.DataFrame, tensors: pd.DataFrame, totals: pd.DataFrame,
               hist: np.ndarray, module_stats: pd.DataFrame) -> Plan:
    """The plan of run ``run`` (Store.runs' row) from Store.fp8 (``records``), Store.tensors, Store.tensor_totals,
    Store.histogram_totals' counts (``hist``: a row per tensor) and Store.module_stats. Raises ValueError when the run
    recorded no FP8 statistics: a Linear's plan needs them (``--fp8``)."""
    if records.empty:
        raise ValueError(f"run {int(run['run_id'])} recorded no FP8 statistics: record one with --fp8 (and "
                         "--fp8-recipe both --fp8-blocks mxfp8,nvfp4 to judge every recipe)")
    notes = []
    numel = dict(zip(tensors["name"], tensors["numel"], strict=True)) if len(tensors) else {}
    by_tensor = totals.set_index("tensor") if len(totals) else None
    last = records[records["step"] == records["step"].max()]
    layers = []
    for layer, rows in records.groupby("module", sort=False):
        share = None
        if by_tensor is not None and f"{layer}.weight" in by_tensor.index:
            row = by_tensor.loc[f"{layer}.weight"]
            share = float(row["bf16_underflow"] / row["numel"]) if row["numel"] else 0.0
        choice, evidence, rejected, worst = linear_choice(layer, rows, share)
        sizes = last[(last["module"] == layer) & (last["recipe"] == last["recipe"].iloc[0])]
        sizes = dict(zip(sizes["role"], sizes["numel"], strict=False))
        layers.append(LayerChoice(layer, choice, evidence, rejected, worst,
                                  int(numel.get(f"{layer}.weight", sizes.get("weight", 0))),
                                  2 * sum(int(sizes.get(r, 0)) for r in ROLES)))
    if not set(RECIPES) <= set(records["recipe"]):
        notes.append("only one per-tensor FP8 recipe was recorded: --fp8-recipe both records current and delayed")
    if not records["recipe"].isin(BLOCK_RECIPES).any():
        notes.append("no block-scaled recipe was recorded: --fp8-blocks mxfp8,nvfp4 records them")
    outputs = module_stats["fwd_absmax"] if len(module_stats) else None
    activation_max = float(np.nanmax(outputs.to_numpy())) if outputs is not None and outputs.notna().any() else None
    precision, k, run_said = run_precision(judged_level(run), hist.sum(axis=0) if hist.size else np.zeros(0),
                                           activation_max)
    moments, moment, moment_said = _moments(run, hist)
    if moments is None:
        notes.append("the optimizer's state is not recorded (a Recorder in your own loop): the memory account "
                     "leaves the moments out")
    params = run.get("params")
    params = int(params) if params is not None and not pd.isna(params) else int(sum(numel.values()))
    plan = Plan(int(run["run_id"]), layers, precision, k, run_said, moments, moment, moment_said, notes)
    return _with_accounts(plan, params)


def _moments(run: pd.Series, hist: np.ndarray) -> tuple[int | None, str | None, str]:
    """(moments per parameter, their format, evidence): the count from the optimizer's class where it fixes it,
    else from the optimizer state's stored bytes (whole tensors of its recorded dtype per parameter); None where
    neither is recorded."""
    config = run.get("config") if isinstance(run.get("config"), dict) else {}
    optimizer = config.get("optimizer") or {}
    state = run.get("model_state") if isinstance(run.get("model_state"), dict) else {}
    moments = MOMENTS_BY_CLASS.get(optimizer.get("class"))
    if moments is None and state.get("params"):
        size = STATE_BYTES.get(str(optimizer.get("state_dtype")), 4)
        moments = int(state.get("optimizer_state", 0) // (size * state["params"]))
    if moments is None:
        return None, None, "the optimizer and its state are not recorded"
    if moments == 0:
        return 0, None, f"{optimizer.get('class', 'the optimizer')} keeps no moments"
    fmt, said = moment_format(hist)
    return moments, fmt, f"{optimizer.get('class', 'the optimizer')}, {moments} moment(s) per parameter: {said}"


def plan_run(store, run_id: int) -> Plan:
    """:func:`build_plan` of a stored run (``store``: a :class:`mpdiag.store.Store`)."""
    _, hist = store.histogram_totals(run_id)
    return build_plan(store.run(run_id), store.fp8(run_id), store.tensors(run_id), store.tensor_totals(run_id),
                      hist, store.module_stats(run_id))


def tracks(reference: pd.DataFrame, steps: pd.DataFrame) -> tuple[bool, float, str]:
    """(tracks, relative difference of the last-window mean losses, in words) of a rerun's Store.steps against
    the FP32 reference's: the rule of TRACK_RTOL and TRACK_WINDOW."""
    merged = reference[["step", "loss"]].merge(steps[["step", "loss"]], on="step", suffixes=("_ref", ""))
    if merged.empty:
        return False, math.nan, "no common steps with the FP32 reference"
    broken = merged[np.isfinite(merged["loss_ref"]) & ~np.isfinite(merged["loss"])]
    if len(broken):
        return False, math.nan, f"its loss is not finite at step {int(broken['step'].iloc[0])}, FP32's is"
    window = merged.tail(max(1, int(len(merged) * TRACK_WINDOW)))
    ref, mine = float(window["loss_ref"].mean()), float(window["loss"].mean())
    rel = abs(mine - ref) / abs(ref) if ref else math.inf
    verdict = "tracks" if rel <= TRACK_RTOL else "does not track"
    return rel <= TRACK_RTOL, rel, (f"{verdict} FP32: mean loss over the last {len(window)} steps {mine:.5g} against "
                                   f"{ref:.5g}, {rel:.2%} apart (TRACK_RTOL {TRACK_RTOL:.0%})")


def after_round(plan: Plan, ran: str, tracked: bool) -> Plan | None:
    """The plan of the next verify round from ``plan`` (the source's) and the last round's ``--fp8-modules``
    (``ran``) and outcome: the plan as that round ran it (:func:`as_ran`); a failed round promotes one more
    (:func:`next_promotion`). None when the round tracked or none is left."""
    plan = as_ran(plan, ran)
    layer = None if tracked else next_promotion(plan)
    return None if layer is None else plan.promoted(layer)


def as_ran(plan: Plan, ran: str) -> Plan:
    """``plan`` (the source's) as a verify round with ``--fp8-modules`` ``ran`` ran it, each Linear in the recipe
    it ran: one the round ran in BF16 but ``plan`` did not was promoted before it; one it ran in another recipe
    than planned (the flags changed by hand) is said so, with a worst share of 1, as its evidence did not hold it
    there: a failed round promotes it first."""
    ran_in = dict(pair.split("=", 1) for pair in ran.split(",") if "=" in pair)
    for layer in plan.layers:
        recipe = ran_in.get(layer.layer, layer.choice)
        if recipe == "bf16" and layer.choice != "bf16":
            plan = plan.promoted(layer.layer)
        elif recipe != layer.choice and recipe in LABELS:
            plan = plan.moved(layer.layer, recipe, f"run in {LABELS[recipe]}, not as planned", 1.0)
    return plan


def next_promotion(plan: Plan) -> str | None:
    """The Linear a failed verify round promotes to BF16: of those still in an FP8/FP4 recipe, the one whose
    recorded evidence came closest to PLAN_LOST_SHARE (largest worst share; ties: the first in the model);
    None when none is left."""
    candidates = [layer for layer in plan.layers if layer.choice in FP8_CLASS]
    if not candidates:
        return None
    return max(candidates, key=lambda layer: layer.worst_share).layer
