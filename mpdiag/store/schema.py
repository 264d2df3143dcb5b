"""The store's on-disk format and how a store file is opened.

This module owns the DDL, SCHEMA_VERSION and the migrations that bring an older file up to it in place, the
histogram blob codec and the sums of histograms over step buckets (hist_rollups: the writer adds each batch with
:class:`HistogramRollups`, the migration to version 15 the rows stored before), the error type, and
connections: read-only ones (falling back to ``immutable=1`` where the file's directory cannot be written) and
the writing one, which is opened only after the file passed an integrity check. Beyond migrations and rollups it
must not read or write runs' data (reader.py, writer.py do), and it must never write to a file that is damaged,
is not an mpdiag store, or carries a schema version newer than this code knows.

SQLite contracts the rest of the package relies on: the file is in WAL mode, so readers never block the one
writer; schema creation and migration run inside one ``BEGIN IMMEDIATE`` transaction, so processes that
open the same new or old file at once serialise on it and the later ones find the work done.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sqlite3
import time
import zlib
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import numpy as np

from mpdiag.numerics.formats import LOW_PRECISION, N_EXP_BINS, SIGNAL_COUNTS

DEFAULT_STORE = "mpdiag_runs.db"
# 2: runs.update_format, update_steps, shadow_steps. 3: representability counts in a long table keyed by format.
# 4: distributed runs: runs.world_size, backend, launch_command; rank_steps. 5: fp8_steps, fp8_histograms (--fp8).
# 6: hist_totals, each tensor's exponent histogram summed over its logged steps (runs recorded before have none).
# 7: bundles, training code uploaded in the app (a script and the files it imports) that watched runs repeat.
# 8: run management: runs.user_note (a person's note; runs.note stays what mpdiag itself noted) and run_tags.
# 9: steps.lr, steps.grad_norm, steps.wall_time_s: recorded at every step (rows of runs recorded before read NULL).
# 10: run_output, the console output of a run mpdiag started or watched (bounded: mpdiag.store.console).
# 11: fp8_blocks, fp8_block_scales: the block-scaled recipes (mxfp8, nvfp4) --fp8 records (their per-tensor counts
# are fp8_steps rows); runs recorded before have none.
# 12: events, raised while training at the step they happen (mpdiag.recording.events); runs.status "stopped".
# 13: replays, replay_modules: the first non-finite step replayed module by module (mpdiag.recording.replay);
# runs recorded before have none.
# 14: kept_steps, the steps whose tensor statistics are stored and why (mpdiag.recording.retention); the logged steps
# of runs recorded before are migrated as kept for "every".
# 15: hist_rollups, each tensor's histograms summed over buckets of ROLLUP_BUCKET_STEPS steps (runs recorded before
# get them built from their tensor_steps rows when the store is migrated).
# 16: step_signals, each step's per-tensor inf/NaN and FP16/BF16 under/overflow counts at the loss scale, stored at
# every step, kept or not (issue 28); runs recorded before get them back from their kept steps' tensor rows.
# 17: the representability counts are columns of tensor_steps again ({fmt}_{kind}, TENSOR_STEP_COUNT_COLUMNS), one
# row per (step, tensor) instead of one per format too: the long table's four rows per tensor and step took ~45 %
# of the writer's insert time (issue 28). A format added to the registry adds its columns (ALTER TABLE ... ADD COLUMN,
# no row rewritten) and reads NULL for the rows before it. The long table is moved in and dropped.
SCHEMA_VERSION = 17
#: "stopped": training ended on request, the reason in the run's error: by --stop-on at an event, or by a signal
#: (SIGTERM: the dashboard's Stop or a kill; SIGINT: Ctrl-C)
STATUSES = ("queued", "running", "finished", "failed", "crashed", "stopped")  # readers also derive "stalled"
STALL_S = 30.0  # a running run with no new step (or, before its first, no heartbeat) for this long reads "stalled"
STALL_STEPS = 10  # ... and for this many of its median steps, so a slow step is not taken for a stall

#: The six representability counts of one tensor at one step in one format: of the unscaled gradient g, then of
#: S*g (suffix _at_scale).
REPRESENTABILITY_KINDS = (
    "underflow", "subnormal", "overflow", "underflow_at_scale", "subnormal_at_scale", "overflow_at_scale",
)
#: The wide column names readers give them (``fp16_underflow``, ..., ``bf16_overflow_at_scale``).
REPRESENTABILITY_COLUMNS = [
    f"{fmt}_{cat}{suffix}"
    for suffix in ("", "_at_scale")
    for fmt in LOW_PRECISION
    for cat in ("underflow", "subnormal", "overflow")
]
SPECIAL_COUNT_COLUMNS = ["zeros", "nan", "posinf", "neginf"]
TENSOR_STAT_COLUMNS = ["numel", *SPECIAL_COUNT_COLUMNS, "absmax", "min_nonzero", "l2"]
STEP_COLUMNS = [
    "step", "loss", "loss_scale", "skipped", "growth_tracker", "scale_after", "step_time_s", "peak_mem_bytes",
    "lr", "grad_norm", "wall_time_s",
]
#: Counts summed per (run, tensor) over all logged steps, as :meth:`Store.tensor_totals` reports them.
TOTAL_COLUMNS = [*SPECIAL_COUNT_COLUMNS, *REPRESENTABILITY_COLUMNS]
#: The step buckets hist_rollups sums each tensor's histograms over: a heatmap W columns wide reads the finest
#: level with at most W buckets, so it reads between W/16 and W rows whatever the run's length (16 steps to
#: 4,096: 100k steps are 6,250, 391 or 25 buckets). A factor of 16 between levels keeps the extra rows at 1/16 +
#: 1/256 + 1/4096 (6.7 %) of the exact ones, and the rows one batch of the writer updates per tensor few.
ROLLUP_BUCKET_STEPS = (16, 256, 4096)
#: Run columns a writer may set (run_id, status bookkeeping and process identity are managed by the writer).
RUN_FIELDS = [
    "name", "script_path", "script_sha256", "opt_level", "scaling", "init_scale", "growth_factor",
    "backoff_factor", "growth_interval", "loss_scale", "min_scale", "max_scale", "seed", "steps", "every",
    "device", "gpu_name", "torch_version", "parent_run_id", "pair_run_id", "batch_size", "params",
    "model_state", "config", "update_format", "world_size", "backend", "launch_command",
]
# Tables every mpdiag store has had since schema version 1: a file without them is not a store.
_CORE_TABLES = {"runs", "steps", "tensors", "tensor_steps", "scripts"}

_KIND_COLUMNS = ", ".join(f"{k} INTEGER NOT NULL" for k in REPRESENTABILITY_KINDS)
#: tensor_steps' representability counts: {fmt}_{kind} for each registry format and kind, format by format (a
#: TensorBatch's order); NULL where the row does not hold the format (recorded before the format joined). The same
#: names as REPRESENTABILITY_COLUMNS, in another order.
TENSOR_STEP_COUNT_COLUMNS = [f"{fmt}_{kind}" for fmt in LOW_PRECISION for kind in REPRESENTABILITY_KINDS]
_TENSOR_STEPS_DDL = f"""CREATE TABLE IF NOT EXISTS tensor_steps (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, tensor_id INTEGER NOT NULL, hist BLOB NOT NULL,
    zeros INTEGER, nan INTEGER, posinf INTEGER, neginf INTEGER, absmax REAL, min_nonzero REAL, l2 REAL,
    {", ".join(f"{c} INTEGER" for c in TENSOR_STEP_COUNT_COLUMNS)},
    PRIMARY KEY (run_id, step, tensor_id)) WITHOUT ROWID"""
#: schema versions 3 to 16 kept the counts as one row per (run, step, tensor, format): created by the migration
#: to version 3 and read by the one to 16, then moved into tensor_steps and dropped (version 17)
_LONG_REPRESENTABILITY_DDL = f"""CREATE TABLE IF NOT EXISTS representability (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, tensor_id INTEGER NOT NULL, fmt TEXT NOT NULL, {_KIND_COLUMNS},
    PRIMARY KEY (run_id, step, tensor_id, fmt)) WITHOUT ROWID"""
_TENSOR_STEPS_INDEX_DDL = "CREATE INDEX IF NOT EXISTS tensor_steps_by_tensor ON tensor_steps (run_id, tensor_id, step)"
_TENSOR_TOTALS_DDL = """CREATE TABLE IF NOT EXISTS tensor_totals (
    run_id INTEGER NOT NULL, tensor_id INTEGER NOT NULL, logged_steps INTEGER NOT NULL,
    zeros INTEGER, nan INTEGER, posinf INTEGER, neginf INTEGER,
    PRIMARY KEY (run_id, tensor_id)) WITHOUT ROWID"""
_STATEMENTS = [
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)",
    """CREATE TABLE IF NOT EXISTS scripts (
    sha256 TEXT PRIMARY KEY, filename TEXT NOT NULL, source TEXT NOT NULL, added_at REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS bundles (
    sha256 TEXT PRIMARY KEY, name TEXT NOT NULL, zip BLOB NOT NULL, added_at REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS runs (
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
    world_size INTEGER, backend TEXT, launch_command TEXT, user_note TEXT)""",
    # a person's labels of a run (mpdiag runs tag, the Runs page): one row per (run, tag)
    """CREATE TABLE IF NOT EXISTS run_tags (
    run_id INTEGER NOT NULL REFERENCES runs(run_id), tag TEXT NOT NULL, PRIMARY KEY (run_id, tag)) WITHOUT ROWID""",
    # what the run's process printed (stdout and stderr as printed), bounded as mpdiag.store.console keeps it;
    # bytes_total: all it printed, kept or cut. Written by whoever started or watched the process, never a child.
    """CREATE TABLE IF NOT EXISTS run_output (
    run_id INTEGER PRIMARY KEY REFERENCES runs(run_id), text TEXT NOT NULL, bytes_total INTEGER NOT NULL,
    updated_at REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS tensors (
    run_id INTEGER NOT NULL REFERENCES runs(run_id), tensor_id INTEGER NOT NULL, name TEXT NOT NULL,
    shape TEXT NOT NULL, numel INTEGER NOT NULL, param_dtype TEXT NOT NULL, grad_dtype TEXT,
    PRIMARY KEY (run_id, tensor_id)) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS steps (
    run_id INTEGER NOT NULL REFERENCES runs(run_id), step INTEGER NOT NULL,
    loss REAL, loss_scale REAL, skipped INTEGER, growth_tracker INTEGER, scale_after REAL,
    step_time_s REAL, peak_mem_bytes INTEGER, logged INTEGER NOT NULL DEFAULT 0,
    lr REAL, grad_norm REAL, wall_time_s REAL,
    PRIMARY KEY (run_id, step)) WITHOUT ROWID""",
    _TENSOR_STEPS_DDL,
    _TENSOR_STEPS_INDEX_DDL,
    """CREATE TABLE IF NOT EXISTS modules (
    run_id INTEGER NOT NULL REFERENCES runs(run_id), module_id INTEGER NOT NULL, name TEXT NOT NULL,
    type TEXT NOT NULL, PRIMARY KEY (run_id, module_id)) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS module_steps (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, module_id INTEGER NOT NULL,
    fwd_order INTEGER, fwd_absmax REAL, fwd_finite INTEGER, bwd_order INTEGER, bwd_absmax REAL, bwd_finite INTEGER,
    PRIMARY KEY (run_id, step, module_id)) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS probes (
    run_id INTEGER NOT NULL REFERENCES runs(run_id), kind TEXT NOT NULL, result TEXT NOT NULL,
    created_at REAL NOT NULL, PRIMARY KEY (run_id, kind)) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS update_steps (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, tensor_id INTEGER NOT NULL,
    updated INTEGER NOT NULL, below_resolution INTEGER NOT NULL, unchanged INTEGER NOT NULL,
    PRIMARY KEY (run_id, step, tensor_id)) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS shadow_steps (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, tensor_id INTEGER NOT NULL,
    rel_error REAL, cosine REAL, ref_norm REAL,
    PRIMARY KEY (run_id, step, tensor_id)) WITHOUT ROWID""",
    # per step and rank of a distributed run: that rank's local loss and, for DDP, its local gradients' inf/NaN
    # count before the all-reduce
    # events raised while training (mpdiag.recording.events): the step it happened at, its kind, its evidence
    # (JSON text); several per (run, step, kind) are possible in principle, so a rowid table
    """CREATE TABLE IF NOT EXISTS events (
    run_id INTEGER NOT NULL REFERENCES runs(run_id), step INTEGER NOT NULL, kind TEXT NOT NULL,
    evidence TEXT NOT NULL, created_at REAL NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS events_by_run ON events (run_id, step)",
    # the replay of a run's first non-finite step (mpdiag.recording.replay): what triggered it, whether it met a
    # non-finite value again, the first offending module and phase, the FP16 bound checked (NULL: none); and per
    # module call in execution order (phase forward|backward, ord within the phase), the absmax of the finite
    # values and the non-finite count of what it produced (output; gradient of its inputs and own parameters)
    # and of what it received (inputs; output gradient)
    """CREATE TABLE IF NOT EXISTS replays (
    run_id INTEGER NOT NULL REFERENCES runs(run_id), step INTEGER NOT NULL, trigger TEXT NOT NULL,
    reproduced INTEGER NOT NULL, first_module TEXT, first_phase TEXT, low_format TEXT, format_max REAL, note TEXT,
    created_at REAL NOT NULL, PRIMARY KEY (run_id, step)) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS replay_modules (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, phase TEXT NOT NULL, ord INTEGER NOT NULL, module TEXT NOT NULL,
    type TEXT NOT NULL, absmax REAL, nonfinite INTEGER, in_absmax REAL, in_nonfinite INTEGER,
    PRIMARY KEY (run_id, step, phase, ord)) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS rank_steps (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, rank INTEGER NOT NULL, loss REAL, nonfinite INTEGER,
    PRIMARY KEY (run_id, step, rank)) WITHOUT ROWID""",
    # --fp8: per logged step, Linear module (by name), role (input, weight, grad_output) and recipe, the scale the
    # recipe would use and the counts of the scaled tensor in the FP8 format fmt; histograms of the unscaled tensor
    """CREATE TABLE IF NOT EXISTS fp8_steps (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, module TEXT NOT NULL, role TEXT NOT NULL, recipe TEXT NOT NULL,
    fmt TEXT NOT NULL, scale REAL, amax REAL, numel INTEGER NOT NULL, underflow INTEGER NOT NULL,
    subnormal INTEGER NOT NULL, overflow INTEGER NOT NULL,
    PRIMARY KEY (run_id, step, module, role, recipe)) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS fp8_histograms (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, module TEXT NOT NULL, role TEXT NOT NULL,
    exponent INTEGER NOT NULL, count INTEGER NOT NULL,
    PRIMARY KEY (run_id, step, module, role, exponent)) WITHOUT ROWID""",
    # --fp8 with block-scaled recipes: per logged step, Linear module, role and recipe, the blocks, the all-zero
    # ones, those with a clipped value and those wider than the element format; the block scales' exponent histogram
    """CREATE TABLE IF NOT EXISTS fp8_blocks (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, module TEXT NOT NULL, role TEXT NOT NULL, recipe TEXT NOT NULL,
    blocks INTEGER NOT NULL, zero_blocks INTEGER NOT NULL, clipped_blocks INTEGER NOT NULL,
    wide_blocks INTEGER NOT NULL,
    PRIMARY KEY (run_id, step, module, role, recipe)) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS fp8_block_scales (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, module TEXT NOT NULL, role TEXT NOT NULL, recipe TEXT NOT NULL,
    exponent INTEGER NOT NULL, count INTEGER NOT NULL,
    PRIMARY KEY (run_id, step, module, role, recipe, exponent)) WITHOUT ROWID""",
    _TENSOR_TOTALS_DDL,
    # per step whose tensor_steps rows are stored, each reason it was kept (mpdiag.recording.retention's names:
    # every, nonfinite, skipped, overflow, ..., before, after)
    """CREATE TABLE IF NOT EXISTS kept_steps (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, reason TEXT NOT NULL,
    PRIMARY KEY (run_id, step, reason)) WITHOUT ROWID""",
    # the writer's running sum of each tensor's histograms (encode_hist), so a run-wide reading of them (the
    # findings) does not decode every (step, tensor) row
    """CREATE TABLE IF NOT EXISTS hist_totals (
    run_id INTEGER NOT NULL, tensor_id INTEGER NOT NULL, hist BLOB NOT NULL,
    PRIMARY KEY (run_id, tensor_id)) WITHOUT ROWID""",
    # per tensor and bucket of bucket_steps steps (bucket b: steps b * bucket_steps up to (b + 1) * bucket_steps - 1),
    # the sum of the histograms of its kept steps: how many (steps_kept), the first and last of them, and how many
    # had no finite non-zero value (empty_steps: nothing in any bin); only buckets with a kept step have a row
    """CREATE TABLE IF NOT EXISTS hist_rollups (
    run_id INTEGER NOT NULL, tensor_id INTEGER NOT NULL, bucket_steps INTEGER NOT NULL, bucket INTEGER NOT NULL,
    first_step INTEGER NOT NULL, last_step INTEGER NOT NULL, steps_kept INTEGER NOT NULL, empty_steps INTEGER NOT NULL,
    hist BLOB NOT NULL,
    PRIMARY KEY (run_id, tensor_id, bucket_steps, bucket)) WITHOUT ROWID""",
    f"""CREATE TABLE IF NOT EXISTS representability_totals (
    run_id INTEGER NOT NULL, tensor_id INTEGER NOT NULL, fmt TEXT NOT NULL, {_KIND_COLUMNS},
    PRIMARY KEY (run_id, tensor_id, fmt)) WITHOUT ROWID""",
    # per step, kept or not: SIGNAL_COUNTS summed over the step's tensors (what a per-step line reads without
    # decoding), and per tensor in ``counts`` (encode_signals). A rowid table: its ~1 kB blobs would overflow the
    # pages of a WITHOUT ROWID table's b-tree.
    f"""CREATE TABLE IF NOT EXISTS step_signals (
    run_id INTEGER NOT NULL, step INTEGER NOT NULL, {", ".join(f"{c} INTEGER NOT NULL" for c in SIGNAL_COUNTS)},
    counts BLOB NOT NULL, UNIQUE (run_id, step))""",
    # the sums alone, so a run's per-step line is read from this index without the blobs' pages (100,000 steps:
    # 0.4 s through the table, a few MB here)
    f"CREATE INDEX IF NOT EXISTS step_signal_sums ON step_signals (run_id, step, {', '.join(SIGNAL_COUNTS)})",
]


class StoreError(RuntimeError):
    """The store file is missing, unreadable, damaged or not an mpdiag store of a known version; the message says
    which and where."""


#: a run's step summary: what the runs table shows of its steps; stored (runs.summary, JSON) when it ends
SUMMARY_COLUMNS = ["steps_done", "skipped_steps", "peak_mem_bytes", "final_loss", "median_step_time_s"]


@dataclass(frozen=True)
class StepSummary:
    """One run's step summary (SUMMARY_COLUMNS) as of its step ``last_step`` (-1: none read), with the step times
    its median is of. Steps are only ever appended, in step order, and the columns summed here are never
    rewritten, so a summary :meth:`extended` by the steps after ``last_step`` is the summary of them all."""
    last_step: int = -1
    steps_done: int = 0
    skipped_steps: int = 0
    peak_mem_bytes: float = float("nan")
    final_loss: float = float("nan")
    #: the step time of every step after the first (warm-up) step that has one, and their median (NaN: none)
    step_times: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0))
    median_step_time_s: float = float("nan")

    def extended(self, conn: sqlite3.Connection, run_id: int) -> StepSummary:
        """This summary with the run's steps after ``last_step`` added (itself when there are none). Counted,
        summed and maximised in SQL (a live run's first read sums its 100k steps: 0.3 s as Python rows); only the
        step times come out, for their median. Each read is bounded by the last step the first one saw, so steps
        committed meanwhile wait for the next extension (the reader sees each statement's own snapshot)."""
        run_id = int(run_id)
        count, last_step, skipped, peak = conn.execute(
            "SELECT COUNT(*), MAX(step), SUM(skipped), MAX(peak_mem_bytes) FROM steps WHERE run_id = ? AND step > ?",
            (run_id, self.last_step)).fetchone()
        if not count:
            return self
        (final_loss,) = conn.execute("SELECT loss FROM steps WHERE run_id = ? AND step = ?",
                                     (run_id, last_step)).fetchone()
        times = conn.execute("SELECT step_time_s FROM steps WHERE run_id = ? AND step > ? AND step <= ? AND step > 0 "
                             "AND step_time_s IS NOT NULL ORDER BY step", (run_id, self.last_step, last_step))
        step_times = np.concatenate([self.step_times, np.fromiter((t for (t,) in times), dtype=float)])
        # SQLite keeps no NaN (it stores NULL), which MAX and SUM skip
        return StepSummary(
            last_step=last_step, steps_done=self.steps_done + count,
            skipped_steps=self.skipped_steps + (skipped or 0),
            peak_mem_bytes=max([p for p in (self.peak_mem_bytes, peak) if p is not None and p == p],
                               default=float("nan")),
            final_loss=float("nan") if final_loss is None else float(final_loss),
            step_times=step_times, median_step_time_s=float(np.median(step_times)) if len(step_times) else float("nan"))

    def as_dict(self) -> dict:
        return {column: getattr(self, column) for column in SUMMARY_COLUMNS}


def step_summaries(conn: sqlite3.Connection, run_ids: Sequence[int], held: dict | None = None,
                   keys: Sequence | None = None) -> dict[int, dict]:
    """Per run id: steps_done, skipped_steps, peak_mem_bytes, final_loss (the last step's; NaN kept) and the
    median step time after the first (warm-up) step, from the steps table; NaN where a run has no such row.
    Reads only these runs' rows. Plain Python, no pandas: the training process's writer calls it as a run ends.
    ``held``: a dict the caller keeps between calls, where each run's :class:`StepSummary` is kept under its key
    (``keys``, one per run id: what tells this run from another that took its id, default the id) and extended
    by only the steps recorded since, so a live run read again and again sums its steps once; the summaries of
    runs not asked for are dropped from it."""
    held = {} if held is None else held
    keys = [int(r) for r in run_ids] if keys is None else list(keys)
    extended = {key: held.get(key, StepSummary()).extended(conn, int(run_id))
                for key, run_id in zip(keys, run_ids, strict=True)}
    held.clear()
    held.update(extended)
    return {int(run_id): extended[key].as_dict() for key, run_id in zip(keys, run_ids, strict=True)}


def encode_hist(counts: np.ndarray) -> bytes:
    """Pack an exponent histogram (length N_EXP_BINS) as: int16 first bin, then int64 counts up to the last
    non-empty bin. Empty histograms pack to the 2-byte header alone."""
    return encode_hists(np.asarray(counts)[None])[0]


def encode_hists(matrix: np.ndarray) -> list[bytes]:
    """:func:`encode_hist` of each row of an (n, N_EXP_BINS) matrix: the bounds found for all rows at once and
    the rows' bytes taken once, so a step of hundreds of tensors costs two bytes slices per tensor."""
    counts = np.ascontiguousarray(matrix, dtype="<i8")
    if not len(counts):
        return []
    occupied = counts != 0
    any_bin = occupied.any(axis=1)
    first = np.where(any_bin, occupied.argmax(axis=1), 0)
    end = np.where(any_bin, counts.shape[1] - occupied[:, ::-1].argmax(axis=1), 0)  # one past the last bin
    heads, data, row_bytes = first.astype("<i2").tobytes(), counts.tobytes(), counts.shape[1] * 8
    return [heads[2 * j : 2 * j + 2] + data[j * row_bytes + 8 * start : j * row_bytes + 8 * stop]
            for j, (start, stop) in enumerate(zip(first.tolist(), end.tolist(), strict=True))]


def encode_signals(tensor_ids: np.ndarray, counts: np.ndarray) -> bytes:
    """One step's signals as a blob: ``counts`` (tensors, len(SIGNAL_COUNTS)) of the tensors ``tensor_ids``, as
    zlib of int32 (tensors, columns), the tensor ids' differences (int32: consecutive ids compress to nothing),
    then the counts column by column (int64: a column of zeros compresses to a few bytes)."""
    ids, counts = np.asarray(tensor_ids, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    if counts.shape != (len(ids), len(SIGNAL_COUNTS)) or ids.ndim != 1:
        raise ValueError(f"signals of {len(ids)} tensors must be ({len(ids)}, {len(SIGNAL_COUNTS)}) counts, "
                         f"got {counts.shape}")
    head = np.array(counts.shape, dtype="<i4").tobytes()
    return zlib.compress(head + np.diff(ids, prepend=0).astype("<i4").tobytes()
                         + np.ascontiguousarray(counts.T, dtype="<i8").tobytes())


def decode_signals(blob: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`encode_signals`: (tensor ids (n,), counts (n, len(SIGNAL_COUNTS))), int64."""
    data = zlib.decompress(blob)
    n, columns = np.frombuffer(data[:8], dtype="<i4").tolist()
    ids = np.cumsum(np.frombuffer(data[8 : 8 + 4 * n], dtype="<i4").astype(np.int64))
    return ids, np.frombuffer(data[8 + 4 * n :], dtype="<i8").reshape(columns, n).T.astype(np.int64)


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


def no_store(path: Path) -> StoreError:
    """The StoreError for a store file that is not there (never created, or removed since it was opened)."""
    return StoreError(f"No store at {path}: run `python -m mpdiag run SCRIPT` to create one.")


def read_error(path: Path, exc: Exception) -> StoreError:
    """The StoreError for an SQLite error met while reading ``path``, worded for the person who chose the file."""
    text = str(exc)
    if "not a database" in text:
        return StoreError(f"{path} is not an SQLite database ({text}). Choose an mpdiag store file.")
    if "malformed" in text or "corrupt" in text:
        return StoreError(f"{path} is damaged ({text}); mpdiag did not write to it. Restore it from a copy or "
                          "choose another store.")
    if "locked" in text:
        return StoreError(f"{path} is locked by another program ({text}); mpdiag did not read or write it. End "
                          "that program's transaction (an sqlite3 shell, or a tool using exclusive locking), then "
                          "reload.")
    return StoreError(f"Could not read {path}: {text}")


#: How long a read waits for a lock (s). In WAL mode a reader waits only for a moment of a checkpoint or of
#: recovery, or for another program holding the file under exclusive locking: the store's first read (opening
#: it) waits FIRST_READ_WAIT_S, so a locked store is said in 2 s, not after every read's wait.
READ_WAIT_S, FIRST_READ_WAIT_S = 10.0, 2.0


def connect_read(path: Path, immutable: bool = False, wait_s: float = READ_WAIT_S) -> sqlite3.Connection:
    """A read-only connection. ``immutable`` opens a file that SQLite cannot share safely because its directory
    is not writable (no -shm can be made beside it): only correct while nobody writes the file."""
    uri = f"file:{quote(str(path))}?{'immutable=1' if immutable else 'mode=ro'}"
    conn = sqlite3.connect(uri, uri=True, timeout=wait_s)
    conn.execute(f"PRAGMA busy_timeout={int(wait_s * 1000)}")
    return conn


def needs_immutable(path: Path) -> bool:
    """Whether ``path`` can only be read with ``immutable=1``: a WAL file in a directory this process cannot
    write, with no -shm beside it, which a ``mode=ro`` connection cannot open. A store in a folder this process
    can write never is: reading it immutable would ignore another program's lock and its write-ahead log."""
    if os.access(path.parent, os.W_OK):
        return False
    try:
        conn = connect_read(path, wait_s=FIRST_READ_WAIT_S)
        try:
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        finally:
            conn.close()
    except sqlite3.OperationalError:
        return path.exists() and not Path(str(path) + "-shm").exists()
    except sqlite3.DatabaseError:
        return False  # not a database at all: the caller's read reports that
    return False


def stored_version(conn: sqlite3.Connection, path: Path) -> int | None:
    """The schema version stamped in the file; None for an empty database (one being created). Raises
    StoreError when the file holds tables but is not an mpdiag store."""
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if not tables:
        return None
    missing = _CORE_TABLES - tables
    if missing:
        raise StoreError(f"{path} is an SQLite file but not an mpdiag store "
                         f"(missing tables: {', '.join(sorted(missing))}).")
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() if "meta" in tables else None
    if row is None:
        return 1  # the first stores were stamped from the start; a store without a stamp predates nothing newer
    try:
        return int(row[0])
    except (TypeError, ValueError):
        raise StoreError(f"{path} carries an unreadable schema version {row[0]!r}.") from None


def older_version(path: Path) -> int | None:
    """The schema version of the mpdiag store at ``path`` when opening it will migrate it (older than this
    mpdiag's), else None (current, newer, new, or not a store: opening it says what is wrong). A store locked by
    another program raises its StoreError here, after one wait, rather than being waited for again on opening."""
    try:
        conn = connect_read(path, immutable=needs_immutable(path), wait_s=FIRST_READ_WAIT_S)
        try:
            version = stored_version(conn, path)
        finally:
            conn.close()
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc):
            raise read_error(path, exc) from exc
        return None
    except (sqlite3.DatabaseError, StoreError, OSError):
        return None
    return version if version is not None and version < SCHEMA_VERSION else None


def refuse_newer(path: Path, version: int | None) -> None:
    if version is not None and version > SCHEMA_VERSION:
        raise StoreError(f"{path} has mpdiag schema version {version}, newer than this mpdiag's version "
                         f"{SCHEMA_VERSION}: upgrade mpdiag to read it. The file was not changed.")


def _check_integrity(path: Path) -> None:
    """Raise StoreError unless ``path`` is a healthy SQLite file (or empty): run before any write."""
    if not path.exists() or path.stat().st_size == 0:
        return
    try:
        conn = connect_read(path, immutable=needs_immutable(path), wait_s=FIRST_READ_WAIT_S)
        try:
            problems = [r[0] for r in conn.execute("PRAGMA quick_check").fetchall()]
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise read_error(path, exc) from exc
    if problems != ["ok"]:
        raise StoreError(f"{path} is damaged (SQLite integrity check: {'; '.join(problems[:3])}); mpdiag did not "
                         "write to it. Restore it from a copy or choose another store.")


#: how long a writer waits for another process's lock before giving up
LOCK_WAIT_S = 30.0


def open_for_writing(path: Path) -> sqlite3.Connection:
    """The writing connection to ``path``, after checking the file's integrity, creating the schema in a new
    file or migrating an older one in place. Raises StoreError, having written nothing, for a damaged file, a
    file that is not an mpdiag store, a newer schema version, or a file this process cannot write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _check_integrity(path)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:  # a file that cannot be created (its folder is not writable) fails here, before any connection
            conn = sqlite3.connect(path, timeout=LOCK_WAIT_S)
        except sqlite3.Error as exc:
            raise _cannot_write(path, exc) from exc
        try:
            conn.execute(f"PRAGMA busy_timeout={int(LOCK_WAIT_S * 1000)}")
            version = stored_version(conn, path)  # the cheap look first: a current store needs no write lock
            refuse_newer(path, version)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            if version != SCHEMA_VERSION:
                _bring_up_to_date(conn, path)
            return conn
        except StoreError:
            conn.close()
            raise
        except sqlite3.OperationalError as exc:
            conn.close()
            # Switching a brand-new file to WAL, or taking the migration lock, needs the file to itself; SQLite
            # answers "locked" at once (no busy wait) when that would deadlock with another process doing the
            # same, so racing creators take turns here.
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise _cannot_write(path, exc) from exc
            time.sleep(0.05)
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise _cannot_write(path, exc) from exc


def close_writing(conn: sqlite3.Connection) -> None:
    """Close a writing connection without locking readers out. The last connection to close a WAL file copies
    the log into the database under an exclusive lock, which a reader opening the store meanwhile waits on and,
    past its wait (FIRST_READ_WAIT_S), reports as "locked by another program": ~1 s for a 60 MB log here, longer
    on a busy disk. A passive checkpoint first does that copy and its sync under no lock readers wait on, so the
    close only removes the log."""
    try:
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
    except sqlite3.Error:  # a store that cannot be checkpointed now (disk full): the close does what it can
        pass
    finally:
        conn.close()


def _cannot_write(path: Path, exc: Exception) -> StoreError:
    return StoreError(f"Cannot write to the store {path} ({exc}). Check that it and its folder are writable.")


def _bring_up_to_date(conn: sqlite3.Connection, path: Path) -> None:
    """Create or migrate the schema in one IMMEDIATE transaction; the version is read again under the lock, so
    a process that lost the race finds the work done and changes nothing."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = stored_version(conn, path)
        refuse_newer(path, version)
        if version != SCHEMA_VERSION:
            for statement in _STATEMENTS:  # every table that is missing, as the current version has it
                conn.execute(statement)
            for table in ("runs", "steps", "tensor_steps"):
                _add_missing_columns(conn, table)
            if version is not None and version < 17:
                conn.execute(_LONG_REPRESENTABILITY_DDL)  # where the migrations below read and write the counts
            if version is not None and version < 3:
                _move_representability_to_long_table(conn)
            if version is not None and version < 6:
                _sum_histograms_into_totals(conn)
            if version is not None and version < 14:
                conn.execute("INSERT INTO kept_steps SELECT run_id, step, 'every' FROM steps WHERE logged = 1")
            if version is not None and version < 15:
                _build_histogram_rollups(conn)
            if version is not None and version < 16:
                _signals_from_tensor_rows(conn)
            if version is not None and version < 17:
                _representability_into_tensor_steps(conn)
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        conn.commit()
    except BaseException:
        conn.rollback()
        raise


def _add_missing_columns(conn: sqlite3.Connection, table: str) -> None:
    """Older stores lack columns added since to ``table`` (runs: summary, update_format, ...; steps: lr, grad_norm,
    wall_time_s at version 9; tensor_steps: a format's counts, version 17 or the format joining the registry): add
    them, empty (NULL), at the end, where the current DDL has them too."""
    ddl = next(s for s in _STATEMENTS if f"TABLE IF NOT EXISTS {table} (" in s)
    with closing(sqlite3.connect(":memory:")) as scratch:
        scratch.execute(ddl)
        wanted = [(r[1], r[2]) for r in scratch.execute(f"PRAGMA table_info({table})")]
    have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
    for name, kind in wanted:
        if name not in have:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")


def _sum_histograms_into_totals(conn: sqlite3.Connection, chunk: int = 50_000) -> None:
    """Migration to version 6: hist_totals for the runs recorded before, summed from their tensor_steps rows
    once (read in chunks, so a store of millions of rows is not held in memory at once)."""
    sums: dict[tuple[int, int], np.ndarray] = {}
    cursor = conn.execute("SELECT run_id, tensor_id, hist FROM tensor_steps")
    while rows := cursor.fetchmany(chunk):
        hists = decode_hists([hist for _, _, hist in rows])
        keys = np.array([(run_id, tensor_id) for run_id, tensor_id, _ in rows], dtype=np.int64)
        unique, inverse = np.unique(keys, axis=0, return_inverse=True)
        partial = np.zeros((len(unique), N_EXP_BINS), dtype=np.int64)
        np.add.at(partial, inverse.reshape(-1), hists)
        for (run_id, tensor_id), hist in zip(unique.tolist(), partial, strict=True):
            sums[(run_id, tensor_id)] = sums[(run_id, tensor_id)] + hist if (run_id, tensor_id) in sums else hist
    conn.executemany("INSERT OR REPLACE INTO hist_totals VALUES (?, ?, ?)",
                     [(run_id, tensor_id, encode_hist(hist)) for (run_id, tensor_id), hist in sums.items()])


def _build_histogram_rollups(conn: sqlite3.Connection, chunk_steps: int = 256) -> None:
    """Migration to version 15: hist_rollups for the runs recorded before, summed from their tensor_steps rows
    as the writer sums its batches (:class:`HistogramRollups`), ``chunk_steps`` steps of a run at a time, so a
    store of millions of rows is never held in memory at once."""
    rollups = HistogramRollups()
    for (run_id,) in conn.execute("SELECT DISTINCT run_id FROM tensor_steps").fetchall():
        (last,) = conn.execute("SELECT MAX(step) FROM tensor_steps WHERE run_id = ?", (run_id,)).fetchone()
        for start in range(0, last + 1, chunk_steps):
            rows = conn.execute("SELECT step, tensor_id, hist FROM tensor_steps WHERE run_id = ? AND step >= ? AND "
                                "step < ?", (run_id, start, start + chunk_steps)).fetchall()
            if rows:
                steps, tensor_ids, hists = zip(*rows, strict=True)
                rollups.add(conn, run_id, np.asarray(steps, dtype=np.int64), np.asarray(tensor_ids, dtype=np.int64),
                            decode_hists(hists))
        rollups.close_run(conn, run_id)


@dataclass
class _BucketSums:
    """Histogram sums over step buckets of one level, one entry per (tensor, bucket): the first and last kept step
    summed, how many (kept), how many of them had an empty histogram, the summed histogram (rows of N_EXP_BINS);
    ``held``: the entry holds a bucket the writer kept open (its sum so far is all of that bucket's)."""

    tensor: np.ndarray
    first: np.ndarray
    last: np.ndarray
    kept: np.ndarray
    empty: np.ndarray
    hist: np.ndarray
    held: np.ndarray

    @classmethod
    def of_rows(cls, steps: np.ndarray, tensor_ids: np.ndarray, hists: np.ndarray) -> _BucketSums:
        steps = np.asarray(steps, dtype=np.int64)
        return cls(np.asarray(tensor_ids, dtype=np.int64), steps, steps, np.ones(len(steps), dtype=np.int64),
                   (hists.sum(axis=1) == 0).astype(np.int64), hists, np.zeros(len(steps), dtype=bool))

    @classmethod
    def none(cls) -> _BucketSums:
        return cls.of_rows(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, N_EXP_BINS), np.int64))

    def concat(self, other: _BucketSums) -> _BucketSums:
        return _BucketSums(*(np.concatenate([getattr(self, f.name), getattr(other, f.name)])
                             for f in dataclasses.fields(self)))

    def plus(self, at: np.ndarray, other: _BucketSums) -> _BucketSums:
        """A copy with ``other``'s entries added to the entries ``at`` (one each, the same buckets)."""
        summed = self.take(slice(None))
        summed.first[at] = np.minimum(summed.first[at], other.first)
        summed.last[at] = np.maximum(summed.last[at], other.last)
        summed.kept[at] += other.kept
        summed.empty[at] += other.empty
        summed.hist[at] += other.hist
        return summed

    def take(self, at: np.ndarray | slice) -> _BucketSums:
        """The entries ``at``, copied."""
        return _BucketSums(*(getattr(self, f.name)[at].copy() for f in dataclasses.fields(self)))

    def grouped(self, size: int) -> _BucketSums:
        """One entry per (tensor, bucket of ``size`` steps), sorted by tensor then bucket (entries of a finer level
        lie inside one bucket of a coarser one, so they group as rows do)."""
        if (np.diff(self.tensor) > 0).all():  # one entry per tensor, in order (one step's rows): grouped already
            return self
        bucket = self.first // size
        order = np.lexsort((bucket, self.tensor))
        tensor, bucket = self.tensor[order], bucket[order]
        starts = np.flatnonzero(np.r_[True, (np.diff(tensor) != 0) | (np.diff(bucket) != 0)])
        return _BucketSums(tensor[starts], np.minimum.reduceat(self.first[order], starts),
                           np.maximum.reduceat(self.last[order], starts), np.add.reduceat(self.kept[order], starts),
                           np.add.reduceat(self.empty[order], starts), summed_histograms(self.hist, order, starts),
                           np.logical_or.reduceat(self.held[order], starts))


def summed_histograms(hists: np.ndarray, order: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The sums of the histograms ``hists[order]`` over the segments beginning at ``starts`` (np.add.at is slow on
    2-D rows: sorted segments are summed by reduceat, over the bins any row uses, a few dozen of N_EXP_BINS)."""
    occupied = np.flatnonzero(hists.any(axis=0))
    sums = np.zeros((len(starts), hists.shape[1]), dtype=np.int64)
    if len(occupied) and len(starts):
        lo, hi = occupied[0], occupied[-1] + 1
        sums[:, lo:hi] = np.add.reduceat(hists[order, lo:hi], starts, axis=0)
    return sums


class _Level:
    """One level of ROLLUP_BUCKET_STEPS for one run: its open buckets (each tensor's latest, in memory until it
    closes) and the highest bucket with a stored row or an open one (a bucket above it has no stored row)."""

    def __init__(self, size: int, highest: int):
        self.size, self.highest, self.open = size, highest, _BucketSums.none()

    def add(self, conn: sqlite3.Connection, run_id: int, entries: _BucketSums) -> _BucketSums:
        """Add ``entries`` (rows, or a finer level's sums); write the buckets this closes. Returns the entries'
        sums at this level (for the next coarser one)."""
        grouped = entries.grouped(self.size)
        at = np.searchsorted(self.open.tensor, grouped.tensor).clip(max=max(len(self.open.tensor) - 1, 0))
        if len(self.open.tensor) and ((self.open.tensor[at] == grouped.tensor)
                                      & (self.open.first[at] // self.size == grouped.first // self.size)).all():
            self.open = self.open.plus(at, grouped)  # the usual batch: every entry in its tensor's open bucket
            return grouped
        merged = self.open.concat(grouped).grouped(self.size)
        stored = ~merged.held & (merged.first // self.size <= self.highest)
        if stored.any():  # steps written late, or a run a writer before this one wrote on: add its stored sums
            _add_stored(conn, run_id, self.size, merged, stored)
        # each tensor's latest bucket stays open; a bucket before it gets no more rows: written once, now
        latest = np.r_[merged.tensor[1:] != merged.tensor[:-1], True]
        _write_buckets(conn, run_id, self.size, merged.take(~latest))
        self.open = merged.take(latest)
        self.open.held[:] = True
        self.highest = max(self.highest, int((merged.first // self.size).max(initial=-1)))
        return grouped


def _add_stored(conn: sqlite3.Connection, run_id: int, size: int, sums: _BucketSums, at: np.ndarray) -> None:
    """Add to the entries ``at`` of ``sums`` the stored rows of their (tensor, bucket) (read-modify-write)."""
    buckets = sums.first // size
    stored = {(t, b): rest for t, b, *rest in conn.execute(
        "SELECT tensor_id, bucket, first_step, last_step, steps_kept, empty_steps, hist FROM hist_rollups "
        "WHERE run_id = ? AND bucket_steps = ? AND bucket BETWEEN ? AND ?",
        (int(run_id), size, int(buckets[at].min()), int(buckets[at].max())))}
    found = [k for k in np.flatnonzero(at).tolist() if (int(sums.tensor[k]), int(buckets[k])) in stored]
    if found:
        before = [stored[int(sums.tensor[k]), int(buckets[k])] for k in found]
        sums.first[found] = np.minimum(sums.first[found], [b[0] for b in before])
        sums.last[found] = np.maximum(sums.last[found], [b[1] for b in before])
        sums.kept[found] += [b[2] for b in before]
        sums.empty[found] += [b[3] for b in before]
        sums.hist[found] += decode_hists([b[4] for b in before])


def _write_buckets(conn: sqlite3.Connection, run_id: int, size: int, sums: _BucketSums) -> None:
    conn.executemany("INSERT OR REPLACE INTO hist_rollups VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     zip(itertools.repeat(int(run_id)), sums.tensor.tolist(), itertools.repeat(size),
                         (sums.first // size).tolist(), sums.first.tolist(), sums.last.tolist(), sums.kept.tolist(),
                         sums.empty.tolist(), encode_hists(sums.hist)))


class HistogramRollups:
    """Kept steps' histograms summed per tensor over buckets of ROLLUP_BUCKET_STEPS steps, into hist_rollups.

    Each tensor's latest bucket at each level is open: its sums are kept here, in memory, and its row is written
    once, when a later bucket of that tensor arrives (steps arrive in order, so it gets no more) or when the run
    ends (:meth:`close_run`) or the writer closes. Until then the store has no row for an open bucket: a reader
    sums its steps from the finer levels and the exact rows (``Store.histogram_columns``), and so it does after a
    crash, which loses the open buckets' sums only. A step written late, into a bucket already written, and a run
    written on by a second writer (its first writer closed mid-bucket) are added to the stored row. Each (step,
    tensor) must be added once."""

    def __init__(self) -> None:
        self._runs: dict[int, list[_Level]] = {}

    def add(self, conn: sqlite3.Connection, run_id: int, steps: np.ndarray, tensor_ids: np.ndarray,
            hists: np.ndarray) -> None:
        """Add kept steps' histograms (row k: ``hists[k]`` of tensor ``tensor_ids[k]`` at ``steps[k]``), inside the
        caller's transaction."""
        if not len(steps):
            return
        run_id = int(run_id)
        if run_id not in self._runs:
            highest = dict(conn.execute("SELECT bucket_steps, MAX(bucket) FROM hist_rollups WHERE run_id = ? "
                                        "GROUP BY bucket_steps", (run_id,)).fetchall())
            self._runs[run_id] = [_Level(size, highest.get(size, -1)) for size in ROLLUP_BUCKET_STEPS]
        entries = _BucketSums.of_rows(steps, tensor_ids, hists)
        for level in self._runs[run_id]:
            entries = level.add(conn, run_id, entries)

    def close_run(self, conn: sqlite3.Connection, run_id: int) -> None:
        """Write the run's open buckets and forget them (the run ended, or this writer stops writing it)."""
        for level in self._runs.pop(int(run_id), []):
            _write_buckets(conn, int(run_id), level.size, level.open)

    def open_runs(self) -> list[int]:
        """The runs with open buckets held here."""
        return list(self._runs)

    def state(self, run_id: int) -> list[tuple] | None:
        """What is held of the run now, for :meth:`restore` (a batch's sums are never added in place)."""
        levels = self._runs.get(int(run_id))
        return None if levels is None else [(level.open, level.highest) for level in levels]

    def restore(self, run_id: int, state: list[tuple] | None) -> None:
        """Back to :meth:`state`'s (the transaction that added a batch was rolled back)."""
        if state is None:
            self._runs.pop(int(run_id), None)
            return
        for level, (held, highest) in zip(self._runs[int(run_id)], state, strict=True):
            level.open, level.highest = held, highest

    def forget(self, run_id: int) -> None:
        """Drop the run's open buckets unwritten (the run was deleted)."""
        self._runs.pop(int(run_id), None)


# The formats whose counts schema versions 1 and 2 kept as columns named {fmt}_{kind}.
_COLUMN_ERA_FORMATS = ("fp16", "bf16")


def _move_representability_to_long_table(conn: sqlite3.Connection) -> None:
    """Migration to version 3: the per-format columns of tensor_steps and tensor_totals become rows of
    representability and representability_totals; both tables are rebuilt without those columns."""
    for fmt in _COLUMN_ERA_FORMATS:
        kinds = ", ".join(f"{fmt}_{k}" for k in REPRESENTABILITY_KINDS)
        conn.execute(f"INSERT INTO representability SELECT run_id, step, tensor_id, ?, {kinds} FROM tensor_steps",
                     (fmt,))
        conn.execute(f"INSERT INTO representability_totals SELECT run_id, tensor_id, ?, {kinds} FROM tensor_totals",
                     (fmt,))
    for table, ddl in (("tensor_steps", _TENSOR_STEPS_DDL), ("tensor_totals", _TENSOR_TOTALS_DDL)):
        conn.execute(f"ALTER TABLE {table} RENAME TO {table}_v2")
        conn.execute(ddl)
        # the columns of version 3 (tensor_steps' counts come back from the long table at version 17)
        old = {r[1] for r in conn.execute(f"PRAGMA table_info({table}_v2)")}
        columns = ", ".join(r[1] for r in conn.execute(f"PRAGMA table_info({table})")
                            if r[1] in old and r[1] not in TENSOR_STEP_COUNT_COLUMNS)
        conn.execute(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM {table}_v2")
        conn.execute(f"DROP TABLE {table}_v2")  # its index went with it
    conn.execute(_TENSOR_STEPS_INDEX_DDL)


def _representability_into_tensor_steps(conn: sqlite3.Connection) -> None:
    """Migration to version 17: each (run, step, tensor)'s rows of the long representability table become its
    tensor_steps columns ({fmt}_{kind}; a format it had no row for stays NULL), in one pass over the long table in
    its key order (its formats pivoted per row), then the long table is dropped."""
    pivoted = ", ".join(f"MAX(CASE WHEN fmt = '{fmt}' THEN {kind} END) AS {fmt}_{kind}"  # registry names only
                        for fmt in LOW_PRECISION for kind in REPRESENTABILITY_KINDS)
    columns = ", ".join(TENSOR_STEP_COUNT_COLUMNS)
    conn.execute(f"UPDATE tensor_steps SET ({columns}) = ({', '.join(f'p.{c}' for c in TENSOR_STEP_COUNT_COLUMNS)}) "
                 f"FROM (SELECT run_id, step, tensor_id, {pivoted} FROM representability "
                 "GROUP BY run_id, step, tensor_id) p "
                 "WHERE p.run_id = tensor_steps.run_id AND p.step = tensor_steps.step AND p.tensor_id = tensor_steps.tensor_id")
    conn.execute("DROP TABLE representability")


def _signals_from_tensor_rows(conn: sqlite3.Connection, chunk: int = 50_000) -> None:
    """Migration to version 16: step_signals for the runs recorded before, at their logged steps (the only steps
    whose counts they stored), from tensor_steps' special counts and the FP16/BF16 representability rows at the
    scale, read in chunks of rows in (run, step) order."""
    at_scale = [c for c in SIGNAL_COUNTS if c.endswith("_at_scale")]
    picks = ", ".join(f"MAX(CASE WHEN r.fmt = '{c.split('_')[0]}' THEN r.{c.split('_', 1)[1]} END)" for c in at_scale)
    cursor = conn.execute(
        f"SELECT t.run_id, t.step, t.tensor_id, t.nan, t.posinf, t.neginf, {picks} FROM tensor_steps t "
        "LEFT JOIN representability r ON r.run_id = t.run_id AND r.step = t.step AND r.tensor_id = t.tensor_id "
        "GROUP BY t.run_id, t.step, t.tensor_id ORDER BY t.run_id, t.step, t.tensor_id")
    carried: list[tuple] = []  # a step's rows cut by the chunk's end, finished with the next chunk
    while rows := cursor.fetchmany(chunk):
        carried += rows
        last = carried[-1][:2]
        done = [row for row in carried if row[:2] != last]
        carried = carried[len(done):]
        _insert_signals(conn, done)
    _insert_signals(conn, carried)


def _insert_signals(conn: sqlite3.Connection, rows: list[tuple]) -> None:
    """step_signals rows from (run, step, tensor, SIGNAL_COUNTS...) rows in (run, step) order (a count missing
    from an old store reads 0)."""
    if not rows:
        return
    values = np.array([[*row[:3], *(0 if v is None else v for v in row[3:])] for row in rows], dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, (np.diff(values[:, :2], axis=0) != 0).any(axis=1)])
    marks = ", ".join("?" * (3 + len(SIGNAL_COUNTS)))
    conn.executemany(f"INSERT OR IGNORE INTO step_signals VALUES ({marks})",
                     [(int(part[0, 0]), int(part[0, 1]), *part[:, 3:].sum(axis=0).tolist(),
                       encode_signals(part[:, 2], part[:, 3:])) for part in np.split(values, starts[1:])])
