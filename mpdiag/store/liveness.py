"""Whether the process that owns a running run still exists, so readers can report a dead one as crashed.

Owns the psutil look-ups only; it must not touch the store file.
"""

from __future__ import annotations

import socket

import psutil


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), or None when there is no such process to see or it
    has exited (a zombie its parent, such as the app that launched it, has not reaped yet)."""
    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def process_is_alive(pid: int | None, host: str | None, started_at: float | None) -> bool:
    """Whether the process that owns a running run still exists (checked on this host only)."""
    if pid is None or host != socket.gethostname():
        return True  # cannot tell from here; assume alive
    created = process_start_time(int(pid))
    if created is None:
        return False
    return started_at is None or abs(created - started_at) < 1.0  # guards against a reused pid


def this_host() -> str:
    return socket.gethostname()
