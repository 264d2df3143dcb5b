"""FP8 capture (``--fp8``): what an FP8 recipe would have cast in every ``nn.Linear``, per recorded step.

Hooks on every Linear keep references to its input activation and its weight (forward) and to the gradient
flowing into its output (backward); :meth:`Fp8Capture.start` hands one step's tensors to
:class:`mpdiag.numerics.fp8.Fp8StatsComputer` (all tensors at once, one readback) and returns the step's
named records. Call it after ``backward`` and before the optimizer step, so the weights are the ones that
forward pass used; the output gradients are divided by the loss scale (they hold S*g at loss-scaled levels).
With block-scaled recipes (``Fp8Settings.block_recipes``: mxfp8, nvfp4), each tensor is also counted by
:func:`mpdiag.numerics.block_scaled.block_stats` (blocks along its last dimension; the pieces of several calls
are stacked as rows), one more record per recipe, a block record and the block scales' exponent histogram. These
counts are read back when the step is started (a synchronisation on a GPU). It owns the hooks and the naming of
records, and the Recorder feature behind ``fp8`` (:class:`Fp8Feature`: starts the counts at the multiples of
``every``, forgets the captured tensors at the other steps, hands the arrived records to the writer); it does not
write to a store itself and counts nothing itself.

Only forward passes with autograd enabled are captured (not evaluation passes). A module called several
times in a step contributes all its calls to one input and one output-gradient tensor; its weight counts
once. Between recorded steps call :meth:`Fp8Capture.skip`: the references would otherwise keep the tensors
alive.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mpdiag.numerics.block_scaled import ELEMENT_FORMAT, BlockStats, PendingBlockStats
from mpdiag.numerics.fp8 import EXP_MIN, Fp8Stats, Fp8StatsComputer, PendingFp8Stats
from mpdiag.numerics.fp8_recipes import ROLES, Fp8Settings
from mpdiag.recording.features import RecordedStep, RecorderFeature, WriterJob

#: the columns of a record, as ``Store.fp8(run_id)`` is to return them
RECORD_COLUMNS = ("step", "module", "role", "fmt", "recipe", "scale", "amax", "numel", "underflow", "subnormal",
                  "overflow")
HISTOGRAM_COLUMNS = ("step", "module", "role", "exponent", "count")
#: per block-scaled recipe: the block counts (``Store.fp8_blocks``) and the block scales' exponent histogram
#: (``Store.fp8_block_scales``: a block counts in e when 2**e <= its dequantisation scale < 2**(e+1))
BLOCK_COLUMNS = ("step", "module", "role", "recipe", "blocks", "zero_blocks", "clipped_blocks", "wide_blocks")
BLOCK_SCALE_COLUMNS = ("step", "module", "role", "recipe", "exponent", "count")


@dataclass
class Fp8StepRecords:
    """One recorded step: ``records`` (tuples in RECORD_COLUMNS order, one per module x role x recipe, for the
    tensors present, block-scaled recipes included), ``histograms`` (tuples in HISTOGRAM_COLUMNS order, non-zero
    bins only), ``blocks`` and ``block_scales`` (BLOCK_COLUMNS, BLOCK_SCALE_COLUMNS; empty without
    block-scaled recipes)."""

    records: list[tuple]
    histograms: list[tuple]
    blocks: list[tuple] = dataclasses.field(default_factory=list)
    block_scales: list[tuple] = dataclasses.field(default_factory=list)

    def extend(self, other: Fp8StepRecords) -> None:
        """Append ``other``'s rows (another step's) to these."""
        for field in dataclasses.fields(self):
            getattr(self, field.name).extend(getattr(other, field.name))


class PendingFp8Records:
    """A step's records on their way to the host (see :class:`mpdiag.numerics.fp8.PendingFp8Stats`)."""

    def __init__(self, step: int, pending: PendingFp8Stats, capture: Fp8Capture, blocks: PendingBlockStats):
        self.step, self._pending, self._capture, self._blocks = step, pending, capture, blocks

    def ready(self) -> bool:
        return self._pending.ready() and self._blocks.ready()

    def result(self) -> Fp8StepRecords:
        return self._capture.records(self.step, self._pending.result(), self._blocks.result())


class Fp8Capture:
    """Hooks on every ``nn.Linear`` of ``model`` (named as in ``model.named_modules()``)."""

    def __init__(self, model: nn.Module, settings: Fp8Settings, device: torch.device | str | None = None):
        settings.validate()
        self.settings = settings
        self.modules = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        #: tensor t = 3 * module index + role index
        self.tensors = [(name, role) for name, _ in self.modules for role in ROLES]
        self.formats = [settings.role_format(role).name for _, role in self.tensors]
        if device is None:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._computer = Fp8StatsComputer(self.formats, settings, device,
                                          divide_by_loss_scale=[role == "grad_output" for _, role in self.tensors])
        self._pieces: list[list[torch.Tensor]] = [[] for _ in self.tensors]
        self._handles = [m.register_forward_hook(self._on_forward(i)) for i, (_, m) in enumerate(self.modules)]

    @property
    def workspace_bytes(self) -> int:
        return self._computer.workspace_bytes

    def _on_forward(self, index: int):
        first = 3 * index

        def hook(module: nn.Linear, args, output):
            if module is not self.modules[index][1]:
                return  # a deep copy of the model (an EMA copy) carries this hook too; it is not the recorded model
            if not torch.is_grad_enabled() or not args or not torch.is_tensor(args[0]):
                return
            self._pieces[first].append(args[0].detach())
            if not self._pieces[first + 1]:
                self._pieces[first + 1].append(module.weight.detach())
            if torch.is_tensor(output) and output.requires_grad:
                output.register_hook(lambda g: self._pieces[first + 2].append(g.detach()))

        return hook

    def start(self, step: int, loss_scale: float | torch.Tensor = 1.0) -> PendingFp8Records:
        """Count the tensors captured since the last call (``loss_scale``: what the output gradients hold,
        a number or GradScaler's scale tensor) and forget them; nothing waits for the device."""
        pieces, self._pieces = self._pieces, [[] for _ in self.tensors]
        blocks = self._block_stats(pieces, loss_scale)
        return PendingFp8Records(step, self._computer.start(pieces, loss_scale), self, blocks)

    def _block_stats(self, pieces: list[list[torch.Tensor]], loss_scale) -> PendingBlockStats:
        """(tensor index, stats) per present tensor and block recipe, all read back at once; the output gradients
        multiplied by the fp32 reciprocal of the loss scale, as :class:`Fp8StatsComputer` unscales them."""
        if not self.settings.recorded_blocks:
            return PendingBlockStats([])
        factor = None
        if torch.is_tensor(loss_scale) or loss_scale != 1.0:
            scale = loss_scale if torch.is_tensor(loss_scale) else torch.tensor(float(loss_scale))
            factor = scale.reshape(()).double().reciprocal().float()
        items = []
        for t, (_, role) in enumerate(self.tensors):
            if not pieces[t]:
                continue
            rows = torch.cat([p.detach().float().reshape(-1, p.shape[-1] if p.dim() else 1) for p in pieces[t]])
            if role == "grad_output" and factor is not None:
                rows = rows * factor.to(rows.device)
            items += [(t, rows, recipe) for recipe in self.settings.recorded_blocks]
        return PendingBlockStats(items)

    def take(self, step: int, loss_scale: float | torch.Tensor = 1.0) -> Fp8StepRecords:
        """:meth:`start`, waiting for the records."""
        return self.start(step, loss_scale).result()

    def skip(self) -> None:
        """Forget the tensors captured since the last call (a step that is not recorded)."""
        self._pieces = [[] for _ in self.tensors]

    def records(self, step: int, stats: Fp8Stats, blocks: list[tuple[int, BlockStats]] = ()) -> Fp8StepRecords:
        """Name one step's statistics (and its block-scaled ones)."""
        records, histograms, block_rows, block_scales = [], [], [], []
        for t, (module, role) in enumerate(self.tensors):
            if not stats.numel[t]:
                continue
            for recipe in self.settings.recipes:
                records.append((step, module, role, self.formats[t], recipe, float(stats.scale[recipe][t]),
                                float(stats.amax[t]), int(stats.numel[t]), *map(int, stats.counts[recipe][t])))
            bins = np.flatnonzero(stats.hist[t])
            histograms += [(step, module, role, int(EXP_MIN + b), int(stats.hist[t, b])) for b in bins]
        for t, b in blocks:
            module, role = self.tensors[t]
            scale = b.tensor_scale if b.recipe == "nvfp4" else None  # MXFP8 has no per-tensor scale
            records.append((step, module, role, ELEMENT_FORMAT[b.recipe], b.recipe, scale, b.amax, b.numel,
                            b.underflow, b.subnormal, b.overflow))
            block_rows.append((step, module, role, b.recipe, b.blocks, b.zero_blocks, b.clipped_blocks, b.wide_blocks))
            block_scales += [(step, module, role, b.recipe, e, n) for e, n in sorted(b.scale_exponents.items())]
        return Fp8StepRecords(records, histograms, block_rows, block_scales)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.skip()


class Fp8Feature(RecorderFeature):
    """``fp8``: at every multiple of ``every``, what the recipe would cast in every ``nn.Linear`` (``Store.fp8``),
    the output gradients divided by that step's loss scale; the records are named once they reach the host."""

    def __init__(self, model: nn.Module, settings: Fp8Settings, device: torch.device, run_id: int):
        #: what the feature casts and holds (its Linears, its workspaces); public for benches that size it
        self.capture, self._run_id = Fp8Capture(model, settings, device), run_id
        self._unread: deque[PendingFp8Records] = deque()
        self._rows = Fp8StepRecords([], [])  # the arrived steps' rows, all steps in one

    def at_record(self, step: RecordedStep) -> None:
        if step.at_multiple:
            self._unread.append(self.capture.start(step.step, step.scale))
        else:
            self.capture.skip()
        self._take(wait=False)

    def _take(self, wait: bool) -> None:
        while self._unread and (wait or self._unread[0].ready()):
            self._rows.extend(self._unread.popleft().result())

    def drain(self, wait: bool) -> list[WriterJob]:
        self._take(wait)
        rows, self._rows = self._rows, Fp8StepRecords([], [])
        if not rows.records:
            return []
        return [lambda w: w.add_fp8_steps(self._run_id, rows.records, rows.histograms, rows.blocks, rows.block_scales)]

    def remove(self) -> None:
        self.capture.remove()
