"""FP8: would this model train in FP8? Per Linear layer and role, what the recorded FP8 recipe loses, the amax
history against the recipe's scale, and what another history, margin or format would have done.

Reads widgets, calls mpdiag.analysis (fp8_summaries, fp8_findings) and the chart layer, renders; no store
queries, no torch. Module names come from the user's model: they reach Markdown only through ``plain``.
"""

import dataclasses

import pandas as pd
import streamlit as st

from mpdiag.analysis import fp8_summaries
from mpdiag.analysis.fp8_findings import fp8_findings, recorded_settings
from mpdiag.analysis.fp8_summaries import TABLE_COLUMNS, fmt_label, percent
from mpdiag.dashboard import charts, reads
from mpdiag.dashboard import frame as ui
from mpdiag.dashboard.untrusted import plain
from mpdiag.numerics.fp8_recipes import ROLES, Fp8Settings

TABLE_ROWS_SHOWN = 30  # a model's Linear layers x roles x recipes: more scroll inside the table
ROLE_HELP = ("input: the activation entering the Linear (E4M3); weight: its weight as that forward pass used it "
             "(E4M3); grad_output: the gradient flowing into its output, unscaled (E5M2, or E4M3 if chosen)")


def not_recorded(run: pd.Series, run_id: int, asked: bool) -> None:
    """Why a run has no FP8 rows (``asked``: it was started with --fp8), and how to get them."""
    if asked and run["status"] != "running":
        st.warning(f"Run #{run_id} was started with FP8 statistics but recorded none: it ended ({plain(run['status'])}) "
                   "before its first logged step, or its model has no nn.Linear. Its error, if any, is on the home page.")
    elif run["opt_level"] == "fp8-sim":
        st.info(f"Run #{run_id} ran with FP8 simulated (fp8-sim) but did not record FP8 statistics: its loss curve "
                "is on Compare. To see what the recipe cast, rerun it with FP8 statistics (Findings page, or "
                f"`python -m mpdiag rerun {run_id} --fp8`).")
    elif run["status"] == "running":
        st.info("No FP8 statistics recorded yet; this view updates as the run records its first logged step.")
    else:
        st.info(f"Run #{run_id} was recorded without FP8 statistics. Record them with "
                f"`python -m mpdiag rerun {run_id} --fp8 --fp8-recipe both` (or tick \"Record FP8 statistics\" in "
                "the run form), then open this page on that run.")


def fp8_view(store, run: pd.Series, final: bool, runs: pd.DataFrame) -> None:
    run_id = int(run["run_id"])
    settings = recorded_settings(run["config"])
    records, histograms = reads.fp8(store, run_id, final) if settings is not None else (pd.DataFrame(), None)
    if settings is None or records.empty:
        not_recorded(run, run_id, settings is not None)
        return
    recipes_said = "current and delayed scaling" if settings.recipe == "both" else f"{settings.recipe} scaling"
    modules = records["module"].nunique()
    st.caption(f"Recorded recipe: {recipes_said}, history {settings.history:,}, margin {settings.margin}, "
               f"output gradients in {fmt_label(settings.role_format('grad_output').name)}"
               f"{', power-of-two scales' if settings.pow2 else ''}; {records['step'].nunique():,} recorded steps, "
               f"{modules:,} Linear module{'' if modules == 1 else 's'}.")
    findings = fp8_findings(records, settings)
    for f in findings:
        st.warning(plain(f"{f.title}. {f.evidence} {f.recommendation}"))
    if not findings:
        st.success(f"No Linear loses values under this recipe: no underflow above "
                   f"{100 * fp8_summaries.LOST_SHARE:g} % of a tensor and no overflow at any recorded step.")

    c1, c2 = st.columns(2)
    recipes = [r for r in ("delayed", "current") if r in set(records["recipe"])]
    recipe = c1.radio("Recipe", recipes, horizontal=True, key="recipe", bind="query-params")
    role = c2.radio("Role", list(ROLES), horizontal=True, key="role", bind="query-params", help=ROLE_HELP)
    cells = fp8_summaries.lost_cells(records, recipe, role)
    ui.show_chart(charts.fp8_lost_heatmap(cells, f"share of {role} values lost, {recipe} scaling (grey: "
                                                   "none; coloured: the table's \"losing\" steps)"), width="stretch")

    table = fp8_summaries.layer_table(records)
    layer = st.selectbox("Layer (worst first; type to search)", list(dict.fromkeys(table["layer"])), key="layer",
                         bind="query-params")
    series = fp8_summaries.amax_series(records, layer, role, recipe)
    over = series[series["overflows"]]
    said = f"{layer} {role}, {recipe} scaling: {len(over):,} of {len(series):,} recorded steps overflow{'s' if len(over) == 1 else ''}"
    if len(over):
        most = over.loc[over["overflow"].idxmax()]
        said += f" (first at step {int(over['step'].iloc[0]):,}"
        said += (f"; the most values at step {int(most['step']):,}: {int(most['overflow']):,})" if len(over) > 1
                 else f": {int(most['overflow']):,} value{'' if most['overflow'] == 1 else 's'})")
    st.caption(plain(said + ", the layer table's \"overflowing\" steps."))
    ui.show_chart(charts.fp8_amax_panel(series, f"amax of {layer}'s {role} against what the {recipe} scale lets "
                                                  "through (▲ values overflowed)"), width="stretch")
    st.subheader("Layers, worst first")
    counts = [c for c in table.columns if c not in ("layer", "role", "recipe", "worst lost", "at step")]
    # every row on the page up to TABLE_ROWS_SHOWN (Streamlit's own height shows ten and scrolls inside the page)
    st.dataframe(table.style.format({"worst lost": percent, **{c: "{:,}" for c in counts}}), hide_index=True,
                 width="stretch", height=ui.table_height(len(table), TABLE_ROWS_SHOWN),
                 column_config={c: st.column_config.Column(help=h) for c, h in TABLE_COLUMNS.items()})
    whatif_view(records, histograms, layer, role, settings)


def whatif_view(records: pd.DataFrame, histograms: pd.DataFrame, layer: str, role: str, recorded: Fp8Settings) -> None:
    """Another recipe on the stored amax series and histograms of the chosen layer and role, without a rerun."""
    st.subheader("What if: another recipe, history, margin or format")
    c = st.columns(5)
    recipe = c[0].radio("Recipe", ["delayed", "current"], key="whatif_recipe")
    history = int(c[1].number_input("History (recorded steps)", 1, 1_000_000, recorded.history, key="whatif_history",
                                    disabled=recipe == "current"))
    margin = int(c[2].number_input("Margin", 0, 64, recorded.margin, key="whatif_margin",
                                   disabled=recipe == "current"))
    grad_format = c[3].radio("Output gradient format", ["e5m2", "e4m3"],
                             index=["e5m2", "e4m3"].index(recorded.grad_format), key="whatif_format",
                             disabled=role != "grad_output")
    pow2 = c[4].checkbox("Power-of-two scales", recorded.pow2, key="whatif_pow2")
    settings = dataclasses.replace(recorded, recipe=recipe, history=history, margin=margin, grad_format=grad_format,
                                   pow2=pow2)
    df = fp8_summaries.whatif(records, histograms, layer, role, recipe, settings)
    low = int((df["underflow low"] + df["overflow low"]).sum())
    high = int((df["underflow high"] + df["overflow high"]).sum())
    counted = f"{low:,}" if low == high else f"between {low:,} and {high:,}"
    said = (f"{layer} {role} in {fmt_label(settings.role_format(role).name)}, {recipe} scaling: {counted} "
            f"value{'' if high == 1 else 's'} lost over the "
            "recorded steps. Computed from the stored exponent histograms and amax series: the scales are exact; a "
            "binade that a format edge cuts (E4M3's overflow at 464 lies inside [256, 512)) gives a range, not a count.")
    recorded_lost = fp8_summaries.recorded_counts(records, layer, role, recipe, settings, recorded)
    if recorded_lost is not None:
        said += f" These are the recorded settings: the recorded count is exactly {recorded_lost:,}."
    st.caption(plain(said))
    if df.empty:
        st.info("No recorded steps of this layer and role: nothing to draw.")
        return
    if high == 0:
        st.caption("No value is lost at any recorded step under these settings: the line lies on 0.")
    ui.show_chart(charts.fp8_whatif_lines(df, "values lost per recorded step (band: lower to upper bound)"),
                  width="stretch")


ui.single_run_page("FP8", fp8_view)
