"""Keeping a run's console output: :func:`tee_console` copies what this process prints through ``sys.stdout`` and
``sys.stderr`` into a :class:`~mpdiag.store.console.ConsoleCapture` while passing it on to the terminal unchanged,
and :class:`OutputKeeper` writes a capture into the store through a run's background writer every
OUTPUT_REFRESH_S, and once more at the end.

Used by ``mpdiag run`` and ``mpdiag watch`` in a terminal (the tee), and by the supervisor of runs started from
the app (its keeper, fed from the child's pipe: the child itself never writes its output to the store). It must
not decide what a run records; it only carries text.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from mpdiag.store.console import OUTPUT_REFRESH_S, ConsoleCapture


class _TeeStream:
    """A text stream that writes through to ``stream`` and copies each write into ``capture``; everything else
    (``isatty``, ``fileno``, ``encoding``, ``buffer``...) is the stream's own, so the script sees its terminal."""

    def __init__(self, stream, capture: ConsoleCapture):
        self._stream, self._capture = stream, capture

    def write(self, text):
        written = self._stream.write(text)
        if isinstance(text, str):
            self._capture.add(text)
        return written

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextmanager
def tee_console(capture: ConsoleCapture | None = None) -> Iterator[ConsoleCapture]:
    """For the block, everything written to ``sys.stdout`` and ``sys.stderr`` (``print``, tracebacks, warnings,
    logging handlers made in the block) reaches them as before and is also added to the yielded capture, in the
    order written. Not seen: writes to the binary ``.buffer`` or straight to file descriptors 1 and 2 (C
    extensions), and the output of other processes (DataLoader workers, torchrun's ranks)."""
    capture = capture if capture is not None else ConsoleCapture()
    saved = sys.stdout, sys.stderr
    if sys.stdout is not None:
        sys.stdout = _TeeStream(sys.stdout, capture)
    if sys.stderr is not None:
        sys.stderr = _TeeStream(sys.stderr, capture)
    try:
        yield capture
    finally:
        sys.stdout, sys.stderr = saved


class OutputKeeper:
    """Writes ``capture`` as the console output of ``run_ids`` through ``writer`` (a BackgroundWriter, whose
    thread runs the refresh) every OUTPUT_REFRESH_S while it changes; :meth:`finish` writes the final text."""

    def __init__(self, writer, run_ids: Sequence[int], capture: ConsoleCapture, every_s: float = OUTPUT_REFRESH_S):
        self._writer, self.run_ids, self.capture = writer, [int(r) for r in run_ids], capture
        self._kept = -1  # bytes_total of the last text written
        self._stop = writer.every(every_s, self._refresh)

    def _write(self, sink) -> None:
        """On the writer's thread, in its queue's order: the output as it is when the job runs, unless unchanged
        (so a later job never writes an older text)."""
        text, total = self.capture.snapshot()
        if total != self._kept:
            self._kept = total
            for run_id in self.run_ids:
                sink.set_run_output(run_id, text, total)

    def _refresh(self) -> None:
        self._writer.submit(self._write)

    def finish(self) -> None:
        """Stop refreshing and write the output as it is now (waits until it is written)."""
        self._stop()
        self._writer.call(self._write)
