"""A run's records as files: every table the Store reads for one run, as Parquet and CSV (``mpdiag export``), and
the same files zipped in memory (the dashboard's download button). No SQL here: everything comes through
:class:`mpdiag.store.reader.Store`. Every step's per-tensor signals, the largest table (a 100,000-step, 500-tensor
run's are 50 million rows), are written in chunks of steps, never held whole."""

from __future__ import annotations

import io
import json
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from mpdiag.numerics.formats import SIGNAL_COUNTS
from mpdiag.store.reader import Store

#: steps of per-tensor signals read and written at once: the dense read of a whole 100,000-step, 500-tensor run
#: would be 2.8 GB of counts (Store.step_signals)
SIGNAL_CHUNK_STEPS = 10_000
#: the per-tensor signals' columns, as every chunk of them is written
SIGNAL_SCHEMA = pa.schema([("step", pa.int64()), ("tensor", pa.string()), *((c, pa.int64()) for c in SIGNAL_COUNTS)])


def run_tables(store: Store, run_id: int) -> dict[str, pd.DataFrame]:
    """Every table of one run by file stem, ready for Parquet (nested values as JSON text), but the per-tensor
    signals (:func:`step_signal_chunks`)."""
    return {
        # dict fields (config, model_state) as JSON text: Parquet cannot store an empty struct (a run that
        # crashed before its first step has no model_state)
        "run": store.run(run_id).map(lambda v: json.dumps(v) if isinstance(v, dict | list) else v).to_frame().T,
        "steps": store.steps(run_id),
        "tensors": store.tensors(run_id).assign(shape=lambda d: d["shape"].map(str)),
        "tensor_stats": store.tensor_stats(run_id),
        "kept_steps": store.kept_steps(run_id),
        "histograms": store.histograms(run_id).assign(exponent=lambda d: d["exponent"].map(str)),
        "hist_rollups": store.histogram_rollups(run_id),
        "step_signal_totals": store.step_signal_totals(run_id).drop(columns="steps"),
        "module_stats": store.module_stats(run_id),
        "update_stats": store.update_stats(run_id),
        "shadow_stats": store.shadow_stats(run_id),
        "rank_steps": store.rank_steps(run_id),
        "fp8": store.fp8(run_id),
        "fp8_histograms": store.fp8_histograms(run_id),
        "probes": store.probes(run_id),
        "events": store.events(run_id).assign(evidence=lambda d: d["evidence"].map(json.dumps)),
        "replays": store.replays(run_id),
        "replay_modules": store.replay_modules(run_id),
        "console_output": _console_output(store, run_id),
    }


def step_signal_chunks(store: Store, run_id: int) -> Iterator[pd.DataFrame]:
    """Every step's per-tensor signals (Store.step_signals: kept in full or not), long, SIGNAL_CHUNK_STEPS steps at
    a time: step, tensor and each of SIGNAL_COUNTS, one row per tensor counted at that step (a tensor without a
    fresh gradient has none). The first chunk always comes, empty for a run without signals."""
    names = store.tensors(run_id)["name"].to_numpy(dtype=object)
    for first in range(0, max(store.max_step(run_id), 0) + 1, SIGNAL_CHUNK_STEPS):
        steps, _, counts = store.step_signals(run_id, first, first + SIGNAL_CHUNK_STEPS - 1)
        at, tensor = np.nonzero(counts[..., 0] >= 0)  # -1: not counted at that step
        yield pd.DataFrame({"step": steps[at], "tensor": pd.Series(names[tensor], dtype=object)}
                           | {c: counts[at, tensor, k] for k, c in enumerate(SIGNAL_COUNTS)})


def _console_output(store: Store, run_id: int) -> pd.DataFrame:
    """The run's kept console output as one row (text, bytes_total, updated_at); no row when none was kept."""
    kept = store.run_output(run_id)
    columns = ["text", "bytes_total", "updated_at"]
    if kept is None:
        return pd.DataFrame({"text": pd.Series(dtype=str), "bytes_total": pd.Series(dtype="int64"),
                             "updated_at": pd.Series(dtype="datetime64[ns, UTC]")})
    return pd.DataFrame([kept], columns=columns)


def export_run(store: Store, run_id: int, out: Path) -> list[Path]:
    """Write every table of one run as Parquet and CSV into ``out`` (created); returns the written paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, df in run_tables(store, run_id).items():
        stem = out / f"run{run_id}_{name}"
        df = df.infer_objects()
        df.to_parquet(stem.with_suffix(".parquet"), index=False)
        df.to_csv(stem.with_suffix(".csv"), index=False)
        written += [stem.with_suffix(".parquet"), stem.with_suffix(".csv")]
    return written + _write_signals(out / f"run{run_id}_step_signals", step_signal_chunks(store, run_id))


def _write_signals(stem: Path, chunks: Iterator[pd.DataFrame]) -> list[Path]:
    """The per-tensor signals as ``stem``.parquet and ``stem``.csv, written a chunk at a time."""
    parquet, csv = stem.with_suffix(".parquet"), stem.with_suffix(".csv")
    with pq.ParquetWriter(parquet, SIGNAL_SCHEMA) as writer:
        for k, df in enumerate(chunks):
            writer.write_table(pa.Table.from_pandas(df, schema=SIGNAL_SCHEMA, preserve_index=False))
            df.to_csv(csv, index=False, header=k == 0, mode="w" if k == 0 else "a")
    return [parquet, csv]


def export_zip(store: Store, run_id: int) -> bytes:
    """The files of :func:`export_run`, zipped in memory."""
    with tempfile.TemporaryDirectory(prefix="mpdiag-export-") as folder:
        paths = export_run(store, run_id, Path(folder))
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in paths:
                archive.write(path, path.name)
    return buffer.getvalue()
