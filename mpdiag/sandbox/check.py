"""Checking a model script before any training: static AMP-mistake warnings, then a trial step, all in a child.

:func:`check_script` (what the Upload page and ``mpdiag check`` call) hands the source, as bytes, to a child
process under the protocol of :mod:`mpdiag.sandbox.child`. There :func:`check_in_child` decodes it, reads its
syntax tree for :func:`static_warnings` (nothing executed), imports the script, calls ``build(device)``,
checks the contract, runs one forward/backward step and checks the loss is a finite scalar. Parsing happens in
the child too, so a pathological file (deep nesting, huge, binary, not UTF-8, null bytes) costs the child,
never the server. The verdict, sent over the child channel, is "ready" with a summary, or the exact problem
with the script's own line numbers. This module must not read a verdict from the script's output.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field
from pathlib import Path

from mpdiag.sandbox.child import SOURCE_FILE, TaskResult, run_task
from mpdiag.sandbox.supervisor import Limits


@dataclass
class ScriptWarning:
    """A likely mistake at ``line`` of the file ``path`` (empty: the one file checked, named by its report)."""

    line: int
    message: str
    path: str = ""

    def __str__(self) -> str:
        return f"{self.path + ', ' if self.path else ''}line {self.line}: {self.message}"


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


#: a GradScaler's initial scale below this (2^8) is warned of: it leaves FP16's smallest values flushed for thousands
#: of steps (a first-time user's FP16 script with init_scale=1.0 had 99.8 % of its gradients subnormal)
SMALL_INIT_SCALE = 2.0**8


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
                            "scaling breaks: its gradients then skip the loss scale S and end up S times too small "
                            "after unscaling")))
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name.endswith(("BCELoss", "binary_cross_entropy")) and "with_logits" not in name and "Logits" not in name:
                found.append(ScriptWarning(node.lineno, (
                    f"{name} is refused under autocast (unsafe in FP16); use BCEWithLogitsLoss / "
                    "binary_cross_entropy_with_logits on logits")))
            if isinstance(node.func, ast.Attribute) and node.func.attr == "half":
                # a cast to measure (g.half() == 0) is fine: only a model or batch cast by hand changes the training
                found.append(ScriptWarning(node.lineno, (
                    ".half() casts to FP16 by hand: if it casts the model or its inputs, the script trains in FP16 "
                    "whatever level it is given (a model script: let the opt level decide, O2/O3 cast weights, O1 "
                    "casts per op); a cast to measure something changes nothing")))
            scale = next((k.value for k in node.keywords if k.arg == "init_scale"), None)
            if name.endswith("GradScaler") and isinstance(scale, ast.Constant) and \
                    isinstance(scale.value, (int, float)) and 0 < scale.value < SMALL_INIT_SCALE:
                found.append(ScriptWarning(node.lineno, (
                    f"GradScaler(init_scale={scale.value!r}): gradient values below 2^-24 / {scale.value!r} flush to "
                    f"zero in the FP16 backward, and GradScaler doubles its scale only after growth_interval "
                    "(2,000 by default) steps without an overflow; its default 2^16 leaves 16 more binades")))
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


def check_script(filename: str, source: str | bytes, device: str = "auto", limits: Limits | None = None) -> CheckReport:
    """Static warnings and a trial step, in a supervised child. Never raises for what the source is or does."""
    data = source.encode("utf-8", "surrogatepass") if isinstance(source, str) else bytes(source)
    result = run_task("check", {"filename": filename, "device": device}, limits or Limits.for_checks(),
                      files={SOURCE_FILE: data})
    return report_of(filename, result)


def report_of(filename: str, result: TaskResult) -> CheckReport:
    """The CheckReport of a check child's result; a missing or malformed verdict is a problem, never trusted."""
    report = CheckReport(filename=filename, ready=False)
    verdict = result.verdict
    try:
        if verdict is None:
            raise ValueError(result.failure(f"{filename}: the check"))
        report.ready = verdict["ready"] is True
        report.problems = [str(p) for p in verdict["problems"]]
        report.warnings = [ScriptWarning(int(line), str(message), str(path)) for line, message, path in verdict["warnings"]]
        report.summary = {str(k): v for k, v in dict(verdict["summary"]).items()}
    except (KeyError, TypeError, ValueError) as exc:
        report.ready, report.summary = False, {}
        report.problems.append(str(exc) if verdict is None else f"{filename}: the check sent a malformed verdict ({exc!r})")
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


def _read_source(filename: str) -> str:
    """The source handed to the child, decoded; raises ScriptError for a file that is not UTF-8 text."""
    from mpdiag.training.script import ScriptError

    data = Path(SOURCE_FILE).read_bytes()  # in the child's scratch directory, its working directory
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScriptError(f"{filename} is not UTF-8 text (byte {exc.start}: {data[exc.start:exc.start + 1]!r}); "
                          "save it as UTF-8.") from None


def check_in_child(payload: dict, channel) -> dict:
    """In the child: decode and parse the source, static warnings, then the trial step; the verdict."""
    from mpdiag.sandbox.supervisor import cuda_present
    from mpdiag.training.script import ScriptError

    filename = payload["filename"]
    verdict = {"ready": False, "problems": [], "summary": {}, "warnings": []}
    try:
        source = _read_source(filename)
        warnings = static_warnings(source, cuda_present())
        verdict["warnings"] = [(w.line, w.message, filename) for w in warnings]
    except ScriptError as exc:
        verdict["problems"].append(str(exc))
        return verdict
    except (RecursionError, MemoryError, ValueError) as exc:  # a syntax tree too deep or large to walk
        verdict["problems"].append(f"{filename}: the source could not be analysed ({type(exc).__name__}: {exc}).")
        return verdict
    return verdict | _trial(source, filename, payload["device"])


def _trial(source: str, filename: str, device_spec: str) -> dict:
    """In the child: build, then one training step as the runner takes it in FP32 (forward, backward, the
    contract's clipping, the optimizer step, the scheduler built over that optimizer and stepped once);
    returns ready, problems and summary. ``accumulate`` needs no step of its own: k micro-batches are k of
    these forward/backward passes."""
    from mpdiag.training.script import ScriptError

    result = {"ready": False, "problems": [], "summary": {}}
    try:
        result["summary"] = _one_step(source, filename, device_spec)
        result["ready"] = True
    except ScriptError as exc:
        result["problems"].append(str(exc))
    except SystemExit as exc:
        result["problems"].append(f"{filename}: the script called sys.exit({exc.code!r}) during the check.")
    except Exception as exc:  # noqa: BLE001 - e.g. ConfigError for --device cuda without a GPU
        result["problems"].append(f"{filename}: {type(exc).__name__}: {exc}")
    return result


def _one_step(source: str, filename: str, device_spec: str) -> dict:
    """Build the script and take its one FP32 step; the summary of what it built (raises what the script raises)."""
    import torch

    from mpdiag.training.runner import resolve_device, seed_everything, to_device
    from mpdiag.training.script import ModelScript, ScriptError, build_model

    device = resolve_device(device_spec)
    seed_everything(0)
    built = build_model(ModelScript(filename=filename, source=source), device)
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
    scheduler = built.make_scheduler(optimizer) if built.make_scheduler is not None else None
    if built.clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, built.clip_grad_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return {
        "name": built.name,
        "parameters": sum(p.numel() for p in params),
        "tensors": len(params),
        "optimizer": type(optimizer).__name__,
        "example batch": _describe_batch(batch),
        "first loss": round(value, 6),
        **({"clip grad norm": built.clip_grad_norm} if built.clip_grad_norm is not None else {}),
        **({"scheduler": type(scheduler).__name__} if scheduler is not None else {}),
        **({"accumulate": built.accumulate} if built.accumulate > 1 else {}),
        "device": str(device),
    }
