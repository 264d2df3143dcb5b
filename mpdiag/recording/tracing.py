"""Per-module activation tracing (``--trace-modules``): where does the first inf or NaN appear?

For every leaf module, a forward hook takes the absmax of its floating-point outputs and a tensor hook on
those outputs takes the absmax of the gradient flowing back into them (scaled by S, as in the backward
pass). Each is one fused ``aminmax`` kept on the device as a 0-dim tensor, in call order; the Recorder copies
a step's values to the host once, at ``record``. A module called several times in a step keeps the first
call's order and the largest magnitude.

Owns those hooks and the rows they make (:class:`ModuleTracer`) and the Recorder feature that takes a step's rows
at ``record`` and hands them, with the traced modules' names first, to the writer (:class:`ModuleTraceFeature`).
"""

from __future__ import annotations

import math

import torch

from mpdiag.numerics.nested import map_tensors
from mpdiag.recording.features import RecordedStep, RecorderFeature, WriterJob


def _absmax(t: torch.Tensor) -> torch.Tensor:
    low, high = torch.aminmax(t.detach())
    return torch.maximum(-low, high).float()


class ModuleTracer:
    """Hooks every leaf module of ``model``; :meth:`take` returns and clears one step's records."""

    def __init__(self, model: torch.nn.Module):
        self.modules = [(name or type(m).__name__, m) for name, m in model.named_modules() if not list(m.children())]
        self._forward: list[tuple[int, torch.Tensor]] = []
        self._backward: list[tuple[int, torch.Tensor]] = []
        self._handles = [m.register_forward_hook(self._on_forward(i)) for i, (_, m) in enumerate(self.modules)]

    def _on_forward(self, index: int):
        def hook(module, args, output):
            if module is not self.modules[index][1]:
                return  # a deep copy of the model (an EMA copy) carries this hook too; it is not the traced model

            def watch(t: torch.Tensor) -> torch.Tensor:
                if t.is_floating_point() and t.numel():
                    self._forward.append((index, _absmax(t)))
                    if t.requires_grad:
                        t.register_hook(lambda g: self._backward.append((index, _absmax(g))) if g.numel() else None)
                return t

            map_tensors(watch, output)

        return hook

    def take(self, step: int) -> list[tuple]:
        """Rows (step, module_id, fwd_order, fwd_absmax, fwd_finite, bwd_order, bwd_absmax, bwd_finite) for
        the modules that ran since the last call; one host copy for all values."""
        forward, backward = self._forward, self._backward
        self._forward, self._backward = [], []
        values = torch.stack([v for _, v in forward + backward]).cpu().tolist() if forward or backward else []
        rows: dict[int, list] = {}
        for order, ((index, _), value) in enumerate(zip(forward, values, strict=False)):
            row = rows.setdefault(index, [step, index, order, value, int(math.isfinite(value)), None, None, None])
            row[3] = value if math.isnan(value) or value > row[3] else row[3]
            row[4] = int(row[4] and math.isfinite(value))
        for order, ((index, _), value) in enumerate(zip(backward, values[len(forward):], strict=True)):
            row = rows.setdefault(index, [step, index, None, None, None, None, None, None])
            if row[5] is None:
                row[5], row[6], row[7] = order, value, int(math.isfinite(value))
            else:
                row[6] = value if math.isnan(value) or value > row[6] else row[6]
                row[7] = int(row[7] and math.isfinite(value))
        return [tuple(r) for r in rows.values()]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class ModuleTraceFeature(RecorderFeature):
    """``trace_modules``: the module rows of every step (``Store.module_steps``), taken at ``record`` (one host copy)
    and handed over at each flush, after the traced modules' names (``Store.modules``) at the first one."""

    def __init__(self, model: torch.nn.Module, run_id: int):
        self._tracer, self._run_id = ModuleTracer(model), run_id
        self._modules = [(i, name, type(m).__name__) for i, (name, m) in enumerate(self._tracer.modules)]
        self._rows: list[tuple] = []

    def at_record(self, step: RecordedStep) -> None:
        self._rows += self._tracer.take(step.step)

    def drain(self, wait: bool) -> list[WriterJob]:
        modules, rows, self._modules, self._rows = self._modules, self._rows, None, []
        jobs = [] if modules is None else [lambda w: w.add_modules(self._run_id, modules)]
        return jobs + ([lambda w: w.add_module_steps(self._run_id, rows)] if rows else [])

    def remove(self) -> None:
        self._tracer.remove()
