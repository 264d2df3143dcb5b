"""Running untrusted model-script work in a supervised child process.

:func:`supervise` starts a command in its own process group with a wall-time limit, a memory limit (an
address-space rlimit on CPU-only machines, and a resident-memory watchdog over the whole process tree
everywhere), a scratch working directory, and its output captured to a bounded log that keeps the *last*
part of a huge output. It never raises for what the child does: it returns an :class:`Outcome` that says
how the child ended, in words a user can act on.

``python -m mpdiag.sandbox.supervisor [limits] -- COMMAND...`` supervises a training run started by the app: when the
run's own process could not close its run (killed at a limit, ``os._exit``, a crash), the supervisor
records why in the store, so the run reads ``failed`` with that reason instead of a bare ``crashed``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

MiB = 2**20


def _env_number(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass(frozen=True)
class Limits:
    """Limits on one supervised child. Defaults come from MPDIAG_RUN_WALL_S, MPDIAG_RUN_MEMORY_MB and
    MPDIAG_LOG_BYTES (runs) or MPDIAG_CHECK_WALL_S (checks)."""

    wall_s: float
    memory_mb: float
    log_bytes: int

    @classmethod
    def for_runs(cls) -> Limits:
        return cls(_env_number("MPDIAG_RUN_WALL_S", 6 * 3600), _env_number("MPDIAG_RUN_MEMORY_MB", 8192),
                   int(_env_number("MPDIAG_LOG_BYTES", MiB)))

    @classmethod
    def for_checks(cls) -> Limits:
        return cls(_env_number("MPDIAG_CHECK_WALL_S", 120), _env_number("MPDIAG_RUN_MEMORY_MB", 8192),
                   int(_env_number("MPDIAG_LOG_BYTES", MiB)))


@dataclass
class Outcome:
    """How a supervised child ended. ``reason``: exited, wall_time, memory."""

    exit_code: int | None
    reason: str
    message: str
    output_tail: str
    dropped_bytes: int
    child_pid: int
    seconds: float

    @property
    def ok(self) -> bool:
        return self.reason == "exited" and self.exit_code == 0


class BoundedLog:
    """Keeps the last ``limit`` bytes of a stream and mirrors them to a file at most twice a second."""

    def __init__(self, path: Path | None, limit: int):
        self.path, self.limit = path, limit
        self.tail = bytearray()
        self.dropped = 0
        self._written = 0.0
        self._lock = threading.Lock()

    def add(self, chunk: bytes) -> None:
        with self._lock:
            self.tail += chunk
            excess = len(self.tail) - self.limit
            if excess > 0:
                del self.tail[:excess]
                self.dropped += excess
        if time.monotonic() - self._written > 0.5:
            self.flush()

    def text(self) -> str:
        with self._lock:
            head = f"[... {self.dropped} earlier bytes of output dropped ...]\n" if self.dropped else ""
            return head + self.tail.decode("utf-8", "replace")

    def flush(self) -> None:
        self._written = time.monotonic()
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(self.text(), encoding="utf-8")
            tmp.replace(self.path)


def cuda_present() -> bool:
    """Whether an NVIDIA driver is present (checked without importing torch, which is slow)."""
    return Path("/dev/nvidiactl").exists()


def _limit_address_space(memory_mb: float):
    """An rlimit for the child on machines without CUDA (CUDA maps far more address space than it uses)."""
    def apply():
        limit = int(memory_mb * MiB)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def supervise(command: list[str], limits: Limits, cwd: str | os.PathLike, log_path: Path | None = None,
              env: dict | None = None, on_start=None) -> Outcome:
    """Run ``command`` under ``limits`` in ``cwd``; returns when it ends or is stopped at a limit."""
    log = BoundedLog(log_path, limits.log_bytes)
    start = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, preexec_fn=None if cuda_present() else _limit_address_space(limits.memory_mb),
    )
    if on_start is not None:
        on_start(proc.pid)
    reader = threading.Thread(target=lambda: [log.add(c) for c in iter(lambda: proc.stdout.read1(65536), b"")],
                              daemon=True)
    reader.start()
    watched = psutil.Process(proc.pid)
    reason = "exited"
    while proc.poll() is None:
        if time.monotonic() - start > limits.wall_s:
            reason = "wall_time"
        elif _tree_rss(watched) > limits.memory_mb * MiB:
            reason = "memory"
        if reason != "exited":
            _kill_group(proc)
            break
        time.sleep(0.1)
    proc.wait()
    reader.join(timeout=5)
    log.flush()
    code = proc.returncode
    return Outcome(exit_code=code, reason=reason, message=_describe(reason, code, limits), output_tail=log.text(),
                   dropped_bytes=log.dropped, child_pid=proc.pid, seconds=time.monotonic() - start)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _describe(reason: str, code: int | None, limits: Limits) -> str:
    if reason == "wall_time":
        return f"stopped at the wall-time limit of {limits.wall_s:g} s (does the script loop forever or wait on input?)"
    if reason == "memory":
        return f"stopped: the process used more than {limits.memory_mb:g} MB of memory"
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"the process was killed by signal {name}"
    if code == 0:
        return "the process exited normally"
    return f"the process exited with code {code}"


def main(argv: list[str] | None = None) -> int:
    """Supervise one training run for the app and record in the store why it ended, if it could not."""
    parser = argparse.ArgumentParser(prog="python -m mpdiag.sandbox.supervisor")
    parser.add_argument("--store", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--cwd", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    log = Path(args.log)
    status = log.with_suffix(".json")

    def started(pid: int) -> None:
        status.write_text(json.dumps({"child_pid": pid}))

    Path(args.cwd).mkdir(parents=True, exist_ok=True)
    outcome = supervise(command, Limits.for_runs(), args.cwd, log, on_start=started)
    status.write_text(json.dumps(asdict(outcome) | {"output_tail": outcome.output_tail[-4000:]}))
    _record_unclosed_run(args.store, outcome)
    return 0


def _record_unclosed_run(store_path: str, outcome: Outcome) -> None:
    """Mark the child's run failed with the reason when the child could not close it itself."""
    from mpdiag.store import Store, StoreError, StoreWriter

    try:
        runs = Store(store_path, create=False).runs()
    except StoreError:
        return
    mine = runs[(runs["pid"] == outcome.child_pid) & (runs["status"].isin(["running", "crashed"]))]
    if mine.empty:
        return
    tail = outcome.output_tail.strip()[-1500:]
    error = outcome.message + (f"\nLast output:\n{tail}" if tail else "")
    with StoreWriter(store_path) as writer:
        for run_id in mine["run_id"]:
            writer.end_run(int(run_id), "failed", error=error)


if __name__ == "__main__":
    sys.exit(main())
