"""Starting runs in supervised child processes (the app never trains, nor runs user code, in its own process).

A launched run is ``python -m mpdiag.sandbox.supervisor ... -- python -m mpdiag run|rerun ...``: the supervisor applies
the limits of :mod:`mpdiag.sandbox.supervisor`, keeps a bounded log, and records why the run ended if the run's own
process could not. The run creates its run row itself; the app finds it by the child's pid.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]  # the directory that holds the mpdiag package
WORK_DIR = Path(tempfile.gettempdir()) / "mpdiag-work"


def child_env() -> dict[str, str]:
    """Environment for children: mpdiag importable, the store location not advertised."""
    env = {k: v for k, v in os.environ.items() if k != "MPDIAG_STORE"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    return env


def scratch_dir(prefix: str) -> Path:
    """A fresh working directory for one child, so relative paths it writes land there."""
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=WORK_DIR))


@dataclass(frozen=True)
class Launched:
    """A supervised run started by :func:`launch`."""

    pid: int  # the supervisor's
    log_path: str
    command: tuple[str, ...]
    started_at: float

    def _status(self) -> dict:
        try:
            return json.loads(Path(self.log_path).with_suffix(".json").read_text())
        except (OSError, ValueError):
            return {}

    def child_pid(self) -> int | None:
        """pid of the run process (what the run row records), once started."""
        return self._status().get("child_pid")

    def is_alive(self) -> bool:
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def ending(self) -> str | None:
        """The supervisor's account of how the run process ended, once it has."""
        return self._status().get("message")

    def log_tail(self, max_chars: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(encoding="utf-8", errors="replace")[-max_chars:]
        except OSError:
            return ""


def _flags(options: dict) -> list[str]:
    flags = []
    for key, value in options.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        # False is sent as --no-FLAG: a rerun would otherwise inherit the parent's True
        flags += [flag] if value is True else ["--no-" + flag[2:]] if value is False else [flag, str(value)]
    return flags


def run_command(store_path: str | os.PathLike, script: str, options: dict) -> list[str]:
    """Command line for a new run of ``script`` (a path, or ``sha256:HASH`` of a stored script). Paths are
    made absolute: the child runs in a scratch directory."""
    if not script.startswith("sha256:"):
        script = os.path.abspath(script)
    return [sys.executable, "-m", "mpdiag", "run", script, *_flags(options), "--store", os.path.abspath(store_path)]


def rerun_command(store_path: str | os.PathLike, run_id: int, options: dict) -> list[str]:
    """Command line for a rerun of ``run_id`` with ``options`` overridden."""
    return [sys.executable, "-m", "mpdiag", "rerun", str(int(run_id)), *_flags(options), "--store",
            os.path.abspath(store_path)]


def launch(command: list[str], store_path: str | os.PathLike) -> Launched:
    """Start ``command`` under the supervisor in its own session; returns at once."""
    work = scratch_dir("run-")
    log_path = work / "output.log"
    supervisor = [sys.executable, "-m", "mpdiag.sandbox.supervisor", "--store", os.path.abspath(store_path), "--log",
                  str(log_path), "--cwd", str(work), "--", *command]
    proc = subprocess.Popen(supervisor, cwd=work, env=child_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return Launched(pid=proc.pid, log_path=str(log_path), command=tuple(command), started_at=time.time())
