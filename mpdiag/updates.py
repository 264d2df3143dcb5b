"""Weight-update swamping: which optimizer updates a low-precision weight cannot hold.

Adding an update u to a weight w stored in a format with m mantissa bits rounds w + u back to w when
|u| is below half a unit in the last place, i.e. (within a factor of two, depending on where |w| lies in its
binade) when |u| < 2^-(m+1)·|w|: 2^-11 for FP16, 2^-8 for BF16 (reference section 4, "weight update
swamping"). FP32 master weights keep such updates; weights updated in FP16 or BF16 directly lose them.

:class:`UpdateTracker` snapshots the tensors an optimizer updates just before its ``step`` and compares
just after, counting per tensor, among the values whose gradient is finite and non-zero:

* ``below_resolution``: |w_after - w_before| < 2^-(m+1)·|w_before| (the issue's rule; with FP32 masters
  these updates are kept, without them they would be lost);
* ``unchanged``: w_after == w_before exactly (the update was lost, or was exactly zero).

Steps the scaler skips never call ``optimizer.step`` and are not counted. Cost per tracked step: one copy
of the tracked tensors into snapshots allocated once (as many bytes as those tensors) and a few elementwise
passes; the counts stay on the device until :meth:`take` is called.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpdiag.formats import LOW_PRECISION


def resolution_log2(format_name: str) -> int:
    """log2 of the relative update below which ``format_name`` weights lose it: -(mantissa bits + 1)."""
    if format_name not in ("fp16", "bf16"):
        raise ValueError(f"update_format must be 'fp16' or 'bf16', got {format_name!r}")
    return -(LOW_PRECISION[format_name].mantissa_bits + 1)


class UpdateTracker:
    """Counts updates of ``targets`` (the tensors the optimizer writes) below ``format_name``'s resolution.

    Call :meth:`before` right before the optimizer step and :meth:`after` right after it (the Recorder does
    this from optimizer step hooks); :meth:`take` returns ``(step, counts)`` pairs with counts an
    (n_targets, 3) int64 tensor: updated, below_resolution, unchanged.
    """

    def __init__(self, targets: Sequence[torch.Tensor], format_name: str):
        self.targets = list(targets)
        self.format_name = format_name
        self.factor = 2.0 ** resolution_log2(format_name)
        self._snapshots = [torch.empty_like(t, memory_format=torch.preserve_format) for t in self.targets]
        self._armed_step: int | None = None
        self._done: list[tuple[int, torch.Tensor]] = []

    def before(self, step: int) -> None:
        """Snapshot the weights that step ``step`` is about to update."""
        with torch.no_grad():
            for snap, t in zip(self._snapshots, self.targets, strict=True):
                snap.copy_(t)
        self._armed_step = step

    def after(self) -> None:
        """Count what the step just done changed; a no-op when :meth:`before` was not called for it."""
        if self._armed_step is None:
            return
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
        self._done.append((self._armed_step, torch.stack(rows)))
        self._armed_step = None

    def take(self) -> list[tuple[int, list[list[int]]]]:
        """The counts of steps finished since the last call, as host lists (one device sync)."""
        done, self._done = self._done, []
        return [(step, counts.tolist()) for step, counts in done]
