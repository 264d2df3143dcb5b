"""What ``mpdiag watch`` runs and how it records it: :class:`WatchConfig` (the command, the options of the table's
``watch`` mode, validated) and :func:`rerun_config` (a watched run repeated with options changed).

Torch-free on purpose: the app's launcher plans a watched job (uploaded code, or a rerun of a watched command) in a
short-lived process that queues its rows and exits without importing torch; the interception itself is
:mod:`mpdiag.training.watch`'s.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from mpdiag.numerics.fp8_recipes import Fp8Settings
from mpdiag.options import (
    WATCH_LEVEL_NAMES,
    WATCH_OPTIONS,
    WATCH_RERUN_OPTIONS,
    ConfigError,
    StopOn,
    check_values,
    rerun_name,
)

REFUSED_LEVELS = {
    "O2": "O2 keeps FP16 weights with FP32 master weights owned by the optimizer; only `mpdiag run` can set that "
          "up, because it builds the model and the optimizer itself",
    "O3": "O3 casts the model's weights to FP16, which means changing how the script builds its model; "
          "only `mpdiag run` can do that",
    "bf16-pure": "bf16-pure casts the model's weights to BF16, which means changing how the script builds its "
                 "model; only `mpdiag run` can do that",
}


def rerun_config(run_id: int, parent_name: str, settings: dict, /, **overrides) -> WatchConfig:
    """The WatchConfig repeating a watched run (its stored ``config.watch``: command line, working directory or
    uploaded code, options) with ``overrides`` (any of WATCH_RERUN_OPTIONS, the rerun's ``name`` among them: the
    Plan page's Verify passed one, which met the parent's name as a second ``name`` and failed), recorded as that
    run's child. Raises ConfigError naming an option watch cannot change, or a script that is no longer where it
    was."""
    refused = sorted(set(overrides) - set(WATCH_RERUN_OPTIONS))
    if refused:
        raise ConfigError(f"run {run_id} was recorded by mpdiag watch: its rerun repeats the script's command "
                          f"and can change only {', '.join('--' + o.replace('_', '-') for o in WATCH_RERUN_OPTIONS)}, "
                          f"not {', '.join('--' + o.replace('_', '-') for o in refused)}.")
    after = {**settings, **{k: v for k, v in overrides.items() if k != "name"}}
    if overrides.get("name") is None:  # none typed: say what changed, never the parent's twin label
        overrides = {**overrides, "name": rerun_name(parent_name, settings, after)}
    config = WatchConfig.from_settings(settings, parent_run_id=int(run_id), **overrides)
    if config.bundle is None and not config.module and not os.path.isfile(os.path.join(config.cwd, config.target)):
        raise ConfigError(f"run {run_id} ran {config.target} in {config.cwd}, and that file is no longer there: rerun "
                          "it with mpdiag watch from where the script is now.")
    return config


@dataclass(frozen=True)
class WatchConfig:
    """What to run and how to record it. ``target`` is a script path, or a module name when ``module``. The
    options (their defaults, bounds and help) are the table's: :data:`mpdiag.options.WATCH_OPTIONS`."""

    target: str
    args: tuple[str, ...] = ()
    module: bool = False
    name: str | None = WATCH_OPTIONS["name"].default
    every: int | None = WATCH_OPTIONS["every"].default
    trace_modules: bool = WATCH_OPTIONS["trace_modules"].default
    #: every N steps, FP32 gradients of the same step (mpdiag.training.watch_shadow) to compare with; 0: never
    shadow_every: int | None = WATCH_OPTIONS["shadow_every"].default
    opt_level: str | None = WATCH_OPTIONS["opt_level"].default
    init_scale: float | None = WATCH_OPTIONS["init_scale"].default
    stop_on: str = WATCH_OPTIONS["stop_on"].default  # --stop-on: the events that end the script (status stopped)
    cwd: str = field(default_factory=os.getcwd)
    parent_run_id: int | None = None  # a rerun of a watched run: the run it repeats
    fp8: Fp8Settings | None = None  # --fp8: also record what this FP8 recipe would cast in every nn.Linear
    #: code uploaded in the app (the SHA-256 of its stored bundle): the target is a path inside it, run from a
    #: fresh copy in a supervised child, whose directory is the copy's; ``cwd`` is not used
    bundle: str | None = None

    @classmethod
    def from_settings(cls, settings: dict, **fields) -> WatchConfig:
        """The config a run recorded (:meth:`settings`), with ``fields`` replaced."""
        argv, module = list(settings["argv"]), settings["argv"][:1] == ["-m"]
        target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
        kept = {k: settings[k] for k in WATCH_RERUN_OPTIONS if k in settings}
        if settings.get("fp8"):
            kept["fp8"] = Fp8Settings.from_dict(settings["fp8"])
        return cls(target=target, args=tuple(args), module=module, cwd=settings.get("cwd") or os.getcwd(),
                   bundle=settings.get("bundle"), **{**kept, **fields})

    def settings(self) -> dict:
        """What a run stores of this config (its ``config["watch"]``), so that a rerun can repeat it."""
        return {"argv": self.command(), "cwd": None if self.bundle else self.cwd, "opt_level": self.opt_level,
                "init_scale": self.init_scale, "every": self.every, "trace_modules": self.trace_modules,
                "shadow_every": self.shadow_every, "stop_on": self.stop_on, "fp8": None if self.fp8 is None else dataclasses.asdict(self.fp8),
                **({"bundle": self.bundle} if self.bundle else {})}

    def validate(self) -> None:
        """Raise ConfigError (nothing run, nothing stored) for an option watch cannot honour."""
        if self.opt_level in REFUSED_LEVELS:
            raise ConfigError(f"watch --opt-level {self.opt_level} is refused: {REFUSED_LEVELS[self.opt_level]}. "
                              f"watch takes {', '.join(WATCH_LEVEL_NAMES)}, or no --opt-level to keep the script's own settings.")
        check_values({name: getattr(self, name) for name in WATCH_RERUN_OPTIONS}, WATCH_OPTIONS)
        StopOn.parse(self.stop_on)
        if self.stop_on and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("--stop-on is not available under torchrun: every rank would have to stop at the same "
                              "step")
        if self.shadow_every and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("--shadow-every is not available under torchrun: the FP32 shadow replays the "
                              "model's forward on a copy of it, which a DDP or FSDP module cannot give")
        if not self.module and self.bundle is None and not os.path.isfile(os.path.join(self.cwd, self.target)):
            raise ConfigError(f"{self.target}: no such file. Give the training script's path (or -m MODULE).")

    def command(self) -> list[str]:
        """The command line the watched process ran, as ``python`` would be given it."""
        return [*(["-m"] if self.module else []), self.target, *self.args]
