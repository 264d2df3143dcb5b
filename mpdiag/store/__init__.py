"""The run store: one SQLite file holding runs, their steps and per-tensor statistics. All of mpdiag's SQL
lives in this package; nothing outside it builds a query.

schema.py owns the file format (DDL, versions, migrations, connections), reader.py the :class:`Store` that
answers questions with DataFrames, writer.py the :class:`StoreWriter` and its row records, liveness.py whether
a run's process still exists. Import from here: ``from mpdiag.store import Store, StoreWriter, StoreError``.

:class:`Store` is imported on first use: it reads into pandas DataFrames, and importing pandas would add
~0.4 s to the start of every training process, which only writes.
"""

from mpdiag.store.schema import (
    DEFAULT_STORE,
    REPRESENTABILITY_COLUMNS,
    REPRESENTABILITY_KINDS,
    RUN_FIELDS,
    SCHEMA_VERSION,
    STATUSES,
    TOTAL_COLUMNS,
    StoreError,
    decode_hist,
    decode_hists,
    encode_hist,
    encode_hists,
)
from mpdiag.store.writer import (
    MAX_NAME_CHARS,
    MAX_NOTE_CHARS,
    MAX_TAG_CHARS,
    MAX_TAGS,
    Representability,
    RunBusy,
    RunTextRefused,
    StepRow,
    StoreWriter,
    TensorBatch,
    TensorRow,
    clean_name,
    clean_note,
    clean_tag,
)

__all__ = [
    "DEFAULT_STORE", "MAX_NAME_CHARS", "MAX_NOTE_CHARS", "MAX_TAGS", "MAX_TAG_CHARS", "REPRESENTABILITY_COLUMNS",
    "REPRESENTABILITY_KINDS", "RUN_FIELDS", "SCHEMA_VERSION", "STATUSES", "TOTAL_COLUMNS", "Representability",
    "RunBusy", "RunTextRefused", "StepRow", "Store", "StoreError", "StoreWriter", "TensorBatch", "TensorRow", "clean_name",
    "clean_note", "clean_tag", "decode_hist", "decode_hists", "encode_hist", "encode_hists",
]


def __getattr__(name: str):
    if name == "Store":
        from mpdiag.store.reader import Store

        return Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
