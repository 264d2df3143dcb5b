"""A run's console output as the store keeps it: bounded, the first HEAD_BYTES and the last TAIL_BYTES of what
the process printed (stdout and stderr interleaved as printed), with one line saying how many bytes were cut
between them.

Owns :class:`ConsoleCapture`, the thread-safe buffer every path that keeps output feeds (the tee of ``mpdiag
run`` and ``mpdiag watch`` in a terminal, the supervisor of a run started from the app), and the cut line's
wording. It must not write the store (the writer's ``set_run_output`` does) nor read a process's streams.
"""

from __future__ import annotations

import threading

KiB = 1024
#: the first bytes kept (the script's start: its configuration, its first warnings)
HEAD_BYTES = 64 * KiB
#: the last bytes kept (where it is now, or how it ended)
TAIL_BYTES = 448 * KiB


def cut_line(cut_bytes: int) -> str:
    """The line standing where output was cut (no line break)."""
    return (f"[... mpdiag cut {cut_bytes:,} bytes of output here: it keeps the first {HEAD_BYTES // KiB} KiB and the "
            f"last {TAIL_BYTES // KiB} KiB ...]")


#: how often the kept output of a running run is refreshed in the store (a stalled run shows its latest lines);
#: the pages re-read it no more often
OUTPUT_REFRESH_S = 3.0


class ConsoleCapture:
    """Output as it arrives (``add``), kept as head + tail; :meth:`snapshot` is what the store holds."""

    def __init__(self, head_bytes: int = HEAD_BYTES, tail_bytes: int = TAIL_BYTES):
        self.head_bytes, self.tail_bytes = head_bytes, tail_bytes
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0  # bytes ever added
        self._lock = threading.Lock()

    def add(self, data: bytes | str) -> None:
        if isinstance(data, str):
            data = data.encode("utf-8", "replace")
        if not data:
            return
        with self._lock:
            self.total += len(data)
            room = self.head_bytes - len(self.head)
            if room > 0:
                self.head += data[:room]
                data = data[room:]
            if data:
                self.tail += data
                excess = len(self.tail) - self.tail_bytes
                if excess > 0:
                    del self.tail[:excess]

    def snapshot(self) -> tuple[str, int]:
        """(text, bytes printed in all). The text is the whole output when it fits in HEAD_BYTES + TAIL_BYTES;
        otherwise the head, the :func:`cut_line` on a line of its own, and the tail. Bytes that are not UTF-8
        (or a character split at the cut) read as U+FFFD."""
        with self._lock:
            head, tail, total = bytes(self.head), bytes(self.tail), self.total
        cut = total - len(head) - len(tail)
        if not cut:
            return (head + tail).decode("utf-8", "replace"), total
        text = head.decode("utf-8", "replace")
        return (text + ("" if text.endswith("\n") else "\n") + cut_line(cut) + "\n"
                + tail.decode("utf-8", "replace")), total
