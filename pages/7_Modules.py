"""Modules: for a run recorded with ``--trace-modules``, every module's largest forward output and gradient per
step, where the first inf/NaN appeared in each pass, and one module's magnitudes against FP16's range.

Reads widgets, calls mpdiag.analysis (module_trace, findings) and the chart layer, renders; no store queries,
no torch. Module names come from the user's model: they reach Markdown only through ``plain``.
"""

import pandas as pd
import streamlit as st

from mpdiag.analysis import module_trace
from mpdiag.dashboard import charts, reads
from mpdiag.dashboard import frame as ui
from mpdiag.dashboard.untrusted import plain


def not_traced(run: pd.Series, run_id: int) -> None:
    """Why a run has no trace, and how to get one."""
    config = run["config"] if isinstance(run["config"], dict) else {}
    asked = bool((config.get("run") or {}).get("trace_modules"))
    if asked and run["status"] == "running":
        st.info("No module trace recorded yet; this view updates as the run records its first logged step.")
    elif asked:
        st.warning(f"Run #{run_id} was started with --trace-modules but recorded no trace: it ended "
                   f"({plain(run['status'])}) before its first logged step. Its error, if any, is on the home page.")
    else:
        st.info(f"Run #{run_id} was recorded without a module trace. Record one with "
                f"`python -m mpdiag rerun {run_id} --trace-modules` (or tick \"Trace modules\" in the rerun form), "
                "then open this page on that run: it shows which module's output or gradient first went inf/NaN.")


def modules_view(store, run: pd.Series, final: bool, runs: pd.DataFrame) -> None:
    run_id = int(run["run_id"])
    modules = reads.module_stats(store, run_id, final)
    if modules.empty:
        not_traced(run, run_id)
        return
    shown = ui.findings_shown_here(store, run_id, "Modules", runs)
    located = module_trace.first_nonfinite(modules).strip()
    where = "" if located and located in shown else (located or "Every forward output and gradient stayed finite.")
    st.caption(plain(f"{modules['module'].nunique():,} modules traced over {modules['step'].nunique():,} steps. "
                     + where))
    order = module_trace.module_order(modules)
    cells, width = module_trace.merge_steps(module_trace.magnitude_cells(modules))
    ui.show_chart(charts.module_heatmap(cells, order, width), width="stretch")

    first = module_trace.first_nonfinite_modules(modules)
    default = next(iter(first.values()))["module"] if first else order[0]
    types = dict(zip(modules["module"], modules["type"], strict=True))
    module = st.selectbox("Module (forward order; type to search)", order, index=order.index(default), key="module",
                          format_func=lambda name: f"{name} ({types[name]})", bind="query-params")
    magnitudes = module_trace.magnitude_cells(modules)
    if module_trace.drawable_magnitudes(magnitudes, module):
        ui.show_chart(charts.module_lines(magnitudes, module), width="stretch")
    else:
        st.caption(plain(f"{module}: no finite, non-zero output or gradient at any traced step (every value was "
                         "inf/NaN or 0), so there is nothing to draw on a log axis."))
    st.subheader("Modules, forward order")
    st.dataframe(module_trace.module_table(modules), hide_index=True, width="stretch")
    st.caption("Gradients are at the loss scale (as the backward pass carried them): divide by the scale on the "
               "Loss scale page for the true gradient. A value past FP16's max in an FP32 module overflows the "
               "next FP16 op.")


ui.single_run_page("Modules", modules_view)
