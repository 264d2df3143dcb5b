"""The one protocol between mpdiag and a child process that runs model-script code: runs, checks, probes.

Parent side, :func:`run_task`: a fresh scratch directory (the child's working directory, removed when it
ends), a pipe whose write end the child inherits (``pass_fds``), and ``python -m mpdiag.sandbox.child TASK``
started under :func:`mpdiag.sandbox.supervisor.supervise` limits. While the child runs, the parent reads
length-prefixed JSON messages from the pipe:

* ``call``: a store write (method name, arguments), handed to the caller's ``on_call``, which alone holds the
  store and decides what a child may write (:mod:`mpdiag.sandbox.launch` for runs);
* ``verdict``: the task's result, sent exactly once by mpdiag's own code after the user's code returned.

Heartbeats are ``update_run(heartbeat_at=...)`` calls sent by the child's
:class:`mpdiag.recording.background.BackgroundWriter`; the parent stamps them with its own clock.

The script's stdout and stderr are a bounded log and nothing more: nothing the script prints is parsed, so it
cannot forge a verdict. Child side, :func:`main` moves the channel to a random high close-on-exec fd number and
closes the one it arrived on, and clears ``sys.argv``, before importing the user's code; after the verdict it
closes the channel, so exit-time code cannot add to it. User code runs in the same process and could still
find the fd (``/proc/self/fd``), so the parent trusts no message for more than it allows: a second verdict or a
malformed message voids the result and stops the child.

This module must not open the store and must not parse the child's output.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import hashlib
import importlib
import json
import os
import random
import re
import shutil
import struct
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from mpdiag.sandbox.shutdown import exit_without_collecting
from mpdiag.sandbox.supervisor import Limits, Outcome, supervise
from mpdiag.store.writer import TensorBatch

ROOT = Path(__file__).resolve().parents[2]  # the directory that holds the mpdiag package
WORK_DIR = Path(tempfile.gettempdir()) / "mpdiag-work"
SOURCE_FILE = "script_source.py"  # where a task finds the script's source, in its scratch directory
STALE_AFTER_S = 24 * 3600
MAX_MESSAGE_BYTES = 256 * 2**20
_HEADER = struct.Struct(">I")

#: task name -> "module:function" run in the child as function(payload, channel) -> verdict (a JSON dict)
TASKS = {
    "check": "mpdiag.sandbox.check:check_in_child",
    "check-bundle": "mpdiag.sandbox.bundle:check_bundle_in_child",
    "probe": "mpdiag.sandbox.probe:probe_in_child",
    "run": "mpdiag.sandbox.launch:run_in_child",
    "watch": "mpdiag.sandbox.launch:watch_in_child",
}


# -- scratch directories ---------------------------------------------------------------------------------------
def scratch_dir(prefix: str) -> Path:
    """A fresh directory under WORK_DIR named after this process (``PREFIX-PID-…``), so a later clean-up can
    tell whether its owner is gone. Stale directories are cleaned first."""
    clean_stale_scratch()
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-", dir=WORK_DIR))


_SCRATCH_NAME = re.compile(r"[a-z]+-(\d+)-\w+")  # what scratch_dir makes: PREFIX-PID-random


def _owner_alive(path: Path, pid: int) -> bool:
    """Whether process ``pid`` still exists and is older than the directory (not a reused pid)."""
    try:
        return psutil.Process(pid).create_time() <= path.stat().st_mtime + 1.0
    except (OSError, psutil.Error):
        return False


def clean_stale_scratch(now: float | None = None) -> list[Path]:
    """Remove scratch directories older than a day whose owner process is gone; returns what was removed.
    Anything else under WORK_DIR (the run slots) is left alone."""
    now = time.time() if now is None else now
    removed = []
    for path in WORK_DIR.iterdir() if WORK_DIR.is_dir() else ():
        named = _SCRATCH_NAME.fullmatch(path.name)
        try:
            old = now - path.stat().st_mtime > STALE_AFTER_S
        except OSError:
            continue
        if named and path.is_dir() and old and not _owner_alive(path, int(named.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def child_env() -> dict[str, str]:
    """Environment for children: mpdiag importable, the store location not advertised."""
    env = {k: v for k, v in os.environ.items() if k != "MPDIAG_STORE"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    return env


# -- messages --------------------------------------------------------------------------------------------------
_BYTES_TAG = "__mpdiag_bytes__"


def _encode_value(value):
    if isinstance(value, TensorBatch):  # the Recorder's columns cross as the named rows the parent rebuilds
        return value.rows()
    if isinstance(value, bytes | bytearray | memoryview):
        return {_BYTES_TAG: base64.b64encode(bytes(value)).decode("ascii")}
    if hasattr(value, "tolist") and getattr(value, "ndim", 0):  # numpy arrays (a step's signals)
        return value.tolist()
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    raise TypeError(f"{type(value).__name__} cannot cross the child channel")


def _decode_object(obj: dict):
    if len(obj) == 1 and _BYTES_TAG in obj:
        return base64.b64decode(obj[_BYTES_TAG])
    return obj


def encode_message(message: dict) -> bytes:
    body = json.dumps(message, default=_encode_value).encode("utf-8")
    return _HEADER.pack(len(body)) + body


class ProtocolError(Exception):
    """A message on the channel that mpdiag's child code would never send."""


def read_messages(fd: int):
    """Yield the messages on a channel until its writers are gone; raises ProtocolError on a bad frame."""
    with os.fdopen(fd, "rb", buffering=0) as stream:
        while True:
            header = _read_exactly(stream, _HEADER.size)
            if header is None:
                return
            (size,) = _HEADER.unpack(header)
            if size > MAX_MESSAGE_BYTES:
                raise ProtocolError(f"a message of {size} bytes (the limit is {MAX_MESSAGE_BYTES})")
            body = _read_exactly(stream, size)
            if body is None:
                raise ProtocolError("the channel closed inside a message")
            try:
                message = json.loads(body, object_hook=_decode_object)
            except ValueError as exc:
                raise ProtocolError(f"a message that is not JSON ({exc})") from None
            if not isinstance(message, dict) or message.get("kind") not in ("call", "verdict"):
                raise ProtocolError("a message of unknown kind")
            yield message


def _read_exactly(stream, size: int) -> bytes | None:
    parts, missing = [], size
    while missing:
        chunk = stream.read(missing)
        if not chunk:
            if missing == size:
                return None
            raise ProtocolError("the channel closed inside a message")
        parts.append(chunk)
        missing -= len(chunk)
    return b"".join(parts)


# -- parent side -----------------------------------------------------------------------------------------------
OnCall = Callable[[str, list, dict], None]


@dataclass
class TaskResult:
    """How a child task ended: the supervisor's outcome and the verdict its mpdiag code sent (None when it
    sent none, or when ``refused`` says why its messages were not trusted)."""

    outcome: Outcome
    verdict: dict | None
    refused: str | None

    def failure(self, what: str, lines: int = 15) -> str:
        """'{what} did not complete: why.' with the last lines of its output, for a task without a verdict."""
        tail = "\n".join(self.outcome.output_tail.strip().splitlines()[-lines:])
        return f"{what} did not complete: {self.outcome.message}." + (f"\nLast output:\n{tail}" if tail else "")


class _ChannelReader:
    """Reads one child's channel on a thread: applies calls through ``on_call``, keeps the one verdict."""

    def __init__(self, fd: int, on_call: OnCall | None):
        self.verdict: dict | None = None
        self.refused: str | None = None
        self._on_call = on_call
        self._thread = threading.Thread(target=self._read, args=(fd,), name="mpdiag-channel", daemon=True)
        self._thread.start()

    def _read(self, fd: int) -> None:
        try:
            for message in read_messages(fd):
                if message["kind"] == "verdict":
                    if self.verdict is not None:
                        raise ProtocolError("a second verdict")
                    verdict = message.get("verdict")
                    if not isinstance(verdict, dict):
                        raise ProtocolError("a verdict that is not an object")
                    self.verdict = verdict
                elif self._on_call is None:
                    raise ProtocolError("a store call from a task that may not write")
                else:
                    method, args, kwargs = message.get("method"), message.get("args", []), message.get("kwargs", {})
                    if not (isinstance(method, str) and isinstance(args, list) and isinstance(kwargs, dict)):
                        raise ProtocolError("a malformed store call")
                    self._on_call(method, args, kwargs)
        except ProtocolError as exc:
            self.refused, self.verdict = f"stopped: the child sent {exc}", None
        except Exception as exc:  # noqa: BLE001 - a call on_call refused or could not apply: the child is stopped
            self.refused, self.verdict = f"stopped: {exc}", None

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def run_task(task: str, payload: dict, limits: Limits, files: dict[str, bytes] | None = None,
             log_path: Path | None = None, on_call: OnCall | None = None,
             on_start: Callable[[int], None] | None = None,
             on_output: Callable[[bytes], None] | None = None,
             stop_requested: Callable[[], bool] | None = None) -> TaskResult:
    """Run ``task`` (a key of TASKS) in a supervised child whose working directory is a fresh scratch
    directory holding ``files`` (by relative path); removes the directory when the child ends. Never raises for what the child
    does. ``payload`` travels in argv (it must not hold the store's path); ``on_output`` gets the child's output as it
    arrives and ``stop_requested()`` says the user asked it to stop (see :func:`~mpdiag.sandbox.supervisor.supervise`)."""
    if task not in TASKS:
        raise ValueError(f"unknown child task {task!r}")
    work = scratch_dir(task)
    try:
        for name, data in (files or {}).items():  # relative paths (a bundle's are checked in bundle.py)
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            (work / name).write_bytes(data)
        read_fd, write_fd = os.pipe()
        reader = _ChannelReader(read_fd, on_call)
        command = [sys.executable, "-m", "mpdiag.sandbox.child", task, "--channel", str(write_fd),
                   "--payload", json.dumps(payload)]

        def started(pid: int) -> None:
            os.close(write_fd)  # the child's copy is the only writer left: its exit ends the reader
            if on_start is not None:
                on_start(pid)

        try:
            outcome = supervise(command, limits, work, log_path=log_path, env=child_env(), on_start=started,
                                pass_fds=(write_fd,), refusal=lambda: reader.refused, on_output=on_output,
                                stop_requested=stop_requested)
        except BaseException:
            _close_quietly(write_fd)
            raise
        reader.join(timeout=10)
        return TaskResult(outcome=outcome, verdict=reader.verdict, refused=reader.refused)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


# -- child side ------------------------------------------------------------------------------------------------
class Channel:
    """The child's end: framed messages to the parent, one writer at a time (several BackgroundWriters may
    share it, as a run and its FP32 twin do)."""

    def __init__(self, fd: int):
        self._fd = fd
        self._lock = threading.Lock()

    def send(self, message: dict) -> None:
        data = encode_message(message)
        with self._lock:
            if self._fd < 0:
                raise RuntimeError("the channel to the supervisor is closed")
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _hide(fd: int) -> int:
    """Move ``fd`` to a random high number, close-on-exec (processes the script starts do not inherit it),
    and close the number named on the command line."""
    hidden = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, random.randrange(200, 900))
    os.close(fd)
    return hidden


class StoreCallForwarder:
    """The child's store sink: each write method call goes to the parent as a message, by name, so it works
    with whatever methods the store's writer has; the parent decides whether to apply it.

    Two calls need an answer in the child and get it without a round trip: ``create_run`` takes the next of
    the run ids the parent created for this child (in order: a run, then its FP32 twin), and ``add_script``
    returns the source's SHA-256 (the parent stored the script it handed out)."""

    def __init__(self, channel: Channel, run_ids: deque[int]):
        self._channel, self._run_ids = channel, run_ids

    def create_run(self, **fields) -> int:
        if not self._run_ids:
            raise RuntimeError("this child may create no more runs")
        run_id = self._run_ids.popleft()
        self._channel.send({"kind": "call", "method": "create_run", "args": [run_id], "kwargs": fields})
        return run_id

    def add_script(self, filename: str, source: str) -> str:
        return hashlib.sha256(source.encode()).hexdigest()  # the key StoreWriter.add_script stores it under

    def close(self) -> None:
        """Nothing to release: the channel outlives each writer."""

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)

        def forward(*args, **kwargs) -> None:
            self._channel.send({"kind": "call", "method": method, "args": list(args), "kwargs": kwargs})

        return forward


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpdiag.sandbox.child")
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--channel", type=int, required=True)
    parser.add_argument("--payload", required=True)
    args = parser.parse_args(argv)
    channel = Channel(_hide(args.channel))
    payload = json.loads(args.payload)
    sys.argv = [payload.get("filename", "script.py")]
    module, _, function = TASKS[args.task].partition(":")
    task = getattr(importlib.import_module(module), function)
    verdict = task(payload, channel)
    sys.stdout.flush()
    channel.send({"kind": "verdict", "verdict": verdict})
    channel.close()
    return 0


if __name__ == "__main__":
    exit_without_collecting(main())
