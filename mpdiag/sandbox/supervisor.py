"""The limits on a child process: wall time, memory, output; and why it ended, in words a user can act on.

:func:`supervise` starts a command in its own process group with a wall-time limit, a memory limit (an
address-space rlimit on CPU-only machines, and a resident-memory watchdog over every process of the run
everywhere), and its output captured to a bounded log that keeps the *last* part of a huge output, mirrored to
its file twice a second. A stop asked for by the caller (the dashboard's Stop button) sends the child's group
SIGTERM, so a training child ends its run itself with its rows flushed, and SIGKILL ``STOP_GRACE_S`` later if it
is still there. The processes of a run are the child and everything it starts, also in a session of
its own (``setsid``, a daemon's double fork): the supervising process makes itself their subreaper (Linux), so
orphans come back to it rather than to init, and each carries the run's token in its environment. When the child
ends, every process of the run still there is killed, and the outcome says which were left running. It never
raises for what the child does: it returns an :class:`Outcome`.

This module is the mechanism only: it knows nothing of tasks, verdicts or the store. The protocol that every
run, check and probe child follows (scratch directory, verdict channel, forwarded store writes) is
:mod:`mpdiag.sandbox.child`; it must not parse the child's output for anything but a log.
"""

from __future__ import annotations

import ctypes
import os
import resource
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

MiB = 2**20
RUN_TOKEN_ENV = "MPDIAG_SUPERVISED_RUN"  # every process of a run inherits it: how an orphan is known as the run's


def _env_number(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass(frozen=True)
class Limits:
    """Limits on one supervised child. Defaults come from MPDIAG_RUN_WALL_S, MPDIAG_RUN_MEMORY_MB,
    MPDIAG_LOG_BYTES and MPDIAG_RUN_DISK_MB (runs) or MPDIAG_CHECK_WALL_S (checks). ``disk_mb``: what the child
    may write into its own directory (uploaded code's copy; None: no cap)."""

    wall_s: float
    memory_mb: float
    log_bytes: int
    disk_mb: float | None = None

    @classmethod
    def for_runs(cls) -> Limits:
        return cls(_env_number("MPDIAG_RUN_WALL_S", 6 * 3600), _env_number("MPDIAG_RUN_MEMORY_MB", 8192),
                   int(_env_number("MPDIAG_LOG_BYTES", MiB)), _env_number("MPDIAG_RUN_DISK_MB", 4096))

    @classmethod
    def for_checks(cls) -> Limits:
        return cls(_env_number("MPDIAG_CHECK_WALL_S", 120), _env_number("MPDIAG_RUN_MEMORY_MB", 8192),
                   int(_env_number("MPDIAG_LOG_BYTES", MiB)))


@dataclass
class Outcome:
    """How a supervised child ended. ``reason``: exited, wall_time, memory, disk, or refused (its parent stopped
    it for breaking the child protocol; ``message`` says how)."""

    exit_code: int | None
    reason: str
    message: str
    output_tail: str
    dropped_bytes: int
    child_pid: int
    seconds: float
    left_running: tuple[str, ...] = ()  # names of the processes of the run still running when the child ended
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
        self._pending = False  # output not yet in the file
        self._lock = threading.Lock()

    def add(self, chunk: bytes) -> None:
        self._pending = True
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

    def flush_if_due(self) -> None:
        """Mirror output that arrived since the last write, once it is half a second old (a child that prints,
        then hangs, has its last line in the file)."""
        if self.path is not None and time.monotonic() - self._written > 0.5 and self._pending:
            self.flush()

    def flush(self) -> None:
        self._written = time.monotonic()
        self._pending = False
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


DISK_CHECK_S = 1.0  # how often a child's directory is measured against its disk cap
#: seconds a child asked to stop (SIGTERM) has to end its run itself before it is killed
STOP_GRACE_S = 10.0


def _directory_bytes(path: str | os.PathLike) -> int:
    """Bytes in the files under ``path`` (links not followed; files that vanish while counted skipped)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process instead of init (Linux's PR_SET_CHILD_SUBREAPER)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: orphans in sessions of their own are then found only while their parent lives


class RunProcesses:
    """The processes of one supervised run: the child, its descendants, and the orphans of its tree that came
    back to this process (its subreaper) still carrying the run's token."""

    def __init__(self, child: psutil.Process, token: str):
        self.child, self.token = child, token
        self.seen: dict[int, psutil.Process] = {}  # every process of the run seen alive, by pid

    def _carries_token(self, proc: psutil.Process) -> bool:
        try:
            return proc.environ().get(RUN_TOKEN_ENV) == self.token
        except psutil.Error:
            return False

    def alive(self) -> list[psutil.Process]:
        found = {}
        try:
            found[self.child.pid] = self.child
            found.update((p.pid, p) for p in self.child.children(recursive=True))
        except psutil.Error:
            pass
        for orphan in psutil.Process().children():
            if orphan.pid not in found and (orphan.pid in self.seen or self._carries_token(orphan)):
                found[orphan.pid] = orphan
                try:
                    found.update((p.pid, p) for p in orphan.children(recursive=True))
                except psutil.Error:
                    pass
        self.seen.update(found)
        return [p for p in found.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    def rss(self) -> int:
        total = 0
        for p in self.alive():
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def end_leftovers(self) -> list[str]:
        """Kill every process of the run still there but the child (already ended) and reap those that are this
        process's children; the names of those that were left running."""
        left = [p for p in self.alive() if p.pid != self.child.pid]
        names = []
        for p in left:
            try:
                names.append(p.name())
                p.kill()
            except psutil.Error:
                pass
        mine = {c.pid for c in psutil.Process().children()}
        for pid in set(self.seen) - {self.child.pid}:  # killed here, or ended earlier as an orphan: reap it
            if pid in mine:
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
        return names


def supervise(command: list[str], limits: Limits, cwd: str | os.PathLike, log_path: Path | None = None,
              env: dict | None = None, on_start: Callable[[int], None] | None = None, pass_fds: tuple[int, ...] = (),
              refusal: Callable[[], str | None] | None = None,
              on_output: Callable[[bytes], None] | None = None,
              stop_requested: Callable[[], bool] | None = None) -> Outcome:
    """Run ``command`` under ``limits`` in ``cwd``; returns when it ends or is stopped at a limit.

    ``pass_fds`` are inherited by the child (its verdict channel); ``on_start(pid)`` runs once it started;
    ``refusal()``, polled while it runs, returns why the parent wants it stopped (or None to let it run);
    ``on_output(chunk)`` is given every chunk of the child's output (stdout and stderr, as it arrives), on the
    thread reading it; ``stop_requested()``, polled too, says the user asked for it to stop (see the module)."""
    log = BoundedLog(log_path, limits.log_bytes)
    start = time.monotonic()
    _become_subreaper()
    token = secrets.token_hex(8)
    proc = subprocess.Popen(
        command, cwd=cwd, env={**(os.environ if env is None else env), RUN_TOKEN_ENV: token}, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, pass_fds=pass_fds,
        preexec_fn=None if cuda_present() else _limit_address_space(limits.memory_mb),
    )
    if on_start is not None:
        on_start(proc.pid)
    reader = threading.Thread(target=_read_output, args=(proc, log, on_output), daemon=True)
    reader.start()
    processes = RunProcesses(psutil.Process(proc.pid), token)
    reason, refused = _watch(proc, limits, cwd, processes, log, refusal, stop_requested, start)
    _end_child(proc, stopped=reason == "stopped")
    left = processes.end_leftovers()  # nothing the run started outlives it, in its group or not
    reader.join(timeout=5)
    log.flush()
    code = proc.returncode
    message = refused or _describe(reason, code, limits)
    if left:
        message += (f"; it left {len(left)} process(es) running ({', '.join(sorted(set(left)))}), ended with it")
    return Outcome(exit_code=code, reason=reason, message=message, output_tail=log.text(),
                   dropped_bytes=log.dropped, child_pid=proc.pid, seconds=time.monotonic() - start,
                   left_running=tuple(left))


def _read_output(proc: subprocess.Popen, log: BoundedLog, on_output: Callable[[bytes], None] | None) -> None:
    """The reader thread: every chunk of the child's output into the log (and to ``on_output``) as it arrives."""
    for chunk in iter(lambda: proc.stdout.read1(65536), b""):
        log.add(chunk)
        if on_output is not None:
            on_output(chunk)


def _watch(proc: subprocess.Popen, limits: Limits, cwd: str | os.PathLike, processes: RunProcesses,
           log: BoundedLog, refusal: Callable[[], str | None] | None, stop_requested: Callable[[], bool] | None,
           start: float) -> tuple[str, str | None]:
    """Poll the running child every 0.1 s until it exits or passes a limit: (reason it ended, the parent's refusal
    or None). The disk is measured every DISK_CHECK_S only (walking the directory costs)."""
    disk_checked = start
    while proc.poll() is None:
        refused = refusal() if refusal is not None else None
        if refused is not None:
            return "refused", refused
        if stop_requested is not None and stop_requested():
            return "stopped", None
        if time.monotonic() - start > limits.wall_s:
            return "wall_time", None
        if processes.rss() > limits.memory_mb * MiB:
            return "memory", None
        if limits.disk_mb is not None and time.monotonic() - disk_checked >= DISK_CHECK_S:
            disk_checked = time.monotonic()
            if _directory_bytes(cwd) > limits.disk_mb * MiB:
                return "disk", None
        log.flush_if_due()
        time.sleep(0.1)
    return "exited", None


def _end_child(proc: subprocess.Popen, stopped: bool) -> None:
    """Kill the child's process group and reap the child; a stop the user asked for first sends SIGTERM and gives
    the child STOP_GRACE_S to end its run itself."""
    if stopped:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc, signal.SIGKILL)
    proc.wait()


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _describe(reason: str, code: int | None, limits: Limits) -> str:
    if reason == "stopped":
        return "stopped from the dashboard (its Stop button)"
    if reason == "wall_time":
        return f"stopped at the wall-time limit of {limits.wall_s:g} s (does the script loop forever or wait on input?)"
    if reason == "memory":
        return f"stopped by the memory cap ({limits.memory_mb:,g} MB): the run's processes used more than that"
    if reason == "disk":
        return (f"stopped by the disk cap ({limits.disk_mb:,g} MB): the run wrote more than that into its directory "
                "(MPDIAG_RUN_DISK_MB sets the cap)")
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return {"SIGTERM": "terminated (SIGTERM)", "SIGKILL": "killed (SIGKILL)",
                "SIGINT": "interrupted (SIGINT)"}.get(name, f"killed by signal {name}")
    if code == 0:
        return "the process exited normally"
    return f"the process exited with code {code}"
