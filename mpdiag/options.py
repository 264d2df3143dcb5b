"""The options table: every option of ``mpdiag run`` and ``mpdiag watch``, its default, bounds, help text, the
opt levels and the commands (modes) it applies to.

Owns :class:`RunConfig` (one frozen dataclass whose field metadata is the option table :data:`OPTIONS`), the
torch-free part of the opt-level table (:data:`LEVELS`: names, one-line summaries, default loss scaling), the
options of the command that are not a run's (:data:`COMMAND_OPTIONS`: ``--pair``), the longest run name
(:data:`MAX_NAME_CHARS`), and :class:`ConfigError` and :class:`ScriptError`. The command line's run options, the dashboard's run form, a rerun's override merging and
the configuration stored with a run are all generated from or checked against this module.

It sits at the bottom of the package (only :mod:`mpdiag.numerics` below it), so training, analysis, the
dashboard and the app share this vocabulary without importing the training layer. Must not import torch (the
dashboard validates its form with it) and must not build policies or look at devices: a device is checked here
only as a string; :func:`mpdiag.training.runner.resolve_device` decides at run time whether it exists.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mpdiag.numerics.fp8_recipes import BLOCK_RECIPES, MODULE_RECIPES, Fp8Settings


class ConfigError(ValueError):
    """A run option is invalid; raised before any training starts. The message names the option."""


class ScriptError(Exception):
    """The model script is broken or breaks the contract; ``str()`` is the message for the user. Defined here,
    torch-free, so the CLI can refuse it in one line without importing torch (mpdiag.training.script raises it)."""


@dataclass(frozen=True)
class Level:
    """What the configuration needs to know about an opt level (its training code is in mpdiag/training/policies.py)."""

    name: str
    summary: str
    #: the loss scaling the level uses unless --loss-scale says otherwise: None (no scaling), "dynamic" or a
    #: static number
    default_scaling: str | float | None = None

    @property
    def scales_loss(self) -> bool:
        return self.default_scaling is not None


LEVELS: dict[str, Level] = {level.name: level for level in (
    Level("O0", "pure FP32: no casting, no loss scaling (the reference)"),
    Level("O1", "autocast FP16 (per-op casting), FP32 weights, dynamic loss scaling", "dynamic"),
    Level("O2", "FP16 weights except norm layers, FP32 master weights in the optimizer, dynamic loss scaling",
          "dynamic"),
    Level("O3", "pure FP16: weights, BatchNorm and optimizer in FP16, no master weights, static scale 1.0", 1.0),
    Level("bf16", "autocast BF16 (per-op casting), FP32 weights, no loss scaling"),
    Level("bf16-pure", "pure BF16: weights, activations and optimizer in BF16, no loss scaling"),
    Level("fp8-sim", "as bf16, with every Linear's input, weight and output gradient quantized and dequantized "
                     "through FP8 at the recipe's scales (simulated, any device)"),
    Level("fp8-sim-fp16", "as O1 (autocast FP16, FP32 weights, dynamic loss scaling), with every Linear simulated as "
                          "fp8-sim does (a precision plan whose run is FP16)", "dynamic"),
)}
ALL_LEVELS = tuple(LEVELS)
SCALING_LEVELS = tuple(name for name, level in LEVELS.items() if level.scales_loss)
#: the levels that simulate FP8 in every Linear (mpdiag.training.fp8_sim): under BF16 or under FP16 autocast
FP8_SIM_LEVELS = ("fp8-sim", "fp8-sim-fp16")
#: --moment-format: the formats the optimizer's state can be held in, rounded after every step ("": as kept)
MOMENT_FORMATS = ("bf16", "fp8")

#: the levels ``mpdiag watch`` can impose on an unmodified script (autocast's dtype, its GradScalers on or off);
#: O2, O3 and the pure levels change how the script builds its model, which only ``mpdiag run`` does
WATCH_LEVEL_NAMES = ("O0", "O1", "bf16")


def watch_fix(fix: Mapping[str, Any]) -> dict:
    """A finding's fix as rerun options of a watched run: ``loss_scale: dynamic`` is what a GradScaler
    already does, so it is dropped (watch's GradScalers are the script's own, always dynamic)."""
    return {k: v for k, v in fix.items() if not (k == "loss_scale" and v == "dynamic")}


def watch_settings(run_config: Any) -> Mapping[str, Any] | None:
    """What ``mpdiag watch`` stored of a run it recorded (the run config's ``watch``: its command and folder or
    uploaded bundle, its options), from the command line, an upload or a rerun of one; None for any other run (a
    stored script's, a Recorder's in the user's own loop, a config that is not a mapping). The one test of whether
    a run was watched."""
    watched = run_config.get("watch") if isinstance(run_config, Mapping) else None
    return watched if isinstance(watched, Mapping) else None


def recorded_by(run_config: Any) -> str:
    """How a run was recorded, for advice on recording it again: "watch" (``mpdiag watch`` or an upload), "run"
    (``mpdiag run``, the model-script contract: its options are command-line flags) or "recorder" (a Recorder in
    the user's own loop, or a framework callback: none of mpdiag's flags reach it)."""
    if watch_settings(run_config) is not None:
        return "watch"
    return "run" if isinstance(run_config, Mapping) and "run" in run_config else "recorder"


def torchrun_rerun(run_config: Mapping[str, Any], world_size: Any, flags: str = "") -> str | None:
    """Why a watched torchrun job (``world_size`` ranks) cannot be rerun by mpdiag, with the command that repeats
    it, or None for any other run: a rerun starts one process, whose ``init_process_group`` then waits for ranks
    that never come (it failed, with 0 steps). ``flags``: the rerun's own options, as command-line flags."""
    watched = watch_settings(run_config)
    try:
        ranks = int(world_size)  # a Store row's number (numpy's), or NaN / None: not known
    except (TypeError, ValueError):
        ranks = 1
    if watched is None or ranks <= 1:
        return None
    argv = " ".join(shlex.quote(str(a)) for a in watched.get("argv") or ())
    where = f"from {watched['cwd']}: " if watched.get("cwd") else ""
    return (f"this run was a torchrun job of {ranks} ranks, and a rerun starts one process; repeat it with torchrun "
            f"{where}torchrun --nproc_per_node {ranks} -m mpdiag watch {flags + ' ' if flags else ''}{argv}")


def rerunnable_by_watch(run_config: Mapping[str, Any], fix: Mapping[str, Any]) -> bool:
    """Whether a finding's ``fix`` can be checked by repeating a watched run's command (a run recorded by
    watch, a fix that changes only what watch can: the level among WATCH_LEVEL_NAMES, the initial scale)."""
    options = watch_fix(fix)
    return watch_settings(run_config) is not None and set(options) <= {"opt_level", "init_scale"} and \
        options.get("opt_level", "O1") in WATCH_LEVEL_NAMES


DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
#: what a person may name a run, in characters (the store refuses a longer name; the form's field stops there)
MAX_NAME_CHARS = 200
UNSET = "default"  # on the command line, an optional number set to this is cleared (--min-scale default)


#: the commands an option can apply to (:attr:`Option.modes`): ``mpdiag run`` (and ``rerun``, and the run form)
#: and ``mpdiag watch`` (and the watch form)
RUN, WATCH = "run", "watch"


@dataclass(frozen=True)
class Option:
    """One option. ``kind`` is one of: int, float, loss_scale, level, device, text, events (``--stop-on``'s text,
    :class:`StopOn`), flag, run_id.

    Bounds: ``above`` / ``below`` exclusive, ``minimum`` / ``maximum`` inclusive; floats must also be finite.
    ``choices``: the levels a ``level`` option takes. ``no_flag`` / ``no_widget`` say why the option has no
    command-line flag / no widget in its mode's form. ``modes``: the commands it applies to; ``watch``: what it
    is under watch where that differs (:meth:`in_mode`). ``widget``: hints for a form that builds its widget from
    the table (label, widget bounds, help in the form's words; a ``device``'s ``choices``; a ``loss_scale``'s
    ``static_label`` and ``static_value``, its static scale's picker and where it starts; ``powers_of_two``: a
    float picked among powers of two; a ``text`` option's ``choices``, picked among them, or ``max_chars``, typed;
    ``keeps_value_disabled``: disabled, the widget keeps its key and value, for an option that then does nothing
    whatever its value).
    """

    default: Any
    help: str
    kind: str
    levels: tuple[str, ...] = ALL_LEVELS
    above: float | None = None
    below: float | None = None
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ALL_LEVELS
    no_flag: str | None = None
    no_widget: str | None = None
    modes: tuple[str, ...] = (RUN,)
    # pairs, not a dict: an Option is frozen and hashable
    watch: tuple[tuple[str, Any], ...] = ()
    widget: tuple[tuple[str, Any], ...] = ()

    def in_mode(self, mode: str) -> Option:
        """This option as ``mode`` reads it: under watch, with its ``watch`` differences applied."""
        return dataclasses.replace(self, **dict(self.watch), watch=()) if mode == WATCH else self

    def requirement(self) -> str:
        """What a valid value is, in words (the end of an error message)."""
        if self.kind == "level":
            return f"one of: {', '.join(self.choices)}"
        if self.kind == "device":
            return "auto, cpu, cuda or cuda:N"
        if self.kind == "text":
            return "text"
        if self.kind == "events":
            return "nonfinite, spike or skips:N (N >= 1), comma-separated"
        if self.kind == "flag":
            return "true or false"
        if self.kind in ("int", "run_id"):
            low = "" if self.minimum is None else f" >= {self.minimum}"
            high = "" if self.maximum is None else f" and <= {self.maximum}"
            return f"an integer{low}{high}"
        number = (f"a finite number between {self.above:g} and {self.below:g} (exclusive)" if self.below is not None
                  else f"a finite number > {self.above:g}")
        return f"'dynamic' or {number}" if self.kind == "loss_scale" else number

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` (already of the Python type, not a command-line string) is valid on its own."""
        if value is None:
            return self.default is None  # optional options accept None, meaning "not set"
        if self.kind == "level":
            return isinstance(value, str) and value in self.choices
        if self.kind == "device":
            return isinstance(value, str) and DEVICE_PATTERN.fullmatch(value) is not None
        if self.kind == "text":
            return isinstance(value, str)
        if self.kind == "events":
            try:
                return isinstance(value, str) and StopOn.parse(value) is not None
            except ConfigError:
                return False
        if self.kind == "flag":
            return isinstance(value, bool)
        if self.kind in ("int", "run_id"):
            return (isinstance(value, int) and not isinstance(value, bool)
                    and (self.minimum is None or value >= self.minimum)
                    and (self.maximum is None or value <= self.maximum))
        if self.kind == "loss_scale" and value == "dynamic":
            return True
        return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and value > self.above and (self.below is None or value < self.below))

    def parse(self, text: str) -> Any:
        """A command-line string as this option's Python type (bounds are checked later, by validation).
        ``default`` clears an optional number (a rerun would inherit the parent's otherwise)."""
        if text == UNSET and self.default is None and self.kind in ("float", "loss_scale"):
            return None
        if self.kind in ("int", "run_id"):
            return int(text)
        if self.kind == "float" or (self.kind == "loss_scale" and text != "dynamic"):
            return float(text)
        return text


@dataclass(frozen=True)
class StopOn:
    """``--stop-on``: the events that end the training (:mod:`mpdiag.recording.events`). ``text`` as given:
    comma-separated ``nonfinite`` (the first non-finite loss or applied gradient), ``spike`` (a loss or
    gradient-norm spike) and ``skips:N`` (N skipped optimizer steps in a row); empty: none."""

    nonfinite: bool = False
    spike: bool = False
    skips: int | None = None
    text: str = ""

    @classmethod
    def parse(cls, text: str | None) -> StopOn:
        """Raise ConfigError naming what is wrong with ``text``."""
        found: dict[str, Any] = {}
        for word in (w.strip() for w in (text or "").split(",")):
            if not word:
                continue
            name, _, count = word.partition(":")
            if name in ("nonfinite", "spike") and not count:
                found[name] = True
            elif name == "skips" and count.isdigit() and int(count) >= 1:
                found["skips"] = int(count)
            else:
                raise ConfigError(f"--stop-on takes nonfinite, spike or skips:N (N >= 1), comma-separated; got {word!r}")
        return cls(**found, text=",".join(w.strip() for w in (text or "").split(",") if w.strip()))

    def __bool__(self) -> bool:
        return self.nonfinite or self.spike or self.skips is not None


_STOP_ON_HELP = ("end the training cleanly (status stopped, the reason stored) at an event: nonfinite, spike or "
                 "skips:N (N skipped steps in a row), comma-separated; default: never")
_STOP_ON_WIDGET = {"label": "Stop the training at",
                   "help": "End the training cleanly at the first of these events (the run reads 'stopped', the "
                           "reason stored, nothing lost); every event is recorded either way. Skipped steps: N "
                           "skipped optimizer steps in a row."}


#: how a data-parallel job shares the model, and the opt levels FSDP2 runs (mpdiag.training.distributed)
PARALLEL = ("ddp", "fsdp")
FSDP_LEVELS = ("O0", "O1", "bf16", "bf16-pure")
_PARALLEL_HELP = "with --nproc above 1: ddp (DistributedDataParallel) or fsdp (FSDP2 fully_shard)"

#: why the run form has no FP8 recipe widgets: the form runs fp8-sim and --fp8 with the default recipe
_FP8_FORM = ("the run form uses the default FP8 recipe (delayed, history 1024, margin 0, E5M2); other recipes: "
             "`mpdiag run --fp8-*`, or a finding's rerun")
#: the FP8 recipe options: they apply to the fp8-sim level, and to every level recorded with --fp8
FP8_RECIPE_OPTIONS = ("fp8_recipe", "fp8_history", "fp8_margin", "fp8_grad_format", "fp8_pow2", "fp8_blocks")


def option(default: Any, help: str, kind: str, watch: bool | Mapping[str, Any] = False, **details) -> Any:
    """A RunConfig field whose metadata is its :class:`Option`. ``watch``: the option is also ``mpdiag watch``'s
    (True), or a mapping of what differs under watch (Option fields). ``widget`` (in ``details`` and in ``watch``):
    the form's hints as a mapping: label, help in the form's words, and number_input's bounds and placeholder."""
    differs = dict(watch) if isinstance(watch, Mapping) else {}
    for hints in (differs, details):  # the form's hints, given as a mapping, held as pairs (an Option is frozen)
        if "widget" in hints:
            hints["widget"] = tuple(hints["widget"].items())
    modes = (RUN, WATCH) if watch is not False else (RUN,)
    return field(default=default, metadata={"option": Option(default, help, kind, modes=modes,
                                                             watch=tuple(differs.items()), **details)})


#: the watch form's widgets say what watch does to the script's own settings; the other forms' words come from
#: their options' help
_WATCH_LEVEL_WIDGET = {
    "label": "Opt level",
    "help": "What watch sets in the script's own autocast regions and GradScalers: "
            + "; ".join(f"{k}: {LEVELS[k].summary}" for k in WATCH_LEVEL_NAMES)
            + ". O2, O3 and the pure levels change how the script builds its model, which only a model script "
              "(mpdiag run) can do."}
_SHADOW_HELP = ("every N steps, compare each tensor's gradient with an FP32 computation on the same weights and "
                "batch (0: off)")
_FP8_HELP = ("record, per logged step, what an FP8 recipe would cast in every nn.Linear (input, weight, output "
             "gradient): exponent histograms, scales and lost values (FP8 page)")
_DEVICE_HELP = "auto (CUDA when present), cpu or cuda[:N]"
#: why the watch form has no FP8 widgets: it records no FP8 statistics
_FP8_WATCH_FORM = "the watch form records no FP8 statistics: `mpdiag watch --fp8` does"


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run besides its script. Every field is an option described in its metadata
    (see :data:`OPTIONS`); :meth:`validate` checks them all and how they combine."""

    opt_level: str = option("O1", "opt level: " + "; ".join(f"{k}: {v.summary}" for k, v in LEVELS.items()), "level",
                            widget={"label": "Opt level",
                                    "help": "\n".join(f"{k}: {v.summary}" for k, v in LEVELS.items())},
                            watch={"default": None, "choices": WATCH_LEVEL_NAMES, "widget": _WATCH_LEVEL_WIDGET,
                                   "help": f"{', '.join(WATCH_LEVEL_NAMES[:-1])} or {WATCH_LEVEL_NAMES[-1]}: override "
                                           "the script's autocast and GradScaler settings (default: leave them alone)"})
    loss_scale: str | float | None = option(
        None, "'dynamic', or a number for a static scale; default: the level's own", "loss_scale",
        levels=SCALING_LEVELS, above=0,
        widget={"label": "Loss scaling", "static_label": "Static scale", "static_value": 2.0**7})
    init_scale: float = option(2.0**16, "initial dynamic loss scale", "float", levels=SCALING_LEVELS, above=0,
                               widget={"label": "Initial scale (dynamic)", "powers_of_two": True},
                               watch={"default": None, "levels": ALL_LEVELS,
                                      "help": "initial scale of every GradScaler the script creates",
                                      "widget": {"label": "Initial loss scale", "min_value": 2.0**-24,
                                                 "max_value": 2.0**64, "placeholder": "the script's",
                                                 "help": "Every GradScaler the script creates starts at this scale "
                                                         "(empty: the script's own)."}})
    growth_factor: float = option(2.0, "dynamic scale growth factor", "float", levels=SCALING_LEVELS, above=1,
                                  widget={"label": "Growth factor"})
    backoff_factor: float = option(0.5, "dynamic scale backoff factor", "float", levels=SCALING_LEVELS,
                                   above=0, below=1, widget={"label": "Backoff factor"})
    growth_interval: int = option(2000, "clean steps before the dynamic scale grows", "int", levels=SCALING_LEVELS,
                                  minimum=1, widget={"label": "Growth interval", "max_value": 1_000_000})
    min_scale: float | None = option(None, "lower bound of the dynamic scale", "float", levels=SCALING_LEVELS,
                                     above=0, widget={"label": "Min scale", "placeholder": "none"})
    max_scale: float | None = option(None, "upper bound of the dynamic scale", "float", levels=SCALING_LEVELS,
                                     above=0, widget={"label": "Max scale", "placeholder": "none"})
    steps: int = option(200, "training steps", "int", minimum=1, widget={"label": "Steps", "max_value": 1_000_000})
    # numpy's seed is at most 2**32 - 1; a negative one is refused by numpy too
    seed: int = option(0, "seed for torch, numpy and random", "int", minimum=0, maximum=2**32 - 1,
                       widget={"label": "Seed"})
    every: int | None = option(
        None, "store tensor statistics every N steps, and at the steps where something happened and the steps next "
              "to them; default: every step for the first 1000, then every 50th (each step's inf/NaN and FP16/BF16 "
              "over/underflow counts are stored either way); on the CPU a step between multiples costs a light pass "
              "and a copy of its gradients, three such copies held (docs/events.md)", "int", minimum=1,
        widget={"label": "Tensor statistics every N steps", "max_value": 1_000_000,
                "placeholder": "every step to 1000, then every 50th"}, watch=True)
    shadow_every: int = option(
        0, _SHADOW_HELP, "int", minimum=0,
        widget={"label": "FP32 shadow every N steps (0: off)", "max_value": 1_000_000,
                "help": "Every N steps, recompute the gradients in FP32 on the same weights and batch and store each "
                        "tensor's relative error and cosine (Findings page). Costs one FP32 forward and backward per "
                        "shadow step."},
        watch={"help": "every N steps, also compute the step's gradients in FP32 and store how far the recorded ones "
                       "are from them (default 0: never)",
               "widget": {"label": "FP32 shadow every N steps", "max_value": 1_000_000,
                          "help": _SHADOW_HELP + ". Under watch: the model's forward is replayed in FP32 from the "
                                  "gradient its outputs received (step 0 is never compared)."}})
    device: str = option("auto", _DEVICE_HELP, "device",
                         widget={"label": "Device", "choices": ("auto", "cpu", "cuda"),
                                 "help": _DEVICE_HELP + ". A CUDA device must exist where the run starts; if not, "
                                                        "the run refuses to start and says so."})
    name: str | None = option(None, "display name of the run", "text",
                              widget={"label": "Run name (optional)", "max_chars": MAX_NAME_CHARS,
                                      "help": "Empty: the script's file name; a rerun: its parent's name and what "
                                              "changed."},
                              watch={"help": "display name of the run (default: the script's file name)",
                                     "no_widget": "a watched run is named after its command, a rerun after its "
                                                  "parent and what changed"})
    trace_modules: bool = option(False, "record each module's output and gradient absmax per step, to locate the "
                                        "first inf/NaN", "flag", widget={"label": "Trace modules"}, watch=True)
    fp8: bool = option(False, _FP8_HELP, "flag", watch={"no_widget": _FP8_WATCH_FORM},
                       widget={"label": "Record FP8 statistics (FP8 page)",
                               "help": _FP8_HELP + ", under the default recipe (delayed scaling, history 1024, E4M3 "
                                                   "forward, E5M2 output gradients)."})
    fp8_recipe: str = option("delayed", "--fp8 and fp8-sim: the FP8 scaling recipe, current or delayed (--fp8 also "
                                        "both; fp8-sim also the block-scaled mxfp8 or nvfp4, which --fp8 then "
                                        "records beside both per-tensor recipes)", "text", levels=FP8_SIM_LEVELS, no_widget=_FP8_FORM,
                             watch={"no_widget": _FP8_WATCH_FORM})
    fp8_history: int = option(1024, "--fp8 and fp8-sim, delayed recipe: recorded steps of amax history", "int",
                              levels=FP8_SIM_LEVELS, minimum=1, no_widget=_FP8_FORM,
                              watch={"no_widget": _FP8_WATCH_FORM})
    fp8_margin: int = option(0, "--fp8 and fp8-sim, delayed recipe: divide the scale by 2^margin", "int",
                             levels=FP8_SIM_LEVELS, minimum=0, maximum=64, no_widget=_FP8_FORM,
                             watch={"no_widget": _FP8_WATCH_FORM})
    fp8_grad_format: str = option("e5m2", "--fp8 and fp8-sim: the output gradients' format, e5m2 (HYBRID) or e4m3",
                                  "text", levels=FP8_SIM_LEVELS, no_widget=_FP8_FORM,
                                  watch={"no_widget": _FP8_WATCH_FORM})
    fp8_pow2: bool = option(False, "--fp8 and fp8-sim: round each scale down to a power of two", "flag",
                            levels=FP8_SIM_LEVELS, no_widget=_FP8_FORM,
                            watch={"no_widget": _FP8_WATCH_FORM})
    fp8_blocks: str = option("", "--fp8: also record block-scaled recipes, comma-separated: mxfp8 and/or nvfp4 "
                                 "(exact counts per Linear and role, and per-block statistics)", "text", levels=(),
                             no_widget=_FP8_FORM, watch={"no_widget": _FP8_WATCH_FORM})
    fp8_bf16_modules: str = option("", "fp8-sim: Linear modules (comma-separated names) left in BF16", "text",
                                   levels=FP8_SIM_LEVELS, no_widget=_FP8_FORM)
    fp8_modules: str = option("", "fp8-sim: a recipe per Linear, comma-separated NAME=RECIPE (RECIPE: "
                                  f"{', '.join(MODULE_RECIPES)}); the others take --fp8-recipe (what `mpdiag plan "
                                  "--verify` reruns)", "text", levels=FP8_SIM_LEVELS, no_widget=_FP8_FORM)
    moment_format: str = option("", "hold the optimizer's state (Adam's moments) in bf16 or fp8 (E4M3 at a per-tensor "
                                    "scale): every floating state tensor but the step count is rounded through it "
                                    "after each optimizer step, by torch's cast (a simulation; default: as the "
                                    "optimizer keeps it)", "text", no_widget="a precision plan's rerun sets it "
                                                                              "(`mpdiag plan --verify`, the Plan page)")
    nproc: int = option(1, "processes of a data-parallel job, launched through torch.distributed.run", "int",
                        minimum=1, widget={"label": "Processes (data parallel, launched like torchrun)", "max_value": 64})
    # with one process it does nothing whatever it says: disabled, it keeps what was picked
    parallel: str = option("ddp", _PARALLEL_HELP, "text",
                           widget={"label": "Parallel", "choices": PARALLEL, "keeps_value_disabled": True,
                                   "help": f"{_PARALLEL_HELP} (FSDP2 runs {', '.join(FSDP_LEVELS)})"})
    stop_on: str = option("", _STOP_ON_HELP, "events", watch=True, widget=_STOP_ON_WIDGET)
    parent_run_id: int | None = option(
        None, "the run this one reruns", "run_id", minimum=1,
        no_flag="set by `rerun RUN_ID` from its argument", no_widget="set by the rerun form from the picked run")

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid option, or the first bad combination, with the fix."""
        check_values(self.to_dict())
        level = LEVELS[self.opt_level]
        for name, spec in OPTIONS.items():
            if not applies(name, self.opt_level, self.fp8) and getattr(self, name) != spec.default:
                why = "does not scale the loss" if name in SCALING_OPTIONS and not level.scales_loss else "does not use it"
                also = ", or any level with --fp8" if name in FP8_RECIPE_OPTIONS else ""
                applies_to = f"{', '.join(spec.levels)}{also}" if spec.levels else "any level with --fp8"
                raise ConfigError(f"--opt-level {self.opt_level} {why}; drop {flag(name)} (it applies to {applies_to})")
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ConfigError(f"--min-scale {self.min_scale} is above --max-scale {self.max_scale}")
        StopOn.parse(self.stop_on)
        if self.parallel not in PARALLEL:
            raise ConfigError(f"--parallel must be one of {', '.join(PARALLEL)}, got {self.parallel!r}")
        if self.nproc > 1 and self.parallel == "fsdp" and self.opt_level not in FSDP_LEVELS:
            raise ConfigError(f"--parallel fsdp runs opt levels {', '.join(FSDP_LEVELS)}; {self.opt_level} needs "
                              "--parallel ddp")
        if self.nproc > 1 and self.fp8:
            raise ConfigError("--fp8 records one process's Linear modules; drop it with --nproc above 1 (in your own "
                              "torchrun loop, Recorder(fp8=...) records rank 0's)")
        if self.nproc > 1 and self.stop_on:
            raise ConfigError("--stop-on ends one process's training; drop it with --nproc above 1 (every rank "
                              "would have to stop at the same step)")
        if self.nproc > 1 and self.shadow_every:
            raise ConfigError("--shadow-every compares one process's gradients; drop it with --nproc above 1")
        if self.moment_format and self.moment_format not in MOMENT_FORMATS:
            raise ConfigError(f"--moment-format must be one of {', '.join(MOMENT_FORMATS)}, got {self.moment_format!r}")
        if self.opt_level in FP8_SIM_LEVELS or self.fp8:
            try:
                self.fp8_settings().validate()
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            if self.opt_level in FP8_SIM_LEVELS and self.fp8_recipe == "both":
                raise ConfigError(f"--opt-level {self.opt_level} runs one recipe: --fp8-recipe current, delayed, mxfp8 or "
                                  "nvfp4, not both")
            if self.fp8_recipe in BLOCK_RECIPES:
                self._check_block_recipe()

    def _check_block_recipe(self) -> None:
        """A block-scaled --fp8-recipe is simulated by fp8-sim (--fp8 records block recipes with --fp8-blocks); its
        scales are per block, so the per-tensor recipe options apply only to what --fp8 records beside it."""
        if self.opt_level not in FP8_SIM_LEVELS:
            raise ConfigError(f"--fp8-recipe {self.fp8_recipe} is simulated by --opt-level fp8-sim (or "
                              f"fp8-sim-fp16) only; to record it, use --fp8 --fp8-blocks {self.fp8_recipe}")
        if not self.fp8:
            for name in ("fp8_history", "fp8_margin", "fp8_grad_format", "fp8_pow2"):
                if getattr(self, name) != OPTIONS[name].default:
                    raise ConfigError(f"--fp8-recipe {self.fp8_recipe} scales per block and does not use "
                                      f"{flag(name)}; drop it (with --fp8 it sets the per-tensor recipes recorded)")

    def fp8_settings(self) -> Fp8Settings:
        """The FP8 recipe of --fp8 and of the fp8-sim level, as the numerics take it."""
        modules = tuple(name.strip() for name in self.fp8_bf16_modules.split(",") if name.strip())
        blocks = tuple(name.strip() for name in self.fp8_blocks.split(",") if name.strip())
        pairs = [item.strip().partition("=") for item in self.fp8_modules.split(",") if item.strip()]
        if any(not sep for _, sep, _ in pairs):
            raise ValueError(f"--fp8-modules takes NAME=RECIPE pairs, comma-separated; got {self.fp8_modules!r}")
        return Fp8Settings(recipe=self.fp8_recipe, history=self.fp8_history, margin=self.fp8_margin,
                           grad_format=self.fp8_grad_format, pow2=self.fp8_pow2, bf16_modules=modules,
                           block_recipes=blocks,
                           module_recipes=tuple((name.strip(), recipe.strip()) for name, _, recipe in pairs))

    def fp32_twin(self, name: str | None = None) -> RunConfig:
        """The O0 twin of this (mixed-precision) run for ``--pair``: same seed, steps and recording, no loss
        scaling; validated."""
        if self.opt_level == "O0":
            raise ConfigError("--pair runs an O0 twin beside a mixed-precision run; choose another --opt-level")
        twin = self.with_options(opt_level="O0", name=name)
        twin.validate()
        return twin

    @property
    def scaling(self) -> str | float | None:
        """The loss scaling this run uses: None (none), "dynamic", or a static scale."""
        return self.loss_scale if self.loss_scale is not None else LEVELS[self.opt_level].default_scaling

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        """The configuration stored with a run (``to_dict``'s output). Not validated: callers validate after
        applying their overrides. Runs stored before the options were one table nest the loss-scale options
        under ``scaling``; they are read as well."""
        data = dict(data)
        nested = data.pop("scaling", None)
        if isinstance(nested, Mapping):
            data = {**nested, **data}
        unknown = set(data) - set(OPTIONS)
        if unknown:
            raise ConfigError(f"unknown run options: {', '.join(sorted(unknown))}")
        return cls(**data)

    def with_options(self, **options) -> RunConfig:
        """A copy with ``options`` (field names) replaced. Options that do not apply to the resulting opt level
        and are not among ``options`` return to their defaults (an O1 parent's scale settings do not follow a
        rerun at bf16)."""
        unknown = set(options) - set(OPTIONS)
        if unknown:
            raise ConfigError(f"unknown run options: {', '.join(sorted(unknown))}")
        level, fp8 = options.get("opt_level", self.opt_level), options.get("fp8", self.fp8)
        reset = {name: spec.default for name, spec in OPTIONS.items()
                 if not applies(name, level, fp8) and name not in options}
        return dataclasses.replace(self, **reset, **options)


OPTIONS: dict[str, Option] = {f.name: f.metadata["option"] for f in dataclasses.fields(RunConfig)}


def mode_options(mode: str) -> dict[str, Option]:
    """The options of ``mode`` (RUN or WATCH), in the table's order, each as that mode reads it."""
    return {name: spec.in_mode(mode) for name, spec in OPTIONS.items() if mode in spec.modes}


#: the options of ``mpdiag run`` / ``rerun`` and the run form that are not a run's configuration (not stored
#: with it): ``pair``, an FP32 twin run beside it (:meth:`RunConfig.fp32_twin`), at the levels it is offered at
COMMAND_OPTIONS: dict[str, Option] = {"pair": Option(
    False, "also run an O0 twin on identical weights and batches", "flag",
    levels=tuple(level for level in ALL_LEVELS if level != "O0"),
    # no help in the form: the label says it all
    widget=(("label", "Also run an FP32 (O0) twin on identical weights and batches"), ("help", "")))}

#: ``mpdiag watch``'s options: its flags, its form and :meth:`mpdiag.training.watch_config.WatchConfig.validate`'s checks
WATCH_OPTIONS = mode_options(WATCH)
#: the watch options a WatchConfig holds as its own fields, so what a rerun of a watched run may change (the rest
#: of the command is the script's own); the FP8 ones reach a WatchConfig as one recipe (its ``fp8``)
WATCH_RERUN_OPTIONS = tuple(name for name in WATCH_OPTIONS if name != "fp8" and name not in FP8_RECIPE_OPTIONS)
SCALING_OPTIONS = tuple(name for name, spec in OPTIONS.items() if spec.levels == SCALING_LEVELS)


def applies(name: str, level: str, fp8: bool) -> bool:
    """Whether option ``name`` applies to a run at ``level``, recorded with --fp8 or not."""
    return level in OPTIONS[name].levels or (fp8 and name in FP8_RECIPE_OPTIONS)


def flag(name: str) -> str:
    """The command-line flag of option ``name``."""
    return "--" + name.replace("_", "-")


def command_flags(options: Mapping[str, Any]) -> str:
    """Run options as command-line flags, quoted for a shell: a set flag option alone (``--fp8``)."""
    words = []
    for name, value in options.items():
        spec = OPTIONS.get(name)
        if spec is not None and spec.kind == "flag":
            words += [flag(name)] if value else []
        else:
            words += [flag(name), shlex.quote(str(value))]
    return " ".join(words)


def check_values(values: Mapping[str, Any], table: Mapping[str, Option] = OPTIONS) -> None:
    """Check each given option on its own (bounds, types) against ``table`` (run's, or WATCH_OPTIONS), so bad
    values are refused before a store is even opened; raises ConfigError with a one-line message."""
    for name, value in values.items():
        spec = table.get(name)
        if spec is None:
            raise ConfigError(f"unknown run option {name!r}")
        if spec.kind == "level" and not spec.accepts(value):
            raise ConfigError(f"--opt-level: unknown opt level {value!r}; choose one of: {', '.join(spec.choices)}")
        if not spec.accepts(value):
            raise ConfigError(f"{flag(name)} must be {spec.requirement()}, got {value!r}")


#: how an FP32 twin's name ends (``--pair``), and what separates a rerun's name from its parent's
TWIN_LABEL = " (FP32 twin)"
RERUN_MARK = " ↻ "
#: what a rerun's name says about each option that changed, beyond the level (a value of None: the option cleared)
_CHANGE_WORDS = {
    "loss_scale": lambda v: "the level's scaling" if v is None else "dynamic scaling" if v == "dynamic"
    else f"static scale {scale_text(v)}",
    "init_scale": lambda v: "the script's initial scale" if v is None else f"initial scale {scale_text(v)}",
    "steps": lambda v: f"{v} steps",
    "shadow_every": lambda v: "no FP32 shadow" if not v else f"FP32 shadow every {v}",
    "every": lambda v: "statistics thinned after 1000 steps" if v is None else f"statistics every {v}",
    "trace_modules": lambda v: "modules traced" if v else "modules not traced",
    "fp8": lambda v: "FP8 statistics" if v else "no FP8 statistics",
    "fp8_recipe": lambda v: f"{str(v).upper()} blocks" if v in BLOCK_RECIPES else f"{v} scaling",
    "fp8_modules": lambda v: f"a recipe per Linear ({len([p for p in str(v).split(',') if p.strip()])})",
    "moment_format": lambda v: f"moments in {str(v).upper()}" if v else "moments as kept",
    "nproc": lambda v: f"{v} processes",
}


def fix_text(fix: Mapping[str, Any]) -> str:
    """A finding's fix (run options) in words, as a rerun's name says them: "bf16", "dynamic scaling, initial
    scale 2^23", "FP8 statistics"; an option without words as "name value"."""
    parts = [f"level {fix['opt_level']}"] if fix.get("opt_level") else []
    for name, value in fix.items():
        if name == "opt_level":
            continue
        words = _CHANGE_WORDS.get(name)
        parts.append(words(value) if words else f"{name.replace('_', ' ')} {value}")
    return ", ".join(parts)


#: where a finding's advice names its fix (Finding.fix), rendered by :func:`fix_said` for the way the run was
#: recorded: the rules state a fix once, as data, and no sentence spells mpdiag's flags itself
FIX = "{fix}"

#: an opt level as the change to make in a loop of one's own, where mpdiag's --opt-level means nothing
_LEVEL_IN_CODE = {
    "bf16": "BF16 autocast without a GradScaler",
    "O1": "FP16 autocast with FP32 weights and a GradScaler",
    "O2": "O2-style mixed precision (an FP16 model, its normalization layers and the optimizer's master weights in "
          "FP32)",
    "O0": "FP32 (no autocast)",
}


def fix_said(fix: Mapping[str, Any] | None, how: str) -> str:
    """A finding's fix as a sentence of its advice says it, for a run recorded ``how`` (:func:`recorded_by`):
    mpdiag's options (``--opt-level bf16``; ``--loss-scale dynamic --init-scale 8388608 (2^23)``), which ``mpdiag run`` and
    ``watch`` take; for a Recorder in the user's own loop, which takes none (``--init-scale 2^15`` was advised to
    one), the change in that loop (``BF16 autocast without a GradScaler``; ``a dynamic
    GradScaler(init_scale=2**23)``)."""
    fix = fix or {}
    level, init = fix.get("opt_level"), fix.get("init_scale")
    if how == "recorder":
        if level is not None:
            return _LEVEL_IN_CODE.get(level, f"mpdiag's {level} level")
        if init is not None:
            exponent = math.log2(float(init))
            power = f"2**{int(exponent)}" if exponent.is_integer() else f"{float(init):g}"
            return f"a {'dynamic ' if fix.get('loss_scale') == 'dynamic' else ''}GradScaler(init_scale={power})"
    words = [f"--opt-level {level}"] if level is not None else []
    if fix.get("loss_scale") is not None:
        words.append(f"--loss-scale {fix['loss_scale']}")
    if init is not None:  # as the command line takes it (it reads no 2^23), with the power beside it
        power = scale_text(init)
        words.append(f"--init-scale {float(init):.17g}" + (f" ({power})" if power.startswith("2^") else ""))
    return " ".join(words) or fix_text(fix)


def fix_in_code(fix: Mapping[str, Any]) -> str | None:
    """A finding's fix as the change to make in the training code itself (a Recorder's loop, or a watched script's
    own lines, where ``--opt-level`` and ``--init-scale`` are mpdiag's words, not the script's), with its spelling in
    PyTorch and in the frameworks mpdiag is tested with; None for a fix that is no such change (O2's FP16 model
    with FP32 normalization and masters, FP8 options)."""
    level = fix.get("opt_level")
    if level == "bf16":
        return ("compute in BF16 with no loss scaling: torch.autocast(device_type, dtype=torch.bfloat16) and no "
                'GradScaler (Lightning: Trainer(precision="bf16-mixed"); Accelerate: '
                'Accelerator(mixed_precision="bf16"); Hugging Face Trainer: TrainingArguments(bf16=True))')
    if level == "O0":
        return ('train in FP32: no autocast and no GradScaler (Lightning: Trainer(precision="32-true"); Accelerate: '
                'Accelerator(mixed_precision="no"))')
    if level == "O1":
        return ("compute in FP16 under autocast with FP32 weights: torch.autocast(device_type, dtype=torch.float16) "
                'and a GradScaler (Lightning: Trainer(precision="16-mixed"); Accelerate: '
                'Accelerator(mixed_precision="fp16"))')
    if level is None and fix.get("loss_scale") == "dynamic" and fix.get("init_scale") is not None:
        start = f"{float(fix['init_scale']):.0f}"
        return (f"start the GradScaler at {scale_text(fix['init_scale'])} and let it grow and back off: "
                f"torch.amp.GradScaler(init_scale={start}) with growth_interval at its default, 2000 (Lightning: "
                f'plugins=[MixedPrecision("16-mixed", device, scaler=torch.amp.GradScaler(init_scale={start}))]; '
                f"Accelerate: kwargs_handlers=[GradScalerKwargs(init_scale={start})])")
    return None


def scale_text(value: Any, digits: bool = False) -> str:
    """A loss scale as every page, finding, event and name writes it: a power of two but 1 as 2^k (GradScaler's
    2^16, never 65,536 beside 2^28 in one column, nor 0.125 beside 2^-6 in two findings; ``digits``: 2^16 (65,536)
    where there is room), other scales as their number (1, 3, 1,000, 0); "not recorded" (NaN), "not finite" (inf);
    a value that is not a number as written ("dynamic", None)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(number):
        return "not recorded"
    if math.isinf(number):
        return "not finite"
    mantissa, exponent = math.frexp(number)
    if mantissa == 0.5 and exponent != 1:
        k = exponent - 1
        return f"2^{k} ({number:,.0f})" if digits and k > 0 else f"2^{k}"
    return f"{number:,.10g}" if abs(number) >= 1 or number == 0 else f"{number:.6g}"


def rerun_name(parent_name: object, before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    """The name a rerun gets when none is typed: its parent's name without the FP32 twin label or an earlier
    rerun's ``↻ ...``, then ``↻``, the rerun's level and the other options that changed (``before``: the
    parent's options; ``after``: the rerun's; RunConfig fields or watch settings). An option the new level does
    not use is not mentioned. Never the parent's twin label: a rerun of a twin at bf16 is ``x.py ↻ bf16``."""
    base = str(parent_name or "run").split(RERUN_MARK)[0].removesuffix(TWIN_LABEL).strip() or "run"
    level = after.get("opt_level") or "as recorded"
    fp8 = bool(after.get("fp8"))
    changes = [words(after.get(name)) for name, words in _CHANGE_WORDS.items()
               if name in after and after.get(name) != before.get(name)
               and (name not in OPTIONS or level not in LEVELS or applies(name, level, fp8))]
    more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
    tail = f"{RERUN_MARK}{level}" + (f": {', '.join(changes[:3])}{more}" if changes else "")
    return base[: max(1, MAX_NAME_CHARS - len(tail))] + tail
