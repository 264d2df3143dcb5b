"""The Recorder: mpdiag's one instrumentation point, used by the CLI runner and by users' own loops.

Call ``record(loss)`` once per optimizer step, after ``backward`` and before the optimizer (or scaler) step.
The Recorder reads, at that moment, the ``.grad`` of every parameter that is this step's
(:mod:`mpdiag.recording.step_gradients`: autograd wrote it since the previous ``record``, and an optimizer stepping
in this step holds it - so a GAN's other model's stale or foreign gradients are not taken for this step's). What it learns only after the step - whether
the optimizer step ran, the scale and growth tracker after ``update()`` - it reads at the next ``record`` (or
at ``close``) from the optimizer's step hooks and the scaler's own ``state_dict()``, never by re-deriving
GradScaler's rule.

Owns the Recorder's constructor (a user's loop: it creates its run; mpdiag's runner and ``watch``: they hand it
the :class:`mpdiag.recording.run.Run` they created) and its core: this step's gradients and the scaler's state,
the step rows, what retention keeps, the flush to the background writer and the end of the run. The optional
parts - the module trace, the FP8 capture, the update counts, the optimizer-step check, the replay and the FP32
shadow comparison - are features behind one protocol (:mod:`mpdiag.recording.features`): the Recorder builds
the list of those its arguments ask for in one place (``_add_optional_features``) and calls their hooks in a loop
at ``record``, around the optimizer step, at each flush and at the end. Must not write the run row itself (its Run
does), validate run options (:mod:`mpdiag.options` does), hold an optional part's state (its feature does) nor
import from the training layer above it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import os
import resource
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.amp.grad_scaler import OptState
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from mpdiag.numerics.formats import LOW_PRECISION, SIGNAL_COUNTS, resolution_log2
from mpdiag.numerics.fp8_recipes import Fp8Settings
from mpdiag.numerics.gradstats import (
    SPECIAL_COUNTS,
    DeviceReadback,
    GradStatsComputer,
    HeldStep,
    PendingStats,
    unscale_factor,
)
from mpdiag.numerics.updates import UpdateTracker
from mpdiag.options import OPTIONS
from mpdiag.recording.background import BackgroundWriter, StoreWriteFailed
from mpdiag.recording.distributed import DiscardingWriter, RankContext, local_shards
from mpdiag.recording.events import EventLog
from mpdiag.recording.features import RecordedStep, RecorderFeature, ShadowComparison, UpdateCounts, found_inf_of
from mpdiag.recording.fp8_capture import Fp8Feature
from mpdiag.recording.nonfinite_step import EVERY_STEP, OptimizerStepCheck
from mpdiag.recording.replay import LOSS_SPIKE_TRIGGER, ReplayFeature, ReplayResult
from mpdiag.recording.retention import Retention
from mpdiag.recording.run import RESERVED_CONFIG_KEYS, Run
from mpdiag.recording.step_gradients import StepGradients, UnscaleWatch
from mpdiag.recording.tracing import ModuleTraceFeature
from mpdiag.store import (
    DEFAULT_STORE,
    REPRESENTABILITY_KINDS,
    RUN_FIELDS,
    StepRow,
    TensorBatch,
)

if TYPE_CHECKING:
    from mpdiag.store import Store


def gpu_name(device: torch.device) -> str | None:
    """The GPU's name a run on ``device`` is recorded with (None off CUDA): runs compare across machines by it."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: the CUDA caching allocator's peak on a GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        # max_memory_allocated's number, read without flattening every allocator statistic into a new dict first
        # (0.4 ms a step on an H200's host, ~3 % of record() at 500 tensors)
        stats = torch.cuda.memory_stats_as_nested_dict(device)
        return int(stats.get("allocated_bytes", {}).get("all", {}).get("peak", 0))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _unscaled_optimizer_ids(scaler) -> set[int]:
    """The ``id`` of each optimizer whose gradients ``scaler.unscale_(optimizer)`` already divided by the scale this
    step (e.g. to clip them). Where several optimizers share one scaler, that may be only some of them: a loop that
    unscales the encoder's alone to clip it; Lightning's manual optimization, which unscales each optimizer inside
    its own step."""
    states = getattr(scaler, "_per_optimizer_states", {})  # GradScaler's own per-optimizer bookkeeping
    return {key for key, state in states.items() if state.get("stage") is OptState.UNSCALED}


def scaler_run_fields(scaler) -> dict[str, Any]:
    """The run fields a dynamic scaler defines, from its own ``state_dict()`` (its scale now as the initial one)."""
    state = scaler.state_dict()
    return {"init_scale": state.get("scale"),
            **{key: state.get(key) for key in ("growth_factor", "backoff_factor", "growth_interval")}}


#: the gradient dtypes whose norms are taken in float32 (clip_grad_norm_'s own rule), and the dtype getter the
#: test maps over the gradients in C
_LOW_DTYPES = frozenset((torch.float16, torch.bfloat16))
_DTYPE = operator.attrgetter("dtype")
_LAYOUT = operator.attrgetter("layout")
_STRIDED = frozenset((torch.strided,))
_COMPLEX = frozenset((torch.complex32, torch.complex64, torch.complex128))
#: the StepGradStats counts of a TensorBatch's representability, format by format (LOW_PRECISION), kind by kind
_REPRESENTABILITY_COUNTS = [f"{fmt}_{kind}" for fmt in LOW_PRECISION for kind in REPRESENTABILITY_KINDS]

FLUSH_INTERVAL_S = 0.5  # rows are committed at least this often, so live readers lag at most this much


def torch_optimizer(optimizer):
    """The torch optimizer a framework's wrapper steps (Accelerate's AcceleratedOptimizer holds it as
    ``.optimizer``, Lightning's LightningOptimizer as ``._optimizer``), else ``optimizer`` itself. The wrapper's own
    step hooks never fire (AcceleratedOptimizer subclasses Optimizer without its ``__init__``: registering one
    raised AttributeError); the inner optimizer's fire whenever the wrapper steps it."""
    for attribute in ("optimizer", "_optimizer"):
        inner = getattr(optimizer, attribute, None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
            return torch_optimizer(inner)
    return optimizer


def values_counted(tensor: torch.Tensor) -> int:
    """How many values the statistics count in ``tensor``: a complex tensor's real and imaginary parts are two
    (:func:`_real_values`); the tensors table stores this as the tensor's numel, so shares stay counts over it."""
    return tensor.numel() * (2 if tensor.is_complex() else 1)


def _real_values(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients as real tensors for the statistics: a complex one as its real and imaginary parts side by
    side (``view_as_real``, no copy), each counted as torch casts them, part by part (read as one real tensor,
    the imaginary parts were dropped: a norm ~40 % low and counts of half the values). The list as it is when
    no gradient is complex (tested in C); the global norm reads the complex gradients, as ``clip_grad_norm_``."""
    if _COMPLEX.isdisjoint(map(_DTYPE, grads)):
        return grads
    return [torch.view_as_real(g) if g.is_complex() else g for g in grads]


def _dense(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient as the strided tensor it stands for: ``nn.Embedding(sparse=True)``'s is a sparse COO tensor,
    which the norm's foreach kernel and the statistics refused (NotImplementedError out of ``record``;
    ``clip_grad_norm_`` itself raises on it), read as its dense value (duplicate indices summed, as SparseAdam
    applies it), one copy of it a step. The list as it is when every gradient is strided (tested in C)."""
    if _STRIDED.issuperset(map(_LAYOUT, grads)):
        return grads
    return [g if g.layout is torch.strided else g.to_dense() for g in grads]


def _arrived(readback: DeviceReadback | None) -> bool:
    """Whether a step row's own gradient norm (None: the readback's) has reached the host."""
    return readback is None or readback.ready()


def _decided(skipped) -> bool:
    """Whether a step row's ``skipped`` (0, 1, None, or a :class:`_SkippedInside`) has reached the host."""
    return not isinstance(skipped, _SkippedInside) or skipped.ready()


class _SkippedInside:
    """A step row's ``skipped`` while it is decided on the device: the ``found_inf`` of each fused optimizer that
    ran its step (:func:`found_inf_of`), read back without a synchronisation; the step was skipped when every one
    of them found an inf (an optimizer that applied its update makes the step applied, as the step hook of a
    non-fused one does)."""

    def __init__(self, found_infs: list[torch.Tensor]):
        device = found_infs[0].device  # several optimizers' may live on several devices
        self._readback = DeviceReadback(torch.cat([f.detach().reshape(1).double().to(device) for f in found_infs]))

    def ready(self) -> bool:
        return self._readback.ready()

    def value(self) -> int:
        return int(bool((self._readback.numpy() > 0).all()))


#: the run's note when no recorded step found a gradient on the model's parameters: its norm reads 0 at every step
NO_GRADIENT_NOTE = ("No parameter of the recorded model had a gradient at any recorded step, so each step's gradient "
                    "norm is 0 and no tensor statistics were kept: the model given to the Recorder is not the one "
                    "whose parameters the backward pass reached (e.g. training through torch.func.functional_call "
                    "over copies of its parameters), or record() was called before backward().")


def _never_ends_training(method):
    """A Recorder method the training loop calls: when writing to the store fails (a full disk, a store gone), the
    Recorder stops recording and says so once; the loop goes on (:meth:`Recorder._stop_recording`)."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        if self.stopped_recording is not None:
            if method.__name__ in ("close", "fail"):
                self._wait_for_stopped_writer()
            return None
        try:
            return method(self, *args, **kwargs)
        except StoreWriteFailed as exc:
            self._stop_recording(exc)
            return None

    return guarded


@dataclass(frozen=True)
class GradientRead:
    """The statistics of a step's gradients, started by :meth:`Recorder.read_gradients` before ``record``.

    step: the step it was read for; present: the recorded tensors' indices read; pending: their statistics on
    their way to the host (None: the step is not logged, or no gradient was this step's); unscale_by: what the
    gradients were divided by to unscale them; norm: the global L2 norm of the step's gradients, unscaled, as a
    0-dim device tensor (read at every step, logged or not; None where this process records no statistics);
    fresh and tensor_norms: the indices of the gradients that norm is over, and their per-tensor norms (still
    scaled), for a norm over fewer of them once the step's owners are known (see ``_settle_owners``)."""

    step: int
    present: tuple[int, ...] = ()
    pending: PendingStats | None = None
    unscale_by: float | torch.Tensor = 1.0
    norm: torch.Tensor | None = None
    fresh: tuple[int, ...] = ()
    tensor_norms: torch.Tensor | None = None


@dataclass
class _UnreadStats:
    """A logged step's statistics until they reach the host and the step's owners are known (its ``keep``: the
    tensors the optimizers stepping in it hold, None where they hold every tensor read; settled once the next step or
    the end began)."""

    step: int
    read: GradientRead
    keep: frozenset[int] | None = None
    settled: bool = False


class Recorder:
    """Records per-step scalars and per-tensor gradient statistics of ``model`` into a store.

    Args:
        model: the module whose parameters' gradients are read.
        store: a store path (default ``MPDIAG_STORE`` or ``mpdiag_runs.db``) or a :class:`Store`.
        name: display name of the run.
        scaler: a ``torch.amp.GradScaler`` (or an object with ``get_scale()``, ``state_dict()`` and
            ``is_enabled()``), or None when the loss is not scaled.
        optimizer: the optimizer whose ``step`` marks a completed step. When None, any optimizer holding
            one of ``model``'s parameters counts.
        every: store tensor statistics every ``every`` steps, and at the steps where something happened and
            the steps next to them; None (the default): every step below ``DENSE_START_STEPS`` (1,000), then
            every ``THIN_EVERY`` (50) and the anomalies (:mod:`mpdiag.recording.retention`). Each step's
            non-finite and FP16/BF16 under/overflow counts per tensor are stored whatever is kept
            (``Store.step_signals``); scalars are recorded every step: the loss, the scale, whether the step was
            skipped, its time, and the three below. With ``every`` above 1, an anomaly between two multiples is
            kept too: :mod:`mpdiag.recording.retention` says which steps are kept and why (``Store.kept_steps``).
            On the CPU the steps between multiples cost a copy of their gradients and one light pass (what
            retention decides with), and the full statistics only if kept: the copies of the last three steps
            are held (three times the gradients' size in FP32); on a GPU the full statistics run at every step
            (a fixed number of launches, no copy). The update counts, the optimizer-step check and ``fp8`` stay
            at the regular steps (the multiples of ``every``, and the default's first 1,000).
        config: run fields (see ``mpdiag.store.RUN_FIELDS``, e.g. ``opt_level``, ``seed``), which set those
            columns, and free-form settings, stored with the run (JSON, ``Store.run(id)["config"]``). They are
            the user's: never read as mpdiag's own configuration. A key mpdiag reads as its own
            (``mpdiag.recording.run.RESERVED_CONFIG_KEYS``: ``run``, ``watch``, ``fp8``, ...) is kept under
            ``"user"`` (``{"run": "baseline-3", "lr": 3e-4}`` is stored as ``{"lr": 3e-4, "user": {"run":
            "baseline-3"}}`` and states no column; the rest of the row is the Recorder's own: its name,
            ``every``, the scaler's state, level ``custom`` unless given).
        trace_modules: also record, per leaf module and step, the absmax of its output and of the gradient
            flowing into it, to find where the first inf/NaN appears (see :mod:`mpdiag.recording.tracing`).
        update_format: ``"fp16"`` or ``"bf16"``: at every logged step, also count the optimizer updates of the
            model's parameters smaller than that format's resolution (see :mod:`mpdiag.numerics.updates`).
            Needs ``optimizer``; costs a copy of the updated weights per logged step, in workspaces allocated
            once.
        fp8: an FP8 recipe (:class:`mpdiag.numerics.fp8_recipes.Fp8Settings`): at every logged step, also record
            what it would cast in every ``nn.Linear`` - the input, the weight and the output gradient (divided
            by the loss scale): exponent histograms, amax, and per recipe the scale and the exact underflow,
            subnormal and overflow counts (see :mod:`mpdiag.recording.fp8_capture`; ``Store.fp8``). Under
            torchrun, rank 0's tensors.
        check_optimizer_step: at every logged step, check whether the optimizer step itself turned weights or
            optimizer state inf/NaN while the loss, gradients, weights and state were finite (e.g. a model kept
            in FP16 with Adam: its eps=1e-8 is 0 there); the first such step is stored with the run
            (``config["optimizer_step_nonfinite"]``, finding ``optimizer-step-nonfinite``). Costs a pass over
            the parameters, their gradients and optimizer state before and after each logged optimizer step,
            until the first finding, and no synchronisation (on a GPU the step is reported at a later record,
            normally the next). ``"every step"``: check every optimizer step, logged or not (mpdiag's runner).
        replay: at the first step whose loss or gradients are inf/NaN, replay that step's forward and backward
            on a copy of the model with a hook on every module and store each module's output and gradient
            absmax and non-finite count, naming the first module to overflow or turn non-finite; and at the
            first loss spike (the ``loss-spike`` event's rule), replay the forwards of that step's and the previous
            step's batches on one copy, naming the batch or the first module whose output jumped
            (:mod:`mpdiag.recording.replay`; ``Store.replays``; the results are :attr:`replayed` and
            :attr:`spike_replayed`). Keeps a reference to every training forward's inputs, its random state and
            its output's gradient until ``record``, and the previous step's inputs and random state one step
            longer, and reads the loss and gradient norm back at each ``record`` until both replays ran. Off by
            default (``False``): its two hooks sit on ``model`` itself, so a ``torch.save(model)`` of the whole
            module would carry them into the checkpoint (and ``torch.load(weights_only=True)`` refuse it). ``None`` (mpdiag's runner, whose scripts never pickle
            the model): on, but on a GPU only when a GradScaler is in use (the read is a synchronisation there,
            and GradScaler's ``step`` synchronises anyway); ``True``: on everywhere. One process only
            (not under torchrun). ``watch`` passes ``None`` too, with ``replay_model``, and hides the two hooks
            from pickling and deep copies of the script's modules for its lifetime
            (:func:`mpdiag.recording.replay.reduce_ex_without_replay_hooks`).
        replay_model: the module whose training forwards the replay keeps and repeats, when it is not ``model``
            (``watch``: ``model`` is a view over the script's parameters that is never called; this is the model
            the script calls). None: ``model``.
        retain_anomalies: ``False``: store (and compute) the statistics of the multiples of ``every`` only, as
            mpdiag did before it kept anomalies (the cheaper choice where a step's statistics cost much).

    mpdiag's runner and ``watch`` pass, instead of ``store``, ``name`` and ``config``:

    * ``run``: the :class:`mpdiag.recording.run.Run` they created (with the whole run configuration), whose
      writer the Recorder shares and does not close; the Recorder describes to it what only it knows (the job's
      shape, ``update_format``), and ends it at :meth:`close` or :meth:`fail`;
    * ``update_targets``: the tensors the optimizer updates, one per trainable parameter of the model in order,
      when they are not the parameters themselves (FP32 master weights, as at O2): the optimizer-step check and
      the update counts read them;
    * ``launcher_names_failures``: the job was launched by mpdiag (``run --nproc``), whose launcher names a rank
      that fails or dies from the ranks' own reports and exit codes; the Recorder's dead-rank watch is for jobs
      torchrun launched.

    ``optimizer`` may also be several (``watch``: every optimizer the script made).

    At every step, logged or not, the step row also holds:

    * ``lr``: the learning rate of the step, ``param_groups[0]["lr"]`` of the first optimizer given (the first
      of several: ``watch`` and Lightning pass every optimizer the script made, and the first is the model's
      main one by convention; a GAN's second optimizer's rate is not recorded), read at ``record``, that is
      before the optimizer step and before a scheduler stepped after it: the rate that step uses. With no
      optimizer given, the first optimizer seen stepping over ``model``'s parameters (read in its step
      pre-hook for the step where it is first seen); NaN/NULL while none is known.
    * ``grad_norm``: the global L2 norm over the step's gradients as ``record`` (or :meth:`read_gradients`)
      reads them - every recorded parameter's gradient that is this step's - divided by the loss scale when they
      are still scaled: the value ``torch.nn.utils.clip_grad_norm_`` returns when called on them then, so call
      ``record`` before clipping for the norm before clipping (``watch`` reads them at the clip call). One
      ``torch._foreach_norm`` over the gradients (in float32 for FP16/BF16 gradients, whose per-tensor norm
      could overflow), no synchronisation; under FSDP2 each tensor's shards' squared norms are summed across
      ranks, as DTensor's own norm sums them. A sparse gradient (``nn.Embedding(sparse=True)``, which
      ``clip_grad_norm_`` refuses) counts as the dense gradient it stands for, as do its statistics. A
      non-finite norm (an overflowed step) is stored as such: inf, or NULL for NaN; 0.0 when no gradient was
      this step's (what ``clip_grad_norm_`` returns for none; a run in which no step had one says so in its note,
      :data:`NO_GRADIENT_NOTE`). Where some of those gradients belong to no
      optimizer of the step (a GAN's generator backward writes the discriminator's too), the norm is over the
      stepping optimizers' alone once the step ends (one process; see ``_settle_owners``).
    * ``wall_time_s``: seconds from the Recorder's creation to the step's ``record`` call (the step's end, as
      ``step_time_s`` counts steps from one ``record`` to the next).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        store: str | os.PathLike | Store | None = None,
        name: str | None = None,
        scaler=None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        every: int | None = OPTIONS["every"].default,
        config: dict[str, Any] | None = None,
        *,
        trace_modules: bool = OPTIONS["trace_modules"].default,
        update_format: str | None = None,
        fp8: Fp8Settings | None = None,
        check_optimizer_step: bool | str = True,
        replay: bool | None = False,
        replay_model: torch.nn.Module | None = None,
        retain_anomalies: bool = True,
        run: Run | None = None,
        update_targets: Sequence[torch.Tensor] | None = None,
        launcher_names_failures: bool = False,
    ):
        if check_optimizer_step not in (True, False, EVERY_STEP):
            raise ValueError(f"check_optimizer_step must be True, False or {EVERY_STEP!r}")
        if run is not None and (store is not None or name is not None or config is not None):
            raise ValueError("a Recorder given a run takes no store, name or config: the run has them")
        self._start(model, scaler, optimizer, every, update_format, update_targets)
        self._retention = Retention(every, [values_counted(p) for _, p in self._params], anomalies=retain_anomalies)
        self._open_run(run, store, name, config, update_format, fp8)
        self.run_id = self._run.run_id
        self._features, self._hooks = [], []  # filled as each is installed: a failure below removes what was
        try:
            self._add_optional_features(model, trace_modules=trace_modules, update_format=update_format, fp8=fp8,
                                        check_optimizer_step=check_optimizer_step, replay=replay,
                                        replay_model=replay_model)
            self._hook_in(watch_ranks=not launcher_names_failures)
        except BaseException as exc:
            self._abandon(exc)
            raise

    def _start(self, model, scaler, optimizer, every, update_format, update_targets) -> None:
        """Everything that does not depend on where the rows go; refuses bad arguments before a writer exists."""
        if every is not None and every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.every = every
        given = [] if optimizer is None else list(optimizer) if isinstance(optimizer, Sequence) else [optimizer]
        self._optimizers = [torch_optimizer(opt) for opt in given]
        self.flush_interval_s = FLUSH_INTERVAL_S
        self._dist = RankContext.of(model)  # under torchrun: rank 0 writes, FSDP2 shards are combined
        # every parameter, frozen ones included: a layer unfrozen later (gradual unfreezing, fine-tuning) is recorded
        # from its first gradient and counts in the norm (left out, the norm missed it silently). Update targets
        # are the trainable parameters' FP32 masters (mpdiag's runner), so they pair with the trainable ones alone.
        self._params = [(self._dist.tensor_name(n), p) for n, p in model.named_parameters()
                        if p.requires_grad or update_targets is None]
        self.device = self._params[0][1].device if self._params else torch.device("cpu")
        self._update_targets = self._checked_targets(update_targets)
        self._check_update_format(update_format)
        self.last_loss = float("nan")  # the unscaled loss of step last_loss_step, as a Python float
        self.last_loss_step: int | None = None  # the latest step whose loss has reached the host
        self._stepped = False
        #: the ``found_inf`` of each fused optimizer GradScaler stepped in the open step (:func:`found_inf_of`): such
        #: a step ran its hooks and may still have been skipped inside the kernel
        self._found_infs: list[torch.Tensor] = []
        #: every optimizer the scaler unscaled since recording started, by id: which gradients it already unscaled
        self._unscaled_seen: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        #: whether an optimizer step can be seen at all: one was given, a GradScaler steps it (it needs one), or a
        #: step over our parameters was seen
        self._observable = bool(self._optimizers) or self.scaler is not None
        self.optimizer_step_nonfinite: dict | None = None  # the first step whose update broke finite values
        #: the replays' results once they ran (``replay``)
        self.replayed: ReplayResult | None = None
        self.spike_replayed: ReplayResult | None = None
        self._unscale_by = 1.0  # what the latest record()'s gradients are divided by to unscale them
        self._computers: dict[tuple[int, ...], GradStatsComputer] = {}
        self._grad_dtype_known: set[int] = set()
        #: whether any recorded parameter had a gradient at a recorded step (the run's note says when none did)
        self._saw_gradient = False
        self._step = 0
        self._empty_buffers()
        #: the optimizer whose param_groups[0]["lr"] is recorded: the first given, else the first seen stepping
        self._lr_optimizer = self._optimizers[0] if self._optimizers else None
        self._closed = False
        #: held while rows move (record, flush, close): the writer's thread also flushes, on a timer
        self._lock = threading.RLock()
        #: why recording stopped while training went on (writing to the store failed), or None
        self.stopped_recording: str | None = None
        #: the events raised from the completed step rows (mpdiag.recording.events); ``configure`` it for --stop-on
        self.events = EventLog(grads_read=self._dist.computes_stats)

    def _empty_buffers(self) -> None:
        """The core's rows on their way from the device to the writer, none yet."""
        # Step rows in order, each with the readback of [loss, scale, growth tracker] taken at its record();
        # a row is complete once the next one's readback (the scaler's state after its update) has arrived.
        self._unread_steps: deque[tuple[list | None, DeviceReadback]] = deque()
        self._unread_stats: deque[_UnreadStats] = deque()
        #: the open step's gradients as read (their per-tensor norms), until its owners are known
        self._open_read: GradientRead | None = None
        self._step_rows: list[tuple] = []
        self._tensor_batches: list[TensorBatch] = []  # the kept steps' tensor rows, a batch per step
        self._kept_rows: list[tuple[int, str]] = []  # (step, reason) of the steps whose tensor rows are kept
        self._signal_rows: list[tuple] = []  # (step, tensor ids, SIGNAL_COUNTS per tensor) of every counted step
        self._rows_through: int | None = None  # the last step whose row is complete
        self._last_flush = time.monotonic()
        self._last_record = self._started = time.perf_counter()

    def _open_run(self, run: Run | None, store, name: str | None, config: dict[str, Any] | None,
                  update_format: str | None, fp8: Fp8Settings | None) -> None:
        """The run the rows go to and the writer that carries them: ``run``'s, or a new run in ``store`` with a
        writer of the Recorder's own."""
        if run is not None:
            self._owns_writer, self._writer, self._run = False, run.writer, run
            # the job's shape is known only now, once the process group exists
            run.describe(**self._dist.run_fields(), **({"update_format": update_format} if update_format else {}))
            return
        if fp8 is not None:
            fp8.validate()  # before a run row exists
        if store is None or isinstance(store, (str, os.PathLike)):
            path = store or os.environ.get("MPDIAG_STORE") or DEFAULT_STORE
        else:  # a Store
            path = store.path
        self._owns_writer = True
        self._writer = BackgroundWriter(path) if self._dist.is_writer else DiscardingWriter()
        fp8_field = {"fp8": dataclasses.asdict(fp8)} if fp8 is not None else {}
        self._run = self._new_run(name, {"update_format": update_format, **self._dist.run_fields(), **fp8_field},
                                  config or {})

    def _hook_in(self, watch_ranks: bool) -> None:
        """Queue the run's tensor rows and install the hooks: only once the writer exists, so a store that cannot
        be opened leaves no hook behind. The optional parts are in ``_features`` already, their hooks installed."""
        self._writer.submit(lambda w: w.add_tensors(self.run_id, self._tensor_rows()))
        self._step_grads = StepGradients([p for _, p in self._params])
        #: the FP32 shadow comparison (always there: its caller decides when) after the optional parts: the order
        #: their hooks are called in (:mod:`mpdiag.recording.features`)
        self._shadow = ShadowComparison([(i, p) for i, (_, p) in enumerate(self._params) if p.requires_grad],
                                        self.run_id)
        self._features.append(self._shadow)
        self._install_step_hooks()
        self._stop_timer = self._writer.every(self.flush_interval_s, self._flush_on_timer)
        if watch_ranks:
            self._dist.watch_for_dead_ranks(self._name_dead_rank)

    def _abandon(self, exc: BaseException) -> None:
        """The constructor failed once the run existed: every hook installed so far removed (they would have run in
        the loop's steps on a Recorder that never started), and the run ended failed saying why (it was left
        running, read later as "crashed: the training process exited without closing the run", with 0 steps)."""
        stop_timer = getattr(self, "_stop_timer", None)
        if stop_timer is not None:
            stop_timer()
        for hook in self._hooks:
            hook.remove()
        for feature in self._features:
            feature.remove()
        step_grads = getattr(self, "_step_grads", None)
        if step_grads is not None:
            step_grads.remove()
        self._run.fail(f"mpdiag could not start recording: {type(exc).__name__}: {exc}", wait=True)
        if self._owns_writer:
            self._writer.close()

    def _add_optional_features(self, model: torch.nn.Module, *, trace_modules: bool, update_format: str | None,
                               fp8: Fp8Settings | None, check_optimizer_step: bool | str, replay: bool | None,
                               replay_model: torch.nn.Module | None) -> None:
        """The optional parts the arguments ask for (see the class's docstring), each added to ``_features`` once
        its hooks are installed; the replay first, so it runs before the others take the step's captured
        tensors."""
        features = self._features
        # replay=None (the runner's): off on a GPU without a GradScaler, where its read of the loss and norm
        # would be the step's only synchronisation (GradScaler's step synchronises anyway)
        sync_free = self.device.type != "cuda" or self.scaler is not None
        if (replay is True or (replay is None and sync_free)) and not self._dist.distributed:
            features.append(ReplayFeature(model if replay_model is None else replay_model, self.run_id,
                                          self._replayed))
        if trace_modules:
            features.append(ModuleTraceFeature(model, self.run_id))
        if fp8 is not None and self._dist.is_writer:
            features.append(Fp8Feature(model, fp8, self.device, self.run_id))
        if update_format is not None:
            features.append(UpdateCounts(UpdateTracker(self._updated_tensors(), update_format), self.run_id))
        if check_optimizer_step:
            features.append(OptimizerStepCheck(check_optimizer_step, self._params, self._update_targets,
                                               self._found_optimizer_step))

    def _name_dead_rank(self, text: str) -> None:
        """Rank 0 under torchrun, from the dead-rank watch's thread: the run's error names the rank that died,
        committed at once (this process may be stopped at any moment); the status follows when the run ends or
        its process is found gone. Nothing once the run has ended (its error is the ending's)."""
        if not self._run.ended:
            self._run.describe(error=text, wait=True)

    # -- setup ----------------------------------------------------------------------------------------------
    def _new_run(self, name: str | None, own: dict[str, Any], user: dict[str, Any]) -> Run:
        """The run of a user's loop: ``own``, what the Recorder knows (columns, and its ``fp8`` settings kept in the
        configuration); ``user``, the user's ``config=``, whose run fields set those columns and whose other keys
        are stored beside them, but for the keys mpdiag reads as its own (RESERVED_CONFIG_KEYS: ``run``,
        ``watch``, ``fp8``, ...), which are kept under ``"user"``: no key of theirs is taken for mpdiag's."""
        fields = {k: v for k, v in {**own, **user}.items() if k in RUN_FIELDS and k != "config"}
        extra = {k: v for k, v in own.items() if k not in RUN_FIELDS}
        extra.update((k, v) for k, v in user.items() if k not in RUN_FIELDS and k not in RESERVED_CONFIG_KEYS)
        if reserved := {k: v for k, v in user.items() if k in RESERVED_CONFIG_KEYS}:
            extra["user"] = reserved
        fields.setdefault("opt_level", "custom")
        fields.setdefault("scaling", "none" if self.scaler is None else "dynamic")  # no scaler: no scale findings
        fields.setdefault("every", self.every)
        fields.setdefault("device", str(self.device))
        fields.setdefault("gpu_name", gpu_name(self.device))
        fields.setdefault("torch_version", torch.__version__)
        if self.scaler is not None:
            for key, value in scaler_run_fields(self.scaler).items():
                fields.setdefault(key, value)
        return Run.create(self._writer, name=name, config=extra, **fields)

    def _tensor_rows(self) -> list[tuple]:
        return [
            (i, n, list(p.shape), values_counted(p), _dtype_name(p.dtype), None)
            for i, (n, p) in enumerate(self._params)
        ]

    def _checked_targets(self, update_targets) -> list[torch.Tensor] | None:
        """``update_targets`` as a list, refused unless they match the recorded parameters in order and shape."""
        if update_targets is None:
            return None
        targets = list(update_targets)
        shapes = [tuple(p.shape) for _, p in self._params]
        if [tuple(t.shape) for t in targets] != shapes:
            raise ValueError(f"update_targets must match the model's {len(shapes)} trainable parameters in order and shape")
        return targets

    def _check_update_format(self, update_format: str | None) -> None:
        if update_format is None:
            return
        if len(self._optimizers) != 1:
            raise ValueError("update_format needs optimizer=: updates are observed through its step hooks")
        resolution_log2(update_format)  # refuses a format without one

    def _updated_tensors(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates: the update targets, else the recorded parameters."""
        return [p for _, p in self._params] if self._update_targets is None else self._update_targets

    def _install_step_hooks(self) -> None:
        """Hooks around the optimizer steps, into ``_hooks``: on the given optimizers; else global ones that act on
        any optimizer holding one of the model's parameters (torch.optim's own global step hooks); and the watch of
        the scaler's unscale_."""
        mine = {id(p) for _, p in self._params}

        def ours(opt) -> bool:
            return bool(self._optimizers) or any(id(p) in mine for group in opt.param_groups for p in group["params"])

        def before(opt, args, kwargs):
            if ours(opt):
                self._step_grads.asked_to_step(opt)
                if self._lr_optimizer is None:
                    self._first_seen_optimizer(opt)
                for feature in self._features:
                    feature.before_optimizer_step(opt)

        def after(opt, args, kwargs):
            if ours(opt):
                self._observable = True
                found_inf = found_inf_of(opt)
                if found_inf is None:
                    self._stepped = True
                else:  # stepped by GradScaler, which may have had it skip inside the kernel
                    self._found_infs.append(found_inf)
                self._after_optimizer_step(opt)

        def unscaled(opt):  # asked to step, whether the scaler then steps it or skips it
            self._unscaled_seen[id(opt)] = opt  # GradScaler's state names it by id alone
            if ours(opt):
                self._step_grads.asked_to_step(torch_optimizer(opt))

        # a compiled optimizer step (``opt.step = torch.compile(opt.step)``, torch's "compiling the optimizer"
        # recipe) calls its hooks inside the traced frame: Dynamo failed tracing the optimizer-step check's numba
        # kernel (ValueError: nonfinite_counts() requires a code object ...), so they run eagerly at a graph break
        before, after = torch.compiler.disable(before), torch.compiler.disable(after)
        hooks = self._hooks  # each kept as it is made: an optimizer refusing one leaves the others removable
        if self._optimizers:
            for opt in self._optimizers:
                hooks.append(opt.register_step_pre_hook(before))
                hooks.append(opt.register_step_post_hook(after))
        else:
            hooks += [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
        if self.scaler is not None:  # last: an optimizer refusing its hooks above leaves no scaler class patched
            hooks.append(UnscaleWatch(self.scaler, unscaled))

    def _first_seen_optimizer(self, opt) -> None:
        """No optimizer was given: the first seen stepping over the model's parameters gives the learning rate,
        from the step it is seen in (whose row is still open)."""
        self._lr_optimizer = opt
        with self._lock:
            if self._unread_steps and self._unread_steps[-1][0] is not None:
                self._unread_steps[-1][0][9] = self._learning_rate()

    def _learning_rate(self) -> float | torch.Tensor:
        """``param_groups[0]["lr"]`` of the recorded optimizer now (a tensor learning rate kept as a tensor, read
        when the row is written); NaN when no optimizer is known."""
        groups = getattr(self._lr_optimizer, "param_groups", None)
        lr = groups[0].get("lr") if groups else None
        if torch.is_tensor(lr):
            return lr.detach().clone()
        try:
            return math.nan if lr is None else float(lr)
        except (TypeError, ValueError):
            return math.nan

    @_never_ends_training
    def _after_optimizer_step(self, opt) -> None:
        for feature in self._features:
            feature.after_optimizer_step(opt)

    def _found_optimizer_step(self, found: dict) -> None:
        """The optimizer-step check's first finding: stored with the run at once."""
        self.optimizer_step_nonfinite = found
        self._run.found_optimizer_step(found)

    def _replayed(self, result: ReplayResult) -> None:
        """A replay ran: its result, said on stderr where events are announced."""
        if result.trigger == LOSS_SPIKE_TRIGGER:
            self.spike_replayed = result
        else:
            self.replayed = result
        if self.events.announce is not None:
            print(result.line(), file=sys.stderr)

    # -- per step -------------------------------------------------------------------------------------------
    @_never_ends_training
    def record(self, loss: torch.Tensor | float, gradients: GradientRead | None = None) -> None:
        """Record the step whose gradients are in ``.grad`` now; ``loss`` is the unscaled loss. ``gradients``:
        this step's gradients as :meth:`read_gradients` read them earlier, instead of reading them now.

        Nothing here waits for the device: the loss, the scaler's state and the statistics travel to the
        host in non-blocking copies and are read when they have arrived (on a GPU, normally at the next
        record(), after GradScaler's own synchronisation in ``step``)."""
        with self._lock:
            self._record(loss, gradients)

    def _record(self, loss: torch.Tensor | float, gradients: GradientRead | None) -> None:
        if self._closed:
            raise RuntimeError("record() called on a closed Recorder")
        if gradients is not None and gradients.step != self._step:
            raise ValueError(f"gradients were read for step {gradients.step}; this is step {self._step}")
        now = time.perf_counter()
        self._close_previous_row(known=True)
        self._settle_owners()
        step = self._step
        scale, values = self._scaler_values(self._dist.exchange_loss(step, loss))
        # the .grad list read once for the statistics and the next step's bookkeeping, when both happen here
        grads = None if gradients is not None else self._step_grads.grads()
        read = gradients if gradients is not None else self._read_tensors(step, scale, grads)
        at_multiple = self._retention.regular(step)  # a multiple of every, or one of the default's first steps
        recorded = RecordedStep(step, loss, scale, scaled=self.scaler is not None, norm=read.norm,
                                at_multiple=at_multiple, logged=at_multiple and read.pending is not None)
        for feature in self._features:
            feature.at_record(recorded)
        state = self._with_norm(values, read.norm)
        if read.pending is not None:
            self._unread_stats.append(_UnreadStats(step, read))
            self._unscale_by = read.unscale_by
        self._step_grads.next_step(grads)
        # logged (index 8) stays 0 here: the writer sets it once the retention keeps the step
        row = [step, None, None, None, None, None, now - self._last_record, peak_memory_bytes(self.device), 0,
               self._learning_rate(), None, now - self._started]
        self._unread_steps.append((row, state))
        self._open_read = read if read.tensor_norms is not None and not self._dist.distributed else None
        self._read_arrived(wait=False)
        self.events.stop_at(step)  # --stop-on: the runner and watch do not step a step whose record raised it
        self._last_record = now
        self._step += 1
        self._stepped, self._found_infs = False, []
        if time.monotonic() - self._last_flush >= self.flush_interval_s:
            self.flush()

    def _scaler_state(self, loss: torch.Tensor | float | None) -> tuple[float | torch.Tensor, DeviceReadback]:
        """The scale now (what the gradients were computed at) as the statistics take it, and a readback of
        [loss, scale, growth tracker, NaN] (no gradient norm)."""
        scale, values = self._scaler_values(loss)
        return scale, self._with_norm(values, None)

    @staticmethod
    def _with_norm(values: torch.Tensor, norm: torch.Tensor | None) -> DeviceReadback:
        """The readback of a step: [loss, scale, growth tracker] and the gradient norm (NaN: none read)."""
        norm_t = torch.full((1,), math.nan, dtype=torch.float64) if norm is None else norm.reshape(1).double()
        return DeviceReadback(torch.cat([values, norm_t.to(values.device)]))

    def _scaler_values(self, loss: torch.Tensor | float | None) -> tuple[float | torch.Tensor, torch.Tensor]:
        """The scale now (what the gradients were computed at) as the statistics take it, and the values
        [loss, scale, growth tracker] on the loss's device. GradScaler's own scale and tracker tensors are read
        without a synchronisation where they live on a GPU; other scalers through ``state_dict()``."""
        loss_t = loss.detach().reshape(1).double() if torch.is_tensor(loss) else \
            torch.tensor([math.nan if loss is None else float(loss)], dtype=torch.float64)
        on_device = getattr(self.scaler, "_scale", None)
        if self.scaler is None:
            scale, tail = 1.0, torch.tensor([1.0, math.nan], dtype=torch.float64, device=loss_t.device)
        elif torch.is_tensor(on_device) and on_device.device.type == "cuda":
            scale = on_device
            tail = torch.cat([on_device.reshape(1).double(), self.scaler._growth_tracker.reshape(1).double()])
        else:
            state = self.scaler.state_dict()
            scale = float(state["scale"])
            tail = torch.tensor([scale, state.get("_growth_tracker", 0)], dtype=torch.float64)
        return scale, torch.cat([loss_t, tail.to(loss_t.device)])

    def read_gradients(self) -> GradientRead:
        """Start the statistics of this step's gradients as they are now, for ``record(loss, gradients=...)``:
        for a loop that changes the gradients (clips them) before it knows whether they are the step's final
        ones (``mpdiag watch`` at a clip call, which may come before another micro-batch's backward). Dropping
        the result costs nothing more; using it after a backward added to the gradients would record stale ones."""
        if self.stopped_recording is not None:
            return GradientRead(self._step)
        if self._closed:
            raise RuntimeError("read_gradients() called on a closed Recorder")
        try:
            with self._lock:  # the statistics workspaces: a held step's may be computing in the writer thread's flush
                return self._read_tensors(self._step, self._scaler_state(None)[0], self._step_grads.grads())
        except StoreWriteFailed as exc:
            self._stop_recording(exc)
            return GradientRead(self._step)

    def _stop_recording(self, exc: StoreWriteFailed) -> None:
        """Writing to the store failed: stop recording, say so once on stderr and, where the store still takes a
        write, as the run's error; take every hook out, so the training goes on exactly as without mpdiag."""
        self.stopped_recording = (f"mpdiag stopped recording at step {self._step}: {exc}. The training itself went "
                                  "on; the steps committed before were kept.")
        print(f"mpdiag: {self.stopped_recording}", file=sys.stderr)
        self._unhook()
        try:
            self._run.fail(self.stopped_recording, wait=True)
        except Exception:  # noqa: BLE001 - the store may refuse this too (a full disk): stderr has said it
            pass
        if self._owns_writer:
            try:
                self._writer.close()
            except Exception:  # noqa: BLE001 - as above
                pass

    def _wait_for_stopped_writer(self) -> None:
        """Recording stopped on the writer's own thread (its timer flush met the failed write), which could only
        queue its ending: the training thread's close waits here until the run's error is written."""
        if self._owns_writer:
            try:
                self._writer.close()
            except Exception:  # noqa: BLE001 - the failure was said once already
                pass

    def _read_tensors(self, step: int, scale: float | torch.Tensor, every_grad: list) -> GradientRead:
        """The global norm of every gradient that is this step's, at every step; and the start of their
        statistics, on the steps whose tensors are logged. ``every_grad``: each recorded parameter's ``.grad``
        now (StepGradients.grads)."""
        if not self._dist.computes_stats:
            return GradientRead(step)
        fresh = self._step_grads.fresh(every_grad)
        self._saw_gradient = self._saw_gradient or bool(fresh)
        grads = _dense(local_shards(every_grad if len(fresh) == len(every_grad) else [every_grad[i] for i in fresh]))
        unscaled_ids = _unscaled_optimizer_ids(self.scaler) if self.scaler is not None else ()
        if unscaled_ids:
            grads = self._unscale_the_rest(grads, fresh, unscaled_ids, scale)
        unscaled = bool(unscaled_ids)
        unscale_by = 1.0 if unscaled else scale
        total, tensor_norms = self._grad_norm(grads)
        norm = self._dist.global_norm(total, tensor_norms) / unscale_by
        owned = dict(unscale_by=unscale_by, fresh=fresh, tensor_norms=tensor_norms)
        if not fresh or not self._retention.computes(step):
            return GradientRead(step, norm=norm, **owned)
        present = fresh
        grads = _real_values(grads)  # after the norm, which reads complex gradients as clip_grad_norm_ does
        computer = self._computers.get(present)
        if computer is None:
            computer = self._computers[present] = GradStatsComputer([g.numel() for g in grads], self.device)
        if self._retention.holds(step) and computer.backend == "numba" and self._dist.parallel != "fsdp":
            # between multiples of every: the gradients copied aside and only what retention decides with counted;
            # the full statistics are computed from the copy if the step is kept
            pending = computer.hold(grads, scale, grads_are_scaled=not unscaled)
        else:
            pending = self._dist.combine(computer.start(grads, scale, grads_are_scaled=not unscaled))
        if pending is None:  # a rank other than 0 took part in combining FSDP2 shards; rank 0 records them
            # its norm kept: a NaN one read as non-finite gradients, and watch announced a false event on that rank
            return GradientRead(step, norm=norm)
        if len(self._grad_dtype_known) < len(self._params):  # until every grad dtype is known (no walk after)
            unseen = [i for i in present if i not in self._grad_dtype_known]
            if unseen:
                self._note_grad_dtypes(unseen)
        return GradientRead(step, present, pending, norm=norm, **owned)

    def _unscale_the_rest(self, grads: list[torch.Tensor], fresh: tuple[int, ...], unscaled_ids: set[int],
                          scale: float | torch.Tensor) -> list[torch.Tensor]:
        """``grads`` (the ``.grad`` of the parameters ``fresh``) all unscaled, the GradScaler having unscaled some
        optimizers' already: a gradient no such optimizer holds still holds S*g and is divided here as ``unscale_``
        divides it (by the scale's float32 reciprocal), in a copy; the script's ``.grad`` is left alone. Read as
        all unscaled, those were stored S times too large. An unscaled optimizer the Recorder cannot name (not
        given to it, and unscaled before it started) leaves every gradient taken as unscaled."""
        known = {id(opt): opt for opt in (*self._optimizers, *self._unscaled_seen.values())}
        if not unscaled_ids <= known.keys():
            return grads
        done = frozenset().union(*(self._step_grads.held_by(torch_optimizer(known[key])) for key in unscaled_ids))
        if done.issuperset(fresh):  # the usual case: every optimizer of the step was unscaled
            return grads
        inv = unscale_factor(scale)
        return [g if i in done else g * (inv.to(g.device) if torch.is_tensor(inv) else inv)
                for g, i in zip(grads, fresh, strict=True)]

    def _grad_norm(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The L2 norm over ``grads`` as ``clip_grad_norm_`` computes it (per-tensor norms by one
        ``torch._foreach_norm``, then the norm of those), in float32 at least; a 0-dim tensor, not read back.
        Also the per-tensor norms (None for no gradient)."""
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=self.device), None
        low = not _LOW_DTYPES.isdisjoint(map(_DTYPE, grads))
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32) if low else torch._foreach_norm(grads, 2)
        try:  # one device: no per-tensor copy (it cost as much as the norms themselves at 500 tensors)
            stacked = torch.stack(norms)
        except RuntimeError:  # gradients on several devices (a model split across GPUs): gathered on the first
            stacked = torch.stack([n.to(norms[0].device) for n in norms])
        return torch.linalg.vector_norm(stacked, 2), stacked

    def _settle_owners(self) -> None:
        """The open step ends: its rows keep the tensors held by the optimizers that stepped in it, and its
        gradient norm is over those alone where other gradients were fresh too (a GAN's generator step: its
        backward also wrote the discriminator's ``.grad``, which no optimizer of this step uses). That norm is
        taken on the device from the same per-tensor norms, in the same order, as ``clip_grad_norm_`` over the
        stepping optimizer's parameters takes it; one process only (under torchrun the norm was summed across
        ranks at ``record``)."""
        fed = self._step_grads.fed()
        unread = self._unread_stats[-1] if self._unread_stats and not self._unread_stats[-1].settled else None
        read, self._open_read = self._open_read, None
        fresh = read.fresh if read is not None else unread.read.present if unread is not None else ()
        covers = fed is None or fed.issuperset(fresh)  # the usual step: tested once here, not again per row
        if unread is not None:
            unread.keep, unread.settled = None if covers else fed, True
        if covers or read is None:
            return
        row = self._unread_steps[-1][0] if self._unread_steps else None
        if row is None or row[0] != read.step:  # (its row is the newest: the next step's is not queued yet)
            return
        kept = [k for k, i in enumerate(read.fresh) if i in fed]
        norm = torch.linalg.vector_norm(read.tensor_norms[kept], 2) if kept else read.tensor_norms.new_zeros(())
        row[10] = DeviceReadback((norm / read.unscale_by).reshape(1).double())

    def recorded_parameter_ids(self) -> frozenset[int]:
        """The ``id`` of every parameter recorded (fixed when recording starts: frozen ones included)."""
        return frozenset(id(p) for _, p in self._params)

    def asked_to_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` steps in the step recorded last, though no step hook of it saw so (GradScaler skipped
        the step; the optimizer's step hook ran before the closure that recorded the step)."""
        self._step_grads.asked_to_step(optimizer)

    @_never_ends_training
    def compare_gradients(self, reference: Sequence[torch.Tensor | None]) -> None:
        """Store, per tensor, how far this step's gradients are from FP32 ``reference`` gradients computed on
        the same weights and batch (one per trainable parameter in order, e.g. from
        :class:`mpdiag.numerics.shadow.Fp32Shadow`): the relative error ||g - g32|| / ||g32|| and the cosine, with g the
        recorded gradient unscaled, in float64. Call after :meth:`record` and before the optimizer step."""
        self.add_shadow_rows(self.shadow_rows(reference, GradientRead(self._step - 1, unscale_by=self._unscale_by)))

    def shadow_rows(self, reference: Sequence[torch.Tensor | None], gradients: GradientRead) -> list[tuple]:
        """:meth:`compare_gradients`' rows for the gradients in ``.grad`` now, read as ``gradients`` (its step and
        unscaling), to be stored by :meth:`add_shadow_rows` once that step is recorded."""
        return self._shadow.rows(reference, gradients.step, gradients.unscale_by)

    @_never_ends_training
    def add_shadow_rows(self, rows: list[tuple]) -> None:
        """Store :meth:`shadow_rows`' rows (with the next flush)."""
        with self._lock:  # the writer thread's timer flush drains them
            self._shadow.add(rows)

    def _note_grad_dtypes(self, indices: Iterable[int]) -> None:
        """Complete the tensors table with each tensor's grad dtype, known once its first grad exists."""
        rows = []
        for i in indices:
            self._grad_dtype_known.add(i)
            name, p = self._params[i]
            rows.append((i, name, list(p.shape), values_counted(p), _dtype_name(p.dtype), _dtype_name(p.grad.dtype)))
        self._writer.submit(lambda w: w.add_tensors(self.run_id, rows))

    def _close_previous_row(self, known: bool) -> None:
        """Note whether the previous recorded step's optimizer step ran (the step hooks are on the host).
        ``known`` False means the run stopped inside the step, so a step that did not run is 'unknown'; so is
        every step of a loop whose optimizer steps cannot be seen (no optimizer or scaler given and no torch.optim
        step over the model's parameters yet: weights updated by hand)."""
        if self._unread_steps and self._unread_steps[-1][0] is not None:
            self._unread_steps[-1][0][3] = 0 if self._stepped else _SkippedInside(self._found_infs) \
                if self._found_infs else (1 if known and self._observable else None)

    def _read_arrived(self, wait: bool) -> None:
        """Move what has reached the host into the row buffers, in step order; ``wait`` waits for all of it.

        A step row takes its loss and scale from its own readback and the growth tracker and scale after
        ``update()`` from the next one's; the final sentinel (row None) is the state at close()."""
        steps = self._unread_steps
        while len(steps) >= 2 and (wait or (steps[0][1].ready() and steps[1][1].ready()
                                            and _arrived(steps[0][0][10]) and _decided(steps[0][0][3]))):
            (row, state), (_, after) = steps.popleft(), steps[0]
            if isinstance(row[3], _SkippedInside):
                row[3] = row[3].value()
            loss, scale, _, norm = state.numpy()
            _, scale_after, tracker, _ = after.numpy()
            row[1], row[2] = float(loss), float(scale)
            row[9] = float(row[9])  # a tensor learning rate is read here, a step later
            row[10] = float(norm if row[10] is None else row[10].numpy()[0])  # the owners' norm, where settled so
            row[4] = None if math.isnan(tracker) else int(tracker)
            row[5] = float(scale_after)
            self._step_rows.append(StepRow(*row))
            self._retention.see_row(row, self.events.see(row))
            self._rows_through = row[0]
        if steps and steps[-1][0] is not None and (wait or steps[-1][1].ready()):
            self.last_loss, self.last_loss_step = float(steps[-1][1].numpy()[0]), steps[-1][0][0]
        elif self._step_rows:
            self.last_loss, self.last_loss_step = self._step_rows[-1][1], self._step_rows[-1][0]
        while self._unread_stats and self._unread_stats[0].settled and (wait or self._unread_stats[0].read.pending.ready()):
            unread = self._unread_stats.popleft()
            self._see_stats(unread.step, unread.read.present, unread.read.pending.result(), unread.keep)
        if self._rows_through is not None:
            # a step is decided once the next one's row and statistics are in (or that step has none)
            through = self._rows_through if not self._unread_stats else \
                min(self._rows_through, self._unread_stats[0].step - 1)
            self._keep(self._retention.decide(through))

    def _see_stats(self, step: int, present: tuple[int, ...], stats, keep: frozenset[int] | None) -> None:
        """Hand a step's statistics to the retention, which holds them until it decides whether to keep the step."""
        # another optimizer's parameter (not in ``keep``): its fresh gradient fed no step here
        if keep is None:  # the usual step (_settle_owners found every tensor fed): no per-tensor test
            kept, counts, tensor_ids = list(range(len(present))), stats.counts, np.asarray(present)
        else:
            kept = [k for k, i in enumerate(present) if i in keep]
            counts, tensor_ids = {name: c[kept] for name, c in stats.counts.items()}, np.asarray(present)[kept]
        if not kept:
            return
        # stored for every step, kept or not: the same counts the rules read (light pass or full statistics)
        self._signal_rows.append((step, tensor_ids, np.stack([counts[c] for c in SIGNAL_COUNTS], axis=1)))
        self._retention.see_stats(step, tensor_ids, counts, (present, stats, kept))

    def _keep(self, decided: list[tuple[int, Any, list[str]]]) -> None:
        """The rows of the steps the retention kept, and why it kept them."""
        for step, (present, stats, kept), reasons in decided:
            self._add_tensor_rows(step, present, stats, kept)
            self._kept_rows += [(step, reason) for reason in reasons]

    def _add_tensor_rows(self, step: int, present: tuple[int, ...], stats, kept: list[int]) -> None:
        if isinstance(stats, HeldStep):
            stats = stats.stats()
        # columns, not rows: at 500 tensors, a Python object per tensor and field cost more than the statistics; all
        # tensors kept (the usual step), the statistics' own arrays, not copies (each step's are its own)
        at = slice(None) if len(kept) == len(present) else np.asarray(kept)
        representability = np.stack([stats.counts[name] for name in _REPRESENTABILITY_COUNTS], axis=1)[at]
        specials = np.stack([stats.counts[c] for c in SPECIAL_COUNTS], axis=1)[at]
        self._tensor_batches.append(TensorBatch.of_step(
            step, np.asarray(present)[at], stats.hist[at], specials, stats.absmax[at], stats.min_nonzero[at],
            stats.l2[at], representability.reshape(-1, len(LOW_PRECISION), len(REPRESENTABILITY_KINDS))))

    def _flush_on_timer(self) -> None:
        """On the writer's thread: hand over the rows that have arrived when the training thread has not for a
        while - it may be stuck inside a step, and the steps before it still reach the store."""
        if not self._lock.acquire(blocking=False):
            return  # the training thread is recording: it flushes itself
        try:
            if not self._closed and time.monotonic() - self._last_flush >= self.flush_interval_s:
                self.flush()
        finally:
            self._lock.release()

    @property
    def features(self) -> tuple[RecorderFeature, ...]:
        """The features this Recorder runs, in the order their hooks are called (benches size their workspaces)."""
        return tuple(self._features)

    @_never_ends_training
    def flush(self) -> None:
        """Hand the rows that have reached the host to the writer thread (committed there in one transaction)."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        self._read_arrived(wait=False)
        steps, tensors, kept, signals = self._step_rows, self._tensor_batches, self._kept_rows, self._signal_rows
        self._step_rows, self._tensor_batches, self._kept_rows, self._signal_rows = [], [], [], []
        self._last_flush = time.monotonic()
        if steps or tensors or signals:
            self._writer.submit(lambda w: w.write_batch(self.run_id, steps, TensorBatch.concat(tensors), kept,
                                                        signals))
        events = self.events.take()
        if events:
            self._writer.submit(lambda w: w.add_events(self.run_id, events))
        ranks = self._dist.take_rank_rows(wait=self._closed)
        if ranks:
            self._writer.submit(lambda w: w.add_rank_steps(self.run_id, ranks))
        for feature in self._features:  # closed: the run ends, so every feature's rows are waited for
            for job in feature.drain(wait=self._closed):
                self._writer.submit(job)

    # -- end ------------------------------------------------------------------------------------------------
    @_never_ends_training
    def close(self, note: str | None = None) -> None:
        """Write everything and mark the run finished (idempotent); ``stopped`` with the reason when an event
        asked to stop (``--stop-on``: the step in progress did not step)."""
        reason = self.events.stop_reason
        self._end(status="finished" if reason is None else "stopped", error=reason, note=note, known=reason is None)

    @_never_ends_training
    def fail(self, error: str, status: str = "failed") -> None:
        """Write everything and mark the run failed with ``error``; after another rank died, ``crashed``, with
        the error naming that rank first."""
        dead = self._dist.dead_rank_named
        if dead is not None:
            status, error = "crashed", f"{dead}; rank {self._dist.rank} then stopped: {error}"
        self._end(status=status, error=error, note=None, known=False)

    def _end(self, status: str, error: str | None, note: str | None, known: bool) -> None:
        with self._lock:
            self._end_locked(status, error, note, known)

    def _unhook(self) -> None:
        """Closed: the timer, the step and gradient hooks, the rank watch and the features' hooks removed."""
        self._closed = True
        self._stop_timer()
        for hook in self._hooks:
            hook.remove()
        self._step_grads.remove()
        self._dist.close()
        for feature in self._features:
            feature.remove()

    def _end_locked(self, status: str, error: str | None, note: str | None, known: bool) -> None:
        if self._closed:
            return
        self._unhook()
        self._close_previous_row(known=known)
        self._settle_owners()
        if self._unread_steps:
            self._unread_steps.append((None, self._scaler_state(None)[1]))  # the state after the last update
        self._read_arrived(wait=True)
        self._keep(self._retention.decide(None))
        self.flush()
        if self.stopped_recording is not None:  # that flush met a failed write: the run was ended failed
            return
        # After the last rows: jobs run in order, so the stored summary counts every step. Waiting for them
        # first makes a write that failed (a full disk) fail here, before the run is ended as if complete.
        self._writer.call(lambda w: None)
        if self._step and not self._saw_gradient and self._dist.computes_stats:
            note = " ".join(filter(None, [note, NO_GRADIENT_NOTE]))
        self._run.end(status, error=error, note=note)
        if self._owns_writer:
            self._writer.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
        else:
            self.fail("".join(traceback.format_exception(exc_type, exc, tb)))
