"""The FP8 page's view-model: what pages/6_FP8.py shows of one run's FP8 records (the recorded recipe, its
findings, the lost-share heatmap, one layer's amax against its scale, the layer table, a what-if recipe, the
block-scaled recipes' table), as typed
values built from mpdiag.analysis.fp8_summaries / fp8_findings and the cached reads (reads.py). No widgets and no
drawing here, so every part is testable without Streamlit. Texts are unescaped: the page passes them through
``plain`` (they quote the user's module names).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pandas as pd

from mpdiag.analysis import fp8_summaries
from mpdiag.analysis.finding import Finding
from mpdiag.analysis.fp8_findings import fp8_findings, recorded_settings
from mpdiag.analysis.fp8_summaries import fmt_label
from mpdiag.dashboard import reads
from mpdiag.numerics.fp8_recipes import BLOCK_RECIPES, RECIPES, Fp8Settings
from mpdiag.store import Store


@dataclass(frozen=True)
class Layer:
    """One layer and role under one recipe: its amax per recorded step against the scale, and the caption."""
    series: pd.DataFrame
    said: str


@dataclass(frozen=True)
class WhatIf:
    """Another recipe on the stored amax series and histograms: values lost per recorded step (a range where a
    format edge cuts a binade), the caption, and whether anything is lost at all."""
    lost: pd.DataFrame
    said: str
    any_lost: bool


@dataclass(frozen=True)
class Fp8Run:
    """One run's FP8 records; ``settings`` None where the run was not started with FP8 statistics, ``records``
    empty where it recorded none."""
    settings: Fp8Settings | None
    records: pd.DataFrame
    histograms: pd.DataFrame | None
    #: the block-scaled recipes' table (fp8_summaries.block_table); empty where none was recorded
    blocks: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)

    @property
    def recorded(self) -> str:
        """The recorded recipe and how much was recorded, in one sentence."""
        s, records = self.settings, self.records
        recipes = ("current and delayed scaling" if s.recipe == "both" or s.is_block else f"{s.recipe} scaling")
        if s.is_block:  # an fp8-sim run of a block recipe: the per-tensor recipes are recorded beside it
            recipes = f"{s.recipe.upper()} simulated; {recipes} recorded beside it"
        modules = records["module"].nunique()
        return (f"Recorded recipe: {recipes}, history {s.history:,}, margin {s.margin}, output gradients in "
                f"{fmt_label(s.role_format('grad_output').name)}{', power-of-two scales' if s.pow2 else ''}; "
                f"{records['step'].nunique():,} recorded steps, {modules:,} Linear module{'' if modules == 1 else 's'}"
                + (f"; block-scaled too: {' and '.join(r.upper() for r in s.recorded_blocks)} (their table is at "
                   "the end of the page)." if s.recorded_blocks else "."))

    @property
    def findings(self) -> list[Finding]:
        return fp8_findings(self.records, self.settings)

    @property
    def recipes(self) -> list[str]:
        return [r for r in ("delayed", "current") if r in set(self.records["recipe"])]

    @property
    def table(self) -> pd.DataFrame:
        return fp8_summaries.layer_table(self.records)

    def lost_cells(self, recipe: str, role: str) -> pd.DataFrame:
        return fp8_summaries.lost_cells(self.records, recipe, role)

    def layer(self, layer: str, role: str, recipe: str) -> Layer:
        """The layer's amax series, and how many of its recorded steps overflow (first, and the most values)."""
        series = fp8_summaries.amax_series(self.records, layer, role, recipe)
        over = series[series["overflows"]]
        said = (f"{layer} {role}, {recipe} scaling: {len(over):,} of {len(series):,} recorded steps "
                f"overflow{'s' if len(over) == 1 else ''}")
        if len(over):
            most = over.loc[over["overflow"].idxmax()]
            said += f" (first at step {int(over['step'].iloc[0]):,}"
            said += (f"; the most values at step {int(most['step']):,}: {int(most['overflow']):,})" if len(over) > 1
                     else f": {int(most['overflow']):,} value{'' if most['overflow'] == 1 else 's'})")
        return Layer(series, said + ", the layer table's \"overflowing\" steps.")

    def whatif(self, layer: str, role: str, settings: Fp8Settings) -> WhatIf:
        """``settings`` (another recipe, history, margin, format) on the layer and role, without a rerun; said to be
        the recorded count where they are the recorded settings."""
        df = fp8_summaries.whatif(self.records, self.histograms, layer, role, settings.recipe, settings)
        low = int((df["underflow low"] + df["overflow low"]).sum())
        high = int((df["underflow high"] + df["overflow high"]).sum())
        counted = f"{low:,}" if low == high else f"between {low:,} and {high:,}"
        said = (f"{layer} {role} in {fmt_label(settings.role_format(role).name)}, {settings.recipe} scaling: "
                f"{counted} value{'' if high == 1 else 's'} lost over the "
                "recorded steps. Computed from the stored exponent histograms and amax series: the scales are exact; a "
                "binade that a format edge cuts (E4M3's overflow at 464 lies inside [256, 512)) gives a range, not a "
                "count.")
        recorded_lost = fp8_summaries.recorded_counts(self.records, layer, role, settings.recipe, settings,
                                                      self.settings)
        if recorded_lost is not None:
            said += (f" These are the recorded settings: the recorded count is exactly {recorded_lost:,} (the layer "
                     "table's underflow + overflow of this row).")
        return WhatIf(df, said, high != 0)


def fp8(store: Store, run: pd.Series, final: bool) -> Fp8Run:
    """The FP8 page's view of ``run``: its records are read only where it was started with FP8 statistics."""
    settings = recorded_settings(run["config"])
    records, histograms = (reads.fp8(store, int(run["run_id"]), final) if settings is not None
                           else (pd.DataFrame(), None))
    blocks = pd.DataFrame()
    if len(records):  # the block-scaled recipes (mxfp8, nvfp4) have their own table; the rest is per-tensor
        block_rows = records[records["recipe"].isin(BLOCK_RECIPES)]
        if len(block_rows):
            blocks = fp8_summaries.block_table(block_rows, *reads.fp8_blocks(store, int(run["run_id"]), final))
        records = records[records["recipe"].isin(RECIPES)]
    return Fp8Run(settings, records, histograms, blocks)
