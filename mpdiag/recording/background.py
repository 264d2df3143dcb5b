"""A background thread that owns a training process's one writing connection to the store.

Training code submits jobs and moves on; SQLite commits happen on this thread, so a slow disk does not stall
the step. A failed job's exception is raised in the submitting thread at its next call.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from mpdiag.store import StoreWriter


class BackgroundWriter:
    """Runs ``job(writer)`` callables in submission order on one thread holding a :class:`StoreWriter`."""

    def __init__(self, path: str | os.PathLike):
        self.path = path
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        ready: Future = Future()
        self._thread = threading.Thread(target=self._loop, args=(ready,), name="mpdiag-writer", daemon=True)
        self._thread.start()
        ready.result()  # surfaces a store that cannot be opened in the caller

    def _loop(self, ready: Future) -> None:
        try:
            writer = StoreWriter(self.path)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            ready.set_exception(exc)
            return
        ready.set_result(None)
        try:
            while True:
                job, future = self._jobs.get()
                if job is None:
                    future.set_result(None)
                    return
                try:
                    future.set_result(job(writer))
                except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread
                    self._error = self._error or exc
                    future.set_exception(exc)
        finally:
            writer.close()

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing to the store {self.path} failed: {error}") from error

    def submit(self, job: Callable[[StoreWriter], Any]) -> Future:
        """Queue a job; returns its future. Raises the error of an earlier failed job, if any."""
        self._raise_pending()
        future: Future = Future()
        self._jobs.put((job, future))
        return future

    def call(self, job: Callable[[StoreWriter], Any]) -> Any:
        """Run a job and wait for its result."""
        return self.submit(job).result()

    def close(self) -> None:
        """Finish every queued job, then close the connection. Raises a job's error, if one failed."""
        if self._thread.is_alive():
            done: Future = Future()
            self._jobs.put((None, done))
            done.result()
            self._thread.join()
        self._raise_pending()
