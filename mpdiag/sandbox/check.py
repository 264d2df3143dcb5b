"""Checking a model script before any training: static AMP-mistake warnings, then a supervised trial step.

:func:`static_warnings` reads the source's syntax tree (nothing is executed). :func:`check_script` then runs
``python -m mpdiag.sandbox.check`` in a child process under :mod:`mpdiag.sandbox.supervisor` limits: it imports the script,
calls ``build(device)``, checks the contract, runs one forward/backward step and checks the loss is a finite
scalar. The verdict is "ready" with a summary, or the exact problem with the script's own line numbers.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mpdiag.sandbox.supervisor import Limits, supervise

REPORT_MARKER = "MPDIAG-CHECK-REPORT:"


@dataclass
class ScriptWarning:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass
class CheckReport:
    """ready: the script can be trained; problems: what stops it; warnings: likely AMP mistakes."""

    filename: str
    ready: bool
    problems: list[str] = field(default_factory=list)
    warnings: list[ScriptWarning] = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    def text(self) -> str:
        lines = [f"{self.filename}: " + ("ready" if self.ready else "not ready")]
        lines += [f"  {k}: {v}" for k, v in self.summary.items()]
        lines += [f"problem: {p}" for p in self.problems]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _dotted(node: ast.AST) -> str:
    """'torch.autograd.Function' for an attribute chain, '' for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def static_warnings(source: str, cuda_available: bool) -> list[ScriptWarning]:
    """Common AMP mistakes found in the source's syntax tree; empty when the source does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found: list[ScriptWarning] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(_dotted(b).endswith("autograd.Function") or _dotted(b) == "Function"
                                                  for b in node.bases):
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name in ("forward", "backward"):
                    wanted = "custom_fwd" if fn.name == "forward" else "custom_bwd"
                    if not any(wanted in ast.unparse(d) for d in fn.decorator_list):
                        found.append(ScriptWarning(fn.lineno, (
                            f"autograd.Function {node.name}.{fn.name} has no @torch.amp.{wanted}: under autocast it "
                            "runs in whatever dtype arrives, and its backward must multiply by grad_output or loss "
                            "scaling breaks (reference section 7)")))
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name.endswith(("BCELoss", "binary_cross_entropy")) and "with_logits" not in name and "Logits" not in name:
                found.append(ScriptWarning(node.lineno, (
                    f"{name} is refused under autocast (unsafe in FP16); use BCEWithLogitsLoss / "
                    "binary_cross_entropy_with_logits on logits")))
            if isinstance(node.func, ast.Attribute) and node.func.attr == "half":
                found.append(ScriptWarning(node.lineno, (
                    ".half() casts to FP16 by hand inside the script; let the opt level decide precision "
                    "(O2/O3 cast weights, O1 casts per op)")))
            if not cuda_available and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "cuda")
                or (name in ("torch.device", "device") and node.args and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).startswith("cuda"))
            ):
                found.append(ScriptWarning(node.lineno, (
                    "hard-coded CUDA, but this machine has no CUDA GPU: use the device passed to build(device)")))
        if (not cuda_available and isinstance(node, ast.Attribute) and _dotted(node).startswith("torch.cuda.")
                and node.attr not in ("is_available", "device_count", "is_bf16_supported", "amp")):
            found.append(ScriptWarning(node.lineno, f"{_dotted(node)} on a machine without a CUDA GPU"))
    return sorted(found, key=lambda w: w.line)


def check_script(filename: str, source: str, device: str = "auto", limits: Limits | None = None) -> CheckReport:
    """Static warnings, then a trial step in a supervised child. Never raises for what the script does."""
    from mpdiag.sandbox.launch import child_env, scratch_dir
    from mpdiag.sandbox.supervisor import cuda_present

    report = CheckReport(filename=filename, ready=False, warnings=static_warnings(source, cuda_present()))
    work = scratch_dir("check-")
    source_file = work / "script_source.py"
    source_file.write_text(source, encoding="utf-8")
    command = [sys.executable, "-m", "mpdiag.sandbox.check", str(source_file), "--filename", filename, "--device", device]
    outcome = supervise(command, limits or Limits.for_checks(), work, env=child_env())
    lines = [ln for ln in outcome.output_tail.splitlines() if ln.startswith(REPORT_MARKER)]
    if lines:
        child = json.loads(lines[-1].removeprefix(REPORT_MARKER))
        report.ready, report.problems, report.summary = child["ready"], child["problems"], child["summary"]
    else:
        tail = "\n".join(outcome.output_tail.strip().splitlines()[-15:])
        report.problems.append(f"{filename}: the check did not complete: {outcome.message}."
                               + (f"\nLast output:\n{tail}" if tail else ""))
    return report


def _describe_batch(batch) -> str:
    import torch

    if torch.is_tensor(batch):
        return f"{str(batch.dtype).removeprefix('torch.')}{list(batch.shape)}"
    if isinstance(batch, dict):
        return "{" + ", ".join(f"{k}: {_describe_batch(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, (list, tuple)):
        return "(" + ", ".join(_describe_batch(v) for v in batch) + ")"
    return type(batch).__name__


def _trial(source_path: str, filename: str, device_spec: str) -> dict:
    """In the child: build, one forward/backward step; returns the report as a dict."""
    from mpdiag.training.runner import resolve_device, seed_everything, to_device
    from mpdiag.training.script import ModelScript, ScriptError, build_model

    result = {"ready": False, "problems": [], "summary": {}}
    try:
        device = resolve_device(device_spec)
        script = ModelScript(filename=filename, source=Path(source_path).read_text(encoding="utf-8"))
        seed_everything(0)
        built = build_model(script, device)
        model = built.model.to(device)
        optimizer = built.make_optimizer(model.parameters())
        batch = next(built.batches(), None)
        if batch is None:
            raise ScriptError(f"{filename}: 'batches' yielded no batch.")
        batch = to_device(batch, device)
        loss = built.loss_fn(model, batch)
        loss.backward()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise ScriptError(f"{filename}: the loss of the first batch is {value} in FP32; fix the model or data "
                              "before looking at mixed precision.")
        params = [p for p in model.parameters() if p.requires_grad]
        result["summary"] = {
            "name": built.name,
            "parameters": sum(p.numel() for p in params),
            "tensors": len(params),
            "optimizer": type(optimizer).__name__,
            "example batch": _describe_batch(batch),
            "first loss": round(value, 6),
            "device": str(device),
        }
        result["ready"] = True
    except ScriptError as exc:
        result["problems"].append(str(exc))
    except SystemExit as exc:
        result["problems"].append(f"{filename}: the script called sys.exit({exc.code!r}) during the check.")
    except Exception as exc:  # noqa: BLE001 - e.g. ConfigError for --device cuda without a GPU
        result["problems"].append(f"{filename}: {type(exc).__name__}: {exc}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpdiag.sandbox.check")
    parser.add_argument("source")
    parser.add_argument("--filename", required=True)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    result = _trial(args.source, args.filename, args.device)
    sys.stdout.flush()
    print("\n" + REPORT_MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

