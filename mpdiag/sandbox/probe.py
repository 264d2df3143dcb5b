"""Scale-linearity probe: does every gradient scale with the loss scale, as a correct graph's must?

Gradients of a correct graph are linear in the loss, so after unscaling, the gradients computed at two loss
scales agree. A custom autograd Function whose backward ignores grad_output (docs/background.md: custom autograd functions) breaks
that: the gradients upstream of it do not grow with S, so unscaled they are S times too small. The probe
recomputes one batch's gradients at PROBE_SCALES under the run's own opt level, in a child process under the
protocol of :mod:`mpdiag.sandbox.child` (it runs the run's stored script; its result comes back as the child's
verdict, never from its output), compares each tensor's unscaled gradient norm, and names the custom autograd
Functions in the graph. :func:`run_probe`, in the calling process, stores the result with the run;
:mod:`mpdiag.analysis.findings` reads it. The child never gets the store. The contract's ``clip_grad_norm``,
``scheduler`` and ``accumulate`` keys play no part: the probe compares one micro-batch's gradients before any
clipping or optimizer step, which none of them change (dividing the loss by k scales both scales' alike).
"""

from __future__ import annotations

import math

from mpdiag.sandbox.child import SOURCE_FILE, run_task
from mpdiag.sandbox.supervisor import Limits

KIND = "scale-linearity"
PROBE_SCALES = (2.0**8, 2.0**12)  # high enough that FP16 underflow barely differs between them
FALLBACK_SCALES = (2.0**0, 2.0**4)  # when the higher pair overflows
#: a tensor fails when its unscaled gradient norms at the two scales differ by more than this factor
MAX_RATIO = 2.0


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


def _probe(filename: str, config_dict: dict) -> dict:
    from pathlib import Path

    from mpdiag.training.policies import make_policy
    from mpdiag.training.runner import RunConfig, resolve_device, seed_everything, to_device
    from mpdiag.training.script import ModelScript, build_model

    config = RunConfig.from_dict(config_dict)
    device = resolve_device(config.device)
    policy = make_policy(config, device)  # validates every option
    seed_everything(config.seed)
    built = build_model(ModelScript(filename=filename, source=Path(SOURCE_FILE).read_text(encoding="utf-8")), device)
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


def probe_in_child(payload: dict, channel) -> dict:
    """In the child: the probe's result (a failure is a result too)."""
    try:
        return _probe(payload["filename"], payload["config"])
    except Exception as exc:  # noqa: BLE001 - reported as the probe's outcome
        return {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}


def run_probe(store_path, run_id: int) -> dict:
    """Run the probe for a stored run in a supervised child, store and return its result."""
    from mpdiag.store import Store, StoreError, StoreWriter

    store = Store(store_path, create=False)
    run = store.run(run_id)
    stored = run["config"].get("run")
    if not stored:
        return {"ok": False, "reason": "runs recorded from a user's own loop cannot be probed"}
    filename, source = store.script_source(run["script_sha256"])
    task = run_task("probe", {"filename": run["script_path"] or filename, "config": stored}, Limits.for_checks(),
                    files={SOURCE_FILE: source.encode("utf-8", "surrogatepass")})
    result = task.verdict if task.verdict is not None else {
        "ok": False, "reason": f"the probe did not complete: {task.outcome.message}",
        "output": task.outcome.output_tail[-2000:]}
    try:
        with StoreWriter(store.path) as writer:
            writer.add_probe(run_id, KIND, result)
    except StoreError as exc:  # e.g. a store in a read-only folder: the result is still shown, just not kept
        result = {**result, "not_stored": str(exc)}
    return result
