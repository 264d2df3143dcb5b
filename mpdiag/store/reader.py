"""Reading a store: :class:`Store` answers typed questions about runs with pandas DataFrames.

Owns every read query. It opens a short read-only connection per call, so a dashboard never holds the file,
and never writes, except that opening a store that does not exist yet (``create=True``), or one with an older
schema, goes through the writer's path in schema.py to create or migrate it. Contracts:

* SQLite cannot hold NaN (it stores NULL). Float columns that may be NaN (loss, absmax, l2, min_nonzero)
  are read back with NULL -> NaN; +-inf round-trips as itself.
* Histogram counts are one row per (run, step, tensor) with a BLOB (see :func:`encode_hist`).
* Representability counts are one row per (run, step, tensor, format) in a long table; the wide
  ``fp16_underflow``... columns of :meth:`Store.tensor_stats` and :meth:`Store.tensor_totals` are built from it.
* A run whose status is ``running`` or ``queued`` but whose process is gone is reported as ``crashed`` by every
  reader; a ``running`` run whose heartbeat (its last committed step, or before its first step its writer's
  heartbeat) is older than STALL_S and STALL_STEPS median steps (its process stopped or hung) as ``stalled``.
* Every SQLite failure, and a store file removed while it is read, reaches the caller as one :class:`StoreError`
  naming the file.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path

import numpy as np
import pandas as pd

from mpdiag.numerics.formats import EXP_MIN, LOW_PRECISION, SIGNAL_COUNTS
from mpdiag.store.liveness import process_is_alive
from mpdiag.store.schema import (
    DEFAULT_STORE,
    FIRST_READ_WAIT_S,
    REPRESENTABILITY_COLUMNS,
    REPRESENTABILITY_KINDS,
    ROLLUP_BUCKET_STEPS,
    SCHEMA_VERSION,
    SPECIAL_COUNT_COLUMNS,
    STALL_S,
    STALL_STEPS,
    STEP_COLUMNS,
    SUMMARY_COLUMNS,
    TENSOR_STAT_COLUMNS,
    StoreError,
    close_writing,
    connect_read,
    decode_hists,
    decode_signals,
    needs_immutable,
    no_store,
    open_for_writing,
    read_error,
    refuse_newer,
    step_summaries,
    stored_version,
)

# Errors a read can raise: sqlite3's own, and pandas' wrapper around them from read_sql_query.
_READ_ERRORS = (sqlite3.DatabaseError, pd.errors.DatabaseError)


def _known_format(fmt: str) -> str:
    if fmt not in LOW_PRECISION:
        raise ValueError(f"unknown format {fmt!r}; the known formats are {', '.join(LOW_PRECISION)}")
    return fmt


def _run_config(stored) -> dict:
    """A run's stored configuration (JSON text) as a dict whose ``run`` and ``watch`` parts, when present, are
    mpdiag's own options (objects). A store from before a user's ``Recorder(config=...)`` was kept under
    ``"user"`` may hold that config at the top: a ``run`` or ``watch`` there that is no object (``{"run":
    "baseline-3"}``), or a configuration that is no object at all, is the user's and is read under ``"user"``."""
    config = json.loads(stored) if isinstance(stored, str) else {}
    if not isinstance(config, dict):
        return {"user": config}
    theirs = {part: config.pop(part) for part in ("run", "watch")
              if part in config and not isinstance(config[part], dict)}
    if theirs:
        config["user"] = {**(config.get("user") if isinstance(config.get("user"), dict) else {}), **theirs}
    return config


def _totals_joins(formats: Sequence[str]) -> tuple[str, str]:
    """(select list, joins) adding each format's six summed counts from representability_totals to the rows of
    alias ``src`` (tensor_totals), named like REPRESENTABILITY_COLUMNS, in its order."""
    # LEFT: a run recorded before a format joined the registry has no rows for it (its counts read NULL / NaN)
    joins = " ".join(f"LEFT JOIN representability_totals r{i} ON r{i}.run_id = src.run_id AND "
                     f"r{i}.tensor_id = src.tensor_id AND r{i}.fmt = '{fmt}'"  # registry names, never user text
                     for i, fmt in enumerate(formats))
    columns = [f"r{i}.{cat}{suffix} AS {fmt}_{cat}{suffix}" for suffix in ("", "_at_scale")
               for i, fmt in enumerate(formats) for cat in ("underflow", "subnormal", "overflow")]
    return ", ".join(columns), joins


#: the fields of a heatmap column as :class:`_ColumnReader` reads them, exact row or bucket sum alike
_COLUMN_FIELDS = ("step", "last_step", "steps_kept", "empty_steps", *SPECIAL_COUNT_COLUMNS, "hist")
_LAST_STEP = 2**62


class _ColumnReader:
    """Reads one tensor's heatmap columns for :meth:`Store.histogram_columns` on one connection."""

    def __init__(self, conn: sqlite3.Connection, run_id: int, tensor_id: int):
        self.conn, self.run_id, self.tensor_id = conn, run_id, tensor_id

    def read(self, kept_steps: int, max_columns: int, split_at: np.ndarray, from_step: int) -> tuple[list[tuple], int]:
        """(the columns from bucket ``from_step`` // level on, in _COLUMN_FIELDS; the level chosen).

        The writer stores a bucket's sum once the bucket is closed (mpdiag.store.schema.HistogramRollups): the
        steps after a level's last stored bucket (its open one, or the ones a crash lost) are read at the next
        finer level, down to the exact rows, which are always there."""
        buckets = dict(self.conn.execute(
            "SELECT bucket_steps, COUNT(*) FROM hist_rollups WHERE run_id = ? AND tensor_id = ? GROUP BY "
            "bucket_steps", (self.run_id, self.tensor_id)).fetchall())
        levels, counts = [1, *ROLLUP_BUCKET_STEPS], [kept_steps]
        for size in ROLLUP_BUCKET_STEPS:  # a level with no stored bucket yet is read at the finer one
            counts.append(buckets.get(size, counts[-1]))
        chosen = next((k for k, n in enumerate(counts) if n <= max_columns), len(levels) - 1)
        done, pending, tail_from = [], [], from_step
        for k in range(chosen, -1, -1):
            tail = self.rows(levels[k], tail_from, _LAST_STEP)
            pending += tail
            if not k:
                break
            if tail:
                tail_from = (max(row[1] for row in tail) // levels[k] + 1) * levels[k]
            split = [_needs_split(row, split_at) for row in pending]
            done += [row for row, s in zip(pending, split, strict=True) if not s]
            pending = [fine for row, s in zip(pending, split, strict=True) if s
                       for fine in self.rows(levels[k - 1], row[0], row[1])]
        return done + pending, levels[chosen]

    def rows(self, size: int, first: int, last: int) -> list[tuple]:
        """The columns of level ``size`` (1: the exact rows) from step ``first`` to ``last``, in _COLUMN_FIELDS."""
        if size == 1:  # an empty histogram is its 2-byte header alone (encode_hist)
            return self.conn.execute(
                "SELECT step, step, 1, LENGTH(hist) = 2, zeros, nan, posinf, neginf, hist FROM tensor_steps "
                "INDEXED BY tensor_steps_by_tensor WHERE run_id = ? AND tensor_id = ? AND step BETWEEN ? AND ?",
                (self.run_id, self.tensor_id, first, last)).fetchall()
        return self.conn.execute(
            "SELECT first_step, last_step, steps_kept, empty_steps, NULL, NULL, NULL, NULL, hist FROM hist_rollups "
            "WHERE run_id = ? AND tensor_id = ? AND bucket_steps = ? AND bucket BETWEEN ? AND ?",
            (self.run_id, self.tensor_id, size, first // size, last // size)).fetchall()


def _needs_split(row: tuple, split_at: np.ndarray) -> bool:
    """Whether a bucket sum (not an exact row: those carry their zeros) must be read finer: it holds a kept step
    with an empty histogram, or a step of ``split_at`` (sorted) lies in (first step, last step]."""
    first, last, _, empty, zeros = row[:5]
    return zeros is None and (empty > 0 or bool(np.searchsorted(split_at, last, "right")
                                                > np.searchsorted(split_at, first, "right")))


class Store:
    """Read access to a store file, returning pandas DataFrames. Creating a Store creates the file's schema
    if the file does not exist yet (``create=True``), so the CLI and the app can start on an empty path, and
    migrates a store of an older schema version in place. A store in a folder this process cannot write is
    read as it is (``immutable``), as long as its schema is current. ``held_summaries``: a dict the caller keeps
    across Store objects (a dashboard session's) where :meth:`runs` holds the live runs' step summaries, so that
    each read of the runs table reads only the steps added since the last (default: this Store's own)."""

    def __init__(self, path: str | os.PathLike | None = None, create: bool = True, held_summaries: dict | None = None):
        # Absolute, so a script that changes the working directory cannot redirect later opens.
        self.path = Path(path or os.environ.get("MPDIAG_STORE") or DEFAULT_STORE).absolute()
        self._held_summaries = {} if held_summaries is None else held_summaries
        self._identity: tuple | None = None  # (the file's stat when read, identity())
        if not self.path.exists() and not create:
            raise no_store(self.path)
        self._immutable = False
        if not self.path.exists():
            try:
                close_writing(open_for_writing(self.path))
            except StoreError as exc:
                raise StoreError(f"No store at {self.path}, and mpdiag cannot create one there: {exc}") from exc
        self._check(create)

    def _connect(self) -> sqlite3.Connection:
        # A file removed since it was opened (a read-only open would only say "unable to open database file")
        if not self.path.exists():
            raise no_store(self.path)
        return connect_read(self.path, immutable=self._immutable)

    def _check(self, create: bool) -> None:
        """Refuse what is not an mpdiag store of a known version; create or migrate what needs it."""
        try:
            self._immutable = needs_immutable(self.path)
            with closing(connect_read(self.path, self._immutable, wait_s=FIRST_READ_WAIT_S)) as conn:
                version = stored_version(conn, self.path)
        except sqlite3.DatabaseError as exc:
            raise read_error(self.path, exc) from exc
        refuse_newer(self.path, version)
        if version is None and not create:
            raise StoreError(f"{self.path} is an empty SQLite file, not an mpdiag store.")
        if version != SCHEMA_VERSION:  # new (another process may be creating it right now) or older: fix it
            try:
                close_writing(open_for_writing(self.path))
            except StoreError as exc:
                if version is None:
                    raise
                raise StoreError(f"{self.path} has mpdiag schema version {version} and must be upgraded to "
                                 f"{SCHEMA_VERSION} before it can be read: make it writable once. ({exc})") from exc

    def _query(self, sql: str, params: Sequence = ()) -> pd.DataFrame:
        try:
            with closing(self._connect()) as conn:
                return pd.read_sql_query(sql, conn, params=list(params))
        except _READ_ERRORS as exc:
            raise read_error(self.path, exc.__cause__ or exc) from exc

    # -- runs -----------------------------------------------------------------------------------------------
    def runs(self) -> pd.DataFrame:
        """One row per run, newest first, with steps_done, final_loss and skipped_steps summarised, ``tags`` (a
        sorted list), ``user_note`` (a person's note; ``note`` is mpdiag's own) and ``fp16_gradients`` (whether a
        recorded tensor's gradient was FP16: a model cast to half by the script itself). Status ``running`` is
        reported as ``crashed`` when the owning process no longer exists; a parent or twin that was deleted reads
        <NA>."""
        df = self._query("SELECT * FROM runs ORDER BY run_id DESC")
        if df.empty:
            return df
        # custom runs only (the rest are judged by their level), each an index probe on its own tensors: every page
        # and live refresh reads runs(), and a scan of every run's tensors grew with the store
        halves = self._query("SELECT run_id FROM runs r WHERE r.opt_level = 'custom' AND EXISTS (SELECT 1 FROM "
                             "tensors t WHERE t.run_id = r.run_id AND t.grad_dtype = 'float16')")
        df["fp16_gradients"] = df["run_id"].isin(set(halves["run_id"].astype(int)))
        self._add_summaries(df)
        _judge_liveness(df)
        _decode_run_columns(df)
        tags = self._query("SELECT run_id, tag FROM run_tags ORDER BY run_id, tag")
        held = tags.groupby("run_id")["tag"].agg(list).to_dict() if len(tags) else {}
        df["tags"] = df["run_id"].map(lambda r: held.get(int(r), []))
        return df

    #: what :meth:`runs_with` can ask about: a page's data, by the table holding it
    RUN_DATA = {"fp8": "fp8_steps", "modules": "module_steps"}

    def runs_with(self, data: str) -> set[int]:
        """The ids of the runs that recorded ``data`` (a key of RUN_DATA: FP8 statistics, a module trace), one
        index probe per run."""
        table = self.RUN_DATA[data]
        ids = self._query(f"SELECT run_id FROM runs WHERE EXISTS (SELECT 1 FROM {table} t WHERE t.run_id = runs.run_id)")
        return set(ids["run_id"].astype(int))

    def _add_summaries(self, df: pd.DataFrame) -> None:
        """The step summary columns of every run in ``df`` (in place). Finished runs carry the summary their writer
        stored when they ended; only the others are read live, each from the steps after those its held summary
        has read."""
        stored = {int(r): json.loads(v) for r, v in zip(df["run_id"], df.pop("summary"), strict=True) if isinstance(v, str)}
        live = df[~df["run_id"].isin(stored)]
        try:
            identity = os.stat(self.path)
            with closing(self._connect()) as conn:
                live = step_summaries(conn, live["run_id"].astype(int).tolist(), self._held_summaries,
                                      # a held summary is of this file and this run, not of one that took its id
                                      [(identity.st_ino, identity.st_dev, int(r), s)
                                       for r, s in zip(live["run_id"], live["started_at"], strict=True)])
        except FileNotFoundError:
            raise no_store(self.path) from None
        except _READ_ERRORS as exc:
            raise read_error(self.path, exc.__cause__ or exc) from exc
        summaries = pd.DataFrame.from_dict({**stored, **live}, orient="index")
        for col in SUMMARY_COLUMNS:
            df[col] = df["run_id"].map(summaries[col]) if col in summaries else np.nan
        for col in ("steps_done", "skipped_steps"):
            df[col] = df[col].fillna(0).astype(int)
        df["final_loss"] = df["final_loss"].astype(float)
        df["median_step_time_s"] = df["median_step_time_s"].astype(float)

    def tags(self) -> pd.DataFrame:
        """Every tag in the store with how many runs carry it: tag, runs; by tag."""
        return self._query("SELECT tag, COUNT(*) AS runs FROM run_tags GROUP BY tag ORDER BY tag")

    def run(self, run_id: int) -> pd.Series:
        """One run's row, as in :meth:`runs`. Raises StoreError naming the id when it does not exist."""
        runs = self.runs()
        match = runs[runs["run_id"] == int(run_id)] if len(runs) else runs
        if match.empty:
            raise StoreError(f"No run {run_id} in {self.path}. `python -m mpdiag runs` lists the runs.")
        return match.iloc[0]

    def run_output(self, run_id: int) -> dict | None:
        """The console output kept with a run (mpdiag started or watched its process): ``text`` (bounded: the
        first and last part, with a line saying how many bytes were cut between them), ``bytes_total`` (all it
        printed) and ``updated_at`` (UTC; refreshed every few seconds while the run goes). None when none was kept:
        a run recorded by a user's own Recorder loop, or one recorded before mpdiag kept output."""
        df = self._query("SELECT text, bytes_total, updated_at FROM run_output WHERE run_id = ?", (int(run_id),))
        if df.empty:
            return None
        row = df.iloc[0]
        return {"text": str(row["text"]), "bytes_total": int(row["bytes_total"]),
                "updated_at": pd.to_datetime(float(row["updated_at"]), unit="s", utc=True)}

    def scripts(self) -> pd.DataFrame:
        """Stored scripts, newest first: sha256, filename, added_at (UTC), runs (how many runs used it)."""
        return self._uploads(
            "SELECT s.sha256, s.filename, s.added_at, (SELECT COUNT(*) FROM runs r WHERE r.script_sha256 = s.sha256) "
            "AS runs FROM scripts s ORDER BY s.added_at DESC"
        )

    def script_source(self, sha256: str) -> tuple[str, str]:
        """(original file name, source text) of a stored script."""
        row = self._upload("SELECT filename, source FROM scripts WHERE sha256 = ?", sha256, "stored script")
        return row["filename"], row["source"]

    def bundles(self) -> pd.DataFrame:
        """Uploaded training code, newest first: sha256, name, bytes (its zip's size), added_at (UTC), runs
        (how many watched runs ran it)."""
        return self._uploads(
            "SELECT b.sha256, b.name, LENGTH(b.zip) AS bytes, b.added_at, (SELECT COUNT(*) FROM runs r WHERE "
            "json_extract(r.config, '$.watch.bundle') = b.sha256) AS runs FROM bundles b ORDER BY b.added_at DESC"
        )

    def bundle(self, sha256: str) -> tuple[str, bytes]:
        """(name, canonical zip) of stored uploaded code."""
        row = self._upload("SELECT name, zip FROM bundles WHERE sha256 = ?", sha256, "uploaded code")
        return row["name"], bytes(row["zip"])

    def _uploads(self, sql: str) -> pd.DataFrame:
        df = self._query(sql)
        df["added_at"] = pd.to_datetime(df["added_at"], unit="s", utc=True)
        return df

    def _upload(self, sql: str, sha256: str, what: str) -> pd.Series:
        df = self._query(sql, (sha256,))
        if df.empty:
            raise StoreError(f"No {what} with hash {sha256} in {self.path}.")
        return df.iloc[0]

    # -- per step -------------------------------------------------------------------------------------------
    def steps(self, run_id: int, since_step: int = -1) -> pd.DataFrame:
        """Per-step records of a run (steps after ``since_step``), loss NaN restored from NULL.
        ``skipped`` is 1 when the optimizer step did not run, 0 when it ran, NaN when unknown (the run stopped
        inside that step); ``growth_tracker`` is NaN for runs without a scaler.

        Recorded at every step since schema 9 (NaN in the rows of runs recorded before, whose ``wall_time_s`` is
        NaN too): ``lr``, the learning rate of the step (NaN when the Recorder knew no optimizer); ``grad_norm``,
        the L2 norm of all the step's gradients, unscaled, before clipping (what ``clip_grad_norm_`` returns),
        +-inf as itself and NaN for a NaN norm; ``wall_time_s``, seconds from the Recorder's start to the end of
        the step."""
        df = self._query(
            f"SELECT {', '.join(STEP_COLUMNS)} FROM steps WHERE run_id = ? AND step > ? ORDER BY step",
            (int(run_id), int(since_step)),
        )
        for col in ("loss", "loss_scale", "skipped", "growth_tracker", "scale_after", "lr", "grad_norm",
                    "wall_time_s"):
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
        """step, tensor and ``columns`` of tensor_steps rows (alias ``src``) after ``since_step``
        (up to ``until_step``), one tensor or all."""
        # One tensor: walk the (run_id, tensor_id, step) index; the planner otherwise prefers the primary key
        # and reads every row of the run. Joined tables are then looked up by their primary keys.
        source = "tensor_steps src INDEXED BY tensor_steps_by_tensor" if tensor is not None else "tensor_steps src"
        sql = (
            f"SELECT src.step, t.name AS tensor, {columns} FROM {source} "
            "JOIN tensors t ON t.run_id = src.run_id AND t.tensor_id = src.tensor_id "
            "WHERE src.run_id = ? AND src.step > ?"
        )
        params: list = [int(run_id), int(since_step)]
        if until_step is not None:
            sql += " AND src.step <= ?"
            params.append(int(until_step))
        if tensor is not None:
            sql += " AND src.tensor_id = (SELECT tensor_id FROM tensors WHERE run_id = ? AND name = ?)"
            params += [int(run_id), tensor]
        return self._query(sql + " ORDER BY src.step, src.tensor_id", params)

    def tensor_totals(self, run_id: int) -> pd.DataFrame:
        """Per tensor, counts summed over every logged step: numel (summed), zeros, nan, posinf, neginf and the
        representability counts of every registry format (``fp16_underflow`` ... ``bf16_overflow_at_scale``);
        numel_per_step is the tensor's size. Read from running totals the writer keeps, so its cost does not
        grow with the number of steps."""
        counts, joins = _totals_joins(list(LOW_PRECISION))
        sums = ", ".join(f"src.{c}" for c in SPECIAL_COUNT_COLUMNS)
        return self._query(
            f"SELECT t.name AS tensor, t.numel AS numel_per_step, t.numel * src.logged_steps AS numel, "
            f"src.logged_steps, {sums}, {counts} FROM tensor_totals src "
            f"JOIN tensors t ON t.run_id = src.run_id AND t.tensor_id = src.tensor_id {joins} "
            "WHERE src.run_id = ? ORDER BY src.tensor_id",
            (int(run_id),),
        )

    def logged_steps(self, run_id: int) -> list[int]:
        """Steps at which tensor statistics were recorded (kept: :meth:`kept_steps` says why)."""
        df = self._query("SELECT step FROM steps WHERE run_id = ? AND logged = 1 ORDER BY step", (int(run_id),))
        return df["step"].tolist()

    def kept_steps(self, run_id: int) -> pd.DataFrame:
        """Why each logged step's tensor statistics were kept: one row per (step, reason), in step order; the
        reasons are mpdiag.recording.retention's (``every``, ``nonfinite``, ``overflow``, ..., ``before``,
        ``after``). Runs recorded before schema version 14 read ``every`` for each of their logged steps."""
        return self._query("SELECT step, reason FROM kept_steps WHERE run_id = ? ORDER BY step, reason",
                           (int(run_id),))

    def step_signal_totals(self, run_id: int, since_step: int = -1, max_rows: int | None = None) -> pd.DataFrame:
        """Per step with signals after ``since_step`` (every step the Recorder counted, kept or not; runs
        recorded before schema 16: their logged steps only): step, each of SIGNAL_COUNTS (``nan``, ``posinf``,
        ``neginf``, ``fp16_underflow_at_scale``, ..., ``bf16_overflow_at_scale``) summed over the step's tensors,
        and ``steps`` (1). With ``max_rows``, more steps than that are read in ranges of consecutive steps, one row
        each: its first step, each count's largest value at one of its steps, and ``steps`` the range holds."""
        where, params = "FROM step_signals WHERE run_id = ? AND step > ?", [int(run_id), int(since_step)]
        count, first, last = (0, 0, 0) if max_rows is None else \
            self._query(f"SELECT COUNT(*), MIN(step), MAX(step) {where}", params).iloc[0].tolist()
        if count <= (max_rows or count):
            return self._query(f"SELECT step, {', '.join(SIGNAL_COUNTS)}, 1 AS steps {where} ORDER BY step", params)
        largest = ", ".join(f"MAX({c}) AS {c}" for c in SIGNAL_COUNTS)
        return self._query(f"SELECT MIN(step) AS step, {largest}, COUNT(*) AS steps {where} GROUP BY (step - ?) / ? "
                           "ORDER BY step", [*params, int(first), -(-(int(last) - int(first) + 1) // max_rows)])

    def step_signals(self, run_id: int, first_step: int = 0, last_step: int | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-tensor signals of the steps from ``first_step`` to ``last_step`` (None: the last) that have them,
        as arrays: steps (n,), the run's tensor ids (m,) and counts (n, m, len(SIGNAL_COUNTS)) in SIGNAL_COUNTS'
        order, -1 for a tensor not counted at that step (no fresh gradient). A range bounds the memory: a whole
        100,000-step, 500-tensor run is 2.8 GB of counts."""
        sql, params = "SELECT step, counts FROM step_signals WHERE run_id = ? AND step >= ?", [int(run_id), first_step]
        if last_step is not None:
            sql, params = sql + " AND step <= ?", [*params, int(last_step)]
        rows = self._query(sql + " ORDER BY step", params)
        tensor_ids = self.tensors(run_id)["tensor_id"].to_numpy(dtype=np.int64)
        counts = np.full((len(rows), len(tensor_ids), len(SIGNAL_COUNTS)), -1, dtype=np.int64)
        for k, blob in enumerate(rows["counts"]):
            ids, step_counts = decode_signals(blob)
            counts[k, np.searchsorted(tensor_ids, ids)] = step_counts
        return rows["step"].to_numpy(dtype=np.int64), tensor_ids, counts

    def step_signals_at(self, run_id: int, step: int) -> pd.DataFrame:
        """The signals of one step (kept in full or not) per tensor counted at it: tensor and each of SIGNAL_COUNTS;
        empty where the step has none (not counted, or a store from before schema 16 at a step it did not keep)."""
        _, tensor_ids, counts = self.step_signals(run_id, int(step), int(step))
        names = self.tensors(run_id)["name"].to_numpy(dtype=object)
        per_tensor = counts[0] if len(counts) else np.full((len(tensor_ids), len(SIGNAL_COUNTS)), -1, np.int64)
        counted = per_tensor[:, 0] >= 0  # -1: no fresh gradient at that step
        return pd.DataFrame({"tensor": names[counted]} | {c: per_tensor[counted, k] for k, c in enumerate(SIGNAL_COUNTS)})

    def step_signal_sums(self, run_id: int) -> pd.Series:
        """Over every step with signals (kept or not; see :meth:`step_signal_totals`): ``steps``, how many, and each
        of SIGNAL_COUNTS summed over them and their tensors. Read from the sums' index alone, one row."""
        sums = ", ".join(f"COALESCE(SUM({c}), 0) AS {c}" for c in SIGNAL_COUNTS)
        return self._query(f"SELECT COUNT(*) AS steps, {sums} FROM step_signals WHERE run_id = ?",
                           (int(run_id),)).iloc[0].astype("int64")

    def signal_counts(self, run_id: int, signal: str) -> pd.DataFrame:
        """One of SIGNAL_COUNTS (``signal``: ``nan``, ..., ``fp16_overflow_at_scale``) per step and tensor, at every
        step with signals (kept or not), where it is above 0: columns step, tensor, count, in step and tensor
        order; empty when no step holds any. Only the steps whose sum is above 0 are decoded, found from the
        sums' index, so a run without any costs one index scan. Raises ValueError for any other ``signal``."""
        if signal not in SIGNAL_COUNTS:
            raise ValueError(f"unknown signal {signal!r}; the signals are {', '.join(SIGNAL_COUNTS)}")
        rows = self._query(f"SELECT step, counts FROM step_signals WHERE run_id = ? AND {signal} > 0 ORDER BY step",
                           (int(run_id),))
        column, none = SIGNAL_COUNTS.index(signal), np.zeros(0, dtype=np.int64)
        steps, ids, counts = [none], [none], [none]
        for step, blob in zip(rows["step"].tolist(), rows["counts"], strict=True):
            tensor_ids, step_counts = decode_signals(blob)
            held = step_counts[:, column] > 0
            steps.append(np.full(int(held.sum()), step, dtype=np.int64))
            ids.append(tensor_ids[held])
            counts.append(step_counts[held, column])
        names = self.tensors(run_id).set_index("tensor_id")["name"]
        return pd.DataFrame({"step": np.concatenate(steps), "tensor": names.reindex(np.concatenate(ids)).to_numpy(
            dtype=object), "count": np.concatenate(counts)})

    def tensor_stats(
        self, run_id: int, tensor: str | None = None, since_step: int = -1, step: int | None = None
    ) -> pd.DataFrame:
        """Per logged step and tensor: counts, absmax, min_nonzero, l2 and the representability counts of the
        unscaled gradient g in every registry format (``fp16_underflow``, ``bf16_subnormal``, ...), and the same
        counts with suffix ``_at_scale`` for S*g; after ``since_step``, or at exactly ``step``."""
        stats = ", ".join(f"src.{c}" for c in [*TENSOR_STAT_COLUMNS[1:], *REPRESENTABILITY_COLUMNS])
        df = self._tensor_steps(f"t.numel, {stats}", run_id, tensor, since_step if step is None else step - 1,
                                until_step=step)
        for col in ("absmax", "min_nonzero", "l2"):
            df[col] = df[col].astype(float)
        return df

    def representability(
        self, run_id: int, fmt: str, tensor: str | None = None, since_step: int = -1, step: int | None = None
    ) -> pd.DataFrame:
        """Per logged step and tensor, how the gradient fits format ``fmt`` (a name in the format registry,
        mpdiag.numerics.formats.LOW_PRECISION): columns step, tensor, numel, underflow, subnormal, overflow
        (elements of the unscaled gradient g) and underflow_at_scale, subnormal_at_scale, overflow_at_scale
        (of S*g). After ``since_step``, or at exactly ``step``; one tensor or all. Raises ValueError naming the
        known formats for any other ``fmt``."""
        fmt = _known_format(fmt)  # a registry name: the only text put into the SQL
        counts = ", ".join(f"src.{fmt}_{kind} AS {kind}" for kind in REPRESENTABILITY_KINDS)
        return self._tensor_steps(f"t.numel, {counts}", run_id, tensor, since_step if step is None else step - 1,
                                  until_step=step)

    def histogram_matrix(
        self, run_id: int, tensor: str | None = None, since_step: int = -1, step: int | None = None
    ) -> tuple[pd.DataFrame, np.ndarray]:
        """(index, counts): index has step and tensor per row; counts[i, b] is the count of exponent bin
        EXP_MIN + b for that row, for one tensor or all, after ``since_step`` or at exactly ``step``.
        The compact form for aggregation; :meth:`histograms` is the long form."""
        df = self._tensor_steps("src.hist", run_id, tensor, since_step if step is None else step - 1, until_step=step)
        return df, decode_hists(df.pop("hist").tolist())

    def histogram_columns(self, run_id: int, tensor: str, max_columns: int, split_at: Sequence[int] = (),
                          from_step: int = 0) -> tuple[pd.DataFrame, np.ndarray]:
        """One tensor's histograms over its kept steps in at most about ``max_columns`` columns, for a heatmap:
        (index, counts) in step order, counts[i] the sum of column i's exponent histograms (bin EXP_MIN + b).

        The exact per-step rows when the tensor's kept steps fit in ``max_columns``; else the finest level of the
        writer's bucket sums (hist_rollups, ROLLUP_BUCKET_STEPS) with at most ``max_columns`` buckets. A bucket
        is read at the next finer level, down to the exact rows, where a sum would hide something: a kept step
        with no finite non-zero value in it (so the heatmap's blank columns stay exact steps), or a step of
        ``split_at`` inside it (first_step < s <= last_step: e.g. where the loss scale changed, so each column
        has one scale). Index columns: step (the column's first kept step), last_step, steps_kept (how many kept
        steps it sums), and for exact rows zeros, nan, posinf, neginf (NaN for a sum); ``index.attrs
        ["bucket_steps"]``: the level read (1: the exact rows). Each count is exact: a sum over whole kept steps,
        never an estimate. ``from_step``, a multiple of the level read before: only the columns of the buckets
        from there on (a live page re-reads its last bucket, which may have grown, and the new ones)."""
        try:
            with closing(self._connect()) as conn:
                found = conn.execute("SELECT t.tensor_id, COALESCE(s.logged_steps, 0) FROM tensors t LEFT JOIN "
                                     "tensor_totals s ON s.run_id = t.run_id AND s.tensor_id = t.tensor_id WHERE "
                                     "t.run_id = ? AND t.name = ?", (int(run_id), tensor)).fetchone()
                rows, level = ([], 1) if found is None else _ColumnReader(conn, int(run_id), found[0]).read(
                    found[1], int(max_columns), np.sort(np.asarray(split_at, dtype=np.int64)), int(from_step))
        except _READ_ERRORS as exc:
            raise read_error(self.path, exc.__cause__ or exc) from exc
        rows.sort(key=lambda row: row[0])
        index = pd.DataFrame([row[:-1] for row in rows], columns=list(_COLUMN_FIELDS[:-1]))
        index = index.drop(columns="empty_steps").astype({c: float for c in SPECIAL_COUNT_COLUMNS}).assign(tensor=tensor)
        index.attrs["bucket_steps"] = level
        return index, decode_hists([row[-1] for row in rows])

    def histogram_totals(self, run_id: int) -> tuple[list[str], np.ndarray]:
        """(tensor names, counts): counts[i, b] is tensor i's exponent bin EXP_MIN + b summed over every logged
        step, from the sums the writer keeps (a store older than schema 6 gets them summed once when it is
        migrated), so its cost does not grow with the number of steps."""
        df = self._query("SELECT t.name AS tensor, h.hist FROM hist_totals h JOIN tensors t ON t.run_id = h.run_id "
                         "AND t.tensor_id = h.tensor_id WHERE h.run_id = ? ORDER BY h.tensor_id", (int(run_id),))
        return df["tensor"].tolist(), decode_hists(df["hist"].tolist())

    def histogram_rollups(self, run_id: int) -> pd.DataFrame:
        """The writer's bucket sums of each tensor's histograms (hist_rollups, what :meth:`histogram_columns` reads
        for a long heatmap), long: tensor, bucket_steps (ROLLUP_BUCKET_STEPS), bucket (steps bucket * bucket_steps
        to (bucket + 1) * bucket_steps - 1), first_step and last_step (its first and last kept step), steps_kept,
        empty_steps (kept steps with no finite non-zero value), exponent (bin 2^e <= |g| < 2^(e+1)) and count, one
        row per non-empty bin; a bucket whose kept steps were all empty has one row, its exponent and count <NA>."""
        df = self._query("SELECT t.name AS tensor, r.bucket_steps, r.bucket, r.first_step, r.last_step, r.steps_kept, "
                         "r.empty_steps, r.hist FROM hist_rollups r JOIN tensors t ON t.run_id = r.run_id AND "
                         "t.tensor_id = r.tensor_id WHERE r.run_id = ? ORDER BY r.tensor_id, r.bucket_steps, r.bucket",
                         (int(run_id),))
        counts = decode_hists(df.pop("hist").tolist())
        rows, bins = np.nonzero(counts)
        empty = np.flatnonzero(~counts.any(axis=1))  # a bucket of empty steps only: one row, without a bin
        row, binned = np.r_[rows, empty], np.r_[np.ones(len(rows), bool), np.zeros(len(empty), bool)]
        order = np.lexsort((np.r_[bins, np.zeros(len(empty), np.int64)], row))  # the query's order, then the bins
        long = df.iloc[row[order]].reset_index(drop=True)
        for column, values in (("exponent", bins + EXP_MIN), ("count", counts[rows, bins])):
            long[column] = pd.Series(np.r_[values, np.zeros(len(empty), np.int64)][order], dtype="Int64").where(
                binned[order])
        return long

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

    def events(self, run_id: int | None = None) -> pd.DataFrame:
        """Events raised while training (:mod:`mpdiag.recording.events`), in step order: run_id, step, kind,
        evidence (a dict: the values the rule read, its ``summary`` and ``rule`` in words), created_at. Every run's
        when ``run_id`` is None. Empty for runs recorded before schema 12."""
        where, params = ("WHERE run_id = ?", (int(run_id),)) if run_id is not None else ("", ())
        df = self._query(f"SELECT run_id, step, kind, evidence, created_at FROM events {where} "
                         "ORDER BY run_id, step, rowid", params)
        df["evidence"] = [json.loads(text) for text in df["evidence"]]
        return df

    def replays(self, run_id: int) -> pd.DataFrame:
        """The run's replayed steps (:mod:`mpdiag.recording.replay`; at most two: the first non-finite step's, and
        the first loss spike's, trigger "loss spike"): step, trigger, reproduced (bool),
        first_module, first_phase (forward|backward; None when the replay found nothing bad), low_format,
        format_max, note, created_at. Empty when no step was replayed, and for runs recorded before schema 13."""
        df = self._query("SELECT step, trigger, reproduced, first_module, first_phase, low_format, format_max, note, "
                         "created_at FROM replays WHERE run_id = ? ORDER BY step", (int(run_id),))
        df["reproduced"] = df["reproduced"].astype(bool)
        return df

    def replay_modules(self, run_id: int, step: int | None = None) -> pd.DataFrame:
        """Per module call of a replayed step, forward then backward, each in execution order: step, phase, ord,
        module, type, absmax (of the finite values; NaN: none), nonfinite, in_absmax, in_nonfinite (of what the
        call received: its inputs; in backward, its output gradient). A loss spike's replay also stores the
        forward of the previous step's batch, under that step."""
        where, params = ("AND step = ?", (int(run_id), int(step))) if step is not None else ("", (int(run_id),))
        df = self._query("SELECT step, phase, ord, module, type, absmax, nonfinite, in_absmax, in_nonfinite "
                         f"FROM replay_modules WHERE run_id = ? {where} "
                         "ORDER BY step, CASE phase WHEN 'forward' THEN 0 ELSE 1 END, ord", params)
        for col in ("absmax", "in_absmax"):
            df[col] = df[col].astype(float)
        return df

    def events_version(self) -> tuple[int, float]:
        """(count, newest created_at) of all stored events: changes whenever an event is stored."""
        row = self._query("SELECT COUNT(*) AS n, COALESCE(MAX(created_at), 0) AS last FROM events").iloc[0]
        return int(row["n"]), float(row["last"])

    def rank_steps(self, run_id: int) -> pd.DataFrame:
        """Per step and rank of a distributed run: ``loss`` (that rank's local loss; NaN restored from NULL)
        and ``nonfinite`` (DDP: the inf/NaN values in that rank's local gradients before the all-reduce; NaN
        where not counted, as under FSDP2). Empty for a one-process run."""
        df = self._query("SELECT step, rank, loss, nonfinite FROM rank_steps WHERE run_id = ? ORDER BY step, rank",
                         (int(run_id),))
        for col in ("loss", "nonfinite"):
            df[col] = df[col].astype(float)
        return df

    def fp8(self, run_id: int) -> pd.DataFrame:
        """A run recorded with --fp8: per logged step, Linear module, role (input, weight, grad_output) and
        recipe (current, delayed), the FP8 format ``fmt`` (fp8_e4m3, fp8_e5m2), the ``scale`` the recipe
        uses, the tensor's ``amax`` and ``numel``, and the underflow / subnormal / overflow counts of the
        scaled tensor in that format. Recorded block-scaled recipes add rows: recipe ``mxfp8`` (fmt fp8_e4m3,
        scale NaN: its scales are per block) and ``nvfp4`` (fmt fp4_e2m1, scale the per-tensor fp32 scale),
        their counts those of the elements (:mod:`mpdiag.numerics.block_scaled`; blocks: :meth:`fp8_blocks`).
        Empty for a run recorded without --fp8."""
        df = self._query(
            "SELECT step, module, role, fmt, recipe, scale, amax, numel, underflow, subnormal, overflow FROM fp8_steps "
            "WHERE run_id = ? ORDER BY step, module, role, recipe", (int(run_id),))
        for col in ("scale", "amax"):
            df[col] = df[col].astype(float)
        return df

    def fp8_blocks(self, run_id: int) -> pd.DataFrame:
        """The block-scaled recipes' blocks per logged step, Linear module, role and recipe (mxfp8, nvfp4):
        ``blocks``, ``zero_blocks`` (all zero), ``clipped_blocks`` (a value clipped), ``wide_blocks`` (largest
        over smallest non-zero |x| past the element format's range). Empty when none was recorded (and for
        stores of schema versions before 11)."""
        return self._query("SELECT step, module, role, recipe, blocks, zero_blocks, clipped_blocks, wide_blocks "
                           "FROM fp8_blocks WHERE run_id = ? ORDER BY step, module, role, recipe", (int(run_id),))

    def fp8_block_scales(self, run_id: int) -> pd.DataFrame:
        """The block-scaled recipes' block scales, long format: step, module, role, recipe, exponent (a block
        counts in e when 2**e <= its dequantisation scale < 2**(e+1); blocks with a non-zero value), count."""
        return self._query("SELECT step, module, role, recipe, exponent, count FROM fp8_block_scales "
                           "WHERE run_id = ? ORDER BY step, module, role, recipe, exponent", (int(run_id),))

    def fp8_histograms(self, run_id: int) -> pd.DataFrame:
        """The exponent histograms of the tensors --fp8 records, unscaled, long format: step, module, role,
        exponent (a value x counts in e when 2**e <= |x| < 2**(e+1)), count; non-empty bins only."""
        return self._query("SELECT step, module, role, exponent, count FROM fp8_histograms WHERE run_id = ? "
                           "ORDER BY step, module, role, exponent", (int(run_id),))

    def probe(self, run_id: int, kind: str) -> dict | None:
        """The stored result of a diagnostic probe of a run (see mpdiag.sandbox.probe), or None."""
        df = self._query("SELECT result FROM probes WHERE run_id = ? AND kind = ?", (int(run_id), kind))
        return json.loads(df.iloc[0]["result"]) if len(df) else None

    def probes_version(self) -> tuple[int, float]:
        """(count, newest created_at) of all stored probe results: changes whenever a probe is stored or
        replaced (a replacement is written with its own time), by the app or by `diagnose`."""
        row = self._query("SELECT COUNT(*) AS n, COALESCE(MAX(created_at), 0) AS last FROM probes").iloc[0]
        return int(row["n"]), float(row["last"])

    def probes(self, run_id: int) -> pd.DataFrame:
        """Every stored probe result of a run: kind, result (JSON text)."""
        return self._query("SELECT kind, result FROM probes WHERE run_id = ? ORDER BY kind", (int(run_id),))

    def data_version(self, run_id: int) -> tuple:
        """What changes whenever the run's stored data does, in one indexed read: its status, when it finished,
        its heartbeat (every batch of rows the writer commits refreshes it) and its last step. ``()`` for a run
        that does not exist. Rows written outside a batch (events, shadow and update rows, a few a flush) show
        with the next batch's heartbeat."""
        rows = self._query("SELECT status, finished_at, heartbeat_at, (SELECT MAX(step) FROM steps WHERE run_id = ?) "
                           "AS last_step FROM runs WHERE run_id = ?", (int(run_id), int(run_id)))
        # NULL reads NaN, which equals nothing, not even itself: None compares
        return tuple(None if pd.isna(v) else v for v in rows.iloc[0].tolist()) if len(rows) else ()

    def identity(self) -> tuple[int, int, float | None]:
        """What tells this store file from one it replaced at the same path: its inode and device, and its oldest
        run's creation time (None: no run), since Linux gives a deleted file's inode to the next file made and the
        new store numbers its runs from 1 again. The run is read again only when the file's stat changed."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            raise no_store(self.path) from None
        stamp = (stat.st_ino, stat.st_dev, stat.st_mtime_ns)
        if self._identity is None or self._identity[0] != stamp:
            try:
                with closing(self._connect()) as conn:  # one read by the primary key
                    row = conn.execute("SELECT started_at FROM runs ORDER BY run_id LIMIT 1").fetchone()
            except _READ_ERRORS as exc:
                raise read_error(self.path, exc.__cause__ or exc) from exc
            self._identity = stamp, (stat.st_ino, stat.st_dev, None if row is None else float(row[0]))
        return self._identity[1]

    def max_step(self, run_id: int) -> int:
        """Last recorded step of a run, -1 when none."""
        df = self._query("SELECT MAX(step) AS s FROM steps WHERE run_id = ?", (int(run_id),))
        value = df.iloc[0]["s"]
        return -1 if pd.isna(value) else int(value)


def _judge_liveness(df: pd.DataFrame) -> None:
    """Runs whose process is gone read ``crashed`` (with why, when nothing said it), and running runs whose
    heartbeat stopped for longer than they pause read ``stalled`` (in place)."""
    dead = df["status"].isin(["running", "queued"]) & ~df.apply(
        lambda r: process_is_alive(r["pid"], r["host"], r["process_started_at"]), axis=1
    )
    quiet_s = np.maximum(STALL_S, STALL_STEPS * df["median_step_time_s"].fillna(0))
    stalled = (df["status"] == "running") & ~dead & (pd.to_numeric(df["heartbeat_at"]) < time.time() - quiet_s)
    df.loc[stalled, "status"] = "stalled"
    df.loc[dead, "status"] = "crashed"
    # NULL (or a store too old to have the column): recorded by one process
    df["world_size"] = df["world_size"].fillna(1).astype(int) if "world_size" in df else 1
    unexplained = dead & df["error"].isna()
    df.loc[unexplained, "error"] = "the training process exited without closing the run"
    # of a job, the process the run row names is rank 0's, the one that writes
    df.loc[unexplained & (df["world_size"] > 1), "error"] = "rank 0 (the process writing the run) exited without closing it"


def _decode_run_columns(df: pd.DataFrame) -> None:
    """The runs table's stored encodings as readers use them (in place): times as UTC datetimes, JSON as
    objects, links to other runs as nullable integers (a link to a deleted run reads as none)."""
    for col in ("started_at", "finished_at", "heartbeat_at"):
        df[col] = pd.to_datetime(df[col], unit="s", utc=True)
    df["model_state"] = df["model_state"].map(lambda v: json.loads(v) if isinstance(v, str) else {})
    df["config"] = df["config"].map(_run_config)
    for col in ("parent_run_id", "pair_run_id"):  # ids stay integers; absent is <NA>, never a float NaN
        df[col] = df[col].astype("Int64")
        # deleting a run leaves other runs' rows as they are
        df[col] = df[col].where(df[col].isin(df["run_id"].astype(int)), pd.NA)
