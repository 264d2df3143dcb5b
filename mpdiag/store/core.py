"""The run store: one SQLite file in WAL mode. This module holds all of mpdiag's SQL.

Readers (``Store``) open a short connection per call, so a dashboard never holds the file; a training
process writes through one ``StoreWriter`` connection. Contracts that SQLite imposes:

* SQLite cannot hold NaN (it stores NULL). Float columns that may be NaN (loss, absmax, l2, min_nonzero)
  are read back with NULL -> NaN; ±inf round-trips as itself.
* Histogram counts are one row per (run, step, tensor) with a BLOB (see :func:`encode_hist`).
* A run whose status is ``running`` but whose process is gone is reported as ``crashed`` by every reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sqlite3
import time
from collections.abc import Iterable, Sequence
from contextlib import closing
from pathlib import Path

import numpy as np
import pandas as pd
import psutil

from mpdiag.numerics.formats import EXP_MIN, N_EXP_BINS

DEFAULT_STORE = "mpdiag_runs.db"
SCHEMA_VERSION = 2  # 2: runs.update_format, update_steps, shadow_steps
STATUSES = ("running", "finished", "failed", "crashed")

REPRESENTABILITY_COLUMNS = [
    f"{fmt}_{cat}{suffix}"
    for suffix in ("", "_at_scale")
    for fmt in ("fp16", "bf16")
    for cat in ("underflow", "subnormal", "overflow")
]
TENSOR_STAT_COLUMNS = ["numel", "zeros", "nan", "posinf", "neginf", "absmax", "min_nonzero", "l2"]
STEP_COLUMNS = [
    "step", "loss", "loss_scale", "skipped", "growth_tracker", "scale_after", "step_time_s", "peak_mem_bytes",
]
# Counts summed per (run, tensor) over all logged steps, maintained by the writer as rows are committed.
TOTAL_COLUMNS = ["zeros", "nan", "posinf", "neginf", *REPRESENTABILITY_COLUMNS]
# -- distributed runs (issue 17): the job's shape on the run row, one row per (step, rank) ------------------
#: run columns of a job launched on several processes (world_size NULL: a one-process run)
DISTRIBUTED_RUN_COLUMNS = ["world_size", "backend", "launch_command"]
_DISTRIBUTED_COLUMN_TYPES = {"world_size": "INTEGER", "backend": "TEXT", "launch_command": "TEXT"}
#: per step and rank: that rank's local loss and, for DDP, its local gradients' inf/NaN count before the all-reduce
_RANK_STEPS_DDL = """
CREATE TABLE IF NOT EXISTS rank_steps (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, rank INTEGER NOT NULL, loss REAL, nonfinite INTEGER,
    PRIMARY KEY (run_id, step, rank)) WITHOUT ROWID;
"""
# -- end of the distributed block ----------------------------------------------------------------------------

# Run columns a writer may set (run_id, status bookkeeping and process identity are managed here).
RUN_FIELDS = [
    "name", "script_path", "script_sha256", "opt_level", "scaling", "init_scale", "growth_factor",
    "backoff_factor", "growth_interval", "loss_scale", "min_scale", "max_scale", "seed", "steps", "every",
    "device", "gpu_name", "torch_version", "parent_run_id", "pair_run_id", "batch_size", "params",
    "model_state", "config", "update_format", *DISTRIBUTED_RUN_COLUMNS,
]

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS scripts (
    sha256 TEXT PRIMARY KEY, filename TEXT NOT NULL, source TEXT NOT NULL, added_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT, script_path TEXT, script_sha256 TEXT REFERENCES scripts(sha256),
    opt_level TEXT, init_scale REAL, growth_factor REAL, backoff_factor REAL, growth_interval INTEGER,
    scaling TEXT, loss_scale REAL, min_scale REAL, max_scale REAL,
    seed INTEGER, steps INTEGER, every INTEGER, device TEXT, gpu_name TEXT, torch_version TEXT,
    status TEXT NOT NULL, error TEXT, note TEXT,
    started_at REAL NOT NULL, finished_at REAL, heartbeat_at REAL,
    pid INTEGER, host TEXT, process_started_at REAL,
    parent_run_id INTEGER REFERENCES runs(run_id), pair_run_id INTEGER REFERENCES runs(run_id),
    batch_size INTEGER, params INTEGER, model_state TEXT, config TEXT, summary TEXT, update_format TEXT,
    world_size INTEGER, backend TEXT, launch_command TEXT);
CREATE TABLE IF NOT EXISTS tensors (
    run_id INTEGER NOT NULL REFERENCES runs(run_id), tensor_id INTEGER NOT NULL, name TEXT NOT NULL,
    shape TEXT NOT NULL, numel INTEGER NOT NULL, param_dtype TEXT NOT NULL, grad_dtype TEXT,
    PRIMARY KEY (run_id, tensor_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS steps (
    run_id INTEGER NOT NULL REFERENCES runs(run_id), step INTEGER NOT NULL,
    loss REAL, loss_scale REAL, skipped INTEGER, growth_tracker INTEGER, scale_after REAL,
    step_time_s REAL, peak_mem_bytes INTEGER, logged INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, step)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tensor_steps (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, tensor_id INTEGER NOT NULL, hist BLOB NOT NULL,
    {", ".join(f"{c} {'REAL' if c in ('absmax', 'min_nonzero', 'l2') else 'INTEGER'}" for c in TENSOR_STAT_COLUMNS[1:])},
    {", ".join(f"{c} INTEGER" for c in REPRESENTABILITY_COLUMNS)},
    PRIMARY KEY (run_id, step, tensor_id)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS tensor_steps_by_tensor ON tensor_steps (run_id, tensor_id, step);
CREATE TABLE IF NOT EXISTS modules (
    run_id INTEGER NOT NULL REFERENCES runs(run_id), module_id INTEGER NOT NULL, name TEXT NOT NULL, type TEXT NOT NULL,
    PRIMARY KEY (run_id, module_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS module_steps (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, module_id INTEGER NOT NULL,
    fwd_order INTEGER, fwd_absmax REAL, fwd_finite INTEGER, bwd_order INTEGER, bwd_absmax REAL, bwd_finite INTEGER,
    PRIMARY KEY (run_id, step, module_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS probes (
    run_id INTEGER NOT NULL REFERENCES runs(run_id), kind TEXT NOT NULL, result TEXT NOT NULL, created_at REAL NOT NULL,
    PRIMARY KEY (run_id, kind)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS update_steps (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, tensor_id INTEGER NOT NULL,
    updated INTEGER NOT NULL, below_resolution INTEGER NOT NULL, unchanged INTEGER NOT NULL,
    PRIMARY KEY (run_id, step, tensor_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS shadow_steps (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, tensor_id INTEGER NOT NULL,
    rel_error REAL, cosine REAL, ref_norm REAL,
    PRIMARY KEY (run_id, step, tensor_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tensor_totals (
    run_id INTEGER NOT NULL, tensor_id INTEGER NOT NULL, logged_steps INTEGER NOT NULL,
    {", ".join(f"{c} INTEGER" for c in TOTAL_COLUMNS)},
    PRIMARY KEY (run_id, tensor_id)) WITHOUT ROWID;
""" + _RANK_STEPS_DDL


class StoreError(RuntimeError):
    """The store file is missing, unreadable or not an mpdiag store; the message says which and where."""


def encode_hist(counts: np.ndarray) -> bytes:
    """Pack an exponent histogram (length N_EXP_BINS) as: int16 first bin, then int64 counts up to the last
    non-empty bin. Empty histograms pack to the 2-byte header alone."""
    nonzero = np.flatnonzero(counts)
    if nonzero.size == 0:
        return np.int16(0).tobytes()
    lo, hi = int(nonzero[0]), int(nonzero[-1])
    return np.int16(lo).tobytes() + counts[lo : hi + 1].astype("<i8").tobytes()


def decode_hist(blob: bytes) -> np.ndarray:
    """Inverse of :func:`encode_hist`: a full-length int64 histogram."""
    return decode_hists([blob])[0]


def decode_hists(blobs: Sequence[bytes]) -> np.ndarray:
    """Many :func:`encode_hist` blobs at once, as an (n, N_EXP_BINS) int64 matrix (vectorised)."""
    out = np.zeros((len(blobs), N_EXP_BINS), dtype=np.int64)
    if not blobs:
        return out
    first = np.array([int.from_bytes(b[:2], "little", signed=True) for b in blobs], dtype=np.int64)
    lengths = np.array([(len(b) - 2) // 8 for b in blobs], dtype=np.int64)
    values = np.frombuffer(b"".join(b[2:] for b in blobs), dtype="<i8")
    rows = np.repeat(np.arange(len(blobs)), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    out[rows, np.repeat(first, lengths) + np.arange(values.size) - starts] = values
    return out


def _connect(path: Path, readonly: bool) -> sqlite3.Connection:
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    else:
        conn = sqlite3.connect(path, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=10000")
    return conn


SUMMARY_COLUMNS = ["steps_done", "skipped_steps", "peak_mem_bytes", "final_loss", "median_step_time_s"]


def _write_schema(path: Path) -> None:
    """Create the schema, or bring an older store up to SCHEMA_VERSION: new tables are created by the
    schema's IF NOT EXISTS, new run columns are added; existing rows are kept."""
    with closing(_connect(path, readonly=False)) as conn:
        conn.executescript(_SCHEMA)
        have = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
        if "update_format" not in have:
            conn.execute("ALTER TABLE runs ADD COLUMN update_format TEXT")
        for column in set(DISTRIBUTED_RUN_COLUMNS) - have:
            conn.execute(f"ALTER TABLE runs ADD COLUMN {column} {_DISTRIBUTED_COLUMN_TYPES[column]}")
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        conn.commit()


def _step_summaries(conn: sqlite3.Connection, run_ids: Sequence[int]) -> pd.DataFrame:
    """Per run (index run_id): steps_done, skipped_steps, peak_mem_bytes, final_loss (NaN kept) and the
    median step time after the first (warm-up) step, from the steps table. Reads only these runs' rows."""
    ids = [int(r) for r in run_ids]
    if not ids:
        return pd.DataFrame(columns=SUMMARY_COLUMNS, index=pd.Index([], name="run_id"))
    marks = ", ".join("?" * len(ids))
    agg = pd.read_sql_query(
        f"""SELECT run_id, COUNT(*) AS steps_done, COALESCE(SUM(skipped), 0) AS skipped_steps,
                   MAX(peak_mem_bytes) AS peak_mem_bytes,
                   (SELECT CASE WHEN s2.loss IS NULL THEN 'nan' ELSE s2.loss END FROM steps s2
                    WHERE s2.run_id = steps.run_id ORDER BY s2.step DESC LIMIT 1) AS final_loss
            FROM steps WHERE run_id IN ({marks}) GROUP BY run_id""", conn, params=ids).set_index("run_id")
    times = pd.read_sql_query(f"SELECT run_id, step_time_s FROM steps WHERE run_id IN ({marks}) AND step > 0",
                              conn, params=ids)
    agg["final_loss"] = agg["final_loss"].astype(float)
    agg["median_step_time_s"] = times.groupby("run_id")["step_time_s"].median()
    return agg.reindex(ids).assign(steps_done=lambda d: d["steps_done"].fillna(0).astype(int),
                                   skipped_steps=lambda d: d["skipped_steps"].fillna(0).astype(int))


def _process_start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _process_is_alive(pid: int | None, host: str | None, started_at: float | None) -> bool:
    """Whether the process that owns a running run still exists (checked on this host only)."""
    if pid is None or host != socket.gethostname():
        return True  # cannot tell from here; assume alive
    created = _process_start_time(int(pid))
    if created is None:
        return False
    return started_at is None or abs(created - started_at) < 1.0  # guards against a reused pid


class Store:
    """Read access to a store file, returning pandas DataFrames. Creating a Store creates the file's schema
    if the file does not exist yet (``create=True``), so the CLI and the app can start on an empty path."""

    def __init__(self, path: str | os.PathLike | None = None, create: bool = True):
        # Absolute, so a script that changes the working directory cannot redirect later opens.
        self.path = Path(path or os.environ.get("MPDIAG_STORE") or DEFAULT_STORE).absolute()
        if not self.path.exists():
            if not create:
                raise StoreError(f"No store at {self.path}: run `python -m mpdiag run SCRIPT` to create one.")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _write_schema(self.path)
        self._check()

    def _check(self) -> None:
        try:
            with closing(_connect(self.path, readonly=True)) as conn:
                tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path} is not an SQLite database ({exc}). Choose an mpdiag store file.") from exc
        missing = {"runs", "steps", "tensors", "tensor_steps", "scripts"} - tables
        if missing:
            raise StoreError(
                f"{self.path} is an SQLite file but not an mpdiag store (missing tables: {', '.join(sorted(missing))})."
            )
        if {"update_steps", "shadow_steps", "rank_steps"} - tables:  # an older store: add what came since
            try:
                _write_schema(self.path)
            except sqlite3.DatabaseError as exc:
                raise StoreError(f"{self.path} has an older mpdiag schema and could not be upgraded ({exc}); "
                                 "make the file writable once so mpdiag can add its new tables.") from exc

    def _query(self, sql: str, params: Sequence = ()) -> pd.DataFrame:
        try:
            with closing(_connect(self.path, readonly=True)) as conn:
                return pd.read_sql_query(sql, conn, params=list(params))
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"Could not read {self.path}: {exc}") from exc

    # -- runs -----------------------------------------------------------------------------------------------
    def runs(self) -> pd.DataFrame:
        """One row per run, newest first, with steps_done, final_loss and skipped_steps summarised.
        Status ``running`` is reported as ``crashed`` when the owning process no longer exists."""
        df = self._query("SELECT * FROM runs ORDER BY run_id DESC")
        if df.empty:
            return df
        # Finished runs carry the summary their writer stored when they ended; only the others are read live.
        stored = {int(r): json.loads(v) for r, v in zip(df["run_id"], df.pop("summary"), strict=True) if isinstance(v, str)}
        try:
            with closing(_connect(self.path, readonly=True)) as conn:
                live = _step_summaries(conn, [r for r in df["run_id"] if int(r) not in stored])
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"Could not read {self.path}: {exc}") from exc
        summaries = pd.concat([pd.DataFrame.from_dict(stored, orient="index"), live])
        for col in SUMMARY_COLUMNS:
            df[col] = df["run_id"].map(summaries[col]) if col in summaries else np.nan
        for col in ("steps_done", "skipped_steps"):
            df[col] = df[col].fillna(0).astype(int)
        df["final_loss"] = df["final_loss"].astype(float)
        df["median_step_time_s"] = df["median_step_time_s"].astype(float)
        dead = (df["status"] == "running") & ~df.apply(
            lambda r: _process_is_alive(r["pid"], r["host"], r["process_started_at"]), axis=1
        )
        df.loc[dead, "status"] = "crashed"
        df.loc[dead & df["error"].isna(), "error"] = "the training process exited without closing the run"
        df["world_size"] = df["world_size"].fillna(1).astype(int)  # NULL: recorded by one process
        for col in ("started_at", "finished_at", "heartbeat_at"):
            df[col] = pd.to_datetime(df[col], unit="s", utc=True)
        for col in ("config", "model_state"):
            df[col] = df[col].map(lambda v: json.loads(v) if isinstance(v, str) else {})
        return df

    def run(self, run_id: int) -> pd.Series:
        """One run's row, as in :meth:`runs`. Raises StoreError naming the id when it does not exist."""
        runs = self.runs()
        match = runs[runs["run_id"] == int(run_id)] if len(runs) else runs
        if match.empty:
            raise StoreError(f"No run {run_id} in {self.path}. `python -m mpdiag runs` lists the runs.")
        return match.iloc[0]

    def scripts(self) -> pd.DataFrame:
        """Stored scripts, newest first: sha256, filename, added_at (UTC), runs (how many runs used it)."""
        df = self._query(
            "SELECT s.sha256, s.filename, s.added_at, (SELECT COUNT(*) FROM runs r WHERE r.script_sha256 = s.sha256) "
            "AS runs FROM scripts s ORDER BY s.added_at DESC"
        )
        df["added_at"] = pd.to_datetime(df["added_at"], unit="s", utc=True)
        return df

    def script_source(self, sha256: str) -> tuple[str, str]:
        """(original file name, source text) of a stored script."""
        df = self._query("SELECT filename, source FROM scripts WHERE sha256 = ?", (sha256,))
        if df.empty:
            raise StoreError(f"No stored script with hash {sha256} in {self.path}.")
        return df.iloc[0]["filename"], df.iloc[0]["source"]

    # -- per step -------------------------------------------------------------------------------------------
    def steps(self, run_id: int, since_step: int = -1) -> pd.DataFrame:
        """Per-step records of a run (steps after ``since_step``), loss NaN restored from NULL.
        ``skipped`` is 1 when the optimizer step did not run, 0 when it ran, NaN when unknown (the run stopped
        inside that step); ``growth_tracker`` is NaN for runs without a scaler."""
        df = self._query(
            f"SELECT {', '.join(STEP_COLUMNS)} FROM steps WHERE run_id = ? AND step > ? ORDER BY step",
            (int(run_id), int(since_step)),
        )
        for col in ("loss", "loss_scale", "skipped", "growth_tracker", "scale_after"):
            df[col] = df[col].astype(float)
        return df

    def tensors(self, run_id: int) -> pd.DataFrame:
        """The recorded parameter tensors: tensor_id, name (dotted), shape (list), numel, param and grad dtype."""
        df = self._query(
            "SELECT tensor_id, name, shape, numel, param_dtype, grad_dtype FROM tensors WHERE run_id = ? "
            "ORDER BY tensor_id",
            (int(run_id),),
        )
        df["shape"] = df["shape"].map(json.loads)
        return df

    def _tensor_steps(self, columns: str, run_id: int, tensor: str | None, since_step: int,
                      until_step: int | None = None) -> pd.DataFrame:
        """step, tensor and ``columns`` of tensor_steps rows after ``since_step`` (up to ``until_step``),
        one tensor or all."""
        # One tensor: walk the (run_id, tensor_id, step) index; the planner otherwise prefers the primary key
        # and reads every row of the run.
        source = "tensor_steps ts INDEXED BY tensor_steps_by_tensor" if tensor is not None else "tensor_steps ts"
        sql = (
            f"SELECT ts.step, t.name AS tensor, {columns} FROM {source} "
            "JOIN tensors t ON t.run_id = ts.run_id AND t.tensor_id = ts.tensor_id WHERE ts.run_id = ? AND ts.step > ?"
        )
        params: list = [int(run_id), int(since_step)]
        if until_step is not None:
            sql += " AND ts.step <= ?"
            params.append(int(until_step))
        if tensor is not None:
            sql += " AND ts.tensor_id = (SELECT tensor_id FROM tensors WHERE run_id = ? AND name = ?)"
            params += [int(run_id), tensor]
        return self._query(sql + " ORDER BY ts.step, ts.tensor_id", params)

    def tensor_totals(self, run_id: int) -> pd.DataFrame:
        """Per tensor, counts summed over every logged step: numel (summed), zeros, nan, posinf, neginf and the
        twelve representability counts; numel_per_step is the tensor's size. Read from running totals the
        writer keeps, so its cost does not grow with the number of steps."""
        sums = ", ".join(f"tt.{c}" for c in TOTAL_COLUMNS)
        return self._query(
            f"SELECT t.name AS tensor, t.numel AS numel_per_step, t.numel * tt.logged_steps AS numel, "
            f"tt.logged_steps, {sums} FROM tensor_totals tt "
            "JOIN tensors t ON t.run_id = tt.run_id AND t.tensor_id = tt.tensor_id WHERE tt.run_id = ? ORDER BY tt.tensor_id",
            (int(run_id),),
        )

    def logged_steps(self, run_id: int) -> list[int]:
        """Steps at which tensor statistics were recorded."""
        df = self._query("SELECT step FROM steps WHERE run_id = ? AND logged = 1 ORDER BY step", (int(run_id),))
        return df["step"].tolist()

    def tensor_stats(
        self, run_id: int, tensor: str | None = None, since_step: int = -1, step: int | None = None
    ) -> pd.DataFrame:
        """Per logged step and tensor: counts, absmax, min_nonzero, l2 and FP16/BF16 representability counts
        of the unscaled gradient g, and the same six counts with suffix ``_at_scale`` for S*g; after
        ``since_step``, or at exactly ``step``."""
        cols = ", ".join(f"ts.{c}" for c in TENSOR_STAT_COLUMNS[1:] + REPRESENTABILITY_COLUMNS)
        df = self._tensor_steps(f"t.numel, {cols}", run_id, tensor, since_step if step is None else step - 1,
                                until_step=step)
        for col in ("absmax", "min_nonzero", "l2"):
            df[col] = df[col].astype(float)
        return df

    def histogram_matrix(
        self, run_id: int, tensor: str | None = None, since_step: int = -1, step: int | None = None
    ) -> tuple[pd.DataFrame, np.ndarray]:
        """(index, counts): index has step and tensor per row; counts[i, b] is the count of exponent bin
        EXP_MIN + b for that row, for one tensor or all, after ``since_step`` or at exactly ``step``.
        The compact form for aggregation; :meth:`histograms` is the long form."""
        df = self._tensor_steps("ts.hist", run_id, tensor, since_step if step is None else step - 1, until_step=step)
        return df, decode_hists(df.pop("hist").tolist())

    def histograms(self, run_id: int, tensor: str | None = None) -> pd.DataFrame:
        """Long format: step, tensor, exponent (int, or 'zero'/'nan'/'posinf'/'neginf'), count; empty bins omitted."""
        index, counts = self.histogram_matrix(run_id, tensor)
        rows, bins = np.nonzero(counts)
        long = pd.DataFrame(
            {
                "step": index["step"].to_numpy()[rows],
                "tensor": index["tensor"].to_numpy()[rows],
                "exponent": (bins + EXP_MIN).astype(object),
                "count": counts[rows, bins],
            }
        )
        special = self.tensor_stats(run_id, tensor)[["step", "tensor", "zeros", "nan", "posinf", "neginf"]]
        special = special.rename(columns={"zeros": "zero"}).melt(
            id_vars=["step", "tensor"], var_name="exponent", value_name="count"
        )
        special = special[special["count"] > 0]
        return pd.concat([long, special], ignore_index=True).sort_values(["step", "tensor"], kind="stable").reset_index(
            drop=True
        )

    def module_stats(self, run_id: int) -> pd.DataFrame:
        """With ``--trace-modules``: per step and module, the order in which the module ran in the forward pass,
        the absmax of its output, whether that output was all finite, and the same for the gradient flowing
        into its output in the backward pass (scaled by S, as it was). absmax is NaN where a NaN occurred."""
        df = self._query(
            "SELECT ms.step, m.name AS module, m.type, ms.fwd_order, ms.fwd_absmax, ms.fwd_finite, ms.bwd_order, "
            "ms.bwd_absmax, ms.bwd_finite FROM module_steps ms JOIN modules m ON m.run_id = ms.run_id AND "
            "m.module_id = ms.module_id WHERE ms.run_id = ? ORDER BY ms.step, ms.fwd_order",
            (int(run_id),),
        )
        for col in ("fwd_absmax", "bwd_absmax"):
            df[col] = df[col].astype(float)
        return df

    def update_stats(self, run_id: int) -> pd.DataFrame:
        """Optimizer updates checked against the run's ``update_format`` (see mpdiag.numerics.updates), per logged step
        that stepped and per tensor: ``updated`` values had a finite non-zero gradient; of those,
        ``below_resolution`` changed by less than 2^-(mantissa bits + 1) of their magnitude and ``unchanged``
        did not change at all."""
        return self._query(
            "SELECT u.step, t.name AS tensor, t.numel, u.updated, u.below_resolution, u.unchanged FROM update_steps u "
            "JOIN tensors t ON t.run_id = u.run_id AND t.tensor_id = u.tensor_id WHERE u.run_id = ? "
            "ORDER BY u.step, u.tensor_id", (int(run_id),))

    def shadow_stats(self, run_id: int) -> pd.DataFrame:
        """Per shadow step and tensor: the relative error ||g - g32|| / ||g32|| and cosine of the recorded
        (unscaled) gradient against an FP32 computation on the same weights and batch, and ||g32||. NaN where
        a norm is zero or a value non-finite."""
        df = self._query(
            "SELECT s.step, t.name AS tensor, t.numel, s.rel_error, s.cosine, s.ref_norm FROM shadow_steps s "
            "JOIN tensors t ON t.run_id = s.run_id AND t.tensor_id = s.tensor_id WHERE s.run_id = ? "
            "ORDER BY s.step, s.tensor_id", (int(run_id),))
        for col in ("rel_error", "cosine", "ref_norm"):
            df[col] = df[col].astype(float)
        return df

    def probe(self, run_id: int, kind: str) -> dict | None:
        """The stored result of a diagnostic probe of a run (see mpdiag.sandbox.probe), or None."""
        df = self._query("SELECT result FROM probes WHERE run_id = ? AND kind = ?", (int(run_id), kind))
        return json.loads(df.iloc[0]["result"]) if len(df) else None

    # -- distributed runs (issue 17) ----------------------------------------------------------------------
    def rank_steps(self, run_id: int) -> pd.DataFrame:
        """Per step and rank of a distributed run: ``loss`` (that rank's local loss; NaN restored from NULL)
        and ``nonfinite`` (DDP: the inf/NaN values in that rank's local gradients before the all-reduce; NaN
        where not counted, as under FSDP2). Empty for a one-process run."""
        df = self._query("SELECT step, rank, loss, nonfinite FROM rank_steps WHERE run_id = ? ORDER BY step, rank",
                         (int(run_id),))
        for col in ("loss", "nonfinite"):
            df[col] = df[col].astype(float)
        return df

    def max_step(self, run_id: int) -> int:
        """Last recorded step of a run, -1 when none."""
        df = self._query("SELECT MAX(step) AS s FROM steps WHERE run_id = ?", (int(run_id),))
        value = df.iloc[0]["s"]
        return -1 if pd.isna(value) else int(value)


def _json_fields(fields: dict) -> dict:
    """Serialise the JSON-valued run fields (config, model_state) given as dicts."""
    return {
        k: json.dumps(v, sort_keys=True, default=str) if k in ("config", "model_state") and isinstance(v, dict) else v
        for k, v in fields.items()
    }


class StoreWriter:
    """The single writing connection of a training process. Not thread-safe: one thread owns it."""

    def __init__(self, path: str | os.PathLike):
        self.path = Store(path).path  # creates and validates the schema; absolute
        self._conn = _connect(self.path, readonly=False)

    def close(self) -> None:
        self._conn.close()

    def add_script(self, filename: str, source: str) -> str:
        """Store a script's source under its SHA-256 (idempotent) and return the hash."""
        sha = hashlib.sha256(source.encode()).hexdigest()
        with self._conn:
            self._conn.execute(
                "INSERT OR IGNORE INTO scripts VALUES (?, ?, ?, ?)", (sha, filename, source, time.time())
            )
        return sha

    def _insert(self, table: str, run_id: int, rows: list[tuple], verb: str = "INSERT") -> None:
        """One transaction adding ``rows`` (the table's columns after run_id) to ``table`` for ``run_id``."""
        if rows:
            marks = ", ".join("?" * (len(rows[0]) + 1))
            with self._conn:
                self._conn.executemany(f"{verb} INTO {table} VALUES ({marks})", [(int(run_id), *row) for row in rows])

    def add_modules(self, run_id: int, rows: list[tuple]) -> None:
        """rows: (module_id, dotted name, type name)."""
        self._insert("modules", run_id, rows, verb="INSERT OR REPLACE")

    def add_module_steps(self, run_id: int, rows: list[tuple]) -> None:
        """rows: (step, module_id, fwd_order, fwd_absmax, fwd_finite, bwd_order, bwd_absmax, bwd_finite)."""
        self._insert("module_steps", run_id, rows)

    def write_summary(self, run_id: int) -> None:
        """Store the run's step summary (see :func:`_step_summaries`) in its row, once its last rows are
        committed, so readers need not scan its steps again."""
        summary = _step_summaries(self._conn, [run_id]).iloc[0].to_dict()
        summary = {k: (v.item() if hasattr(v, "item") else v) for k, v in summary.items()}
        with self._conn:
            self._conn.execute("UPDATE runs SET summary = ? WHERE run_id = ?", (json.dumps(summary), int(run_id)))

    def add_update_steps(self, run_id: int, rows: list[tuple]) -> None:
        """rows: (step, tensor_id, updated, below_resolution, unchanged)."""
        self._insert("update_steps", run_id, rows)

    def add_shadow_steps(self, run_id: int, rows: list[tuple]) -> None:
        """rows: (step, tensor_id, rel_error, cosine, ref_norm); non-finite floats are stored as NULL."""
        self._insert("shadow_steps", run_id, rows)

    def add_rank_steps(self, run_id: int, rows: list[tuple]) -> None:
        """rows: (step, rank, loss, nonfinite); a non-finite loss and an uncounted nonfinite are stored as NULL."""
        self._insert("rank_steps", run_id, rows)

    def add_probe(self, run_id: int, kind: str, result: dict) -> None:
        with self._conn:
            self._conn.execute("INSERT OR REPLACE INTO probes VALUES (?, ?, ?, ?)",
                               (int(run_id), kind, json.dumps(result), time.time()))

    def create_run(self, **fields) -> int:
        """Insert a run with status ``running``, owned by this process. Unknown field names are an error."""
        unknown = set(fields) - set(RUN_FIELDS)
        if unknown:
            raise ValueError(f"unknown run fields: {sorted(unknown)}")
        fields = _json_fields(fields)
        now = time.time()
        pid = os.getpid()
        fields.update(
            status="running", started_at=now, heartbeat_at=now, pid=pid, host=socket.gethostname(),
            process_started_at=_process_start_time(pid),
        )
        names = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        with self._conn:
            cur = self._conn.execute(f"INSERT INTO runs ({names}) VALUES ({marks})", list(fields.values()))
        return int(cur.lastrowid)

    def update_run(self, run_id: int, **fields) -> None:
        allowed = set(RUN_FIELDS) | {"status", "error", "note", "finished_at"}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"unknown run fields: {sorted(unknown)}")
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}")
        fields = _json_fields(fields)
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._conn:
            self._conn.execute(f"UPDATE runs SET {sets} WHERE run_id = ?", [*fields.values(), int(run_id)])

    def add_tensors(self, run_id: int, rows: Iterable[tuple]) -> None:
        """rows: (tensor_id, name, shape list, numel, param_dtype, grad_dtype)."""
        with self._conn:
            self._conn.executemany(
                "INSERT OR REPLACE INTO tensors VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(int(run_id), t, n, json.dumps(list(s)), int(k), p, g) for t, n, s, k, p, g in rows],
            )

    def write_batch(self, run_id: int, step_rows: list[tuple], tensor_rows: list[tuple]) -> None:
        """Commit step rows (STEP_COLUMNS order, then the logged flag) and tensor rows (tensor_steps column
        order), add the tensor rows' counts to the running totals and refresh the run's heartbeat, in one
        transaction. Each (step, tensor) must be written once: the totals would count a rewrite twice."""
        n_tensor_cols = 4 + len(TENSOR_STAT_COLUMNS) - 1 + len(REPRESENTABILITY_COLUMNS)
        totals = _sum_counts(tensor_rows)
        updates = ", ".join(f"{c} = {c} + excluded.{c}" for c in ["logged_steps", *TOTAL_COLUMNS])
        with self._conn:
            self._conn.executemany(
                f"INSERT INTO steps VALUES ({', '.join('?' * (len(STEP_COLUMNS) + 2))})",
                [(int(run_id), *row) for row in step_rows],
            )
            self._conn.executemany(
                f"INSERT INTO tensor_steps VALUES ({', '.join('?' * n_tensor_cols)})",
                [(int(run_id), *row) for row in tensor_rows],
            )
            self._conn.executemany(
                f"INSERT INTO tensor_totals VALUES ({', '.join('?' * (3 + len(TOTAL_COLUMNS)))}) "
                f"ON CONFLICT (run_id, tensor_id) DO UPDATE SET {updates}",
                [(int(run_id), tensor_id, *sums) for tensor_id, sums in totals.items()],
            )
            self._conn.execute("UPDATE runs SET heartbeat_at = ? WHERE run_id = ?", (time.time(), int(run_id)))


# Positions in a tensor_steps row (without run_id) of the columns summed into tensor_totals.
_TOTAL_POSITIONS = [3, 4, 5, 6] + [3 + len(TENSOR_STAT_COLUMNS) - 1 + i for i in range(len(REPRESENTABILITY_COLUMNS))]


def _sum_counts(tensor_rows: list[tuple]) -> dict[int, list[int]]:
    """tensor_id -> [logged steps, *TOTAL_COLUMNS sums] over ``tensor_rows``."""
    sums: dict[int, list[int]] = {}
    for row in tensor_rows:
        acc = sums.setdefault(row[1], [0] * (1 + len(TOTAL_COLUMNS)))
        acc[0] += 1
        for k, pos in enumerate(_TOTAL_POSITIONS, start=1):
            acc[k] += row[pos]
    return sums
