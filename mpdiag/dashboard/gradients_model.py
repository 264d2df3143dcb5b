"""The Gradients page's view-model: what pages/1_Gradients.py shows of one run, as typed values built from the cached
reads (reads.py) and mpdiag.analysis.summaries for the choices its widgets make. No widgets and no drawing here, so
every part of the page is testable without Streamlit's script runner; the page reads its widgets and draws these.
Texts are returned as written, unescaped: the page passes user-named parts (tensor names) through ``plain``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from mpdiag.analysis import summaries
from mpdiag.analysis.compare import fp32_twin_row, twin_parted_at
from mpdiag.dashboard import reads
from mpdiag.dashboard.tables import Column
from mpdiag.numerics.formats import LOW_PRECISION
from mpdiag.options import recorded_by
from mpdiag.store import Store

SPECIALS = {"zeros": "zero", "nan": "NaN", "posinf": "+inf", "neginf": "-inf"}
CATEGORIES = ("underflow", "subnormal", "overflow")
#: the small multiples draw this many tensors until "show all" is ticked
GRID_FIRST = 12
#: the table's count columns (thousands separated); the others are text
COUNT_COLUMNS = ("numel", "nonfinite")
#: how many stored columns the heatmap reads per column it draws, at most: the rollup levels are 16x apart, so
#: reading the finest level within 16x its width (heatmap_cells merges them) draws it at its full width; rollup
#: rows lie together in the file, and exact rows are read only for runs of up to 16x its width in kept steps
READ_PER_DRAWN_COLUMN = 16


@dataclass(frozen=True)
class Ranking:
    """The tensors worst first for one format and view, and the columns the table shows of them."""
    fmt: str
    at_scale: bool
    #: FP16 left the values it flushed as exact zeros: the page states that share beside the exact counts
    states_flushed: bool
    #: summaries.gradient_ranking's rows (a flushed_share column only with a twin)
    rows: pd.DataFrame
    ranked_by: str
    #: ``(column, label, help)`` of each table column, in order
    columns: list[tuple[str, str, str]]

    @property
    def tensors(self) -> list[str]:
        return self.rows["tensor"].tolist()

    @property
    def what(self) -> str:
        return "S·g" if self.at_scale else "g"


@dataclass(frozen=True)
class TensorView:
    """One tensor over every logged step: the heatmap of its exponents (or why there is none)."""
    tensor: str
    #: its exponent histograms in the heatmap's step columns, (index, counts) as reads.tensor_columns gives them
    index: pd.DataFrame
    counts: np.ndarray
    #: the line under the selector (the tensor's shares; the flushed share when FP16 flushed values)
    summary: str
    cells: pd.DataFrame
    drawn: pd.DataFrame | None
    extent: tuple[float, float] | None
    title: str
    #: what the heatmap leaves out to stay readable; the logged steps it leaves blank, said; or why it is empty
    off: list[str]
    blank: str | None
    empty: str | None
    #: why the heatmap has gaps: which steps the run stored (--every N, and around anomalies); None: every step
    kept: str | None = None


@dataclass(frozen=True)
class StepView:
    """One tensor at one logged step: its histogram at the step's loss scale, exact shares, and every tensor's rows
    and histograms at that step (the table and the small multiples)."""
    step: int
    scale: float
    at_step: pd.Series
    hist: np.ndarray
    #: the step histogram's bars, None where the loss scale was 0 (S·g is 0: no exponent)
    bars: pd.DataFrame | None
    tiles: dict
    unscaled: dict
    denom: int
    #: where the ranking states it: the share FP16 flushed at this step against the twin (None without a twin,
    #: NaN where the twin lacks the tensor) and the sentence saying it; else None and ""
    flushed: float | None
    flushed_said: str
    all_rows: pd.DataFrame
    h_index: pd.DataFrame
    h_counts: np.ndarray


@dataclass(frozen=True)
class Grid:
    """Every tensor's histogram at the step as small multiples, and the caption saying what they show."""
    bars: pd.DataFrame
    drawn: list[str]
    lines: pd.DataFrame | None
    extent: tuple[float, float] | None
    said: str


def _held(key_of: Callable):
    """A GradientsRun method whose value is held by the run's view for the arguments' ``key_of(*args)``: the view
    itself is held while a live run's data stays the same (:func:`gradients`), so a refresh with nothing new hands
    back the very values (and frames) of the previous one, and the chart layer reuses its charts of them."""
    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def held(self, *args, **kwargs):
            key = (method.__name__, *key_of(*args, **kwargs))
            if key not in self.held:
                self.held[key] = method(self, *args, **kwargs)
            return self.held[key]
        return held
    return wrap


@dataclass(frozen=True)
class GradientsRun:
    """One run as the page opens on it; its methods give what the page shows for its widgets' choices."""
    store: Store
    run: pd.Series
    final: bool
    logged: list[int]
    totals: pd.DataFrame
    steps: pd.DataFrame
    #: the FP32 twin's runs-table row and its per-tensor totals; None without a twin, and the totals None where
    #: the two runs' losses part (``twin_parted_at``: compare.twin_parted_at), whose zeros then tell nothing
    twin: pd.Series | None
    twin_totals: pd.DataFrame | None
    #: how many steps the FP32 shadow compared (the flushed text says what they add)
    shadow_steps: int
    #: why each logged step was kept (Store.kept_steps)
    kept: pd.DataFrame | None = None
    twin_parted_at: int | None = None
    #: what the methods below gave, by their arguments (_held)
    held: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def run_id(self) -> int:
        return int(self.run["run_id"])

    @property
    def nothing_logged(self) -> str:
        if self.run["status"] == "running":
            return "No gradient statistics recorded yet; this view updates as the run records its first step."
        return f"Run #{self.run_id} recorded no gradient statistics (it stopped before its first step completed)."

    @functools.cached_property
    def whatif_exponents(self) -> list[int]:
        """The powers of two the what-if control offers (summaries.whatif_exponents over the run's steps)."""
        return summaries.whatif_exponents(self.steps)

    @property
    def formats(self) -> list[str]:
        return summaries.recorded_formats(self.totals)

    @property
    def default_format(self) -> str:
        """The format the page opens on: the one the run computes in (BF16 for a BF16 run: it opened on FP16's
        limits and shares), else the first recorded (FP16)."""
        own = (summaries.LEVEL_FORMAT.get(summaries.judged_level(self.run)) or "").lower()
        return own if own in self.formats else self.formats[0]

    @property
    def format_help(self) -> str:
        return ("FP8 (E4M3, E5M2) as a plain cast, without a per-tensor scale; what FP8 recipes' scaled casts do "
                "to each Linear's tensors is on the FP8 page" + ("" if len(self.formats) == len(LOW_PRECISION) else
                ". This run was recorded before FP8 counts existed; rerun it to get them."))

    @_held(lambda fmt, at_scale: (fmt, at_scale))
    def ranking(self, fmt: str, at_scale: bool) -> Ranking:
        """The tensors worst first. FP16 leaves the values it flushed as exact zeros, invisible to the exact
        counts: such a run is ranked by that share (against its FP32 twin) or, without a twin, by its zeros."""
        states_flushed = fmt == "fp16" and summaries.judged_level(self.run) in summaries.FP16_LEVELS
        rows, ranked_by = summaries.gradient_ranking(self.totals, fmt, at_scale, states_flushed, self.twin_totals)
        what = "S·g" if at_scale else "g"
        return Ranking(fmt, at_scale, states_flushed, rows, ranked_by,
                       table_columns(fmt, what, states_flushed and self.twin_totals is not None))

    @_held(lambda ranking, tensor, show_bf16: (ranking.fmt, ranking.at_scale, tensor, show_bf16))
    def tensor(self, ranking: Ranking, tensor: str, show_bf16: bool) -> TensorView:
        """The chosen tensor's line and heatmap, with FP16's (or the chosen format's) limits, BF16's too if asked."""
        fmt, at_scale, what = ranking.fmt, ranking.at_scale, ranking.what
        chosen = ranking.rows[ranking.rows["tensor"] == tensor].iloc[0]
        line = summaries.tensor_summary_line(chosen, fmt)
        if ranking.states_flushed:
            flushed = None if self.twin_totals is None else float(
                summaries.flushed_to_zero(self.totals, self.twin_totals).get(tensor, np.nan))
            line += " " + summaries.flushed_text(flushed, self.shadow_steps, recorded_by(self.run["config"]),
                                                 self.twin_parted_at)
        index, counts = self._columns(tensor, at_scale)
        cells = summaries.heatmap_cells(index, counts, self.steps, at_scale=at_scale)
        title = f"{tensor}: |{what}| per step (click a column to see its step below)"
        kept = None if self.kept is None else summaries.kept_steps_text(self.kept, self.run["every"])
        if not len(cells):
            return TensorView(tensor, index, counts, line, cells, None, None, title, [], None, empty=(
                f"{tensor}: no finite non-zero value of |{what}| at any logged step (every value was 0, NaN or "
                f"inf{', or the loss scale was 0' if at_scale else ''}), so there is nothing to place on the "
                "exponent axis. The counts below say what it held."), kept=kept)
        lines = summaries.format_lines(("fp16", "bf16") if show_bf16 else (fmt,))
        drawn, extent, off = summaries.heatmap_view(cells, lines, f"of {tensor} at any logged step")
        # the columns with nothing to draw are exact steps carrying their counts (Store.histogram_columns)
        numel = self.totals.set_index("tensor")["numel_per_step"].get(tensor, np.nan)
        blank = summaries.blank_steps(index, counts, self.steps, index.assign(numel=numel), at_scale=at_scale)
        return TensorView(tensor, index, counts, line, cells, drawn, extent, title, off,
                          summaries.blank_steps_text(blank, len(self.logged)) if len(blank) else None, None, kept)

    def _columns(self, tensor: str, at_scale: bool) -> tuple[pd.DataFrame, np.ndarray]:
        """The tensor's histograms in at most READ_PER_DRAWN_COLUMN times as many step columns as its heatmap draws
        (summaries.heatmap_width), each of one loss scale in the S·g view."""
        names, totals = reads.histogram_totals(self.store, self.run_id, self.final)
        width = summaries.heatmap_width(totals[names.index(tensor)] if tensor in names else np.zeros(1))
        split_at = summaries.scale_changes(self.steps) if at_scale else ()
        return reads.tensor_columns(self.store, self.run_id, tensor, READ_PER_DRAWN_COLUMN * width, split_at,
                                    self.final)

    @_held(lambda ranking, shown, step: (ranking.fmt, ranking.at_scale, shown.tensor, step))
    def at_step(self, ranking: Ranking, shown: TensorView, step: int) -> StepView:
        """The tensor at one logged step: the histogram in the shown view, and the exact shares of S·g at the step's
        own loss scale and of g (one function, cast_shares, gives both, so tiles and what-if agree)."""
        fmt, scale = ranking.fmt, summaries.scale_at_step(self.steps, step)
        tensor = shown.tensor
        at_step = reads.tensor_at_step(self.store, self.run_id, tensor, step, self.final)
        h_index, h_counts = reads.histograms_at_step(self.store, self.run_id, step, self.final)
        row = np.flatnonzero(h_index["tensor"].to_numpy() == tensor)  # the step's exact histogram, never a sum
        hist = h_counts[row[0]] if len(row) else np.zeros(h_counts.shape[1], dtype=np.int64)
        # the multiplier the shown view applies to g: 1, or the step's loss scale (log2 of 0 is -inf: S·g all 0)
        with np.errstate(divide="ignore"):
            shown = float(np.log2(scale)) if ranking.at_scale and np.isfinite(scale) else 0.0
            own = float(np.log2(scale)) if np.isfinite(scale) else 0.0
        specials = {SPECIALS[k]: int(at_step[k]) for k in SPECIALS}
        bars = summaries.step_histogram(hist, specials, LOW_PRECISION[fmt], shown) if np.isfinite(shown) else None
        flushed = self._flushed_at(at_step, tensor, step) if ranking.states_flushed else None
        return StepView(step, scale, at_step, hist, bars, summaries.cast_shares(at_step, hist, fmt, own, scale),
                        summaries.cast_shares(at_step, hist, fmt, 0, scale),
                        int(summaries.nonzero_finite(at_step.to_frame().T).iloc[0]), flushed,
                        f"At step {step}: " + summaries.flushed_text(flushed, self.shadow_steps,
                                                                     recorded_by(self.run["config"]),
                                                                     self._parted_by(step))
                        if ranking.states_flushed else "",
                        reads.tensors_at_step(self.store, self.run_id, step, self.final).set_index("tensor"),
                        h_index, h_counts)

    def _parted_by(self, step: int) -> int | None:
        """The step the twin's loss parted from the run's, if it had by ``step`` (before it, a step's weights are
        still alike, and the twin's row there shows what FP16 flushed)."""
        parted = self.twin_parted_at
        return parted if parted is not None and step >= parted else None

    def _flushed_at(self, at_step: pd.Series, tensor: str, step: int) -> float | None:
        """The share FP16 flushed of the tensor at the step against the twin's row there (NaN where the twin did not
        record the tensor); None when the twin did not log the step, there is no twin, or their losses had parted
        by then."""
        if self._parted_by(step) is not None:
            return None
        twin_step = reads.twin_at_step(self.store, self.twin, tensor, step)
        return None if twin_step is None else float(
            summaries.flushed_to_zero(at_step.to_frame().T, twin_step.to_frame().T).iloc[0])

    def whatif(self, ranking: Ranking, at: StepView, k: int) -> dict:
        """The tensor's shares were g multiplied by 2^k (exact at the powers cast_shares counts exactly)."""
        return summaries.cast_shares(at.at_step, at.hist, ranking.fmt, k, at.scale)

    @_held(lambda ranking, at, k: (ranking.fmt, ranking.at_scale, at.step, k))  # the same for every tensor
    def table(self, ranking: Ranking, at: StepView, k: int) -> tuple[pd.DataFrame, dict[str, Column]]:
        """The ranking as the table shows it, with the underflow at the what-if's power at this step beside the
        underflow over all steps; each column (named by its long label) with a short header, its long label and
        explanation as the header's tooltip, and a width: at 1,280 px every column is on screen (table_columns)."""
        table = pd.DataFrame({label: (ranking.rows[c] if c in ("tensor", *COUNT_COLUMNS) else
                                      ranking.rows[c].map(lambda v: "n/a" if pd.isna(v) else f"{v:.2%}"))
                              for c, label, _ in ranking.columns})
        label = f"{ranking.fmt} underflow at 2^{k}, step {at.step:,}"
        empty = np.zeros(at.h_counts.shape[1] if len(at.h_counts) else 1, dtype=np.int64)
        hists = dict(zip(at.h_index["tensor"], at.h_counts, strict=True))

        def underflow_at_k(name: str) -> str:
            if name not in at.all_rows.index:
                return "not logged"
            shares = summaries.cast_shares(at.all_rows.loc[name], hists.get(name, empty), ranking.fmt, k, at.scale)
            return summaries.share_text(shares["underflow"])

        where = [c for c, _, _ in ranking.columns].index("underflow_share") + 1
        table.insert(where, label, ranking.rows["tensor"].map(underflow_at_k).to_numpy())
        columns = [*ranking.columns]
        columns.insert(where, ("whatif", label, f"Of its finite non-zero values at step {at.step:,}, the share that "
                                                f"would underflow in {ranking.fmt} were g multiplied by 2^{k} (the "
                                                "what-if above); a range where a bin straddles the edge."))
        return table, {label: table_column(c, label, help_, k) for c, label, help_ in columns}

    @_held(lambda ranking, at, everything: (ranking.fmt, ranking.at_scale, at.step, everything))
    def grid(self, ranking: Ranking, at: StepView, everything: bool) -> Grid:
        """Every tensor's exponent histogram at the step, worst first (the ranking's order), the first GRID_FIRST
        unless ``everything``; the caption names the rules drawn and the tensors with nothing to draw."""
        what, total = ranking.what, len(at.h_index)
        with np.errstate(divide="ignore"):
            shift = (float(np.log2(at.scale)) if at.scale > 0 else -np.inf) if ranking.at_scale else 0.0
        bars, drawn, empty = summaries.histogram_grid(at.h_index, at.h_counts, ranking.tensors, ranking.fmt, shift,
                                                      limit=None if everything else GRID_FIRST)
        said = (f"Step {at.step:,} (the step chosen above), {len(drawn) + len(empty):,} of {total:,} tensors, worst "
                f"first as in the table; bin e holds |{what}| from 2^e to 2^(e+1).")
        lines = extent = None
        if drawn:
            lines, extent, off = summaries.heatmap_view(bars, summaries.format_lines((ranking.fmt,)),
                                                        f"of these tensors at step {at.step:,}")
            rules = {"min subnormal": "dotted", "min normal": "dashed", "max": "long-dashed"}
            said += "".join(f" {rules[r.kind].capitalize()} rule: {r.limit}." for r in lines.itertuples())
            if off:
                said += " Not drawn, to keep the data readable: " + "; ".join(off) + "."
        if empty:
            why = "the loss scale was 0 (S·g holds no finite non-zero value)" if ranking.at_scale and \
                not np.isfinite(shift) else "every value was 0, NaN or inf"
            said += (f" Nothing to draw for {len(empty):,}: " + ", ".join(empty[:20])
                     + (f" and {len(empty) - 20:,} more" if len(empty) > 20 else "") + f" ({why}).")
        return Grid(bars, drawn, lines, extent, said)


def table_columns(fmt: str, what: str, show_flushed: bool) -> list[tuple[str, str, str]]:
    """``(column, label, help)`` of the ranking table: each column named with its unit and explained; the flushed
    share only where it is known (an FP16 run with an FP32 twin)."""
    return [
        ("tensor", "tensor", "The parameter, as the model names it."),
        *([("flushed_share", "flushed vs FP32 twin (%)",
            "Flushed to zero: the share of all values, over all logged steps, that are zeros beyond the FP32 twin's "
            "(values non-zero in FP32 that FP16 flushed to zero before they were recorded).")] if show_flushed else []),
        ("underflow_share", f"{fmt} underflow (%)",
         f"Share of the recorded finite non-zero values of {what} that are too small for {fmt} (become 0), "
         "exact counts over all logged steps."),
        ("subnormal_share", f"{fmt} subnormal (%)",
         f"Share of the recorded finite non-zero values of {what} kept only as {fmt} subnormals (fewer "
         "significant bits)."),
        ("overflow_share", f"{fmt} overflow (%)",
         f"Share of the recorded finite non-zero values of {what} too large for {fmt} (become inf)."),
        ("zero_share", "zeros (%)",
         "Share of all values that are exact zeros in the record, over all logged steps (in an FP16 run: genuine "
         "zeros and the values FP16 flushed)."),
        ("numel", "values per step", "The tensor's size: its values at one step (the other columns are over all "
         "logged steps, so its NaN / inf count can be larger)."),
        ("nonfinite", "NaN / inf", "NaN, +inf and -inf values (a count, not a share), summed over steps."),
    ]


#: each ranking column's short header and width (px): together at most tables.TABLE_PX, so at 1,280 px no column is
#: off screen (the long names, 'fp16 underflow at 2^0, step 99', took 1,030 px); the format is in the section's title
TABLE_HEADERS = {"tensor": ("tensor", 155), "flushed_share": ("flushed", 80), "underflow_share": ("underflow", 85),
                 "whatif": (None, 120), "subnormal_share": ("subnormal", 85), "overflow_share": ("overflow", 80),
                 "zero_share": ("zeros", 65), "numel": ("size", 75), "nonfinite": ("NaN / inf", 70)}


def table_column(column: str, label: str, help_: str, k: int) -> Column:
    """How the table shows one of its columns (``label``: its long name with its unit, first in the tooltip)."""
    header, width = TABLE_HEADERS[column]
    if column in COUNT_COLUMNS:
        return Column(header, f"{label}: {help_}", width, kind="number", format="%,d")
    return Column(header or f"underflow at 2^{k}", f"{label}: {help_}" if column != "tensor" else help_, width,
                  pinned=True if column == "tensor" else None)


def gradients(store: Store, run: pd.Series, final: bool, runs: pd.DataFrame) -> GradientsRun:
    """The Gradients page's view of ``run`` (a row of ``runs``, the runs table the page read once: its FP32 twin's
    row is found there, not read again). A live run's view, with what its methods gave, is held by the session
    while the run's data and its twin's stay the same (its refresh every second finds nothing new most times);
    a final run's reads are cached (reads.py)."""
    if final:
        return _gradients(store, run, final, runs)
    return reads.while_unchanged("gradients", reads.data_version(store, run),
                                 lambda: _gradients(store, run, final, runs), str(store.path), int(run["run_id"]))


def _gradients(store: Store, run: pd.Series, final: bool, runs: pd.DataFrame) -> GradientsRun:
    run_id = int(run["run_id"])
    twin, steps = fp32_twin_row(runs, run), reads.steps(store, run_id, final)
    parted = None if twin is None else twin_parted_at(steps, reads.steps(store, int(twin["run_id"]),
                                                                        reads.is_final(twin)))
    return GradientsRun(store, run, final, reads.logged_steps(store, run_id, final),
                        reads.tensor_totals(store, run_id, final), steps, twin,
                        None if parted is not None else reads.twin_totals(store, twin),
                        int(reads.shadow_stats(store, run_id, final)["step"].nunique()),
                        reads.kept_steps(store, run_id, final), parted)
