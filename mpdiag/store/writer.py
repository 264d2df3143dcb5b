"""Writing a store: :class:`StoreWriter`, the one object every path that writes uses, and the row records it
takes.

Owns every INSERT, UPDATE and DELETE of runs' data and the running totals, kept in the same transaction as the
rows they sum, and the rules for what a person may write about a run (:func:`clean_name`, :func:`clean_tag`,
:func:`clean_note`: one clear :class:`RunTextRefused` message for an empty name, an overlong tag or a control
character). It must not create or migrate the schema (schema.py does that when the writer opens the file) and
must not answer questions about runs (reader.py). Use it as a context manager: a run created through it that
is still open when the block raises is marked failed with the traceback, and the connection is closed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import sqlite3
import time
import traceback
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mpdiag.numerics.formats import LOW_PRECISION, SIGNAL_COUNTS
from mpdiag.options import MAX_NAME_CHARS
from mpdiag.store.liveness import process_is_alive, process_start_time, this_host
from mpdiag.store.schema import (
    RUN_FIELDS,
    SPECIAL_COUNT_COLUMNS,
    STATUSES,
    TENSOR_STEP_COUNT_COLUMNS,
    HistogramRollups,
    StoreError,
    close_writing,
    decode_hists,
    encode_hists,
    encode_signals,
    open_for_writing,
    step_summaries,
    summed_histograms,
)

#: what a person may write about a run (tags, notes), in characters; a run's name: MAX_NAME_CHARS (the options
#: table's, where the run form's field reads it)
MAX_TAG_CHARS = 40
MAX_TAGS = 20
MAX_NOTE_CHARS = 2000


class RunTextRefused(ValueError):
    """A run name, tag or note that cannot be stored; the message says what is wrong in one sentence."""


class RunBusy(StoreError):
    """A run that cannot be deleted now: its process is still running it."""


def _control_character(text: str, allowed: str = "") -> str | None:
    """The first control or invisible formatting character of ``text`` (not in ``allowed``) as U+XXXX, or None.
    Format characters (bidi overrides among them) are refused too; the emoji joiner U+200D is not."""
    for ch in text:
        if ch not in allowed and ch != "\u200d" and unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp"):
            return f"U+{ord(ch):04X}"
    return None


def _clean(text: object, what: str, limit: int, allowed: str = "", empty_ok: bool = False) -> str:
    if not isinstance(text, str):
        raise RunTextRefused(f"{what} must be text.")
    text = text.strip()
    if not text and not empty_ok:
        raise RunTextRefused(f"{what} cannot be empty.")
    if len(text) > limit:
        raise RunTextRefused(f"{what} is at most {limit:,} characters; this one has {len(text):,}.")
    bad = _control_character(text, allowed)
    if bad:
        raise RunTextRefused(f"{what} cannot contain control characters (found {bad}).")
    return text


def clean_name(name: object) -> str:
    """A run name as stored: surrounding space removed; refused (RunTextRefused) when empty, longer than
    MAX_NAME_CHARS or holding a control character."""
    return _clean(name, "A run name", MAX_NAME_CHARS)


def clean_tag(tag: object) -> str:
    """A tag as stored: surrounding space removed; refused when empty, longer than MAX_TAG_CHARS or holding a
    control character."""
    return _clean(tag, "A tag", MAX_TAG_CHARS)


def clean_note(note: object) -> str:
    """A note as stored ("" clears it): surrounding space removed; line breaks and tabs kept; refused when
    longer than MAX_NOTE_CHARS or holding another control character."""
    return _clean("" if note is None else note, "A note", MAX_NOTE_CHARS, allowed="\n\t", empty_ok=True)


class StepRow(NamedTuple):
    """One training step, as the steps table holds it (field order = column order after run_id)."""

    step: int
    loss: float | None
    loss_scale: float | None
    skipped: int | None  # 1: the optimizer step did not run, 0: it ran, None: unknown (the run stopped in it)
    growth_tracker: int | None
    scale_after: float | None
    step_time_s: float
    peak_mem_bytes: int
    logged: int  # 1 when tensor statistics were recorded at this step
    #: the learning rate the step used (the first optimizer's param_groups[0]["lr"]); None: no optimizer known
    lr: float | None = None
    #: the L2 norm of all the step's gradients, unscaled, before clipping (clip_grad_norm_'s value); NaN/inf kept
    #: as such (SQLite stores NaN as NULL); None: not recorded
    grad_norm: float | None = None
    wall_time_s: float | None = None  # seconds from the Recorder's start to the step's end (its record() call)


class Representability(NamedTuple):
    """How one tensor's gradient at one step fits one format: element counts for g, then for S*g."""

    underflow: int
    subnormal: int
    overflow: int
    underflow_at_scale: int
    subnormal_at_scale: int
    overflow_at_scale: int


class TensorRow(NamedTuple):
    """One tensor's gradient statistics at one step; ``representability`` maps registry format names to counts."""

    step: int
    tensor_id: int
    hist: bytes  # see encode_hist
    zeros: int
    nan: int
    posinf: int
    neginf: int
    absmax: float
    min_nonzero: float
    l2: float
    representability: Mapping[str, Representability]


#: tensor_steps' columns in the order the writer binds them: a TensorRow's fields, its counts as columns
TENSOR_STEP_COLUMNS = ["run_id", *TensorRow._fields[:-1], *TENSOR_STEP_COUNT_COLUMNS]


@dataclass(frozen=True)
class TensorBatch:
    """Tensor rows as columns, one numpy array each: what the Recorder hands the writer per flush, so that a
    step of hundreds of tensors costs no Python object per tensor on the training thread (the writer turns the
    columns into SQL parameters in C: ``tolist`` and ``zip``). Row k is ``step[k]``, ``tensor_id[k]``, the exponent
    histogram ``hist[k]`` (N_EXP_BINS counts), ``specials[k]`` (zeros, nan, posinf, neginf), ``absmax[k]``,
    ``min_nonzero[k]``, ``l2[k]`` and ``representability[k, f]`` (REPRESENTABILITY_KINDS) for the f-th format of
    LOW_PRECISION where ``formats[k, f]`` (a row may hold fewer formats: only those are stored)."""

    step: np.ndarray
    tensor_id: np.ndarray
    hist: np.ndarray
    specials: np.ndarray
    absmax: np.ndarray
    min_nonzero: np.ndarray
    l2: np.ndarray
    representability: np.ndarray
    formats: np.ndarray

    def __len__(self) -> int:
        return len(self.step)

    @classmethod
    def of_step(cls, step: int, tensor_id: np.ndarray, hist: np.ndarray, specials: np.ndarray, absmax: np.ndarray,
                min_nonzero: np.ndarray, l2: np.ndarray, representability: np.ndarray) -> TensorBatch:
        """One step's rows, every format present."""
        return cls(np.full(len(tensor_id), step, dtype=np.int64), np.asarray(tensor_id, dtype=np.int64), hist,
                   specials, absmax, min_nonzero, l2, representability,
                   np.ones(representability.shape[:2], dtype=bool))

    @classmethod
    def from_rows(cls, rows: Sequence[TensorRow]) -> TensorBatch:
        """The batch of named rows (a test's, or a supervised child's rows as the channel carried them); a
        representability key that is not a registry format is a ValueError."""
        unknown = {fmt for row in rows for fmt in row.representability} - set(LOW_PRECISION)
        if unknown:
            raise ValueError(f"unknown formats {sorted(unknown)}; the known formats are {', '.join(LOW_PRECISION)}")
        n, kinds = len(rows), len(Representability._fields)
        representability = np.zeros((n, len(LOW_PRECISION), kinds), dtype=np.int64)
        formats = np.zeros((n, len(LOW_PRECISION)), dtype=bool)
        for k, row in enumerate(rows):
            for f, fmt in enumerate(LOW_PRECISION):
                if fmt in row.representability:
                    representability[k, f], formats[k, f] = row.representability[fmt], True
        columns = list(zip(*(row[:-1] for row in rows), strict=True)) or [()] * (len(TensorRow._fields) - 1)
        step, tensor_id, hists, *specials, absmax, min_nonzero, l2 = columns
        return cls(np.asarray(step, dtype=np.int64), np.asarray(tensor_id, dtype=np.int64), decode_hists(hists),
                   np.asarray(specials, dtype=np.int64).T.reshape(n, len(SPECIAL_COUNT_COLUMNS)),
                   *(np.asarray(c, dtype=np.float64) for c in (absmax, min_nonzero, l2)), representability, formats)

    @classmethod
    def concat(cls, batches: Sequence[TensorBatch]) -> TensorBatch:
        if len(batches) == 1:
            return batches[0]
        if not batches:
            return cls.from_rows([])
        return cls(*(np.concatenate([getattr(b, f.name) for b in batches]) for f in dataclasses.fields(cls)))

    def rows(self) -> list[TensorRow]:
        """The batch as named rows (for a channel that carries plain values: a supervised child's)."""
        names = list(LOW_PRECISION)
        reps = [{names[f]: Representability(*counts) for f, counts in enumerate(per_format) if present[f]}
                for per_format, present in zip(self.representability.tolist(), self.formats.tolist(), strict=True)]
        return list(map(TensorRow, self.step.tolist(), self.tensor_id.tolist(), encode_hists(self.hist),
                        *self.specials.T.tolist(), self.absmax.tolist(), self.min_nonzero.tolist(), self.l2.tolist(),
                        reps))


def _json_fields(fields: dict) -> dict:
    """Serialise the JSON-valued run fields (config, model_state) given as dicts."""
    return {
        k: json.dumps(v, sort_keys=True, default=str) if k in ("config", "model_state") and isinstance(v, dict) else v
        for k, v in fields.items()
    }


class StoreWriter:
    """The single writing connection of a process. Not thread-safe: one thread owns it.

    ``with StoreWriter(path) as w: run_id = w.create_run(...); ...`` marks the run failed with the traceback
    when the block raises, and finished when the block ends cleanly if ``finish_runs`` (otherwise a run that is
    still open stays ``running``, for a caller that ends it later with :meth:`end_run`)."""

    def __init__(self, path: str | os.PathLike, finish_runs: bool = False):
        self.path = Path(path).absolute()
        self._conn = open_for_writing(self.path)  # checks, creates or migrates; raises StoreError having written nothing
        self._finish_runs = finish_runs
        self._open_runs: list[int] = []  # created here and not yet ended
        self._rollups = HistogramRollups()  # each tensor's open step buckets, written as they close
        self._hist_totals = _HistTotals()

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            for run_id in list(self._open_runs):
                if exc is not None:
                    error = "".join(traceback.format_exception(exc_type, exc, tb))
                    try:
                        self.end_run(run_id, "failed", error=error)
                    except sqlite3.Error as store_exc:  # the block's own error is the one to raise
                        exc.add_note(f"mpdiag could not mark run {run_id} failed in {self.path}: {store_exc}")
                elif self._finish_runs:
                    self.end_run(run_id, "finished")
        finally:
            self.close()

    def close(self) -> None:
        """Write the open histogram buckets of the runs written here (a run written on later, by another writer,
        adds to them) and close the connection."""
        try:
            if self._rollups.open_runs():
                with self._conn:
                    for run_id in self._rollups.open_runs():
                        self._rollups.close_run(self._conn, run_id)
        except sqlite3.Error:  # lost as in a crash: readers sum those buckets' steps from their exact rows
            pass
        finally:
            close_writing(self._conn)

    def add_script(self, filename: str, source: str) -> str:
        """Store a script's source under its SHA-256 (idempotent) and return the hash."""
        sha = hashlib.sha256(source.encode()).hexdigest()
        with self._conn:
            self._conn.execute(
                "INSERT OR IGNORE INTO scripts VALUES (?, ?, ?, ?)", (sha, filename, source, time.time())
            )
        return sha

    def add_bundle(self, name: str, data: bytes) -> str:
        """Store uploaded training code (its canonical zip, :class:`mpdiag.sandbox.bundle.Bundle`) under the
        zip's SHA-256 (idempotent) and return the hash."""
        sha = hashlib.sha256(data).hexdigest()
        with self._conn:
            self._conn.execute("INSERT OR IGNORE INTO bundles VALUES (?, ?, ?, ?)", (sha, name, data, time.time()))
        return sha

    def _insert(self, table: str, run_id: int, rows: Sequence[tuple], verb: str = "INSERT") -> None:
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

    def add_update_steps(self, run_id: int, rows: list[tuple]) -> None:
        """rows: (step, tensor_id, updated, below_resolution, unchanged)."""
        self._insert("update_steps", run_id, rows)

    def add_shadow_steps(self, run_id: int, rows: list[tuple]) -> None:
        """rows: (step, tensor_id, rel_error, cosine, ref_norm); non-finite floats are stored as NULL."""
        self._insert("shadow_steps", run_id, rows)

    def add_events(self, run_id: int, rows: list[tuple]) -> None:
        """rows: (step, kind, evidence as JSON text, created_at), as :meth:`mpdiag.recording.events.Event.row`
        makes them; refused unless the evidence is a JSON object."""
        checked = []
        for step, kind, evidence, created_at in rows:
            if not isinstance(json.loads(evidence), dict):
                raise ValueError("an event's evidence must be a JSON object")
            checked.append((int(step), str(kind), str(evidence), float(created_at)))
        self._insert("events", run_id, checked)

    def add_replay(self, run_id: int, summary: tuple, modules: list[tuple]) -> None:
        """A replayed step (:meth:`mpdiag.recording.replay.ReplayResult.summary_row` and ``module_rows``), in one
        transaction; a NaN absmax (nothing measured) is stored as NULL."""
        def real(v):
            return None if v is None or not math.isfinite(v) else float(v)

        step, trigger, reproduced, first_module, first_phase, low_format, format_max, note = summary
        rows = [(int(s), str(phase), int(order), str(module), str(kind), real(absmax), int(nonfinite), real(in_absmax),
                 int(in_nonfinite)) for s, phase, order, module, kind, absmax, nonfinite, in_absmax, in_nonfinite
                in modules]
        with self._conn:
            self._conn.execute("INSERT OR REPLACE INTO replays VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                               (int(run_id), int(step), str(trigger), int(reproduced), first_module, first_phase,
                                low_format, real(format_max), note, time.time()))
            self._conn.executemany("INSERT OR REPLACE INTO replay_modules VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                   [(int(run_id), *row) for row in rows])

    def add_rank_steps(self, run_id: int, rows: list[tuple]) -> None:
        """rows: (step, rank, loss, nonfinite); a non-finite loss and an uncounted nonfinite are stored as NULL."""
        self._insert("rank_steps", run_id, rows)

    def add_fp8_steps(self, run_id: int, records: Sequence[tuple], histograms: Sequence[tuple],
                      blocks: Sequence[tuple] = (), block_scales: Sequence[tuple] = ()) -> None:
        """records: tuples in ``mpdiag.recording.fp8_capture.RECORD_COLUMNS`` order (step, module, role, fmt,
        recipe, scale, amax, numel, underflow, subnormal, overflow); histograms: (step, module, role, exponent,
        count); blocks and block_scales: the block-scaled recipes' rows in BLOCK_COLUMNS and BLOCK_SCALE_COLUMNS
        order. One transaction."""
        with self._conn:
            self._conn.executemany(
                "INSERT INTO fp8_steps (run_id, step, module, role, fmt, recipe, scale, amax, numel, underflow, "
                "subnormal, overflow) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(int(run_id), *row) for row in records])
            self._conn.executemany("INSERT INTO fp8_histograms VALUES (?, ?, ?, ?, ?, ?)",
                                   [(int(run_id), *row) for row in histograms])
            self._conn.executemany("INSERT INTO fp8_blocks VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                   [(int(run_id), *row) for row in blocks])
            self._conn.executemany("INSERT INTO fp8_block_scales VALUES (?, ?, ?, ?, ?, ?, ?)",
                                   [(int(run_id), *row) for row in block_scales])

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
            status="running", started_at=now, heartbeat_at=now, pid=pid, host=this_host(),
            process_started_at=process_start_time(pid),
        )
        names = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        with self._conn:
            cur = self._conn.execute(f"INSERT INTO runs ({names}) VALUES ({marks})", list(fields.values()))
        self._open_runs.append(int(cur.lastrowid))
        return int(cur.lastrowid)

    def hand_run_to(self, run_id: int, pid: int) -> None:
        """Process ``pid`` (on this host) owns the run from now on: readers report it crashed once that process is
        gone (the app's supervisor, for the queued rows a short-lived planning process created)."""
        with self._conn:
            self._conn.execute("UPDATE runs SET pid = ?, host = ?, process_started_at = ? WHERE run_id = ?",
                               (int(pid), this_host(), process_start_time(int(pid)), int(run_id)))

    def update_run(self, run_id: int, **fields) -> None:
        """Set run fields (RUN_FIELDS, status, error, note, finished_at); unknown names are an error."""
        with self._conn:
            self._update_run(run_id, fields)

    def _update_run(self, run_id: int, fields: dict) -> None:
        allowed = set(RUN_FIELDS) | {"status", "error", "note", "finished_at", "heartbeat_at"}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"unknown run fields: {sorted(unknown)}")
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}")
        fields = _json_fields(fields)
        sets = ", ".join(f"{k} = ?" for k in fields)
        self._conn.execute(f"UPDATE runs SET {sets} WHERE run_id = ?", [*fields.values(), int(run_id)])

    def set_optimizer_step_nonfinite(self, run_id: int, record: dict) -> None:
        """Store the first optimizer step that made weights or optimizer state non-finite from finite values
        (:class:`mpdiag.recording.nonfinite_step.NonfiniteStepCheck`'s record) as ``config.optimizer_step_nonfinite``,
        keeping the rest of the run's configuration."""
        with self._conn:
            self._conn.execute(
                "UPDATE runs SET config = json_set(COALESCE(config, '{}'), '$.optimizer_step_nonfinite', json(?)) "
                "WHERE run_id = ?", (json.dumps(record), int(run_id)))

    def end_run(self, run_id: int, status: str, error: str | None = None, note: str | None = None) -> None:
        """End a run: store its step summary (once its last rows are committed, so readers need not scan its steps
        again), its status, ``error`` and the time, and ``note`` when given, in one transaction."""
        summary = step_summaries(self._conn, [run_id])[int(run_id)]
        fields = {"status": status, "error": error, "finished_at": time.time(), **({"note": note} if note else {})}
        with self._conn:
            self._rollups.close_run(self._conn, run_id)
            self._update_run(run_id, fields)
            self._conn.execute("UPDATE runs SET summary = ? WHERE run_id = ?", (json.dumps(summary), int(run_id)))
        self._hist_totals.forget(run_id)
        if int(run_id) in self._open_runs:
            self._open_runs.remove(int(run_id))

    def set_run_output(self, run_id: int, text: str, bytes_total: int) -> None:
        """Keep ``text`` as the run's console output (replacing what was kept; :class:`mpdiag.store.console.
        ConsoleCapture` bounds it), ``bytes_total`` the bytes printed in all. Only the process that started or
        watched the run calls this: a supervised child has no way to (it is not among its allowed calls)."""
        with self._conn:
            self._conn.execute("INSERT OR REPLACE INTO run_output VALUES (?, ?, ?, ?)",
                               (int(run_id), str(text), int(bytes_total), time.time()))

    # -- what a person says about a run: one method per action, each one transaction -------------------------
    def _existing(self, run_id: int) -> tuple:
        row = self._conn.execute("SELECT status, pid, host, process_started_at FROM runs WHERE run_id = ?",
                                 (int(run_id),)).fetchone()
        if row is None:
            raise StoreError(f"No run {run_id} in {self.path}. `mpdiag runs` lists the runs.")
        return row

    def rename_run(self, run_id: int, name: str) -> str:
        """Give a run a new display name (:func:`clean_name`); returns the name stored."""
        name = clean_name(name)
        with self._conn:
            self._existing(run_id)
            self._conn.execute("UPDATE runs SET name = ? WHERE run_id = ?", (name, int(run_id)))
        return name

    def tag_run(self, run_id: int, tags: Iterable[str]) -> list[str]:
        """Add tags (:func:`clean_tag`) to a run, keeping those it has; returns the run's tags, sorted. A run
        holds at most MAX_TAGS."""
        cleaned = sorted({clean_tag(t) for t in tags})
        with self._conn:
            self._existing(run_id)
            held = {r[0] for r in self._conn.execute("SELECT tag FROM run_tags WHERE run_id = ?", (int(run_id),))}
            if len(held | set(cleaned)) > MAX_TAGS:
                raise RunTextRefused(f"A run holds at most {MAX_TAGS} tags; run {run_id} has {len(held)} and "
                                     f"{len(set(cleaned) - held)} would be added.")
            self._conn.executemany("INSERT OR IGNORE INTO run_tags VALUES (?, ?)", [(int(run_id), t) for t in cleaned])
        return sorted(held | set(cleaned))

    def untag_run(self, run_id: int, tags: Iterable[str]) -> list[str]:
        """Remove tags from a run (a tag it does not have is ignored); returns the run's tags, sorted."""
        with self._conn:
            self._existing(run_id)
            self._conn.executemany("DELETE FROM run_tags WHERE run_id = ? AND tag = ?",
                                   [(int(run_id), str(t).strip()) for t in tags])
            return sorted(r[0] for r in self._conn.execute("SELECT tag FROM run_tags WHERE run_id = ?",
                                                           (int(run_id),)))

    def set_tags(self, run_id: int, tags: Iterable[str]) -> list[str]:
        """Make a run's tags exactly ``tags`` (:func:`clean_tag` each, at most MAX_TAGS), in one transaction;
        returns them, sorted. The Runs page saves its tag editor with this."""
        cleaned = sorted({clean_tag(t) for t in tags})
        if len(cleaned) > MAX_TAGS:
            raise RunTextRefused(f"A run holds at most {MAX_TAGS} tags; {len(cleaned)} were given.")
        with self._conn:
            self._existing(run_id)
            self._conn.execute("DELETE FROM run_tags WHERE run_id = ?", (int(run_id),))
            self._conn.executemany("INSERT INTO run_tags VALUES (?, ?)", [(int(run_id), t) for t in cleaned])
        return cleaned

    def set_user_note(self, run_id: int, note: str | None) -> str:
        """Store a person's note with a run (:func:`clean_note`; empty clears it); returns the note stored.
        mpdiag's own note about the run (``runs.note``) is a different field and is left alone."""
        note = clean_note(note)
        with self._conn:
            self._existing(run_id)
            self._conn.execute("UPDATE runs SET user_note = ? WHERE run_id = ?", (note or None, int(run_id)))
        return note

    def delete_run(self, run_id: int) -> dict[str, int]:
        """Delete a run: its rows in every table that has a ``run_id`` column, in one transaction; returns the
        rows deleted per table. Nothing else is touched: stored scripts and uploaded code stay (other runs may
        use them), and so do other runs' rows, their links to this run included (readers drop a link to a run
        that no longer exists). Raises RunBusy, deleting nothing, while the run's process is still alive."""
        run_id = int(run_id)
        self._conn.execute("BEGIN IMMEDIATE")  # the status read and the deletes under one lock
        try:
            status, pid, host, started = self._existing(run_id)
            if status in ("running", "queued") and process_is_alive(pid, host, started):
                raise RunBusy(f"Run {run_id} is still {status} (process {pid} on {host}): it would go on writing "
                              "rows into the store. Stop it or wait until it ends, then delete it.")
            tables = [name for (name,) in self._conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
                if any(col[1] == "run_id" for col in self._conn.execute(f"PRAGMA table_info({name})"))]
            deleted = {table: self._conn.execute(f"DELETE FROM {table} WHERE run_id = ?", (run_id,)).rowcount
                       for table in tables}
            self._conn.commit()
            self._rollups.forget(run_id)
            self._hist_totals.forget(run_id)
        except BaseException:
            self._conn.rollback()
            raise
        if run_id in self._open_runs:
            self._open_runs.remove(run_id)
        return deleted

    def add_tensors(self, run_id: int, rows: Iterable[tuple]) -> None:
        """rows: (tensor_id, name, shape list, numel, param_dtype, grad_dtype)."""
        with self._conn:
            self._conn.executemany(
                "INSERT OR REPLACE INTO tensors VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(int(run_id), t, n, json.dumps(list(s)), int(k), p, g) for t, n, s, k, p, g in rows],
            )

    def write_batch(self, run_id: int, step_rows: Sequence[StepRow], tensor_rows: Sequence[TensorRow] | TensorBatch,
                    kept: Sequence[tuple[int, str]] = (),
                    signals: Sequence[tuple[int, Sequence, Sequence]] = ()) -> None:
        """Commit step and tensor rows (named rows or a :class:`TensorBatch`), add the tensor rows' counts to the
        running totals and refresh the run's heartbeat, in one transaction. Each (step, tensor) must be written
        once: the totals would count a rewrite twice. A representability key that is not a registry format is
        a ValueError. ``kept``: (step, reason) of the steps whose tensor rows are stored
        (mpdiag.recording.retention), into kept_steps; their step rows, in this batch or an earlier one, are
        marked ``logged``. The histograms are added to their step buckets' sums (hist_rollups, written as each
        bucket closes: :class:`mpdiag.store.schema.HistogramRollups`) too. ``signals``:
        (step, tensor ids, counts (tensors, SIGNAL_COUNTS)) of any step, kept or not, into step_signals (a step's
        second set is ignored: the first came from the same gradients)."""
        run_id = int(run_id)
        batch = tensor_rows if isinstance(tensor_rows, TensorBatch) else TensorBatch.from_rows(tensor_rows)
        held = self._rollups.state(run_id), self._hist_totals.state(run_id)
        try:
            self._commit_batch(run_id, step_rows, batch, kept, signals)
        except BaseException:  # rolled back: the sums held in memory go back to what the store agrees with
            self._rollups.restore(run_id, held[0])
            self._hist_totals.restore(run_id, held[1])
            raise

    def _commit_batch(self, run_id: int, step_rows: Sequence[StepRow], batch: TensorBatch,
                      kept: Sequence[tuple[int, str]], signals: Sequence[tuple[int, Sequence, Sequence]]) -> None:
        with self._conn:
            self._conn.executemany(f"INSERT INTO steps (run_id, {', '.join(StepRow._fields)}) "
                                   f"VALUES ({', '.join('?' * (len(StepRow._fields) + 1))})",
                                   [(run_id, *row) for row in step_rows])
            self._insert_tensor_rows(run_id, batch)
            self._add_totals(run_id, batch)
            self._conn.executemany(f"INSERT OR IGNORE INTO step_signals VALUES "
                                   f"({', '.join('?' * (3 + len(SIGNAL_COUNTS)))})", _signal_rows(run_id, signals))
            self._conn.executemany("INSERT OR IGNORE INTO kept_steps VALUES (?, ?, ?)",
                                   [(run_id, step, reason) for step, reason in kept])
            self._conn.executemany("UPDATE steps SET logged = 1 WHERE run_id = ? AND step = ?",
                                   [(run_id, step) for step in sorted({step for step, _ in kept})])
            self._conn.execute("UPDATE runs SET heartbeat_at = ? WHERE run_id = ?", (time.time(), run_id))

    def _insert_tensor_rows(self, run_id: int, batch: TensorBatch) -> None:
        """The batch's tensor_steps rows, each with its representability counts as columns (NULL for a format
        the row does not hold), inside the caller's transaction."""
        if not len(batch):
            return
        counts = batch.representability.reshape(len(batch), -1)  # rows x TENSOR_STEP_COUNT_COLUMNS
        held = np.repeat(batch.formats, len(Representability._fields), axis=1)
        if not held.all():  # a format some rows lack (rare: a child's rows): NULL there
            counts = np.where(held, counts.astype(object), None)
        counts = counts.T.tolist()
        self._conn.executemany(
            f"INSERT INTO tensor_steps ({', '.join(TENSOR_STEP_COLUMNS)}) VALUES ({', '.join('?' * len(TENSOR_STEP_COLUMNS))})",
            zip(itertools.repeat(run_id), batch.step.tolist(), batch.tensor_id.tolist(), encode_hists(batch.hist),
                *batch.specials.T.tolist(), batch.absmax.tolist(), batch.min_nonzero.tolist(), batch.l2.tolist(),
                *counts))

    def _add_totals(self, run_id: int, batch: TensorBatch) -> None:
        """Add the batch to its tensors' running totals: counts, representability, histograms and the histograms'
        step-bucket sums (hist_rollups), inside the caller's transaction."""
        if not len(batch):
            return
        kinds = Representability._fields
        sums = _TensorSums.of(batch)
        self._conn.executemany(
            f"INSERT INTO tensor_totals VALUES ({', '.join('?' * (3 + len(SPECIAL_COUNT_COLUMNS)))}) "
            "ON CONFLICT (run_id, tensor_id) DO UPDATE SET "
            + ", ".join(f"{c} = {c} + excluded.{c}" for c in ["logged_steps", *SPECIAL_COUNT_COLUMNS]),
            zip(itertools.repeat(run_id), sums.ids.tolist(), sums.rows.tolist(), *sums.specials.T.tolist()))
        tensors, formats = np.nonzero(sums.formats)
        names = list(LOW_PRECISION)
        self._conn.executemany(
            f"INSERT INTO representability_totals VALUES ({', '.join('?' * (3 + len(kinds)))}) "
            "ON CONFLICT (run_id, tensor_id, fmt) DO UPDATE SET " + ", ".join(f"{k} = {k} + excluded.{k}" for k in kinds),
            zip(itertools.repeat(run_id), sums.ids[tensors].tolist(), [names[f] for f in formats.tolist()],
                *sums.representability[tensors, formats].T.tolist()))
        totals = self._hist_totals.add(self._conn, run_id, sums.ids, sums.hist)
        self._conn.executemany("INSERT OR REPLACE INTO hist_totals VALUES (?, ?, ?)",
                               zip(itertools.repeat(run_id), sums.ids.tolist(), encode_hists(totals)))
        self._rollups.add(self._conn, run_id, batch.step, batch.tensor_id, batch.hist)


@dataclass(frozen=True)
class _TensorSums:
    """A batch's rows summed per tensor (``ids`` ascending): how many rows, the special counts, the
    representability counts of the formats each row holds, which formats any row held, and the histograms."""

    ids: np.ndarray
    rows: np.ndarray
    specials: np.ndarray
    representability: np.ndarray
    formats: np.ndarray
    hist: np.ndarray

    @classmethod
    def of(cls, batch: TensorBatch) -> _TensorSums:
        # sorted segments summed by reduceat: np.add.at cost the writer thread ~1 ms a step at 500 tensors
        order = np.argsort(batch.tensor_id, kind="stable")
        ids = batch.tensor_id[order]
        starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
        return cls(ids[starts], np.diff(np.r_[starts, len(ids)]),
                   np.add.reduceat(batch.specials[order], starts, axis=0),
                   np.add.reduceat((batch.representability * batch.formats[:, :, None])[order], starts, axis=0),
                   np.logical_or.reduceat(batch.formats[order], starts, axis=0),
                   summed_histograms(batch.hist, order, starts))


class _HistTotals:
    """Each run's hist_totals sums as this writer last wrote them, so a batch adds to them without reading them
    back (a tensor's stored sum is read once, when a run written before reaches this writer). A batch's sums are
    never added in place, so :meth:`state` is the state before it."""

    def __init__(self) -> None:
        self._runs: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # run -> (tensor ids ascending, their sums)

    def add(self, conn: sqlite3.Connection, run_id: int, ids: np.ndarray, sums: np.ndarray) -> np.ndarray:
        """Add ``sums`` (per tensor of ``ids``, ascending) to the run's totals; returns those tensors' totals."""
        held_ids, held = self._runs.get(run_id, (np.zeros(0, np.int64), np.zeros((0, sums.shape[1]), np.int64)))
        unseen = ids[~np.isin(ids, held_ids)]
        if len(unseen):
            stored = dict(conn.execute(f"SELECT tensor_id, hist FROM hist_totals WHERE run_id = ? AND tensor_id IN "
                                       f"({', '.join('?' * len(unseen))})", (run_id, *unseen.tolist())).fetchall())
            start = np.zeros((len(unseen), sums.shape[1]), np.int64)
            found = [k for k, tensor_id in enumerate(unseen.tolist()) if tensor_id in stored]
            start[found] = decode_hists([stored[int(unseen[k])] for k in found])
            order = np.argsort(np.r_[held_ids, unseen], kind="stable")
            held_ids, held = np.r_[held_ids, unseen][order], np.concatenate([held, start])[order]
        else:
            held = held.copy()
        at = np.searchsorted(held_ids, ids)
        held[at] += sums
        self._runs[run_id] = (held_ids, held)
        return held[at]

    def state(self, run_id: int) -> tuple[np.ndarray, np.ndarray] | None:
        return self._runs.get(int(run_id))

    def restore(self, run_id: int, state: tuple[np.ndarray, np.ndarray] | None) -> None:
        if state is None:
            self._runs.pop(int(run_id), None)
        else:
            self._runs[int(run_id)] = state

    def forget(self, run_id: int) -> None:
        self._runs.pop(int(run_id), None)


def _signal_rows(run_id: int, signals: Sequence[tuple[int, Sequence, Sequence]]) -> list[tuple]:
    """step_signals rows: (run, step, each count summed over the step's tensors, the per-tensor blob)."""
    rows = []
    for step, tensor_ids, counts in signals:
        counts = np.asarray(counts, dtype=np.int64).reshape(-1, len(SIGNAL_COUNTS))
        rows.append((run_id, int(step), *counts.sum(axis=0).tolist(), encode_signals(tensor_ids, counts)))
    return rows
