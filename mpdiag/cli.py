"""Command line: ``python -m mpdiag run|runs|export``.

Exit codes: 0 success, 1 the run failed (its error is printed and stored), 2 bad options or input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from mpdiag.policies import POLICIES, ConfigError, ScalingConfig
from mpdiag.runner import RunConfig, train
from mpdiag.script import ModelScript, ScriptError
from mpdiag.store import DEFAULT_STORE, Store, StoreError


def _store_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store", default=None, help=f"store file (default: $MPDIAG_STORE, else ./{DEFAULT_STORE})"
    )


def _run_options(parser: argparse.ArgumentParser) -> None:
    defaults = ScalingConfig()
    parser.add_argument("--opt-level", default="O1", help=f"one of {', '.join(POLICIES)} (default O1)")
    parser.add_argument("--init-scale", type=float, default=defaults.init_scale, help="initial loss scale (default 65536)")
    parser.add_argument("--growth-factor", type=float, default=defaults.growth_factor)
    parser.add_argument("--backoff-factor", type=float, default=defaults.backoff_factor)
    parser.add_argument("--growth-interval", type=int, default=defaults.growth_interval)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=1, help="record tensor statistics every N steps (default 1)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]")
    parser.add_argument("--name", default=None, help="display name of the run")
    _store_arg(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mpdiag", description="Mixed-precision training diagnostics.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a model script and record it")
    run.add_argument("script", help="path of a model script (.py) defining build(device)")
    _run_options(run)
    runs = sub.add_parser("runs", help="list the runs in the store")
    _store_arg(runs)
    export = sub.add_parser("export", help="write a run's records as Parquet and CSV")
    export.add_argument("run_id", type=int)
    export.add_argument("--out", required=True, help="output directory")
    _store_arg(export)
    return parser


def _config(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        opt_level=args.opt_level,
        scaling=ScalingConfig(
            init_scale=args.init_scale,
            growth_factor=args.growth_factor,
            backoff_factor=args.backoff_factor,
            growth_interval=args.growth_interval,
        ),
        steps=args.steps,
        seed=args.seed,
        every=args.every,
        device=args.device,
        name=args.name,
    )


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


def cmd_run(args: argparse.Namespace) -> int:
    script = ModelScript.from_path(args.script)
    config = _config(args)
    store = Store(args.store)
    print(f"mpdiag: running {script.filename} at {config.opt_level} into {store.path}", flush=True)
    run_id = train(script, config, store.path, progress=_progress(config.steps))
    return report(store, run_id)


def cmd_runs(args: argparse.Namespace) -> int:
    runs = Store(args.store).runs()
    if runs.empty:
        print("no runs yet: python -m mpdiag run mpdiag/examples/mlp_digits.py")
        return 0
    cols = ["run_id", "name", "opt_level", "init_scale", "device", "status", "steps_done", "skipped_steps", "final_loss", "started_at"]
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
    }
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


COMMANDS = {"run": cmd_run, "runs": cmd_runs, "export": cmd_export}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, ScriptError, StoreError) as exc:
        print(f"mpdiag: {exc}", file=sys.stderr)
        return 2
