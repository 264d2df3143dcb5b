"""How the dashboard's tables show their columns, and the one way a table writes a loss: the view models declare each
column of a table they hand a page (a short header, its long explanation as a tooltip, a width in pixels, a number
format, whether it stays in view when the table scrolls) as plain data, testable without Streamlit; the pages turn
these into ``st.column_config`` (frame.column_config). At 1,280 px with the sidebar open a table has about
:data:`TABLE_PX` pixels: the widths of a table's columns are chosen to add up to at most that, so no column hides
off screen. A final loss reads the same on every page (Runs, Findings, Compare): to as many significant digits as
tell the store's runs apart (at least 4), never rounded into another run's number.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from mpdiag.analysis.compare import distinct_digits, loss_text

#: the pixels a table has at a 1,280 px window with the sidebar open (the wide layout's main column, less borders)
TABLE_PX = 815
#: the width of a column holding a run number
RUN_PX = 40


@dataclass(frozen=True)
class Column:
    """One column of a table as a page shows it: ``label`` its header (None: the column's name), ``help`` the
    tooltip on the header, ``width`` in pixels (or "small", "medium", "large"), ``kind`` text, number, link or
    checkbox, ``format`` a number's printf-style format (or "percent", "localized"), ``pinned`` kept in view when
    the table scrolls sideways, ``display_text`` what a link column shows in place of its URL."""
    label: str | None = None
    help: str | None = None
    width: int | str | None = None
    kind: str = "text"
    format: str | None = None
    pinned: bool | None = None
    display_text: str | None = None


def width_px(columns: dict[str, Column]) -> int:
    """The pixels ``columns`` take when every width is a number (a named width counts as Streamlit draws it)."""
    named = {"small": 75, "medium": 200, "large": 400}
    return sum(named.get(c.width, c.width) if isinstance(c.width, str) else (c.width or 0) for c in columns.values())


def loss_digits(runs: pd.DataFrame) -> int:
    """The significant digits every page writes a final loss with: as many as tell apart the different final losses
    of ``runs`` (the whole runs table, Store.runs), at least 4."""
    return distinct_digits(runs["final_loss"]) if "final_loss" in runs else 4


def loss_texts(values, digits: int) -> list[str]:
    """Losses as a table writes them ("NaN" for a missing or NaN loss), to ``digits`` significant digits."""
    return [loss_text(v, digits) for v in values]
