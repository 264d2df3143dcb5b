"""The run store: one SQLite file holding runs, their steps and per-tensor statistics. All of mpdiag's SQL
lives in this package; nothing outside it builds a query."""

from mpdiag.store.core import (
    DEFAULT_STORE,
    REPRESENTABILITY_COLUMNS,
    RUN_FIELDS,
    SCHEMA_VERSION,
    STATUSES,
    TOTAL_COLUMNS,
    Store,
    StoreError,
    StoreWriter,
    decode_hist,
    decode_hists,
    encode_hist,
)

__all__ = [
    "DEFAULT_STORE", "REPRESENTABILITY_COLUMNS", "RUN_FIELDS", "SCHEMA_VERSION", "STATUSES", "TOTAL_COLUMNS", "Store", "StoreError",
    "StoreWriter", "decode_hist", "decode_hists", "encode_hist",
]
