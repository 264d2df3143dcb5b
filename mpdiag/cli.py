"""Command line: ``python -m mpdiag run|rerun|watch|check|diagnose|plan|runs|export|dashboard``; ``runs`` lists,
renames, tags, notes and deletes runs (through the store's writer, one method per action).

Exit codes: 0 success, 1 the run failed (its error is printed and stored), 2 bad options or input (one line
on stderr, and nothing created). Owns argument parsing and what each command prints. Must not define run or
watch options, their defaults or their bounds: the flags of run, rerun and watch are generated from the options
table (:data:`mpdiag.options.OPTIONS`, watch's as :data:`mpdiag.options.WATCH_OPTIONS`), and validated by it
before any store is opened.

Torch is imported inside the commands that load a script, train or watch, not at the top: ``runs``,
``diagnose``, ``export``, ``dashboard`` and ``--help`` answer in under a second, without its 3 s import.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from mpdiag.analysis.compare import DIVERGENCE_RTOL, first_divergence, loss_comparison
from mpdiag.analysis.findings import diagnose, fix_not_rerunnable
from mpdiag.analysis.plan import LABELS, MAX_ROUNDS, Plan, plan_run
from mpdiag.analysis.run_choice import select_runs
from mpdiag.options import (
    ALL_LEVELS,
    COMMAND_OPTIONS,
    FP8_RECIPE_OPTIONS,
    OPTIONS,
    WATCH_OPTIONS,
    WATCH_RERUN_OPTIONS,
    ConfigError,
    Option,
    RunConfig,
    ScriptError,
    check_values,
    command_flags,
    fix_in_code,
    flag,
    rerunnable_by_watch,
    torchrun_rerun,
    watch_fix,
    watch_settings,
)
from mpdiag.recording.console import tee_console
from mpdiag.sandbox.check import check_script
from mpdiag.sandbox.probe import KIND as PROBE_KIND
from mpdiag.sandbox.probe import run_probe
from mpdiag.store import DEFAULT_STORE, RunTextRefused, Store, StoreError, StoreWriter
from mpdiag.store.export import export_run

if TYPE_CHECKING:
    from mpdiag.training.script import ModelScript
    from mpdiag.training.watch_config import WatchConfig


def _store_arg(parser: argparse.ArgumentParser, inner: bool = False) -> None:
    """--store; ``inner``: on an action of ``runs`` too, where its default must not hide one given before it."""
    parser.add_argument(
        "--store", default=argparse.SUPPRESS if inner else None,
        help=f"store file (default: $MPDIAG_STORE, else ./{DEFAULT_STORE})"
    )


def _runs_filters(parser: argparse.ArgumentParser, inner: bool = False) -> None:
    """The runs listing's filters: each repeatable, a run is kept when it matches any value given."""
    default = argparse.SUPPRESS if inner else []
    parser.add_argument("--tag", action="append", default=default, help="runs carrying this tag (repeatable)")
    parser.add_argument("--status", action="append", default=default,
                        help="runs with this status: queued, running, stalled, finished, failed, crashed, stopped (repeatable)")
    parser.add_argument("--script", action="append", default=default,
                        help="runs of this script file name, as the listing shows it (repeatable)")
    if inner:
        _store_arg(parser, inner=True)


def _add_option(parser: argparse.ArgumentParser, name: str, inherit: bool = False,
                table: Mapping[str, Option] = OPTIONS) -> None:
    """The flag of option ``name``, from its entry in ``table`` (run's, or WATCH_OPTIONS). With ``inherit``
    (rerun) it defaults to the parent run's value, so only typed options are present in the parsed arguments."""
    spec = table[name]
    applies = "" if spec.levels == ALL_LEVELS else f"; applies to {', '.join(spec.levels)}"
    said_default = not inherit and spec.default not in (None, False)  # no "(default None)": absent means unset
    help_text = (spec.help + applies + (f" (default {spec.default})" if said_default else "")).replace("%", "%%")
    default = argparse.SUPPRESS if inherit else spec.default
    if spec.kind == "flag":
        parser.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction, default=default,
                            help=help_text)
        return

    def parse(text: str):
        try:
            return spec.parse(text)
        except ValueError:
            return text  # not a number: validation refuses it with the option's one-line message

    parser.add_argument(flag(name), dest=name, type=parse, default=default, help=help_text)


def _run_options(parser: argparse.ArgumentParser, inherit: bool = False) -> None:
    """Every run option that has a flag (mpdiag.options.OPTIONS), then --pair and --store."""
    for name, spec in OPTIONS.items():
        if spec.no_flag is None:
            _add_option(parser, name, inherit)
    parser.add_argument("--pair", action="store_true", help=COMMAND_OPTIONS["pair"].help)
    _store_arg(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mpdiag", description="Mixed-precision training diagnostics.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a model script and record it")
    run.add_argument("script", help="path of a model script (.py) defining build(device), or sha256:HASH of a stored one")
    _run_options(run)
    check = sub.add_parser("check", help="check a model script in a supervised child process, without training")
    check.add_argument("script")
    _add_option(check, "device")
    _diagnose_parser(sub)
    _plan_parser(sub)
    _runs_parser(sub)
    rerun = sub.add_parser("rerun", help="run a stored run's script again, overriding any option")
    rerun.add_argument("run_id", type=int)
    _run_options(rerun, inherit=True)
    _watch_parser(sub)
    _export_parser(sub)
    dashboard = sub.add_parser("dashboard", help="start the dashboard (the Streamlit app) on this machine")
    dashboard.add_argument("--port", type=int, default=8501, help="port on 127.0.0.1 (default 8501)")
    _store_arg(dashboard)
    return parser


def _diagnose_parser(sub) -> None:
    diagnose = sub.add_parser("diagnose", help="findings: what is wrong with a run, where, and what to change")
    diagnose.add_argument("run_id", type=int)
    diagnose.add_argument("--json", action="store_true", help="print the findings as JSON")
    diagnose.add_argument("--no-probe", action="store_true",
                          help="skip the scale-linearity probe (it reruns one batch of the stored script in a child)")
    _store_arg(diagnose)


def _plan_parser(sub) -> None:
    plan = sub.add_parser("plan", help="a precision plan: the cheapest precision for each Linear, the run and the "
                          "optimizer state that a run recorded with --fp8 allows, with evidence and savings")
    plan.add_argument("run_id", type=int)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--verify", action="store_true", help="rerun the plan as planned beside the FP32 reference "
                      "(fp8-sim, or fp8-sim-fp16 with a GradScaler from the planned scale when the run is FP16; a "
                      "recipe per Linear; the optimizer's moments held in their planned format); promote a Linear "
                      f"and rerun while the loss does not track FP32 (at most {MAX_ROUNDS} rounds); each round's "
                      "predicted against measured")
    _store_arg(plan)


def _watch_parser(sub) -> None:
    watch = sub.add_parser("watch", help="run an unmodified training script (python SCRIPT ARGS...) and record it",
                           usage="%(prog)s [options] (SCRIPT | -m MODULE) [ARGS...]")
    watch.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m MODULE would")
    for name in WATCH_OPTIONS:
        _add_option(watch, name, table=WATCH_OPTIONS)
    _store_arg(watch)
    watch.add_argument("command_line", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS...]",
                       help="the script and its arguments: everything after SCRIPT belongs to the script")


def _export_parser(sub) -> None:
    export = sub.add_parser("export", help="write a run's records as Parquet and CSV")
    export.add_argument("run_id", type=int)
    export.add_argument("--out", required=True, help="output directory: new or empty (see --force)")
    export.add_argument("--force", action="store_true", help="write into a directory that is not empty, replacing "
                        "files of the same names")
    _store_arg(export)


def _runs_parser(sub) -> None:
    """``runs``: list the runs (filtered), or act on one (rename, tag, untag, note, delete)."""
    runs = sub.add_parser("runs", help="list the runs in the store (filter by --tag, --status, --script); rename, "
                          "tag, untag, note or delete one", description="Without an action: list the runs.")
    _runs_filters(runs)
    _store_arg(runs)
    actions = runs.add_subparsers(dest="action", metavar="{list,rename,tag,untag,note,delete}")
    listing = actions.add_parser("list", help="list the runs (the default)")
    _runs_filters(listing, inner=True)
    for name, helps, extra in (
        ("rename", "give a run a new name", [("name", {"help": "the new name (quote it if it has spaces)"})]),
        ("tag", "add tags to a run", [("tags", {"nargs": "+", "metavar": "TAG"})]),
        ("untag", "remove tags from a run", [("tags", {"nargs": "+", "metavar": "TAG"})]),
        ("note", "set a run's note (\"\" clears it)", [("text", {"help": "the note (quote it)"})]),
        ("delete", "delete a run and every row recorded for it (asks first)", []),
    ):
        action = actions.add_parser(name, help=helps, description=helps)
        action.add_argument("run_id", type=int)
        for arg, kwargs in extra:
            action.add_argument(arg, **kwargs)
        if name == "delete":
            action.add_argument("--yes", action="store_true", help="do not ask (needed when not at a terminal)")
        _store_arg(action, inner=True)


def _options(args: argparse.Namespace) -> dict:
    """The run options given on the command line (all of them for run, only those typed for rerun), each
    checked on its own: bad values are refused before a store is opened or created."""
    options = {k: getattr(args, k) for k in OPTIONS if hasattr(args, k)}
    check_values(options)
    return options


def _progress(total: int):
    every = max(1, total // 20)

    def show(run_id: int, step: int, loss: float) -> None:
        if step % every == 0 or step == total - 1:
            print(f"run {run_id}  step {step:>6}/{total}  loss {loss:.6g}", flush=True)

    return show


def report(store: Store, run_id: int) -> int:
    """Print a run's outcome; returns the exit code for it."""
    run = store.run(run_id)
    print(
        f"run {run_id} ({run['name']}): {run['status']}, {run['steps_done']} steps, "
        f"{run['skipped_steps']} skipped, final loss {run['final_loss']:.6g}"
    )
    if isinstance(run["note"], str):
        print(f"note: {run['note']}")
    if run["status"] == "failed":
        print(f"error: {run['error']}", file=sys.stderr)
        return 1
    if run["status"] == "stopped":  # --stop-on's event, or a signal (the dashboard's Stop, Ctrl-C)
        print(f"stopped: {run['error']}", file=sys.stderr)
        return _stopped_exit_code(run["error"])
    return 0


def _stopped_exit_code(reason) -> int:
    """A stopped run's exit status: as python's for the signal that stopped it (128 + its number: SIGTERM 143,
    SIGINT 130), else --stop-on's (an event ended the training cleanly)."""
    from mpdiag.training.watch import STOPPED_EXIT_CODE

    for stop in (signal.SIGTERM, signal.SIGINT):
        if isinstance(reason, str) and stop.name in reason:
            return 128 + stop
    return STOPPED_EXIT_CODE


def _execute(script: ModelScript, config: RunConfig, store: Store, pair: bool) -> int:
    from mpdiag.training.runner import RunStopped, train, train_pair

    print(f"mpdiag: running {script.filename} at {config.opt_level} into {store.path}", flush=True)
    progress = _progress(config.steps)
    with tee_console() as console:  # what the run prints, kept with it (and shown on the terminal as ever)
        if not pair:
            run_id = train(script, config, store.path, progress=progress, console=console)
        else:
            try:
                mixed_id, fp32_id = train_pair(script, config, store.path, progress=progress, console=console)
            except RunStopped as exc:  # the first run was stopped (and recorded so): no twin, no traceback
                print(f"mpdiag: {exc}", file=sys.stderr)
                return 128 + signal.SIGTERM
    if not pair:
        return report(store, run_id)
    code = max(report(store, mixed_id), report(store, fp32_id))
    comparison = loss_comparison(store.steps(fp32_id), store.steps(mixed_id))
    step = first_divergence(comparison)
    where = "never" if step is None else f"first at step {step}"
    print(f"loss vs FP32 twin: relative difference above {DIVERGENCE_RTOL:.0%} {where}")
    return code


STORED_PREFIX = "sha256:"


def cmd_run(args: argparse.Namespace) -> int:
    from mpdiag.training.runner import resolve_device
    from mpdiag.training.script import ModelScript

    config = RunConfig().with_options(**_options(args))
    config.validate()  # every option and combination, before any file is created
    if args.pair:
        config.fp32_twin()
    resolve_device(config.device)  # a CUDA device that is not there, too
    if args.script.startswith(STORED_PREFIX):  # a script kept in the store (uploaded in the app)
        store = Store(args.store, create=False)
        filename, source = store.script_source(args.script.removeprefix(STORED_PREFIX))
        script = ModelScript(filename=filename, source=source)
    else:
        script = ModelScript.from_path(args.script)
        store = Store(args.store)
    return _execute(script, config, store, args.pair)


def cmd_rerun(args: argparse.Namespace) -> int:
    from mpdiag.training.runner import rerun_plan
    from mpdiag.training.watch_config import rerun_config

    options = _options(args)
    store = Store(args.store, create=False)
    parent = store.run(args.run_id)
    watched = watch_settings(parent["config"])
    if watched is not None:  # recorded by mpdiag watch: repeat its command
        if watched.get("bundle"):
            raise ConfigError(f"run {args.run_id} ran training code uploaded in the app; rerun it there (the Runs "
                              "page's rerun form, or a fix on the Findings page), where uploaded code runs in a "
                              "supervised child process and never in this one.")
        typed = watch_fix({k: v for k, v in options.items() if v is not None})
        refused = torchrun_rerun(parent["config"], parent["world_size"], command_flags(typed))
        if refused is not None:
            raise ConfigError(f"run {args.run_id}: {refused}")
        if args.pair:
            raise ConfigError(f"run {args.run_id} was recorded by mpdiag watch, which runs no FP32 twin (--pair).")
        config = rerun_config(args.run_id, parent["name"], watched, **typed)
        return _watch_and_report(config, store)
    script, config = rerun_plan(store, args.run_id, **options)
    return _execute(script, config, store, args.pair)


def cmd_check(args: argparse.Namespace) -> int:
    from mpdiag.training.script_source import ModelScript  # torch-free: the script runs in the check's child

    check_values({"device": args.device})
    script = ModelScript.from_path(args.script)
    report = check_script(script.filename, script.source, args.device)
    print(report.text())
    return 0 if report.ready else 1


def cmd_diagnose(args: argparse.Namespace) -> int:
    store = Store(args.store, create=False)
    run = store.run(args.run_id)
    own_loop = not isinstance(run["script_sha256"], str)  # recorded by a Recorder or watch: nothing to rerun or probe
    watched = watch_settings(run["config"])
    if not args.no_probe and not own_loop and run["scaling"] != "none" and store.probe(args.run_id, PROBE_KIND) is None:
        print(f"probing run {args.run_id}: recomputing one batch at two loss scales in a child process…", file=sys.stderr)
        run_probe(store.path, args.run_id)
    findings = diagnose(store, args.run_id)
    if args.json:
        print(json.dumps([f.as_dict() for f in findings], indent=2))
        return 0
    if not findings:
        print(f"run {args.run_id} ({run['name']}, {run['opt_level']}): no findings")
    for f in findings:
        print(f"[{f.severity}] {f.title}\n  evidence: {f.evidence}\n  do: {f.recommendation}")
        blocked = fix_not_rerunnable(run["config"], f.fix, run["world_size"], run["scaling"]) if f.fix else None
        if blocked is not None:  # a Recorder's run (the change in its loop, in code), or what watch cannot change
            print(f"  check it: {blocked}")
        elif f.fix and own_loop and rerunnable_by_watch(run["config"], f.fix) and watched.get("bundle"):
            print(f"  check it: rerun it with {command_flags(watch_fix(f.fix))} from the app's Findings page (the run's "
                  "code was uploaded there)")
        elif f.fix and own_loop and rerunnable_by_watch(run["config"], f.fix):
            print(f"  check it: python -m mpdiag rerun {args.run_id} {command_flags(watch_fix(f.fix))}  (repeats the "
                  "watched command)")
        elif f.fix:
            print(f"  check it: python -m mpdiag rerun {args.run_id} {command_flags(f.fix)}")
        in_code = fix_in_code(f.fix) if f.fix and watched is not None else None
        if in_code is not None:
            print(f"  in the script itself: {in_code}")
    return 0


def _megabytes(n: float) -> str:
    return f"{n / 1e6:,.3f} MB"


def plan_text(plan: Plan) -> str:
    """A plan as ``mpdiag plan`` prints it: the run, the optimizer, each Linear with its evidence and the cheaper
    choices it rejected, the savings, what was not recorded and the rerun that takes it."""
    scale = f", dynamic loss scaling from 2^{plan.loss_scale_log2}" if plan.loss_scale_log2 is not None else ""
    lines = [f"run: {LABELS[plan.run_precision]}{scale}", f"  evidence: {plan.run_evidence}",
             f"optimizer moments: {LABELS.get(plan.moment_format, 'none') if plan.moments else 'none'}",
             f"  evidence: {plan.moment_evidence}"]
    for layer in plan.layers:
        lines.append(f"{layer.layer}: {LABELS[layer.choice]}")
        lines.append(f"  evidence: {layer.evidence}")
        lines += [f"  not {LABELS[recipe]}: {why}" for recipe, why in layer.rejected.items()]
    memory, gemm = plan.memory["bytes"], plan.gemm
    lines.append(f"memory (16Ψ account, Ψ = {plan.memory['params']:,}): FP32 {_megabytes(memory['fp32'])}, mixed "
                 f"precision {_megabytes(memory['mixed'])}, plan {_megabytes(memory['plan'])}")
    lines.append(f"Linear GEMM operands per step: FP32 {_megabytes(gemm['fp32'])}, BF16 {_megabytes(gemm['bf16'])}, "
                 f"plan {_megabytes(gemm['plan'])}")
    lines += [f"not recorded: {note}" for note in plan.notes]
    lines.append(f"take it: python -m mpdiag rerun {plan.run_id} {plan.flags()}")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    store = Store(args.store, create=False)
    try:
        plan = plan_run(store, args.run_id)
    except ValueError as exc:
        return _refuse(str(exc))
    if args.json and not args.verify:
        print(json.dumps(plan.as_dict(), indent=2))
        return 0
    run = store.run(args.run_id)
    if not args.json:
        print(f"plan for run {args.run_id} ({printable(run['name'])}, {run['opt_level']}):\n{plan_text(plan)}")
    if not args.verify:
        return 0
    from mpdiag.analysis.plan_verify import BYTES_UNMEASURED, round_lines, round_row, verify

    reference, rounds = verify(store.path, args.run_id, progress=_progress(int(run["steps"])))
    rows = [round_row(number, done.run_id, done.plan, done.rel_diff, done.said) for number, done in enumerate(rounds, 1)]
    if args.json:
        print(json.dumps({"plan": plan.as_dict(), "reference_run_id": reference, "bytes_measured": BYTES_UNMEASURED,
                          "rounds": [{"run_id": r.run_id, "tracked": r.tracked, "rel_diff": r.rel_diff, "said": r.said,
                                      "promoted": r.promoted, "options": r.plan.rerun_options(),
                                      "fp8_modules": r.plan.module_flag(), "row": row}
                                     for r, row in zip(rounds, rows, strict=True)]}, indent=2))
        return 0
    for done, row in zip(rounds, rows, strict=True):
        print("\n  ".join(round_lines(row, done.promoted)))
    final = rounds[-1]
    print(f"verified: run {final.run_id} tracks FP32 run {reference}; take it: {final.plan.flags()}" if final.tracked
          else f"not verified in {len(rounds)} rounds: the last plan does not track FP32 run {reference}")
    return 0 if final.tracked else 1


def cmd_watch(args: argparse.Namespace) -> int:
    from mpdiag.recording.distributed import RankContext
    from mpdiag.training.distributed import exit_skipping_finalization, launched_by_torchrun
    from mpdiag.training.watch import WatchConfig, watch

    if args.module is None and not args.command_line:
        raise ConfigError("watch needs a script (watch [options] SCRIPT [ARGS...]) or -m MODULE")
    target, rest = (args.module, args.command_line) if args.module else (args.command_line[0], args.command_line[1:])
    recipe = RunConfig(opt_level="O0", fp8=args.fp8, **{name: getattr(args, name) for name in FP8_RECIPE_OPTIONS})
    recipe.validate()  # a recipe option without --fp8 is refused, naming it
    config = WatchConfig(target=target, args=tuple(rest), module=args.module is not None,
                         fp8=recipe.fp8_settings() if args.fp8 else None,
                         **{name: getattr(args, name) for name in WATCH_RERUN_OPTIONS})
    config.validate()  # the flags are parsed by the table, not argparse: refused here, before a store is opened
    if RankContext.launched_as_other_rank():  # torchrun: rank 0 opens (and may create) the store, not this rank
        code = watch(config, args.store or DEFAULT_STORE)[1]
        if launched_by_torchrun():
            exit_skipping_finalization(code)
        return code
    return _watch_and_report(config, Store(args.store))


def _watch_and_report(config: WatchConfig, store: Store) -> int:
    """Watch ``config`` into ``store`` from its working directory, print the run's outcome, return the script's
    exit code."""
    from mpdiag.training.distributed import exit_skipping_finalization, launched_by_torchrun
    from mpdiag.training.watch import watch

    here = os.getcwd()
    os.chdir(config.cwd)  # the script's relative paths are relative to where it was started
    try:
        with tee_console() as console:  # the script's output, kept with the run and shown here unchanged
            run_id, code = watch(config, store.path, console=console)
    finally:
        os.chdir(here)
    run = store.run(run_id)
    print(f"mpdiag watch: run {run_id} ({run['name']}): {run['status']}, {run['steps_done']} steps, "
          f"{run['skipped_steps']} skipped, into {store.path}", file=sys.stderr)
    if isinstance(run["note"], str):
        print(f"mpdiag watch: note: {run['note']}", file=sys.stderr)
    if run["status"] == "stopped":
        print(f"mpdiag watch: stopped: {run['error']}", file=sys.stderr)
    if launched_by_torchrun():
        exit_skipping_finalization(code)
    return code


def printable(text: object) -> str:
    """``text`` safe to print on a terminal: control and invisible formatting characters (an escape sequence
    in a run name written by a script) shown as \\xNN / \\uNNNN, not sent to the terminal."""
    return "".join(ch.encode("unicode_escape").decode() if unicodedata.category(ch) in ("Cc", "Cf") else ch
                   for ch in str(text))


def cmd_runs(args: argparse.Namespace) -> int:
    action = getattr(args, "action", None) or "list"
    if action == "list":
        return _list_runs(args)
    store = Store(args.store, create=False)
    run = store.run(args.run_id)  # an unknown run is refused before anything is written
    label = f"run {args.run_id} ({printable(run['name'])})"
    try:
        with StoreWriter(store.path) as writer:
            if action == "rename":
                print(f"{label} renamed to {printable(writer.rename_run(args.run_id, args.name))}")
            elif action in ("tag", "untag"):
                change = writer.tag_run if action == "tag" else writer.untag_run
                tags = change(args.run_id, args.tags)
                print(f"{label} tags: {printable(', '.join(tags)) or 'none'}")
            elif action == "note":
                note = writer.set_user_note(args.run_id, args.text)
                print(f"{label} note {'saved' if note else 'cleared'}")
            elif action == "delete":
                if not args.yes and not _confirm_delete(label, run):
                    return _refuse(f"{label} was not deleted" + ("" if sys.stdin.isatty() else
                                   ": not at a terminal, so nothing can be confirmed; pass --yes to delete it"))
                deleted = writer.delete_run(args.run_id)
                print(f"deleted {label}: {sum(deleted.values()):,} rows from "
                      f"{sum(1 for n in deleted.values() if n)} tables; scripts and other runs were not touched")
    except RunTextRefused as exc:
        return _refuse(str(exc))
    return 0


def _confirm_delete(label: str, run: pd.Series) -> bool:
    """Ask on the terminal; False (nothing asked) when stdin is not one."""
    if not sys.stdin.isatty():
        return False
    answer = input(f"Delete {label}, {run['status']}, {int(run['steps_done'])} steps, and every row recorded for "
                   "it? This cannot be undone. [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def _number(fmt: str):
    """A column formatter: ``fmt`` for a number, blank for a value the run does not have (no NaN on the terminal)."""
    return lambda v: "" if v is None or (not isinstance(v, (str, list)) and pd.isna(v)) else format(v, fmt)


# Losses in significant digits (0.000064 read as 6.4e-05), scales and ids as whole numbers; blank where absent
# (an O0 run has no initial scale, a run without a twin no pair).
_RUNS_FORMATTERS = {"final_loss": _number(".6g"), "init_scale": _number(".6g"), "steps_done": _number(",.0f"),
                    "skipped_steps": _number(",.0f"), "parent_run_id": _number(".0f"), "pair_run_id": _number(".0f")}


def _list_runs(args: argparse.Namespace) -> int:
    runs = Store(args.store).runs()
    if runs.empty:
        print("no runs yet: python -m mpdiag run mpdiag/examples/mlp_digits.py")
        return 0
    shown = select_runs(runs, tags=args.tag, statuses=args.status, scripts=args.script)
    if shown.empty:
        print(f"no run matches these filters ({len(runs)} runs in the store)")
        return 0
    table = shown.assign(name=shown["name"].map(printable), tags=shown["tags"].map(lambda t: printable(",".join(t))),
                         note=shown["user_note"].map(lambda n: printable(n.splitlines()[0][:40]) if isinstance(n, str)
                                                      and n else ""))
    cols = ["run_id", "name", "tags", "opt_level", "scaling", "init_scale", "device", "status", "steps_done",
            "skipped_steps", "final_loss", "parent_run_id", "pair_run_id", "note"]
    with pd.option_context("display.width", 250, "display.max_columns", 20, "display.max_colwidth", 60):
        shown = table[cols].astype(object).apply(lambda col: col.map(_RUNS_FORMATTERS.get(col.name, _number(""))))
        print(shown.to_string(index=False))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    store = Store(args.store, create=False)
    store.run(args.run_id)  # an unknown run is refused before anything is created
    out = Path(args.out)
    try:
        if out.is_dir() and any(out.iterdir()) and not args.force:
            return _refuse(f"{out} is not empty; export into a new or empty directory, or pass --force to write into "
                           "it (files of the same names are replaced)")
        written = export_run(store, args.run_id, out)
    except OSError as exc:
        return _refuse(f"cannot write the export to {out}: {exc.strerror or exc}")
    print("\n".join(str(p) for p in written))
    return 0


def _refuse(message: str) -> int:
    print(f"mpdiag: {message}", file=sys.stderr)
    return 2


VALUE_FLAGS = frozenset(flag(name) for name, spec in OPTIONS.items() if spec.no_flag is None and spec.kind != "flag")


def _attach_dash_values(argv: list[str]) -> list[str]:
    """``--name -x`` as ``--name=-x``: argparse reads an argument starting with a dash as an option, not as
    the value the flag before it needs; a run option's value is the next argument, whatever it looks like."""
    joined: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--":
            joined += [arg, *args]
            break
        value = next(args, None) if arg in VALUE_FLAGS else None
        if value is not None and value.startswith("-"):
            joined.append(f"{arg}={value}")
        else:
            joined += [arg] if value is None else [arg, value]
    return joined


def app_directory() -> Path:
    """Where the Streamlit app (app.py, pages/, .streamlit/) lives: beside the package in a source checkout or
    an editable install, else where `pip install` put it (<prefix>/share/mpdiag)."""
    for folder in (Path(__file__).resolve().parent.parent, Path(sys.prefix) / "share" / "mpdiag"):
        if (folder / "app.py").is_file() and (folder / "pages").is_dir():
            return folder
    raise ConfigError(f"the dashboard's files (app.py, pages/) are neither beside {Path(__file__).parent} nor in "
                      f"{Path(sys.prefix) / 'share' / 'mpdiag'}: reinstall mpdiag (pip install .)")


def cmd_dashboard(args: argparse.Namespace) -> int:
    """streamlit run app.py in the app's folder (so its .streamlit/config.toml applies: this machine only, the
    upload limit, no error details), on the store named here resolved against the caller's directory. This process
    becomes the server (exec), so a signal that stops it stops the server: as a child, it outlived a SIGTERM sent
    to the command and kept serving."""
    folder = app_directory()
    store = Path(args.store or os.environ.get("MPDIAG_STORE") or DEFAULT_STORE).absolute()
    print(f"mpdiag dashboard on http://127.0.0.1:{args.port} (store {store}, app {folder}); Ctrl+C stops it",
          flush=True)
    os.chdir(folder)
    os.execve(sys.executable, [sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(args.port)],
              {**os.environ, "MPDIAG_STORE": str(store)})


COMMANDS = {"run": cmd_run, "check": cmd_check, "diagnose": cmd_diagnose, "plan": cmd_plan, "rerun": cmd_rerun, "runs": cmd_runs,
            "export": cmd_export, "watch": cmd_watch, "dashboard": cmd_dashboard}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # watch: everything after SCRIPT is the script's own, passed on untouched
    args = build_parser().parse_args(argv if argv[:1] == ["watch"] else _attach_dash_values(argv))
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, ScriptError, StoreError) as exc:
        return _refuse(str(exc))
