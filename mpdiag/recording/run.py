"""The run handle: the one piece of code that writes a run's row in the store.

Owns a run's lifecycle - created (or queued for a process that will run it), running, ended - and the writes of
its row: the fields that describe it, its configuration, its end, and which configuration states columns (mpdiag's
own, marked :class:`MpdiagConfig` by the runner, ``watch``, the distributed launcher and the app's launcher; a user's
``Recorder(config=...)`` states none). The runner, ``watch``, the distributed launcher,
the app's launcher and the Recorder describe the run to a :class:`Run`; none of them calls the writer's
``create_run``/``update_run``/``end_run`` itself. Must not decide what a run records (the Recorder does) nor
validate options (:mod:`mpdiag.options` does); it writes through the writer it is given (a
:class:`mpdiag.recording.background.BackgroundWriter`, or the ``DiscardingWriter`` of a rank that writes nothing),
so a supervised child's writes reach its supervisor by the same forwarding as every other call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mpdiag.options import watch_settings

#: the top-level keys of a run's configuration that mpdiag reads as its own: a user's ``Recorder(config=...)``
#: key of one of these names is kept under "user" (mpdiag.recording.recorder), never taken for mpdiag's
RESERVED_CONFIG_KEYS = ("run", "watch", "fp8", "optimizer", "optimizer_step_nonfinite", "user")
#: the statuses a run is ended with
END_STATUSES = ("finished", "failed", "crashed", "stopped")  # stopped: at an event (--stop-on) or by a signal

#: run options (``config["run"]``) stored as the run column of the same name too, so the runs table can be
#: filtered and listed without parsing every run's JSON
_RUN_OPTION_COLUMNS = ("opt_level", "seed", "steps", "every", "parent_run_id")
#: the dynamic loss scaler's options: columns of a run that scales its loss dynamically (the others leave them NULL)
_DYNAMIC_SCALING_COLUMNS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "min_scale",
                            "max_scale")


@dataclass(frozen=True)
class MpdiagConfig:
    """A run's configuration as mpdiag's own commands write it, whose options state run columns
    (:func:`columns_from`): ``{"run": ...}`` (a ``mpdiag.options.RunConfig``'s options: ``mpdiag run`` and its
    twin, the app's launcher, the distributed launcher) or ``{"watch": ...}`` (``mpdiag watch``'s settings), with
    what the run found beside them. Only a configuration given as this is read as mpdiag's: a plain mapping (the
    configuration of a user's ``Recorder(config=...)``) is stored as given and states no column, whatever its
    keys (a ``"run"`` of its own is the user's)."""

    data: Mapping[str, Any]


def columns_from(config: MpdiagConfig | Mapping[str, Any] | None) -> dict[str, Any]:
    """The run columns a run's configuration states: for mpdiag's own (:class:`MpdiagConfig`), by what it holds,
    ``run`` (a RunConfig's options) or ``watch`` (``mpdiag watch``'s settings). Only what the configuration says
    is derived; the rest of the row is facts of the process (the device it resolved, the torch version, the
    script), given beside it. Anything else (a Recorder's configuration in a user's loop) states no column."""
    if not isinstance(config, MpdiagConfig):
        return {}
    stated = config.data
    if isinstance(stated.get("run"), Mapping):
        return _run_option_columns(stated["run"])
    settings = watch_settings(stated)
    if settings is not None:
        # no level: watch leaves the script's own autocast and GradScalers alone, which the column calls custom
        columns = {"opt_level": settings["opt_level"] or "custom"} if "opt_level" in settings else {}
        return {**columns, **({"every": settings["every"]} if "every" in settings else {})}
    return {}


def stored_config(config: MpdiagConfig | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The JSON a configuration is stored as: mpdiag's own or a user's alike, as given."""
    if config is None:
        return None
    return dict(config.data if isinstance(config, MpdiagConfig) else config)


def _run_option_columns(options: Mapping[str, Any]) -> dict[str, Any]:
    """The columns of a run's options: those stored under their own name, a name it was given, and the loss
    scaling its level and ``loss_scale`` make (stated only with the level; the scaling columns it does not use
    are NULL, so a configuration described anew leaves none of the previous one's)."""
    columns = {name: options[name] for name in _RUN_OPTION_COLUMNS if name in options}
    if options.get("name"):  # else the caller's default_name (the script's file name)
        columns["name"] = options["name"]
    if "opt_level" not in options:
        return columns
    # here, not at the top: the app's supervising process adopts runs through this module and stays light (the
    # options module imports numpy)
    from mpdiag.options import RunConfig

    stated = RunConfig.from_dict(options)
    columns.update(dict.fromkeys(("loss_scale", *_DYNAMIC_SCALING_COLUMNS)))
    if stated.scaling is None:
        columns["scaling"] = "none"
    elif stated.scaling == "dynamic":
        columns.update(scaling="dynamic", **{name: getattr(stated, name) for name in _DYNAMIC_SCALING_COLUMNS})
    else:
        columns.update(scaling="static", loss_scale=float(stated.scaling))
    return columns


def _refuse_restated(fields: Mapping[str, Any], derived: Mapping[str, Any]) -> None:
    """A column the configuration states is given by the configuration only, so the two cannot disagree."""
    restated = sorted(set(fields) & set(derived))
    if restated:
        raise ValueError(f"{', '.join(restated)}: stated by the run's configuration; give the configuration only")


class Run:
    """A handle on one run row, moving it from created to running to ended.

    A Run is made in one of two ways:

    * :meth:`create` inserts the row (status ``running``; with ``queued=True`` status ``queued``, for a row a
      child process will take over, as the app's launcher makes them);
    * :meth:`adopt` takes a row someone else created (the distributed launcher's run for rank 0, a queued row the
      supervisor ends for a child that never did, a finished run the launcher annotates).

    States and transitions::

        queued --(the process that runs it creates it again: the supervisor turns that into status running)-->
        running --end(status)--> ended

    * :meth:`describe` sets fields of the row (any of ``mpdiag.store.RUN_FIELDS``, ``error``, ``note``); allowed
      while the run is not ended by this handle. ``config`` given here replaces the held configuration, and the
      columns it states with it.
    * :meth:`end` is the only way a run is ended: it stores the step summary, the status (one of
      :data:`END_STATUSES`), ``error`` and ``note``. It is idempotent: once this handle has ended the run, later
      calls write nothing and return False, so the first ending (the most specific: a Recorder's, with its
      flushed rows) is the one kept. A call whose write could not be queued (the writer failed before) leaves
      the run not ended, so the caller may end it again.
    * :meth:`fail` is ``end`` with an error.

    The configuration (the JSON ``config`` column) is held here once: given to :meth:`create` (or :meth:`adopt`,
    when the adopter knows it), extended by :meth:`found_optimizer_step`; :attr:`config` is the handle's copy.
    The row's columns that mpdiag's own configuration states (a :class:`MpdiagConfig`; :func:`columns_from`: the
    level, steps, seed, the loss scaling, ...) are derived from it and written with it; a caller gives the
    configuration, never those columns (:meth:`create` and :meth:`describe` refuse them), so the columns and the
    JSON cannot disagree. A user's configuration (a plain dict) is stored as given and states none.

    While the run is running, the writer's thread keeps its heartbeat for a run it created (see
    :mod:`mpdiag.recording.background`): a handle adds no beat of its own; an adopted run gets none from this
    writer (it lives by its creator's process, e.g. the distributed launcher, and by its committed step rows).
    The writer's own ``create_run``/``update_run``/``end_run`` are called here and nowhere else but where the
    writer carries them (the background thread's pass-through and heartbeat; the app's supervisor applying a
    child's forwarded calls by name; ``tests/recording/test_run.py`` holds that list).

    Writes are queued on the writer (``submit``) unless ``wait`` is true (``call``: the write is committed, or
    its error raised, on return). On a writer that discards (ranks other than 0) every write is a no-op and
    :attr:`run_id` is None for a run created there.
    """

    def __init__(self, writer, run_id: int | None, config: MpdiagConfig | dict[str, Any] | None, state: str):
        self.writer = writer
        self.run_id = run_id
        self._hold(config)
        self.state = state  # "queued", "running" or "ended" (as far as this handle knows)

    def _hold(self, config: MpdiagConfig | Mapping[str, Any] | None) -> None:
        """Hold ``config`` as the run's: its JSON (:attr:`config`) and whether it is mpdiag's own."""
        self.config: dict[str, Any] = stored_config(config) or {}
        self._mpdiag_owned = isinstance(config, MpdiagConfig)

    def _held(self) -> MpdiagConfig | dict[str, Any]:
        """The configuration held, as it was given (mpdiag's own, or a user's)."""
        return MpdiagConfig(self.config) if self._mpdiag_owned else self.config

    # -- making one -----------------------------------------------------------------------------------------
    @classmethod
    def create(cls, writer, *, config: MpdiagConfig | dict[str, Any] | None = None, queued: bool = False,
               default_name: str | None = None, **fields) -> Run:
        """Insert a run row with ``config`` (mpdiag's own, :class:`MpdiagConfig`, or a user's dict), the columns
        it states and ``fields`` (the other ``mpdiag.store.RUN_FIELDS``) and return its handle. ``default_name``:
        the run's name when its configuration names none; ``queued``: the row waits, status ``queued``, for the
        process that will run it."""
        derived = columns_from(config)
        _refuse_restated(fields, derived)
        if default_name is not None and "name" not in derived:
            fields["name"] = default_name
        fields.update(derived, **({} if config is None else {"config": stored_config(config)}))

        def insert(w) -> int:
            run_id = w.create_run(**fields)
            if queued:
                w.update_run(run_id, status="queued")
            return run_id

        run_id = writer.call(insert)
        return cls(writer, run_id, config, "queued" if queued else "running")

    @classmethod
    def adopt(cls, writer, run_id: int, *, config: MpdiagConfig | dict[str, Any] | None = None) -> Run:
        """The handle of run ``run_id``, created by another process or handle; nothing is written.
        ``config``: its stored configuration, when known (so it is held here too)."""
        return cls(writer, run_id, config, "running")

    # -- while it runs --------------------------------------------------------------------------------------
    @property
    def ended(self) -> bool:
        return self.state == "ended"

    def _write(self, job, wait: bool) -> None:
        if wait:
            self.writer.call(job)
        else:
            self.writer.submit(job)

    def describe(self, *, wait: bool = False, **fields) -> None:
        """Set fields of the run's row; ``config`` replaces the held configuration and the columns it states
        (which are not given otherwise). Refused once ended here."""
        if self.ended:
            raise RuntimeError(f"run {self.run_id} was ended; it can no longer be described ({sorted(fields)})")
        if not fields:
            return
        derived = columns_from(fields.get("config", self._held()))
        _refuse_restated({k: v for k, v in fields.items() if k != "config"}, derived)
        if "config" in fields:
            self._hold(fields["config"])
            fields.update(derived, config=stored_config(fields["config"]))  # a copy: found_optimizer_step adds to ours
        run_id = self.run_id
        self._write(lambda w: w.update_run(run_id, **fields), wait)

    def found_optimizer_step(self, record: dict) -> None:
        """Store the first optimizer step that broke finite values (the record of
        :class:`mpdiag.recording.nonfinite_step.NonfiniteStepCheck`) in the configuration, keeping the rest of the
        stored configuration as it is (also what another process wrote there)."""
        if self.ended:
            raise RuntimeError(f"run {self.run_id} was ended")
        self.config["optimizer_step_nonfinite"] = record
        run_id = self.run_id
        self.writer.submit(lambda w: w.set_optimizer_step_nonfinite(run_id, record))

    # -- the end --------------------------------------------------------------------------------------------
    def end(self, status: str = "finished", error: str | None = None, note: str | None = None, *,
            wait: bool = False) -> bool:
        """End the run as ``status`` (finished, failed, crashed, or stopped by --stop-on) with ``error`` and ``note``; False (nothing
        written) when this handle ended it before."""
        if status not in END_STATUSES:
            raise ValueError(f"a run ends as one of {END_STATUSES}, not {status!r}")
        if self.ended:
            return False
        run_id = self.run_id
        self._write(lambda w: w.end_run(run_id, status, error=error, note=note), wait)
        self.state = "ended"
        return True

    def fail(self, error: str, status: str = "failed", *, wait: bool = False) -> bool:
        """End the run as failed (or ``crashed``) with ``error``; see :meth:`end`."""
        return self.end(status, error=error, wait=wait)

    def __repr__(self) -> str:
        return f"Run({self.run_id}, {self.state})"
