"""The Compare page's view-model: what pages/3_Compare.py shows of 2-4 runs side by side (curves, costs, FP16
shares, overlaid histograms), as typed values built from the cached reads (reads.py) and mpdiag.analysis.compare
for the choices its widgets make. No widgets and no drawing here, so every part is testable without Streamlit's
script runner. Sentences for Markdown are built with ``plain`` around every run label (run names are the user's).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from mpdiag.analysis import summaries
from mpdiag.analysis.compare import (
    DIVERGENCE_RTOL,
    NO_STEP,
    STEP_TIME_OUTLIER,
    config_table,
    cost_table,
    counted_text,
    first_divergence,
    fp16_overflow_parts,
    fp16_underflow_parts,
    fp32_twin_row,
    histogram_steps,
    histogram_tensors,
    loss_comparison,
    overlaid_histograms,
    reference_hint,
    reference_run,
    setting_label,
    smoothed,
    step_time_outliers,
    twin_parted_at,
    worst_by_total,
)
from mpdiag.dashboard import reads
from mpdiag.dashboard.tables import TABLE_PX, Column, loss_digits
from mpdiag.dashboard.untrusted import plain
from mpdiag.options import recorded_by
from mpdiag.store import Store


@dataclass(frozen=True)
class Curves:
    """The runs' curves on one x axis: the loss, its difference to each run's FP32 reference, the loss scale, the
    learning rate and the gradient norm, each only for the runs that recorded it, and what is left out, said."""
    x: str
    smooth: bool
    #: the runs' steps on the x axis (empty: no run has a value on it, e.g. no wall time)
    curves: pd.DataFrame
    #: each mixed run's loss against its FP32 reference, and the first step they differ; None without one
    diffs: pd.DataFrame | None
    first: int | None
    #: the runs with loss scaling, with a learning rate, with a gradient norm (None: none recorded one)
    scaled: pd.DataFrame
    lr: pd.DataFrame
    normed: pd.DataFrame | None
    #: captions (Markdown, labels through ``plain``) and each run's note on its FP32 reference
    said: list[str]
    notes: list[str]


@dataclass(frozen=True)
class Costs:
    """Step times after the warm-up step 0 (without the outliers), peak memory, and the table of costs."""
    timed: pd.DataFrame
    warmups: str | None
    outliers: str | None
    #: None: no run recorded its peak memory
    memory: pd.DataFrame | None
    table: pd.DataFrame


@dataclass(frozen=True)
class Fp16Shares:
    """FP16 underflow (flushed and counted parts) and overflow (inf/NaN when recorded and counted parts) per tensor
    and run, worst first; None where no run recorded statistics, empty where nothing would underflow or overflow."""
    under: pd.DataFrame | None
    over: pd.DataFrame | None
    no_stats: list[str]
    #: the FP16 runs whose flushed share is not estimated (no FP32 twin, or one whose loss parted from theirs):
    #: (label, why, as summaries.flushed_text says it)
    no_twin: list[tuple[str, str]]


@dataclass(frozen=True)
class Overlay:
    """One tensor's exponent histogram in each run at one step (None: summed), and per run what it held."""
    bins: pd.DataFrame
    per_run: pd.DataFrame
    when: str
    #: FP16's limits, drawn over the histograms (summaries.format_lines)
    lines: pd.DataFrame
    #: the runs without the step's histogram (its full statistics not kept) that counted it all the same (their
    #: per-step signals): what each counted of the tensor, label first (Markdown, the label through ``plain``)
    counted: list[str]
    #: what the histograms are of (g, or S·g at each run's loss scale), and how S·g was placed on the bins
    what: str = "unscaled gradient g"
    scale_said: str | None = None


#: how many columns the S·g sum over all logged steps reads of a tensor at most, besides one per change of the loss
#: scale (Store.histogram_columns: the writer's bucket sums, never split across a scale change)
SCALED_SUM_COLUMNS = 64
#: how many widget choices' results a CompareRuns holds (each one tensor's overlay at one step, or smaller)
HELD_CHOICES = 64


def _held_per_choice(method):
    """``method`` computed once per CompareRuns and choice of its widgets (the arguments): a view held while its
    runs' data stays the same (:func:`compare`) hands back the very frames it handed before, so a refresh builds
    no chart again (mpdiag.dashboard.charts reuses a chart of the same frames)."""
    @functools.wraps(method)
    def held(self, *args, **kwargs):
        choice = (method.__name__, args, tuple(sorted(kwargs.items())))
        if choice not in self.held:
            while len(self.held) >= HELD_CHOICES:  # the oldest first
                del self.held[next(iter(self.held))]
            self.held[choice] = method(self, *args, **kwargs)
        return self.held[choice]
    return held


@dataclass(frozen=True)
class CompareRuns:
    """The chosen runs (rows of the runs table the page read once) as the page compares them; its methods give
    what each section shows for its widgets' choices, each once per choice (``held``)."""
    store: Store
    chosen: pd.DataFrame
    all_runs: pd.DataFrame
    labels: list[str]
    #: each run's steps, smoothed and thinned for drawing, with its label as ``run``, all in one frame
    everything: pd.DataFrame
    held: dict = field(default_factory=dict, repr=False, compare=False)

    def _rows(self):
        return zip(self.labels, (r for _, r in self.chosen.iterrows()), strict=True)

    @_held_per_choice
    def curves(self, x: str, smooth: bool) -> Curves:
        """The curves on ``x`` ("step" or "wall_time_s"); the difference to FP32 is drawn over steps only."""
        labels, everything = self.labels, self.everything
        diffs, notes, firsts = self._references()
        curves, said = everything, []
        if x == "wall_time_s":
            untimed = [lab for lab in labels if everything.loc[everything["run"] == lab, "wall_time_s"].isna().all()]
            curves = everything[everything["wall_time_s"].notna()]
            if untimed:
                said.append("Not on the wall-time axis (recorded before mpdiag kept a wall time per step): "
                            + "; ".join(plain(lab) for lab in untimed) + ".")
        if curves.empty:
            return Curves(x, smooth, curves, None, None, curves, curves, None, said, notes)
        if diffs and x != "step":
            said.append("The difference to the FP32 reference is drawn over steps only: choose the step axis to see it.")
        # a run without loss scaling (O0, bf16: no GradScaler) has scale 1 at every step: drawn, its line at 2^0
        # would cover a static scale of 1 and read as a scale it never had; it is named instead
        unscaled = [lab for lab, scaling in zip(labels, self.chosen["scaling"], strict=True) if scaling == "none"]
        unscaled_shown = [lab for lab in unscaled if lab in set(curves["run"])]
        if unscaled_shown:
            said.append("Not in the loss-scale panel (no loss scaling: no GradScaler, the loss is used as it is): "
                        + "; ".join(plain(lab) for lab in unscaled_shown) + ".")
        with_lr = curves.groupby("run")["lr"].transform(lambda v: np.isfinite(v.astype(float)).any())
        normed = curves[summaries.recorded_norms(curves)]
        shown = [lab for lab in labels if lab in set(curves["run"])]
        missing_lr = [lab for lab in shown if not with_lr[curves["run"] == lab].any()]
        missing_norm = [lab for lab in shown if lab not in set(normed["run"])]
        if missing_lr:
            said.append("No learning rate recorded (a run recorded before mpdiag kept it, or without a known "
                        "optimizer): " + "; ".join(plain(lab) for lab in missing_lr) + ".")
        if missing_norm:
            said.append("No gradient norm recorded (a run recorded before mpdiag kept it): "
                        + "; ".join(plain(lab) for lab in missing_norm) + ".")
        drawn_norms = len(normed) and (normed["grad_norm"].astype(float) != 0).any()
        return Curves(x, smooth, curves, pd.concat(diffs) if diffs else None,
                      min((s for s in firsts if s is not None), default=None), curves[~curves["run"].isin(unscaled)],
                      curves[with_lr] if with_lr.any() else curves.iloc[:0], normed if drawn_norms else None,
                      said, notes)

    def _references(self) -> tuple[list[pd.DataFrame], list[str], list[int | None]]:
        """Each mixed run's loss against its FP32 reference (preferring a chosen one), the note saying where they
        first differ (or that there is none), and that step."""
        selected = self.chosen["run_id"].astype(int).tolist()
        diffs, notes, firsts = [], [], []
        for lab, r in self._rows():
            ref_id = reference_run(self.all_runs, int(r["run_id"]), prefer=selected)
            if ref_id is None:
                if r["opt_level"] != "O0":
                    notes.append(f"**{plain(lab)}**: no finished FP32 (O0) run of the same training to compare "
                                 f"with ({reference_hint(r)}).")
                continue
            ref = self.all_runs[self.all_runs["run_id"] == ref_id].iloc[0]
            comparison = loss_comparison(reads.steps(self.store, ref_id, True),
                                         self.everything[self.everything["run"] == lab]).assign(run=lab)
            step = first_divergence(comparison)
            firsts.append(step)
            where = (f"stays within {DIVERGENCE_RTOL:.0%}" if step is None else
                     f"first differs by more than {DIVERGENCE_RTOL:.0%} (or turns non-finite) at step {step}")
            notes.append(f"**{plain(lab)}** versus its FP32 reference {plain(summaries.run_label(ref))}: {where}.")
            diffs.append(comparison)
        return diffs, notes, firsts

    @_held_per_choice
    def costs(self) -> Costs:
        """Step 0 holds the warm-up (allocation, kernel selection, compilation): said apart, out of the medians; a
        later step far above its run's median (a stall) is listed, not drawn: the axis would be scaled to it."""
        everything = self.everything
        timed = everything[(everything["step"] > 0) & np.isfinite(everything["step_time_s"].astype(float))]
        outliers = step_time_outliers(timed)
        warmups = everything[everything["step"] == 0]
        far = timed[outliers]
        listed = "; ".join(f"{plain(run)} step {int(step):,} {seconds:,.3g} s" for run, step, seconds in
                           zip(far["run"].head(5), far["step"].head(5), far["step_time_s"].head(5), strict=True))
        more = f"; and {len(far) - 5:,} more" if len(far) > 5 else ""
        memory = everything.assign(peak_mem_mb=everything["peak_mem_bytes"] / 2**20)
        return Costs(timed[~outliers], "Step 0 (warm-up, not in the chart or the medians): " + "; ".join(
            f"{plain(run)} {seconds:,.3g} s" for run, seconds in zip(warmups["run"], warmups["step_time_s"],
                                                                       strict=True)) if len(warmups) else None,
                     f"Not in the chart (over {STEP_TIME_OUTLIER:g}× their run's 90th percentile step time; in the "
                     f"medians): {listed}{more}." if outliers.any() else None,
                     memory if np.isfinite(memory["peak_mem_mb"].astype(float)).any() else None,
                     cost_table(self.chosen, self.labels, loss_digits(self.all_runs)))

    @_held_per_choice
    def fp16_shares(self) -> Fp16Shares:
        """Each run's bars are what is true of that run: an FP16 run's flushed values (zeros in its record) beside
        what would underflow if cast, an FP32 run's only the latter. The FP32 twin's row is looked up in the
        runs table the page read."""
        parts, overflow, no_stats, no_twin = [], [], [], []
        for lab, r in self._rows():
            totals = reads.tensor_totals(self.store, int(r["run_id"]), reads.is_final(r))
            if totals.empty:
                no_stats.append(lab)
                continue
            twin_row, parted = fp32_twin_row(self.all_runs, r), None
            if twin_row is not None:  # a twin whose loss parted from the run's tells nothing of its flushed values
                parted = twin_parted_at(reads.steps(self.store, int(r["run_id"]), reads.is_final(r)),
                                        reads.steps(self.store, int(twin_row["run_id"]), reads.is_final(twin_row)))
            twin = None if parted is not None else reads.twin_totals(self.store, twin_row)
            if twin is None and summaries.judged_level(r) in summaries.FP16_LEVELS:
                no_twin.append((lab, summaries.flushed_text(None, recorded_by=recorded_by(r["config"]),
                                                            parted_at=parted)))
            parts.append(fp16_underflow_parts(totals, twin, summaries.judged_level(r), lab))
            overflow.append(fp16_overflow_parts(totals, lab))
        if not parts:
            return Fp16Shares(None, None, no_stats, no_twin)
        return Fp16Shares(worst_by_total(pd.concat(parts, ignore_index=True)),
                          worst_by_total(pd.concat(overflow, ignore_index=True)), no_stats, no_twin)

    @_held_per_choice
    def configuration(self, only_differences: bool) -> pd.DataFrame:
        """The runs' settings side by side (config_table), each setting named as the page shows it."""
        return config_table(self.chosen, self.labels, only_differences).rename(index=setting_label)

    def configuration_columns(self) -> dict[str, Column]:
        """The configuration table's columns, a run each: headed by its number and level, its whole label the
        tooltip, all of them on screen at 1,280 px (headed by their whole labels, a third run's was cut off)."""
        width = (TABLE_PX - SETTING_PX) // max(len(self.labels), 1)
        return {"_index": Column("setting", width=SETTING_PX),
                **{lab: Column(f"#{int(r['run_id'])} · {r['opt_level']}", help=lab, width=width)
                   for lab, r in self._rows()}}

    def _reads(self):
        return [(lab, int(r["run_id"]), reads.is_final(r)) for lab, r in self._rows()]

    @_held_per_choice
    def histogram_choices(self) -> tuple[list[str], list[int], int | None]:
        """The tensors offered (the first run's worst FP16 underflow first), the steps any run logged, and the last
        step all of them logged (the default)."""
        rows = self._reads()
        tensors = histogram_tensors([reads.tensor_totals(self.store, run_id, final) for _, run_id, final in rows])
        return tensors, *histogram_steps([reads.logged_steps(self.store, run_id, final) for _, run_id, final in rows])

    def scaled(self) -> bool:
        """Whether a run shown ran at a loss scale other than 1 at some step: its histogram then opens on S·g, what
        its FP16 backward held (the fix of a pair, at 2^20, read as flushing everything against FP16's limits)."""
        scale = self.everything["loss_scale"].astype(float)
        return bool((np.isfinite(scale) & (scale != 1)).any())

    @_held_per_choice
    def overlay(self, tensor: str, step: int | None, at_scale: bool = False) -> Overlay:
        """The tensor's histogram in each run at ``step`` (None: summed over the logged steps), of the unscaled
        gradient g or (``at_scale``) of S·g at each run's own loss scale of each step, and per run its values, zero
        share, and why it has no line where it has none."""
        records, scales = {}, {} if at_scale else None
        for lab, run_id, final in self._reads():
            index, counts = self._tensor_histogram(run_id, final, tensor, step, at_scale)
            records[lab] = (reads.tensor_totals(self.store, run_id, final),
                            None if step is None else reads.tensors_at_step(self.store, run_id, step, final),
                            index, counts)
            if at_scale:  # each row's scale at its first step (a summed column holds one scale: split where it changes)
                # NaN where the step has no row (a run killed before writing it): that S·g is left out, not taken as g
                steps = reads.steps(self.store, run_id, final)
                scales[lab] = steps.set_index("step")["loss_scale"].reindex(index["step"]).astype(float).to_numpy()
        bins, per_run = overlaid_histograms(records, tensor, step, scales)
        return Overlay(bins, per_run, "all logged steps, summed" if step is None else f"step {step:,}",
                       summaries.format_lines(("fp16",)),
                       [] if step is None else self._counted_at(per_run, tensor, step),
                       "S·g at each run's loss scale" if at_scale else "unscaled gradient g",
                       scale_said(bins, step) if at_scale else None)

    def _counted_at(self, per_run: pd.DataFrame, tensor: str, step: int) -> list[str]:
        """What the runs that kept no histogram at ``step`` counted of ``tensor`` there (their per-step signals)."""
        unlogged = set(per_run.loc[per_run["missing"] == NO_STEP, "run"])
        said = []
        for lab, run_id, final in self._reads():
            if lab not in unlogged:
                continue
            signals = reads.signals_at_step(self.store, run_id, step, final)
            counted = signals[signals["tensor"] == tensor]
            if len(counted):  # none: the run did not count the step (or the tensor had no gradient there)
                said.append(f"{plain(lab)}: {counted_text(counted.iloc[0])}")
        return said

    def _tensor_histogram(self, run_id: int, final: bool, tensor: str, step: int | None,
                          at_scale: bool = False) -> tuple[pd.DataFrame, np.ndarray]:
        """The tensor's histogram as (index, counts) of one row, none where it has none: summed over every logged
        step from the writer's totals (``step`` None), else the exact one at ``step``; never all its steps. Summed
        at the scale (``at_scale``): its columns, each of one loss scale (split where the scale changes), for each
        to be moved by its own."""
        if step is None and at_scale:
            return reads.tensor_columns(self.store, run_id, tensor, SCALED_SUM_COLUMNS,
                                        summaries.scale_changes(reads.steps(self.store, run_id, final)), final)
        if step is None:
            names, totals = reads.histogram_totals(self.store, run_id, final)
            picked = [k for k, name in enumerate(names) if name == tensor]
            return pd.DataFrame({"step": [-1] * len(picked), "tensor": tensor}), totals[picked]
        index, counts = reads.histograms_at_step(self.store, run_id, step, final)
        picked = (index["tensor"] == tensor).to_numpy()
        return index[picked].reset_index(drop=True), counts[picked]


def scale_said(bins: pd.DataFrame, step: int | None) -> str:
    """How the S·g histograms were placed on the bins (overlaid_histograms' ``bins``), in words."""
    said = (f"S·g: each run's recorded g at step {step:,} multiplied by the loss scale it ran at there"
            if step is not None else
            "S·g: summed over each run's logged steps, each step's g multiplied by the loss scale that step ran at")
    said += (": a power-of-two scale 2^k moves every value exactly k bins; a scale S that is not a power of two "
             "moves the bins' edges to S·2^e (a line off the whole exponents). A run without loss scaling (O0, "
             "bf16) is g itself. FP16's limits then mean what they say for every run.")
    rounded = sorted(set(bins.loc[bins["rounded"], "run"])) if "rounded" in bins else []
    if rounded:
        said += (" Approximate for " + "; ".join(plain(r) for r in rounded) + ": its steps' scales are not a power "
                 "of two apart, so each step was moved by the power of two nearest its scale.")
    return said


def with_smoothing(df: pd.DataFrame, weight: float) -> pd.DataFrame:
    """One run's steps with the loss and gradient norm smoothed (before thinning: the average sees every step)."""
    return smoothed(smoothed(df, "loss", weight), "grad_norm", weight) if weight > 0 else df


#: the cost table's columns, what tells the runs apart first, every one on screen at 1,280 px
COST_COLUMNS = {
    "run": Column(width=200, pinned=True, help="Hover a cell for the whole label."),
    "final loss": Column(width=90, help="The last step's loss, as every page writes it."),
    "skipped steps": Column("skipped", width=80, help="Optimizer steps the loss scaler skipped, of the steps "
                                                      "recorded."),
    "median step time": Column("step time", width=85, help="Median time per step, over the steps after the "
                                                           "warm-up step 0."),
    "throughput": Column(width=125, help="Batch size over the median step time."),
    "peak memory": Column(width=100),
    "model state": Column(width=100),
}
#: the configuration table's column of setting names
SETTING_PX = 170


def compare(store: Store, chosen: pd.DataFrame, all_runs: pd.DataFrame, weight: float) -> CompareRuns:
    """The Compare page's view of ``chosen`` (rows of ``all_runs``, the runs table the page read once), their
    loss and gradient norm smoothed with TensorBoard's ``weight`` (0: none). Held by the session while the runs'
    data stays the same (reads.view_version) and ``weight`` too: a live refresh that finds no new rows, or a choice
    in a widget below the curves, does not smooth and thin every run's steps again."""
    version = (reads.view_version(store, all_runs, *(r for _, r in chosen.iterrows())), weight)
    return reads.while_unchanged("compare", version, lambda: _compare(store, chosen, all_runs, weight),
                                 str(store.path), tuple(chosen["run_id"].astype(int)))


def _compare(store: Store, chosen: pd.DataFrame, all_runs: pd.DataFrame, weight: float) -> CompareRuns:
    labels = [summaries.run_label(r) for _, r in chosen.iterrows()]
    steps = [summaries.thin_steps(with_smoothing(reads.steps(store, int(r["run_id"]), reads.is_final(r)).assign(
        run=lab), weight)) for lab, (_, r) in zip(labels, chosen.iterrows(), strict=True)]
    return CompareRuns(store, chosen, all_runs, labels, pd.concat(steps, ignore_index=True))
