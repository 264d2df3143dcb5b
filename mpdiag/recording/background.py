"""A background thread that owns a training process's one writing path to the store, and its heartbeat.

Training code submits jobs and moves on; writes happen on this thread, so a slow disk does not stall the step.
A failed job's exception is raised in the submitting thread at its next call.

Jobs call write methods on a *sink*: in a process that may hold the store (the CLI, a user's own loop with a
Recorder) the sink is a :class:`mpdiag.store.StoreWriter`; in a child started by the app it is
:class:`mpdiag.sandbox.child.StoreCallForwarder`, which hands each call to the supervising process, the only one
that writes that store. While a run this writer created is open, the thread sends ``update_run(run_id,
heartbeat_at=now)`` every HEARTBEAT_S until the run's first step rows are committed; from then on the heartbeat is
the commit of step rows itself (the store's ``write_batch``), so a training loop that hangs reads as stalled while
this thread lives on. Periodic work registered with :meth:`BackgroundWriter.every` (the Recorder's flush of rows
that arrived, so steps reach the store while the training thread is stuck) runs on this thread; what it calls on
the writer (:meth:`call`, :meth:`close`: the Recorder stopping on a failed write) runs there at once, since queued
it would wait on itself. This module must not decide what a run records; it only carries the calls.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from mpdiag.store import StoreWriter


class StoreWriteFailed(RuntimeError):
    """A write to the store (or to the supervising process) failed; raised in the thread that submits next."""


HEARTBEAT_S = 5.0
TICK_S = 0.25  # how often periodic work is looked at
_ENDED = ("finished", "failed", "crashed", "stopped")


class _OpenRuns:
    """The sink as jobs see it: every call passes through; the runs created here and not yet ended are noted,
    for the heartbeat."""

    def __init__(self, sink):
        self.sink = sink
        self.open: set[int] = set()
        self.stepping: set[int] = set()  # open runs with step rows committed: write_batch is their heartbeat

    def create_run(self, **fields) -> int:
        run_id = self.sink.create_run(**fields)
        self.open.add(int(run_id))
        return run_id

    def update_run(self, run_id: int, **fields) -> None:
        self.sink.update_run(run_id, **fields)
        if fields.get("status") in _ENDED:
            self.open.discard(int(run_id))

    def write_batch(self, run_id: int, step_rows, tensor_rows, kept=(), signals=()) -> None:
        self.sink.write_batch(run_id, step_rows, tensor_rows, kept, signals)
        if step_rows:
            self.stepping.add(int(run_id))

    def beat(self) -> None:
        for run_id in sorted(self.open - self.stepping):
            self.sink.update_run(run_id, heartbeat_at=time.time())

    def __getattr__(self, name: str):
        return getattr(self.sink, name)


class BackgroundWriter:
    """Runs ``job(sink)`` callables in submission order on one thread.

    ``target``: a store path (the thread opens a :class:`StoreWriter` on it), or a callable returning a sink
    (any object with the store writer's methods and ``close()``). ``heartbeat`` False: send none (a supervisor
    writing on behalf of a child, whose own heartbeat is what tells whether it is alive)."""

    def __init__(self, target: str | os.PathLike | Callable[[], Any], heartbeat: bool = True):
        self.path = None if callable(target) else target
        self._heartbeat = heartbeat
        self._open_sink = target if callable(target) else (lambda: StoreWriter(target))
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._periodic: dict[int, tuple[float, Callable[[], None]]] = {}  # id -> (interval, fn)
        self._runs: _OpenRuns | None = None  # the sink as jobs see it, once this thread opened it
        self._ended = False  # the thread has left its loop: nothing queued now would ever run
        self._queue_lock = threading.Lock()  # a job is queued before the loop ends, or refused after
        self._last_run: dict[int, float] = {}
        ready: Future = Future()
        self._thread = threading.Thread(target=self._loop, args=(ready,), name="mpdiag-writer", daemon=True)
        self._thread.start()
        ready.result()  # surfaces a store that cannot be opened in the caller

    def _loop(self, ready: Future) -> None:
        try:
            sink = self._open_sink()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            ready.set_exception(exc)
            return
        runs = self._runs = _OpenRuns(sink)
        ready.set_result(None)
        last_beat = time.monotonic()
        try:
            while True:
                try:
                    job, future = self._jobs.get(timeout=TICK_S if self._periodic else HEARTBEAT_S)
                except queue.Empty:
                    job = future = None
                self._run_periodic()
                if future is not None and job is None:
                    future.set_result(None)
                    return
                if job is not None:
                    try:
                        future.set_result(job(runs))
                    except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread
                        self._error = self._error or exc
                        future.set_exception(exc)
                if self._heartbeat and time.monotonic() - last_beat >= HEARTBEAT_S:
                    last_beat = time.monotonic()
                    try:
                        runs.beat()
                    except Exception as exc:  # noqa: BLE001 - re-raised in the training thread
                        self._error = self._error or exc
        finally:
            sink.close()
            self._answer_queued_after_end()

    def _answer_queued_after_end(self) -> None:
        """Nothing waits forever on a writer that ended: a close queued after the one that ended it is answered,
        a job is refused."""
        with self._queue_lock:
            self._ended = True
        while True:
            try:
                job, future = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                future.set_result(None)
            else:
                future.set_exception(StoreWriteFailed("the writer had already closed"))

    def every(self, interval_s: float, fn: Callable[[], None]) -> Callable[[], None]:
        """Run ``fn()`` on this writer's thread about every ``interval_s`` until the returned function is called;
        an exception in it is raised in the submitting thread, as a job's is."""
        key = id(fn)
        self._periodic[key] = (interval_s, fn)
        return lambda: self._periodic.pop(key, None)

    def _run_periodic(self) -> None:
        now = time.monotonic()
        for key, (interval, fn) in list(self._periodic.items()):
            if now - self._last_run.get(key, now - interval) >= interval:
                self._last_run[key] = now
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - re-raised in the training thread
                    self._error = self._error or exc
                    self._periodic.pop(key, None)

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            where = f"the store {self.path}" if self.path is not None else "the supervising process"
            raise StoreWriteFailed(f"writing to {where} failed: {error}") from error

    def submit(self, job: Callable[[Any], Any]) -> Future:
        """Queue a job; returns its future. Raises the error of an earlier failed job, if any."""
        self._raise_pending()
        return self._queue(job)

    def _queue(self, job: Callable[[Any], Any] | None) -> Future:
        future: Future = Future()
        with self._queue_lock:
            if not self._ended:
                self._jobs.put((job, future))
                return future
        if job is None:
            future.set_result(None)
        else:
            future.set_exception(StoreWriteFailed("the writer had already closed"))
        return future

    def _on_own_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, job: Callable[[Any], Any]) -> Any:
        """Run a job and wait for its result; on this writer's own thread (from periodic work), run it now."""
        if self._on_own_thread():
            return job(self._runs)
        return self.submit(job).result()

    def close(self) -> None:
        """Finish every queued job, then close the sink. Raises a job's error, if one failed. From periodic work
        on this writer's own thread: the thread ends after the jobs queued so far, and nothing is raised here."""
        if self._on_own_thread():
            self._queue(None)
            return
        self._queue(None).result()
        self._thread.join()
        self._raise_pending()
