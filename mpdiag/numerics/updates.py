"""Weight-update swamping: which optimizer updates a low-precision weight cannot hold.

Adding an update u to a weight w stored in a format with m mantissa bits rounds w + u back to w when
|u| is below half a unit in the last place, i.e. (within a factor of two, depending on where |w| lies in its
binade) when |u| < 2^-(m+1)·|w|: 2^-11 for FP16, 2^-8 for BF16 (docs/background.md, "weight-update
swamping"). FP32 master weights keep such updates; weights updated in FP16 or BF16 directly lose them.

:class:`UpdateTracker` snapshots the tensors an optimizer updates just before its ``step`` and compares
just after, counting per tensor, among the values whose gradient is finite and non-zero:

* ``below_resolution``: |w_after - w_before| < 2^-(m+1)·|w_before| (the issue's rule; with FP32 masters
  these updates are kept, without them they would be lost);
* ``unchanged``: w_after == w_before exactly (the update was lost, or was exactly zero).

Steps the scaler skips are not counted: a non-fused optimizer's ``step`` is never called, and a fused one's
(``fused=True``, which GradScaler steps with its ``found_inf`` and which skips inside the kernel) is given to
:meth:`UpdateTracker.after` with that ``found_inf``, whose counts are dropped once it reads non-zero (they said
every value unchanged, as if each update had been lost). Cost per tracked step: one copy
of the tracked tensors into snapshots allocated once (as many bytes as those tensors), then on the CPU one
numba pass over snapshot, weights and gradients (:func:`mpdiag.numerics.cpu_kernel.update_counts`), elsewhere a few
elementwise torch passes whose counts reach the host in a non-blocking copy, taken once it has arrived.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mpdiag.numerics.formats import resolution_log2
from mpdiag.numerics.gradstats import NUMBA_AVAILABLE, DeviceReadback, work_items

_BIT_VIEWS = {torch.float16: torch.int16, torch.bfloat16: torch.int16}  # numba has no FP16/BF16 arrays


@dataclass
class _CpuKernel:
    """The numba update-count kernel with what stays fixed between steps: the work items, their count
    workspace, the snapshots' numpy views (kept alive: the kernel reads them by address) and where they are, and
    the table decoding their bits."""

    run: Callable
    array_table: Callable
    items: np.ndarray
    item_counts: np.ndarray
    snapshot_views: list[np.ndarray]
    snapshots: np.ndarray
    weight_table: np.ndarray
    dtype: torch.dtype  # the targets' (and snapshots') dtype the kernel was built for


class UpdateTracker:
    """Counts updates of ``targets`` (the tensors the optimizer writes) below ``format_name``'s resolution.

    Call :meth:`before` right before the optimizer step and :meth:`after` right after it (the Recorder does
    this from optimizer step hooks); :meth:`take` returns ``(step, counts)`` pairs with counts a list of
    [updated, below_resolution, unchanged] per target. ``backend``: "numba" (the default
    where it applies: numba installed, contiguous CPU targets of one dtype) or "torch" (any device).
    """

    def __init__(self, targets: Sequence[torch.Tensor], format_name: str, backend: str | None = None):
        if backend not in (None, "numba", "torch"):
            raise ValueError(f"backend must be 'numba' or 'torch', got {backend!r}")
        self.targets = list(targets)
        self.format_name = format_name
        self.factor = 2.0 ** resolution_log2(format_name)
        self._snapshots = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in self.targets]
        self._armed_step: int | None = None
        self._done: list[tuple[int, DeviceReadback]] = []
        self._kernel = None if backend == "torch" else self._cpu_kernel()
        if backend == "numba" and self._kernel is None:
            raise ValueError("the numba backend needs numba and contiguous CPU targets of one float dtype")

    def _cpu_kernel(self):
        """The numba kernel and its fixed inputs, when every target is a contiguous CPU tensor of one dtype
        among float32/FP16/BF16; None otherwise (the torch path counts)."""
        dtypes = {t.dtype for t in self.targets}
        if (not NUMBA_AVAILABLE or not self.targets or len(dtypes) != 1
                or not {torch.float32, *_BIT_VIEWS} >= dtypes
                or any(t.device.type != "cpu" or not t.is_contiguous() for t in self.targets)):
            return None
        from mpdiag.numerics.cpu_kernel import array_table, on_torch_threads, update_counts

        items = work_items([t.numel() for t in self.targets])
        views, table = _numpy_views(self._snapshots)  # the tracker's own tensors: viewed once
        return _CpuKernel(on_torch_threads(update_counts), array_table, items, np.empty((len(items), 3), np.int64),
                          views, array_table(views, views[0].dtype), table, self.targets[0].dtype)

    def before(self, step: int) -> None:
        """Snapshot the weights that step ``step`` is about to update."""
        with torch.no_grad():
            for snap, t in zip(self._snapshots, self.targets, strict=True):
                snap.copy_(t)
        self._armed_step = step

    def after(self, found_inf: torch.Tensor | None = None) -> None:
        """Count what the step just done changed; a no-op when :meth:`before` was not called for it.
        ``found_inf``: the one GradScaler handed a fused optimizer for this step: non-zero, the step was skipped
        inside the optimizer and its counts are dropped at :meth:`take` (read back without a synchronisation)."""
        if self._armed_step is None:
            return
        counts = self._count_on_cpu()
        counts = counts if counts is not None else self._count_with_torch()
        skipped = None if found_inf is None else DeviceReadback(found_inf.detach().reshape(1).double())
        self._done.append((self._armed_step, DeviceReadback(counts), skipped))
        self._armed_step = None

    def _count_on_cpu(self) -> torch.Tensor | None:
        """The counts from the numba kernel, or None where it does not apply to this step's gradients."""
        grads = [t.grad for t in self.targets]
        if self._kernel is None or any(g is None or not g.is_contiguous() for g in grads) or \
                len({g.dtype for g in grads}) != 1:
            return None
        k = self._kernel
        if any(t.dtype != k.dtype for t in self.targets):
            return None  # a target rebound to another dtype (model.half()): read as the snapshots' type, garbage
        # per step: a parameter may be rebound. The views stay referenced here while the kernel reads them.
        after, _ = _numpy_views([t.detach() for t in self.targets])
        grad_values, grad_table = _numpy_views([g.detach() for g in grads])
        counts = np.empty((len(self.targets), 3), np.int64)
        weight_like, grad_like = after[0].dtype.type(0), grad_values[0].dtype.type(0)  # float32 or uint16
        k.run(k.snapshots, k.array_table(after, after[0].dtype), k.array_table(grad_values, grad_values[0].dtype),
              weight_like, grad_like, k.items, k.weight_table, grad_table, np.float32(self.factor), k.item_counts,
              counts)
        return torch.from_numpy(counts)

    def _count_with_torch(self) -> torch.Tensor:
        rows = []
        with torch.no_grad():
            for snap, t in zip(self._snapshots, self.targets, strict=True):
                grad = t.grad
                if grad is None:
                    rows.append(torch.zeros(3, dtype=torch.int64, device=t.device))
                    continue
                moved = grad.isfinite() & (grad != 0)
                old, new = snap.float(), t.detach().float()
                delta = (new - old).abs()  # exact near the threshold: values within 2x subtract exactly (Sterbenz)
                rows.append(torch.stack([
                    moved.sum(),
                    (moved & (delta < self.factor * old.abs())).sum(),
                    (moved & (new == old)).sum(),
                ]))
        return torch.stack(rows)

    def take(self, wait: bool = False) -> list[tuple[int, list[list[int]]]]:
        """The counts of the tracked steps not taken yet whose counts have reached the host, in step order;
        ``wait`` waits for all of them."""
        taken = []
        while self._done and (wait or (self._done[0][1].ready()
                                       and (self._done[0][2] is None or self._done[0][2].ready()))):
            step, counts, skipped = self._done.pop(0)
            if skipped is None or skipped.numpy()[0] == 0:
                taken.append((step, counts.numpy().tolist()))
        return taken


@functools.cache
def _float32_table(dtype: torch.dtype) -> np.ndarray:
    """The float32 value of every 16-bit pattern of ``dtype`` (FP16/BF16), by torch's own conversion."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    table = np.empty(2**16, np.float32)
    table[patterns.numpy().view(np.uint16)] = patterns.view(dtype).float().numpy()
    return table


def _numpy_views(tensors: list[torch.Tensor]) -> tuple[list[np.ndarray], np.ndarray]:
    """Flat numpy views of same-dtype contiguous CPU tensors for the numba kernel, and the table that
    decodes them (FP16/BF16 travel as uint16 bit patterns; an unused stub for float32)."""
    dtype = tensors[0].dtype
    if dtype == torch.float32:
        return [t.reshape(-1).numpy() for t in tensors], np.zeros(1, np.float32)
    return [t.reshape(-1).view(_BIT_VIEWS[dtype]).numpy().view(np.uint16) for t in tensors], _float32_table(dtype)
