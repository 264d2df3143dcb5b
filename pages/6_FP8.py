"""FP8: would this model train in FP8? Per Linear layer and role, what the recorded FP8 recipe loses, the amax
history against the recipe's scale, and what another history, margin or format would have done.

Reads widgets, asks mpdiag.dashboard.fp8_model for what to show and draws it with the chart layer; no store
queries, no torch. Module names come from the user's model: they reach Markdown only through ``plain``.
"""

import dataclasses

import pandas as pd
import streamlit as st

from mpdiag.analysis import fp8_summaries
from mpdiag.analysis.findings import fp8_record_again
from mpdiag.analysis.fp8_summaries import TABLE_COLUMNS, percent
from mpdiag.dashboard import charts, fp8_model
from mpdiag.dashboard import frame as ui
from mpdiag.dashboard.fp8_model import Fp8Run
from mpdiag.dashboard.untrusted import plain
from mpdiag.numerics.fp8_recipes import ROLES

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
        again, rerunnable = fp8_record_again(run_id, run["config"] if isinstance(run["config"], dict) else {},
                                             {"fp8": True, "fp8_recipe": "both"})
        form = " (or tick \"Record FP8 statistics\" in the run form)" if rerunnable else ""
        st.info(f"Run #{run_id} was recorded without FP8 statistics. To record them, {plain(again)}{form}, then open "
                "this page on that run.")


def fp8_view(store, run: pd.Series, final: bool, runs: pd.DataFrame) -> None:
    run_id = int(run["run_id"])
    model = fp8_model.fp8(store, run, final)
    if model.settings is None or model.records.empty:
        not_recorded(run, run_id, model.settings is not None)
        return
    st.caption(model.recorded)
    findings = model.findings
    for f in findings:
        st.warning(plain(f"{f.title}. {f.evidence} {f.recommendation}"))
    if not findings:
        st.success(f"No Linear loses values under this recipe: no underflow above "
                   f"{100 * fp8_summaries.LOST_SHARE:g} % of a tensor and no overflow at any recorded step.")

    c1, c2 = st.columns(2)
    recipe = c1.radio("Recipe", model.recipes, horizontal=True, key="recipe", bind="query-params")
    role = c2.radio("Role", list(ROLES), horizontal=True, key="role", bind="query-params", help=ROLE_HELP)
    ui.show_chart(charts.fp8_lost_heatmap(model.lost_cells(recipe, role),
                                          f"share of {role} values lost, {recipe} scaling (grey: none; coloured: the "
                                          "table's \"losing\" steps)"), width="stretch")
    table = model.table
    layer = st.selectbox("Layer (worst first; type to search)", list(dict.fromkeys(table["layer"])), key="layer",
                         bind="query-params")
    shown = model.layer(layer, role, recipe)
    st.caption(plain(shown.said))
    ui.show_chart(charts.fp8_amax_panel(shown.series, f"amax of {layer}'s {role} against what the {recipe} scale lets "
                                                      "through (▲ values overflowed)"), width="stretch")
    st.subheader("Layers, worst first")
    st.caption(fp8_summaries.TABLE_CAPTION)
    counts = [c for c in table.columns if c not in ("layer", "role", "recipe", "worst lost", "at step")]
    # every row on the page up to TABLE_ROWS_SHOWN (Streamlit's own height shows ten and scrolls inside the page)
    st.dataframe(table.style.format({"worst lost": percent, **{c: "{:,}" for c in counts}}), hide_index=True,
                 width="stretch", height=ui.table_height(len(table), TABLE_ROWS_SHOWN),
                 column_config={c: st.column_config.Column(help=h) for c, h in TABLE_COLUMNS.items()})
    whatif_view(model, layer, role)
    blocks_view(model)


def blocks_view(model: Fp8Run) -> None:
    """The block-scaled recipes (MXFP8, NVFP4) recorded beside the per-tensor ones: exact counts per layer."""
    if model.blocks.empty:
        return
    st.subheader("Block-scaled recipes: MXFP8 and NVFP4")
    st.caption("Exact counts of each recorded tensor cast in blocks along its last dimension (equal to torchao's "
               "reference casts value by value); shares are the worst recorded step's.")
    shares = ["worst underflow", "worst subnormal", "worst clipped blocks", "worst wide blocks"]
    st.dataframe(model.blocks.style.format({**{c: percent for c in shares}, "clipped": "{:,}", "steps": "{:,}"}),
                 hide_index=True, width="stretch", height=ui.table_height(len(model.blocks), TABLE_ROWS_SHOWN),
                 column_config={c: st.column_config.Column(help=h)
                                for c, h in fp8_summaries.BLOCK_TABLE_COLUMNS.items()})


def whatif_view(model: Fp8Run, layer: str, role: str) -> None:
    """Another recipe on the stored amax series and histograms of the chosen layer and role, without a rerun."""
    st.subheader("What if: another recipe, history, margin or format")
    recorded, c = model.settings, st.columns(5)
    recipe = c[0].radio("Recipe", ["delayed", "current"], key="whatif_recipe")
    history = int(c[1].number_input("History (recorded steps)", 1, 1_000_000, recorded.history, key="whatif_history",
                                    disabled=recipe == "current"))
    margin = int(c[2].number_input("Margin", 0, 64, recorded.margin, key="whatif_margin",
                                   disabled=recipe == "current"))
    grad_format = c[3].radio("Output gradient format", ["e5m2", "e4m3"],
                             index=["e5m2", "e4m3"].index(recorded.grad_format), key="whatif_format",
                             disabled=role != "grad_output")
    pow2 = c[4].checkbox("Power-of-two scales", recorded.pow2, key="whatif_pow2")
    whatif = model.whatif(layer, role, dataclasses.replace(recorded, recipe=recipe, history=history, margin=margin,
                                                           grad_format=grad_format, pow2=pow2))
    st.caption(plain(whatif.said))
    if whatif.lost.empty:
        st.info("No recorded steps of this layer and role: nothing to draw.")
        return
    if not whatif.any_lost:
        st.caption("No value is lost at any recorded step under these settings: the line lies on 0.")
    ui.show_chart(charts.fp8_whatif_lines(whatif.lost, "values lost per recorded step (band: lower to upper bound)"),
                  width="stretch")


ui.single_run_page("FP8", fp8_view, shows="fp8")
