"""Scale-linearity probe: does every gradient scale with the loss scale, as a correct graph's must?

Gradients of a correct graph are linear in the loss, so after unscaling, the gradients computed at two loss
scales agree. A custom autograd Function whose backward ignores grad_output (reference section 7) breaks
that: the gradients upstream of it do not grow with S, so unscaled they are S times too small. The probe
recomputes one batch's gradients at PROBE_SCALES under the run's own opt level, in a supervised child
process (it runs the run's stored script), compares each tensor's unscaled gradient norm, and names the
custom autograd Functions in the graph. Results are stored with the run; :mod:`mpdiag.analysis.findings` reads them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from mpdiag.sandbox.supervisor import Limits, supervise

KIND = "scale-linearity"
PROBE_SCALES = (2.0**8, 2.0**12)  # high enough that FP16 underflow barely differs between them
FALLBACK_SCALES = (2.0**0, 2.0**4)  # when the higher pair overflows
#: a tensor fails when its unscaled gradient norms at the two scales differ by more than this factor
MAX_RATIO = 2.0
MARKER = "MPDIAG-PROBE-RESULT:"


def custom_functions(loss) -> list[str]:
    """Names of the custom autograd Functions in the graph that produced ``loss``."""
    import torch

    seen, names, stack = set(), [], [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            names.append(type(node).__name__.removesuffix("Backward"))
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return sorted(set(names))


def _gradients_at(scale, model, optimizer, policy, built, batch):
    policy.zero_grad(optimizer)
    with policy.autocast():
        loss = built.loss_fn(model, batch)
    (loss * scale).backward()
    grads = {n: p.grad.detach().double() / scale for n, p in model.named_parameters() if p.grad is not None}
    return loss, grads


def _child(source_path: str, filename: str, config_json: str) -> dict:
    from pathlib import Path

    from mpdiag.training.policies import make_policy
    from mpdiag.training.runner import RunConfig, resolve_device, seed_everything, to_device
    from mpdiag.training.script import ModelScript, build_model

    config = RunConfig.from_dict(json.loads(config_json))
    device = resolve_device(config.device)
    policy = make_policy(config, device)  # validates every option
    seed_everything(config.seed)
    built = build_model(ModelScript(filename=filename, source=Path(source_path).read_text(encoding="utf-8")), device)
    model, optimizer = policy.prepare(built.model.to(device), built.make_optimizer)
    batch = to_device(next(built.batches()), device)
    for scales in (PROBE_SCALES, FALLBACK_SCALES):
        results = [_gradients_at(s, model, optimizer, policy, built, batch) for s in scales]
        if all(all(bool(g.isfinite().all()) for g in grads.values()) for _, grads in results):
            break
    else:
        return {"ok": False, "reason": "gradients were non-finite at every probed scale", "scales": list(scales)}
    (loss, low), (_, high) = results
    tensors = {}
    for name, g_low in low.items():
        n_low, n_high = float(g_low.norm()), float(high[name].norm())
        if n_low > 0 and n_high > 0:
            tensors[name] = n_high / n_low
    failing = sorted(n for n, r in tensors.items() if abs(math.log(r)) > math.log(MAX_RATIO))
    return {"ok": True, "scales": list(scales), "ratios": tensors, "failing": failing,
            "functions": custom_functions(loss)}


def run_probe(store_path, run_id: int) -> dict:
    """Run the probe for a stored run in a supervised child, store and return its result."""
    from mpdiag.sandbox.launch import child_env, scratch_dir
    from mpdiag.store import Store, StoreError, StoreWriter

    store = Store(store_path, create=False)
    run = store.run(run_id)
    stored = run["config"].get("run")
    if not stored:
        return {"ok": False, "reason": "runs recorded from a user's own loop cannot be probed"}
    filename, source = store.script_source(run["script_sha256"])
    work = scratch_dir("probe-")
    (work / "script_source.py").write_text(source, encoding="utf-8")
    command = [sys.executable, "-m", "mpdiag.sandbox.probe", str(work / "script_source.py"), "--filename",
               run["script_path"] or filename, "--config", json.dumps(stored)]
    outcome = supervise(command, Limits.for_checks(), work, env=child_env())
    lines = [ln for ln in outcome.output_tail.splitlines() if ln.startswith(MARKER)]
    result = json.loads(lines[-1].removeprefix(MARKER)) if lines else {
        "ok": False, "reason": f"the probe did not complete: {outcome.message}", "output": outcome.output_tail[-2000:]}
    try:
        with StoreWriter(store.path) as writer:
            writer.add_probe(run_id, KIND, result)
    except StoreError as exc:  # e.g. a store in a read-only folder: the result is still shown, just not kept
        result = {**result, "not_stored": str(exc)}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpdiag.sandbox.probe")
    parser.add_argument("source")
    parser.add_argument("--filename", required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    try:
        result = _child(args.source, args.filename, args.config)
    except Exception as exc:  # noqa: BLE001 - reported as the probe's outcome
        result = {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}
    print("\n" + MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
