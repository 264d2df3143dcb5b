"""Starting runs in child processes (the app never trains, nor runs user code, in its own process).

A launched run is ``python -m mpdiag run|rerun ...`` in a new process session with its output in a log
file; it creates its run row itself, which the app finds by the child's pid.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
LOG_DIR = Path(tempfile.gettempdir()) / "mpdiag-logs"


@dataclass(frozen=True)
class Launched:
    """A run process started by :func:`launch`."""

    pid: int
    log_path: str
    command: tuple[str, ...]
    started_at: float

    def is_alive(self) -> bool:
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def log_tail(self, max_chars: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(max(0, os.path.getsize(self.log_path) - max_chars))
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return ""


def _flags(options: dict) -> list[str]:
    flags = []
    for key, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def run_command(store_path: str | os.PathLike, script: str, options: dict) -> list[str]:
    """Command line for a new run of ``script`` (a path, or ``sha256:HASH`` of a stored script)."""
    return [sys.executable, "-m", "mpdiag", "run", script, *_flags(options), "--store", str(store_path)]


def rerun_command(store_path: str | os.PathLike, run_id: int, options: dict) -> list[str]:
    """Command line for a rerun of ``run_id`` with ``options`` overridden."""
    return [sys.executable, "-m", "mpdiag", "rerun", str(int(run_id)), *_flags(options), "--store", str(store_path)]


def launch(command: list[str]) -> Launched:
    """Start ``command`` in its own process session, output to a log file; returns at once."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{time.monotonic_ns()}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    return Launched(pid=proc.pid, log_path=str(log_path), command=tuple(command), started_at=time.time())
