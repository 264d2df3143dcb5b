"""The Modules page's view-model: what pages/7_Modules.py shows of a --trace-modules run (every module's
magnitudes per step as a heatmap, where the first inf/NaN appeared, one module's lines, the table), as typed values
built from the cached reads (reads.py) and mpdiag.analysis.module_trace. No widgets and no drawing here, so every
part is testable without Streamlit. Texts are unescaped: the page passes them through ``plain`` (module names
are the user's).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from mpdiag.analysis import module_trace
from mpdiag.dashboard import reads
from mpdiag.store import Store


@dataclass(frozen=True)
class ModulesRun:
    """A run's module trace (empty: none recorded), in forward order, the heatmap's merged cells, the module
    offered first (the first to go inf/NaN, else the first in forward order) and each module's type."""
    modules: pd.DataFrame
    order: list[str]
    cells: pd.DataFrame | None
    width: int | None
    default: str | None
    types: dict[str, str]
    magnitudes: pd.DataFrame | None

    def said(self, shown: str) -> str:
        """How much was traced and where the first inf/NaN appeared, unless ``shown`` (the findings said at the
        page's top) already says it."""
        located = module_trace.first_nonfinite(self.modules).strip()
        where = "" if located and located in shown else (located or "Every forward output and gradient stayed finite.")
        return (f"{self.modules['module'].nunique():,} modules traced over {self.modules['step'].nunique():,} steps. "
                + where)

    def drawable(self, module: str) -> bool:
        return module_trace.drawable_magnitudes(self.magnitudes, module)

    @property
    def table(self) -> pd.DataFrame:
        return module_trace.module_table(self.modules)


def modules(store: Store, run: pd.Series, final: bool) -> ModulesRun:
    """The Modules page's view of ``run``."""
    traced = reads.module_stats(store, int(run["run_id"]), final)
    if traced.empty:
        return ModulesRun(traced, [], None, None, None, {}, None)
    order = module_trace.module_order(traced)
    magnitudes = module_trace.magnitude_cells(traced)
    cells, width = module_trace.merge_steps(magnitudes)
    first = module_trace.first_nonfinite_modules(traced)
    return ModulesRun(traced, order, cells, width, next(iter(first.values()))["module"] if first else order[0],
                      dict(zip(traced["module"], traced["type"], strict=True)), magnitudes)
