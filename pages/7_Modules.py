"""Modules: for a run recorded with ``--trace-modules``, every module's largest forward output and gradient per
step, where the first inf/NaN appeared in each pass, and one module's magnitudes against FP16's range; and, for
any run whose first non-finite step the Recorder replayed, that step as a forward-then-backward strip of module
calls with the first offender marked (a first loss spike's replay: how much each forward call's output rose against
the previous step's batch, beside the spike rule's threshold): first on the page when the URL names
it (``?replay=STEP``, the link of the findings ``nonfinite-origin`` and ``loss-spike-origin``), else below the
trace.

Reads widgets, asks mpdiag.dashboard.modules_model for what to show and draws it with the chart layer; no store
queries, no torch. Module names come from the user's model: they reach Markdown only through ``plain``.
"""

import pandas as pd
import streamlit as st

from mpdiag.dashboard import charts, modules_model
from mpdiag.dashboard import frame as ui
from mpdiag.dashboard.untrusted import plain, url_count
from mpdiag.options import torchrun_rerun


def not_traced(run: pd.Series, run_id: int) -> None:
    """Why a run has no trace, and how to get one."""
    config = run["config"] if isinstance(run["config"], dict) else {}
    asked = bool((config.get("run") or {}).get("trace_modules"))
    if asked and run["status"] == "running":
        st.info("No module trace recorded yet; this view updates as the run records its first logged step.")
    elif asked:
        st.warning(f"Run #{run_id} was started with --trace-modules but recorded no trace: it ended "
                   f"({plain(run['status'])}) before its first logged step. Its error, if any, is on the home page.")
    elif torchrun_rerun(config, run["world_size"]) is not None:  # a rerun starts one process: torchrun repeats it
        st.info(f"Run #{run_id} was recorded without a module trace. Record one: "
                f"{plain(torchrun_rerun(config, run['world_size'], '--trace-modules'))}; then open this page on that "
                "run: it shows which module's output or gradient first went inf/NaN.")
    else:
        st.info(f"Run #{run_id} was recorded without a module trace. Record one with "
                f"`python -m mpdiag rerun {run_id} --trace-modules` (or tick \"Trace modules\" in the rerun form), "
                "then open this page on that run: it shows which module's output or gradient first went inf/NaN.")


def replay_view(replay: modules_model.ReplayStrip | None) -> None:
    """The replayed step (non-finite, or a loss spike's), when the Recorder replayed one (traced or not)."""
    if replay is not None:
        st.subheader(f"Replay of step {replay.step}")
        st.caption(plain(replay.said()))
        if replay.spike:  # all finite: the strip would be one colour; how much each call's output rose is the news
            ui.show_chart(charts.spike_rises(replay.rises, replay.step, modules_model.SPIKE_FACTOR), width="stretch")
            if replay.undrawn_said():
                st.caption(plain(replay.undrawn_said()))
        else:
            ui.show_chart(charts.replay_strip(replay.rows, replay.step), width="stretch")


def modules_view(store, run: pd.Series, final: bool, runs: pd.DataFrame) -> None:
    run_id = int(run["run_id"])
    named = url_count(st.query_params.get("replay"))
    model = modules_model.modules(store, run, final, replay_step=named)
    if named is not None or model.modules.empty:  # a link to the replay opens on it, above any trace
        replay_view(model.replay)
    if model.modules.empty:
        not_traced(run, run_id)
        return
    shown = ui.findings_shown_here(store, run, "Modules", runs)
    st.caption(plain(model.said(shown)))
    ui.show_chart(charts.module_heatmap(model.cells, model.order, model.width), width="stretch")
    module = st.selectbox("Module (forward order; type to search)", model.order, index=model.order.index(model.default),
                          key="module", format_func=lambda name: f"{name} ({model.types[name]})", bind="query-params")
    if model.drawable(module):
        ui.show_chart(charts.module_lines(model.magnitudes, module), width="stretch")
    else:
        st.caption(plain(f"{module}: no finite, non-zero output or gradient at any traced step (every value was "
                         "inf/NaN or 0), so there is nothing to draw on a log axis."))
    st.subheader("Modules, forward order")
    st.dataframe(model.table, hide_index=True, width="stretch")
    st.caption("Gradients are at the loss scale (as the backward pass carried them): divide by the scale on the "
               "Loss scale page for the true gradient. A value past FP16's max in an FP32 module overflows the "
               "next FP16 op.")
    if named is None:
        replay_view(model.replay)


ui.single_run_page("Modules", modules_view, shows="modules")
