"""How the app starts runs: a supervising process that alone holds the store, and a child that trains.

:func:`launch` (the app's Runs form, reruns, the Upload page's start button) starts
``python -m mpdiag.sandbox.launch`` in its own session and hands it the job on stdin (never in argv or the
environment, where a child could read it). That supervising process:

1. has the job planned by a short-lived process of its own (``--plan``, :func:`plan_and_queue`: a model script's
   source and :class:`~mpdiag.training.runner.RunConfig`, or a watched command: uploaded code from the store, or
   a script ``mpdiag watch`` ran from the command line; a bad option ends here with its message), which stores
   the script and creates the run rows with status ``queued`` (two with ``pair``), owned by the supervisor - so
   the supervisor itself never imports torch or pandas before its slot, and a queued click costs ~20 MB (the
   planning imports no torch either: :mod:`mpdiag.training.planning`, :mod:`mpdiag.training.watch_config`);
2. waits for one of :func:`max_concurrent_runs` run slots (lock files: a slot frees itself when its holder
   dies);
3. runs the ``run`` (or ``watch``) task of :mod:`mpdiag.sandbox.child` under :meth:`Limits.for_runs`. The
   child gets the script source (or the uploaded files), the configuration and the run ids only; its
   Recorder's writes arrive as calls, applied by :class:`RunOwner` after checking the method is allowed, the
   run is one this process created, and leaving what the plan fixed (a watched run's command) as planned;
4. marks any of its runs the child left open ``failed``, with why (a limit, a crash, ``os._exit``);
5. keeps the child's console output with its runs (bounded, refreshed every few seconds while it runs, final at
   the end), read from the child's pipe and written by this process: the child cannot write it.

This module must not let a child name the store or write a run it was not given.
"""

from __future__ import annotations

import base64
import ctypes
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from mpdiag.recording.run import MpdiagConfig, Run  # light: no torch, no pandas
from mpdiag.sandbox.bundle import BundleRefused, bundle_from_zip, module_name
from mpdiag.sandbox.child import (
    SOURCE_FILE,
    WORK_DIR,
    StoreCallForwarder,
    TaskResult,
    child_env,
    run_task,
    scratch_dir,
)
from mpdiag.sandbox.shutdown import exit_without_collecting
from mpdiag.sandbox.supervisor import Limits, cuda_present

STATUS_FILE = "status.json"
#: written into a job's record directory by the page that started it (a click on Stop): its process stops the job
STOP_FILE = "stop"
LOG_FILE = "output.log"
STORED_PREFIX = "sha256:"
#: store writer methods a run child may call, each with the run id as its first argument
ALLOWED_CALLS = frozenset({"create_run", "update_run", "add_tensors", "write_batch", "add_modules",
                           "add_module_steps", "add_update_steps", "add_shadow_steps", "end_run", "add_events",
                           "set_optimizer_step_nonfinite", "add_replay"})


def max_concurrent_runs() -> int:
    """Runs the app trains at once: ``MPDIAG_MAX_RUNS``, else the CPU count."""
    try:
        return max(1, int(os.environ["MPDIAG_MAX_RUNS"]))
    except (KeyError, ValueError):
        return os.cpu_count() or 1


def limits_text() -> str:
    """The limits on runs started from the app, in one sentence for the pages."""
    limits = Limits.for_runs()
    return (f"Each run started here may use up to {limits.memory_mb:,g} MB of memory and {limits.wall_s / 3600:g} h "
            f"of wall time, and write up to {limits.disk_mb:,g} MB into its directory (the last "
            f"{limits.log_bytes / 2**20:g} MiB of its output is kept); everything it starts ends with it; at most "
            f"{max_concurrent_runs()} run(s) train at once, later ones wait as queued.")


def run_job(script: str, options: dict) -> dict:
    """A new run of ``script`` (a path, made absolute, or ``sha256:HASH`` of a stored script) with run options
    by RunConfig field name (mpdiag.options), plus ``pair``."""
    if not script.startswith(STORED_PREFIX):
        script = os.path.abspath(script)
    return {"kind": "run", "script": script, "options": dict(options)}


def rerun_job(run_id: int, options: dict) -> dict:
    """A rerun of ``run_id`` with ``options`` overridden (for a watched run: WATCH_RERUN_OPTIONS only)."""
    return {"kind": "rerun", "run_id": int(run_id), "options": dict(options)}


def watch_job(bundle_sha256: str, entry: str, args: list[str], module: bool, options: dict) -> dict:
    """A watched run of uploaded code: ``entry`` (a file of the stored bundle) run as ``python [-m] ENTRY ARGS``
    from the bundle's root, with watch options (opt_level, init_scale, every, trace_modules, name)."""
    return {"kind": "watch", "bundle": bundle_sha256, "entry": entry, "args": [str(a) for a in args],
            "module": bool(module), "options": dict(options)}


@dataclass(frozen=True)
class Launched:
    """A supervised run started by :func:`launch`."""

    pid: int  # the supervising process's; its run rows record it
    log_path: str
    job: dict
    started_at: float

    def _status(self) -> dict:
        try:
            return json.loads((Path(self.log_path).parent / STATUS_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def run_ids(self) -> list[int]:
        """The run rows created for this job (empty until they exist, and when the job was refused)."""
        return self._status().get("run_ids", [])

    def is_alive(self) -> bool:
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def request_stop(self) -> None:
        """Ask the job's process to stop it: a run's child gets SIGTERM (its run ends itself, the signal named, rows
        flushed) and SIGKILL if still there STOP_GRACE_S later; a verification stops its rerun and goes no further."""
        (Path(self.log_path).parent / STOP_FILE).touch()

    def stop_requested(self) -> bool:
        return (Path(self.log_path).parent / STOP_FILE).exists()

    def ending(self) -> str | None:
        """The supervisor's account of how the job ended, once it has."""
        return self._status().get("message")

    def log_tail(self, max_chars: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(encoding="utf-8", errors="replace")[-max_chars:]
        except OSError:
            return ""


def launch(job: dict, store_path: str | os.PathLike, max_runs: int | None = None) -> Launched:
    """Start a supervising process for ``job`` (from :func:`run_job` / :func:`rerun_job`); returns at once.
    ``max_runs`` overrides :func:`max_concurrent_runs`."""
    record = scratch_dir("launch")  # the log and status outlive the run, for the page that started it
    full = {**job, "store": os.path.abspath(store_path), "max_runs": max_runs or max_concurrent_runs()}
    with open(record / "supervisor.log", "wb") as errors:
        proc = subprocess.Popen([sys.executable, "-m", "mpdiag.sandbox.launch"], cwd=record, env=child_env(),
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errors,
                                start_new_session=True)
    proc.stdin.write(json.dumps(full).encode())
    proc.stdin.close()
    return Launched(pid=proc.pid, log_path=str(record / LOG_FILE), job=dict(job), started_at=time.time())


# -- the supervising process -------------------------------------------------------------------------------------
def forbid_inspection() -> None:
    """Make this process non-dumpable: its /proc entries (open files, environment, memory) become unreadable
    to processes of the same ordinary user, so the child cannot find the store through its supervisor. Root
    is not stopped by this (nor by anything a process can do to itself)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):
        pass  # not Linux: nothing to hide this way


@contextmanager
def run_slot(max_runs: int, poll_s: float = 0.5):
    """Hold one of ``max_runs`` slots (flock'ed files under WORK_DIR) while the block runs; waits for one."""
    slots = WORK_DIR / "run-slots"
    slots.mkdir(parents=True, exist_ok=True)
    while True:
        for i in range(max_runs):
            handle = open(slots / f"{i}.lock", "a")  # noqa: SIM115 - held for the block, closed below
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            try:
                yield
            finally:
                handle.close()
            return
        time.sleep(poll_s)


@dataclass
class Plan:
    """What the supervising process does for a job: create its queued run rows (``queue(writer)`` returns
    their ids), then run ``task`` in a child given ``payload`` (plus the run ids) and ``files``. ``fixed``: the
    run fields the child's ``create_run`` may not set otherwise."""

    task: str
    payload: dict
    files: dict[str, bytes]
    queue: Callable[[object], list[int]]
    parent_run_id: int | None
    fixed: dict


def plan(job: dict, store_path: str) -> Plan:
    """The Plan of a job; raises ConfigError, ScriptError or StoreError saying what is wrong."""
    from mpdiag.options import UNSET, RunConfig, watch_settings
    from mpdiag.store import Store
    from mpdiag.training.planning import fp32_twin_of, rerun_plan
    from mpdiag.training.script_source import ModelScript

    # None: not given (keep the default or the parent's value); UNSET: cleared; False stays False, so a rerun can
    # turn off a switch its parent had on.
    options = {k: None if v == UNSET else v for k, v in job["options"].items() if v is not None}
    if job["kind"] == "watch":
        return _watch_plan(_uploaded_watch(job, options), Store(store_path))
    pair = bool(options.pop("pair", False))
    if job["kind"] == "rerun":
        store = Store(store_path, create=False)
        parent = store.run(job["run_id"])
        if watch_settings(parent["config"]) is not None:
            return _watch_plan(_watch_rerun(job["run_id"], parent, options, pair), store)
        script, config = rerun_plan(store, job["run_id"], **options)
    elif job["script"].startswith(STORED_PREFIX):  # a script kept in the store (uploaded in the app)
        filename, source = Store(store_path).script_source(job["script"].removeprefix(STORED_PREFIX))
        script = ModelScript(filename=filename, source=source)
        config = RunConfig().with_options(**options)
    else:
        script = ModelScript.from_path(job["script"])
        config = RunConfig().with_options(**options)
    config.validate()
    configs = [config, fp32_twin_of(script, config)] if pair else [config]  # as train_pair will run them
    return Plan(task="run", payload={"filename": script.filename, "config": config.to_dict(), "pair": pair},
                files={SOURCE_FILE: script.source.encode()}, queue=lambda w: _queue_rows(w, script, configs),
                parent_run_id=config.parent_run_id, fixed={})


def _uploaded_watch(job: dict, options: dict):
    """The WatchConfig of uploaded code (a stored bundle's entry point)."""
    from mpdiag.options import WATCH_RERUN_OPTIONS, ConfigError
    from mpdiag.training.watch_config import WatchConfig

    unknown = sorted(set(options) - set(WATCH_RERUN_OPTIONS))
    if unknown:
        raise ConfigError(f"a watched run takes {', '.join(WATCH_RERUN_OPTIONS)}, not {', '.join(unknown)}")
    return WatchConfig(target=module_name(job["entry"]) if job["module"] else job["entry"], args=tuple(job["args"]),
                       module=bool(job["module"]), bundle=job["bundle"], **options)


def _watch_rerun(run_id: int, parent, options: dict, pair: bool):
    from mpdiag.options import ConfigError, watch_settings
    from mpdiag.training.watch_config import rerun_config

    if pair:
        raise ConfigError(f"run {run_id} was recorded by mpdiag watch, which runs no FP32 twin.")
    return rerun_config(run_id, parent["name"], watch_settings(parent["config"]), **options)


def _watch_plan(config, store) -> Plan:
    """Run a WatchConfig in a child: uploaded code unpacked in its directory, or a command-line script in the
    directory it was watched from."""
    from mpdiag.options import ConfigError

    config.validate()
    files = {}
    if config.bundle is not None:
        name, data = store.bundle(config.bundle)
        bundle = bundle_from_zip(name, data)
        files = dict(bundle.files)
        target = config.target.replace(".", "/") + ".py" if config.module else config.target
        if target not in files and not (config.module and target.removesuffix(".py") + "/__main__.py" in files):
            raise ConfigError(f"{config.target} is not a file of the uploaded code {name}.")
    name = config.name or os.path.basename(config.target)
    settings = config.settings()
    fields = {"name": name, "parent_run_id": config.parent_run_id,
              "script_path": None if config.module or config.bundle else os.path.join(config.cwd, config.target)}

    def queue(writer) -> list[int]:
        return [Run.create(writer, queued=True, config=MpdiagConfig({"watch": settings}), scaling="none",
                           **fields).run_id]

    return Plan(task="watch", payload={"watch": settings, "name": name, "parent_run_id": config.parent_run_id},
                files=files, queue=queue, parent_run_id=config.parent_run_id,
                fixed={**fields, "config": {"watch": settings}})


class RunOwner:
    """Applies a run child's store calls to this process's writer, refusing what the child may not do."""

    def __init__(self, writer, run_ids: list[int], parent_run_id: int | None, fixed: dict | None = None):
        self._writer = writer
        self.run_ids = list(run_ids)
        self._unclaimed = list(run_ids)
        self._parent = parent_run_id
        self._fixed = dict(fixed or {})

    def apply(self, method: str, args: list, kwargs: dict) -> None:
        if method not in ALLOWED_CALLS:
            raise PermissionError(f"the child called {method!r}, which runs may not call")
        run_id = args[0] if args else kwargs.get("run_id")
        if not isinstance(run_id, int) or run_id not in self.run_ids:
            raise PermissionError(f"the child tried to write run {run_id!r}; it may write only runs {self.run_ids}")
        if method == "create_run":
            if run_id not in self._unclaimed:
                raise PermissionError(f"the child created run {run_id} twice")
            self._unclaimed.remove(run_id)
            method, kwargs = "update_run", {**kwargs, **self._fixed, "status": "running"}
        ended = ("finished", "failed", "crashed", "stopped")
        if method == "end_run" and (args[1:2] or [kwargs.get("status")])[0] not in ended:
            raise PermissionError("a child may end its run only as finished, failed, crashed (stopped by a signal) "
                                  "or stopped (at an event, --stop-on)")
        if method == "write_batch":
            args = [run_id, *_row_records(*args[1:])]
        if method == "update_run":
            self._check_links(kwargs)
            if "heartbeat_at" in kwargs or kwargs.get("status") == "running":
                kwargs["heartbeat_at"] = time.time()  # this process's clock, not the child's
        self._writer.call(lambda w: getattr(w, method)(*args, **kwargs))

    def _check_links(self, fields: dict) -> None:
        pair = fields.get("pair_run_id")
        if pair is not None and pair not in self.run_ids:
            raise PermissionError(f"the child tried to pair its run with run {pair!r}")
        if "parent_run_id" in fields and fields["parent_run_id"] != self._parent:
            raise PermissionError(f"the child tried to set parent run {fields['parent_run_id']!r}")

    def close_unfinished(self, store_path: str, error: str) -> None:
        """Mark the runs the child left queued or running (or never started) failed with ``error``."""
        from mpdiag.store import Store

        runs = Store(store_path).runs()
        mine = runs[runs["run_id"].isin(self.run_ids) & runs["status"].isin(["queued", "running", "stalled"])]
        for run_id in mine["run_id"]:
            Run.adopt(self._writer, int(run_id)).fail(error, wait=True)


    def note_leftovers(self, store_path: str, names: tuple[str, ...]) -> None:
        """Say in each run's note that processes it started were still running when it ended (they were killed)."""
        from mpdiag.store import Store

        said = (f"The training code left {len(names)} process(es) running when it ended "
                f"({', '.join(sorted(set(names)))}); they were ended with the run.")
        notes = Store(store_path).runs().set_index("run_id")["note"]
        for run_id in self.run_ids:
            note = notes.get(run_id)
            text = said if not isinstance(note, str) or not note else f"{note} {said}"
            Run.adopt(self._writer, run_id).describe(note=text, wait=True)


def _ending(store_path: str, run_ids: list[int], result: TaskResult) -> str:
    """How the job ended, for the page that started it: how its child process ended, unless that exited normally
    while a run failed (a script's own error, caught by watch; an allocation the memory cap refused): then that."""
    from mpdiag.store import Store

    if not result.outcome.ok:
        return result.outcome.message
    runs = Store(store_path).runs()
    failed = runs[runs["run_id"].isin(run_ids) & (runs["status"] == "failed")]
    if failed.empty:
        return result.outcome.message
    error = str(failed.iloc[0]["error"] or "").strip()
    last = error.splitlines()[-1] if error else "no error was recorded"
    if "MemoryError" in last and not cuda_present():
        return f"stopped by the memory cap ({Limits.for_runs().memory_mb:,g} MB): an allocation was refused ({last})"
    return f"the run failed: {last}"


def _error_of(result: TaskResult) -> str:
    """Why a child's runs did not end themselves: the child's own verdict, or how the process ended and its last
    output."""
    verdict_error = (result.verdict or {}).get("error")
    if not result.refused and isinstance(verdict_error, str):
        return verdict_error
    tail = result.outcome.output_tail.strip()[-1500:]
    return result.outcome.message + (f"\nLast output:\n{tail}" if tail else "")


def _row_records(step_rows: list, tensor_rows: list, kept: list = (), signals: list = ()) -> tuple[list, ...]:
    """write_batch's rows as the writer takes them: the channel carries named records, the kept steps'
    (step, reason) pairs and the signals' (step, tensor ids, counts) as plain lists (the writer checks their
    shapes)."""
    from mpdiag.store import Representability, StepRow, TensorRow

    return ([StepRow(*row) for row in step_rows],
            [TensorRow(*row[:-1], {fmt: Representability(*counts) for fmt, counts in row[-1].items()})
             for row in tensor_rows],
            [(int(step), str(reason)) for step, reason in kept],
            [(int(step), tensor_ids, counts) for step, tensor_ids, counts in signals])


def _queue_rows(writer, script, configs: list) -> list[int]:
    """Store the script and create the job's run rows (a run, then its FP32 twin) with status queued, each with
    its configuration; the child fills them in."""
    sha = writer.call(lambda w: w.add_script(os.path.basename(script.filename), script.source))
    return [Run.create(writer, queued=True, config=MpdiagConfig({"run": config.to_dict()}), script_sha256=sha,
                       default_name=os.path.basename(script.filename), script_path=script.filename).run_id
            for config in configs]


def store_key(store_path: str | os.PathLike) -> str:
    """What a job's status file says of its store: a digest of its path, which names the store to a page that
    knows it without telling a child (which can read the status files) where it is."""
    return hashlib.sha256(str(Path(store_path).absolute()).encode()).hexdigest()[:16]


def last_output_line(store_path: str | os.PathLike, run_id: int) -> str | None:
    """The last line a run started from the app printed (its mirrored log), or None when this machine holds no
    log of it (a run recorded from the command line, or one whose log was cleaned up)."""
    key = store_key(store_path)
    for status in sorted(WORK_DIR.glob("launch-*/" + STATUS_FILE), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            said = json.loads(status.read_text())
            if said.get("store_key") != key or int(run_id) not in said.get("run_ids", []):
                continue
            lines = [line for line in (status.parent / LOG_FILE).read_text(errors="replace").splitlines() if line.strip()]
        except (OSError, ValueError, TypeError):
            continue
        return lines[-1][-500:] if lines else None
    return None


def plan_and_queue(job: dict) -> dict:
    """In the planning process: the job's plan, with its queued run rows created and handed to the supervisor
    (``job["owner_pid"]``), as JSON-able data; or ``{"error": why}`` when the job cannot run."""
    from mpdiag.options import ConfigError, ScriptError
    from mpdiag.recording.background import BackgroundWriter
    from mpdiag.store import StoreError

    try:
        planned = plan(job, job["store"])
    except (ConfigError, ScriptError, StoreError, BundleRefused, OSError) as exc:
        return {"error": str(exc)}
    writer = BackgroundWriter(job["store"], heartbeat=False)
    try:
        run_ids = planned.queue(writer)
        writer.call(lambda w: [w.hand_run_to(run_id, int(job["owner_pid"])) for run_id in run_ids])
    finally:
        writer.close()
    return {"task": planned.task, "payload": planned.payload, "run_ids": run_ids, "parent_run_id": planned.parent_run_id,
            "fixed": planned.fixed, "files": {path: base64.b64encode(data).decode() for path, data in planned.files.items()}}


def _planned_elsewhere(job: dict) -> dict:
    """:func:`plan_and_queue` in a process of its own, which exits once the rows exist (pandas goes with it)."""
    done = subprocess.run([sys.executable, "-m", "mpdiag.sandbox.launch", "--plan"], env=child_env(),
                          input=json.dumps({**job, "owner_pid": os.getpid()}).encode(), capture_output=True)
    try:
        return json.loads(done.stdout.splitlines()[-1])  # the last line: anything printed before is not the plan
    except (ValueError, IndexError):
        tail = done.stderr.decode("utf-8", "replace").strip()[-1500:]
        return {"error": f"the job could not be planned (exit code {done.returncode}): {tail}"}


def supervise_job(job: dict) -> None:
    """The supervising process's work for one job (see the module docstring); never raises for the child."""
    record = Path.cwd()
    status = record / STATUS_FILE
    store_path = job["store"]
    planned = _planned_elsewhere(job)
    if "error" in planned:
        status.write_text(json.dumps({"message": planned["error"]}))
        return
    run_ids = planned["run_ids"]
    key = store_key(store_path)
    status.write_text(json.dumps({"run_ids": run_ids, "store_key": key}))
    with run_slot(int(job["max_runs"])):
        from mpdiag.recording.background import BackgroundWriter  # only now: waiting costs no heavy imports
        from mpdiag.recording.console import OutputKeeper
        from mpdiag.store.console import ConsoleCapture

        # heartbeat=False: the child's heartbeat is the one that tells whether the run is alive
        writer = BackgroundWriter(store_path, heartbeat=False)
        output = None
        try:
            owner = RunOwner(writer, run_ids, planned["parent_run_id"], planned["fixed"])
            files = {path: base64.b64decode(data) for path, data in planned["files"].items()}
            console = ConsoleCapture()
            output = OutputKeeper(writer, run_ids, console)  # this process writes it, from the child's pipe
            try:
                result = run_task(planned["task"], {**planned["payload"], "run_ids": run_ids}, Limits.for_runs(),
                                  files=files, log_path=record / LOG_FILE, on_call=owner.apply, on_output=console.add,
                                  stop_requested=(record / STOP_FILE).exists)
            except BaseException as exc:  # noqa: BLE001 - whatever stopped this process, its runs say so
                message = f"the run could not be supervised: {type(exc).__name__}: {exc}"
                owner.close_unfinished(store_path, message)
                status.write_text(json.dumps({"run_ids": run_ids, "store_key": key, "message": message}))
                raise
            output.finish()  # before the status file says the job ended: its page then finds the final output
            owner.close_unfinished(store_path, _error_of(result))
            if result.outcome.left_running:
                owner.note_leftovers(store_path, result.outcome.left_running)
            status.write_text(json.dumps({"run_ids": run_ids, "store_key": key,
                                          "message": _ending(store_path, run_ids, result)}))
        finally:
            try:
                if output is not None:
                    output.finish()
            finally:
                writer.close()


def run_in_child(payload: dict, channel) -> dict:
    """In the child: train the script into the runs the supervisor created, writing through ``channel``."""
    from mpdiag.training.policies import ConfigError
    from mpdiag.training.runner import RunConfig, RunStopped, train, train_pair
    from mpdiag.training.script import ModelScript

    run_ids = deque(payload["run_ids"])
    script = ModelScript(filename=payload["filename"], source=Path(SOURCE_FILE).read_text(encoding="utf-8"))
    config = RunConfig.from_dict(payload["config"])

    def sink() -> StoreCallForwarder:
        return StoreCallForwarder(channel, run_ids)

    try:
        ids = train_pair(script, config, sink) if payload["pair"] else (train(script, config, sink),)
    except (ConfigError, RunStopped) as exc:  # a stopped pair: its twin's queued row ends failed saying so
        return {"error": str(exc)}
    return {"run_ids": list(ids)}


def watch_in_child(payload: dict, channel) -> dict:
    """In the child: run the watched command into the run the supervisor created, writing through ``channel``;
    from a copy of uploaded code (this directory), or from the directory a command-line watch ran in."""
    from mpdiag.options import ConfigError
    from mpdiag.training.watch import WatchConfig, watch

    settings = payload["watch"]
    if not settings.get("bundle"):
        os.chdir(settings["cwd"])  # the script's relative paths are relative to where it was first run
    config = WatchConfig.from_settings(settings, name=payload["name"], parent_run_id=payload["parent_run_id"])
    run_ids = deque(payload["run_ids"])
    try:
        run_id, code = watch(config, lambda: StoreCallForwarder(channel, run_ids))
    except ConfigError as exc:
        return {"error": str(exc)}
    return {"run_ids": [run_id], "exit_code": code}


def main() -> int:
    forbid_inspection()
    job = json.loads(sys.stdin.read())
    if sys.argv[1:] == ["--plan"]:
        print(json.dumps(plan_and_queue(job)))
    else:
        supervise_job(job)
    return 0


if __name__ == "__main__":
    exit_without_collecting(main())
