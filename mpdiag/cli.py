"""Command line: ``python -m mpdiag run|runs|export``.

Exit codes: 0 success, 1 the run failed (its error is printed and stored), 2 bad options or input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from mpdiag.analysis.compare import DIVERGENCE_RTOL, first_divergence, loss_comparison
from mpdiag.analysis.findings import diagnose
from mpdiag.sandbox.check import check_script
from mpdiag.sandbox.probe import KIND as PROBE_KIND
from mpdiag.sandbox.probe import run_probe
from mpdiag.store import DEFAULT_STORE, Store, StoreError
from mpdiag.training.policies import POLICIES, ConfigError, ScalingConfig
from mpdiag.training.runner import RunConfig, rerun_plan, train, train_pair
from mpdiag.training.script import ModelScript, ScriptError


def _store_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store", default=None, help=f"store file (default: $MPDIAG_STORE, else ./{DEFAULT_STORE})"
    )


def _loss_scale(text: str) -> str | float:
    if text == "dynamic":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'dynamic' or a number, got {text!r}") from None


def _run_options(parser: argparse.ArgumentParser, inherit: bool = False) -> None:
    """Run options. With ``inherit`` (rerun) every option defaults to the parent run's value."""
    d = ScalingConfig()

    def add(flag, default, help_text, **kw):
        parser.add_argument(flag, default=argparse.SUPPRESS if inherit else default,
                            help=help_text + ("" if inherit else f" (default {default})"), **kw)

    add("--opt-level", "O1", f"one of {', '.join(POLICIES)}")
    add("--loss-scale", None, "'dynamic', or a number for a static scale; default: the level's own", type=_loss_scale)
    add("--init-scale", d.init_scale, "initial dynamic loss scale", type=float)
    add("--growth-factor", d.growth_factor, "dynamic scale growth factor", type=float)
    add("--backoff-factor", d.backoff_factor, "dynamic scale backoff factor", type=float)
    add("--growth-interval", d.growth_interval, "clean steps before the scale grows", type=int)
    add("--min-scale", None, "lower bound of the dynamic scale", type=float)
    add("--max-scale", None, "upper bound of the dynamic scale", type=float)
    add("--steps", 200, "training steps", type=int)
    add("--seed", 0, "seed for torch, numpy and random", type=int)
    add("--every", 1, "record tensor statistics every N steps", type=int)
    add("--shadow-every", 0, "every N steps, compare each tensor's gradient with an FP32 computation on the same "
        "weights and batch (0: off)", type=int)
    add("--device", "auto", "auto (CUDA when present), cpu or cuda[:N]")
    add("--name", None, "display name of the run")
    add("--nproc", 1, "processes of a data-parallel job, launched through torch.distributed.run", type=int)
    add("--parallel", "ddp", "with --nproc above 1: ddp (DistributedDataParallel) or fsdp (FSDP2 fully_shard)")
    parser.add_argument("--trace-modules", action="store_true", default=argparse.SUPPRESS if inherit else False,
                        help="record each module's output and gradient absmax per step, to locate the first inf/NaN")
    parser.add_argument("--pair", action="store_true", help="also run an O0 twin on identical weights and batches")
    _store_arg(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mpdiag", description="Mixed-precision training diagnostics.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a model script and record it")
    run.add_argument("script", help="path of a model script (.py) defining build(device), or sha256:HASH of a stored one")
    _run_options(run)
    check = sub.add_parser("check", help="check a model script in a supervised child process, without training")
    check.add_argument("script")
    check.add_argument("--device", default="auto")
    diagnose = sub.add_parser("diagnose", help="findings: what is wrong with a run, where, and what to change")
    diagnose.add_argument("run_id", type=int)
    diagnose.add_argument("--json", action="store_true", help="print the findings as JSON")
    diagnose.add_argument("--no-probe", action="store_true",
                          help="skip the scale-linearity probe (it reruns one batch of the stored script in a child)")
    _store_arg(diagnose)
    runs = sub.add_parser("runs", help="list the runs in the store")
    _store_arg(runs)
    rerun = sub.add_parser("rerun", help="run a stored run's script again, overriding any option")
    rerun.add_argument("run_id", type=int)
    _run_options(rerun, inherit=True)
    export = sub.add_parser("export", help="write a run's records as Parquet and CSV")
    export.add_argument("run_id", type=int)
    export.add_argument("--out", required=True, help="output directory")
    _store_arg(export)
    return parser


OPTION_NAMES = ("opt_level", "loss_scale", "init_scale", "growth_factor", "backoff_factor", "growth_interval",
                "min_scale", "max_scale", "steps", "seed", "every", "shadow_every", "device", "name", "trace_modules",
                "nproc", "parallel")


def _options(args: argparse.Namespace) -> dict:
    """The run options given on the command line (all of them for run, only those typed for rerun)."""
    return {k: getattr(args, k) for k in OPTION_NAMES if hasattr(args, k)}


def _progress(total: int):
    every = max(1, total // 20)

    def show(step: int, loss: float) -> None:
        if step % every == 0 or step == total - 1:
            print(f"step {step:>6}/{total}  loss {loss:.6g}", flush=True)

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
    return 0


def _execute(script: ModelScript, config: RunConfig, store: Store, pair: bool) -> int:
    print(f"mpdiag: running {script.filename} at {config.opt_level} into {store.path}", flush=True)
    progress = _progress(config.steps)
    if not pair:
        return report(store, train(script, config, store.path, progress=progress))
    mixed_id, fp32_id = train_pair(script, config, store.path, progress=progress)
    code = max(report(store, mixed_id), report(store, fp32_id))
    comparison = loss_comparison(store.steps(fp32_id), store.steps(mixed_id))
    step = first_divergence(comparison)
    where = "never" if step is None else f"first at step {step}"
    print(f"loss vs FP32 twin: relative difference above {DIVERGENCE_RTOL:.0%} {where}")
    return code


STORED_PREFIX = "sha256:"


def cmd_run(args: argparse.Namespace) -> int:
    store = Store(args.store)
    if args.script.startswith(STORED_PREFIX):  # a script kept in the store (uploaded in the app)
        filename, source = store.script_source(args.script.removeprefix(STORED_PREFIX))
        script = ModelScript(filename=filename, source=source)
    else:
        script = ModelScript.from_path(args.script)
    config = RunConfig().with_options(**_options(args))
    return _execute(script, config, store, args.pair)


def cmd_rerun(args: argparse.Namespace) -> int:
    store = Store(args.store, create=False)
    script, config = rerun_plan(store, args.run_id, **_options(args))
    return _execute(script, config, store, args.pair)


def cmd_check(args: argparse.Namespace) -> int:
    script = ModelScript.from_path(args.script)
    report = check_script(script.filename, script.source, args.device)
    print(report.text())
    return 0 if report.ready else 1


def cmd_diagnose(args: argparse.Namespace) -> int:
    store = Store(args.store, create=False)
    run = store.run(args.run_id)
    if not args.no_probe and run["scaling"] != "none" and store.probe(args.run_id, PROBE_KIND) is None:
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
        if f.fix:
            flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in f.fix.items())
            print(f"  check it: python -m mpdiag rerun {args.run_id} {flags}")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    runs = Store(args.store).runs()
    if runs.empty:
        print("no runs yet: python -m mpdiag run mpdiag/examples/mlp_digits.py")
        return 0
    cols = ["run_id", "name", "opt_level", "scaling", "init_scale", "device", "status", "steps_done", "skipped_steps",
            "final_loss", "parent_run_id", "pair_run_id"]
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(runs[cols].to_string(index=False))
    return 0


def export_run(store: Store, run_id: int, out: Path) -> list[Path]:
    """Write every table of one run as Parquet and CSV into ``out``; returns the written paths."""
    out.mkdir(parents=True, exist_ok=True)
    tables = {
        "run": store.run(run_id).to_frame().T,
        "steps": store.steps(run_id),
        "tensors": store.tensors(run_id).assign(shape=lambda d: d["shape"].map(str)),
        "tensor_stats": store.tensor_stats(run_id),
        "histograms": store.histograms(run_id).assign(exponent=lambda d: d["exponent"].map(str)),
        "module_stats": store.module_stats(run_id),
        "update_stats": store.update_stats(run_id),
        "shadow_stats": store.shadow_stats(run_id),
    }
    probe = store.probe(run_id, PROBE_KIND)
    if probe is not None:
        tables["probe"] = pd.DataFrame([{"kind": PROBE_KIND, "result": json.dumps(probe)}])
    written = []
    for name, df in tables.items():
        stem = out / f"run{run_id}_{name}"
        df = df.infer_objects()
        df.to_parquet(stem.with_suffix(".parquet"), index=False)
        df.to_csv(stem.with_suffix(".csv"), index=False)
        written += [stem.with_suffix(".parquet"), stem.with_suffix(".csv")]
    return written


def cmd_export(args: argparse.Namespace) -> int:
    written = export_run(Store(args.store, create=False), args.run_id, Path(args.out))
    print("\n".join(str(p) for p in written))
    return 0


COMMANDS = {"run": cmd_run, "check": cmd_check, "diagnose": cmd_diagnose, "rerun": cmd_rerun, "runs": cmd_runs, "export": cmd_export}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, ScriptError, StoreError) as exc:
        print(f"mpdiag: {exc}", file=sys.stderr)
        return 2
