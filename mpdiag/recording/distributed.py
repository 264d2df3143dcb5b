"""What the Recorder does differently when its model trains on several processes (torchrun, DDP or FSDP2).

Owns: finding the job's shape (rank, world size, backend, DDP or FSDP2), the one-writer rule (rank 0 writes,
the other ranks send nothing to the store and never open it), the exact combination of FSDP2 shard
statistics, the per-rank rows (local loss, DDP's local inf/NaN count before the all-reduce), and naming a rank
that died (:class:`DeadRankWatch`).
Must not: gather gradient values, issue a collective at a point where ranks can disagree (every collective
here runs inside ``Recorder.record``, which every rank calls once per step, in the same order), or write
SQL (rows go through the Recorder's writer).

Collectives per recorded step (see docs/distributed.md, design cost): one ``all_gather`` of 2 float64 per rank (loss,
non-finite count); under FSDP2 one more ``all_gather`` of each rank's packed per-tensor statistics on the
steps whose tensor statistics are logged. DDP needs none for statistics: after its all-reduce every rank
holds the same gradients, so rank 0 computes them alone.
"""

from __future__ import annotations

import itertools
import os
import shlex
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import psutil
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from mpdiag.numerics.gradstats import DeviceReadback, PendingStats, StepGradStats

#: the name prefix DDP adds to its module's parameters; dropped so a DDP run's tensors are named as the model's
DDP_PREFIX = "module."
#: how long a dead rank's naming waits for the exchange rank 0 is in to end (one that succeeds ends in
#: milliseconds; one the dead rank never joined fails, or blocks until the launcher stops rank 0)
EXCHANGE_WAIT_S = 0.5


def _dtensor_class() -> type | None:
    """FSDP2's DTensor class, or None while nothing in this process has imported it (then no tensor can be
    one). Looked up, not imported: importing torch.distributed.tensor adds ~0.8 s to every training
    process's start, distributed or not."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local_shards(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The part of each tensor this rank holds: an FSDP2 DTensor's local shard, else the tensor itself (the
    list as it is when nothing imported DTensor: no per-tensor work on the training step)."""
    dtensor = _dtensor_class()
    if dtensor is None or not any(map(isinstance, tensors, itertools.repeat(dtensor))):  # tested in C: no shard
        return tensors
    return [t.to_local() if isinstance(t, dtensor) else t for t in tensors]


def _is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or a submodule (its parameters are DTensors)."""
    dtensor = _dtensor_class()
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


def launch_command() -> str:
    """The launcher's command line: the parent process's (torchrun's agent) when started by torchrun."""
    process = psutil.Process(os.getppid()) if "TORCHELASTIC_RUN_ID" in os.environ else psutil.Process()
    try:
        return shlex.join(process.cmdline())
    except psutil.Error:
        return ""


class DiscardingWriter:
    """The writer of a rank other than 0: takes the Recorder's jobs and runs none, so those ranks never open
    the store (one writer per job, no schema race when the store file does not exist yet)."""

    def submit(self, job) -> None:
        return None

    def call(self, job) -> None:
        return None

    def every(self, interval_s, fn):
        return lambda: None

    def close(self) -> None:
        return None


class DeadRankWatch:
    """Rank 0 of a torchrun job: names a rank whose process died, while the job still runs.

    Once a rank dies, rank 0 either fails in its next collective or is stopped by the launcher (torchrun
    SIGTERMs every rank once one has died, and SIGKILLs them after a grace period), whichever comes first,
    and rank 0's main thread may be blocked inside that collective the whole time. So the naming is done
    by a daemon thread, which polls the other ranks' processes on this host (ranks on other hosts cannot be
    checked from here) every POLL_S and, at the first that is gone, calls ``report(text)`` once, e.g.
    "rank 1 died at step 2". A SIGTERM handler, chained in front of the one it finds (installed only from the
    main thread), gives the thread up to GRACE_S to do it before the signal does what it did before.
    """

    POLL_S = 0.05
    GRACE_S = 2.0

    def __init__(self, peers: list[tuple[str, int]], rank: int, step: Callable[[], int],
                 report: Callable[[str], None]):
        here = socket.gethostname()
        self._local = [(r, pid) for r, (host, pid) in enumerate(peers) if r != rank and host == here]
        self._step, self._report = step, report
        self.named: str | None = None
        self._settled, self._stopping = threading.Event(), threading.Event()
        self._sigterm = self._chain_sigterm() if threading.current_thread() is threading.main_thread() else None
        threading.Thread(target=self._watch, name="mpdiag-dead-rank-watch", daemon=True).start()

    def dead_ranks(self) -> list[int]:
        def ended(pid: int) -> bool:
            try:
                return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # not yet reaped by torchrun
            except psutil.NoSuchProcess:
                return True

        return [r for r, pid in self._local if ended(pid)]

    def _naming(self, dead: list[int]) -> str:
        return ", ".join(f"rank {r} died" for r in dead) + f" at step {self._step()}"

    def check_now(self, grace_s: float = 1.0) -> str | None:
        """The dead rank's naming, looked at now if the thread has not yet: this rank's collective has just failed,
        and the peer whose death made it fail may have died since the thread's last look - or be dying: a killed
        process's sockets close before it is a zombie, so it is looked at for up to ``grace_s``."""
        deadline = time.monotonic() + grace_s
        while self.named is None:
            dead = self.dead_ranks()
            if dead:
                self.named = self._naming(dead)
            elif time.monotonic() > deadline:
                break
            else:
                time.sleep(self.POLL_S)
        return self.named

    def _watch(self) -> None:
        while not self._stopping.wait(self.POLL_S):
            dead = self.dead_ranks()
            if dead:
                self.named = self.named or self._naming(dead)
                try:
                    self._report(self.named)
                finally:
                    self._settled.set()
                return

    def _chain_sigterm(self) -> tuple:
        previous = signal.getsignal(signal.SIGTERM)

        def stopped(signum, frame):
            self._settled.wait(self.GRACE_S)  # a dead rank is why the launcher stops us: let the thread name it
            signal.signal(signal.SIGTERM, previous)
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                os.kill(os.getpid(), signal.SIGTERM)  # the default action, restored above: the process ends

        signal.signal(signal.SIGTERM, stopped)
        return stopped, previous

    def stop(self) -> None:
        """Stop watching (the run ended); the SIGTERM handler found at the start is put back if ours is still
        the one installed."""
        self._stopping.set()
        self._settled.set()
        if self._sigterm is not None and threading.current_thread() is threading.main_thread():
            ours, previous = self._sigterm
            if signal.getsignal(signal.SIGTERM) is ours:
                signal.signal(signal.SIGTERM, previous)
            self._sigterm = None


@dataclass
class RankContext:
    """This process's place in the job. ``parallel`` is "ddp", "fsdp" or None (one process, or a model
    wrapped by neither: then each rank's gradients are its own and only rank 0's are recorded)."""

    rank: int = 0
    world_size: int = 1
    backend: str | None = None
    parallel: str | None = None
    _counter: NonfiniteCounter | None = None
    _named_by_ddp: bool = False  # the Recorder was given the DDP module itself: its names start "module."
    _pending_rows: list[tuple[int, DeviceReadback]] = field(default_factory=list)
    #: every rank's (host name, pid) under torchrun, gathered once when the Recorder starts, to name a dead rank
    _peers: list = field(default_factory=list)
    last_exchanged: int = -1  # the last step whose losses every rank sent (see exchange_loss)
    #: held by rank 0 through an exchange and the note of its step: a dead rank's naming waits for it
    _exchanging: threading.Lock = field(default_factory=threading.Lock)
    _dead_watch: DeadRankWatch | None = None

    @classmethod
    def of(cls, model: torch.nn.Module) -> RankContext:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        # the model itself, or (watch's view of a script's parameters) the outermost module holding them
        ddp = next((m for m in model.modules() if isinstance(m, DistributedDataParallel)), None)
        parallel = "ddp" if ddp is not None else "fsdp" if _is_fsdp2(model) else None
        context = cls(dist.get_rank(), dist.get_world_size(), dist.get_backend(), parallel)
        context._named_by_ddp = isinstance(model, DistributedDataParallel)  # (watch names the module inside)
        if ddp is not None:
            context._counter = NonfiniteCounter(ddp)
        if "TORCHELASTIC_RUN_ID" in os.environ:  # every rank creates its Recorder once: one collective
            context._peers = [None] * context.world_size
            dist.all_gather_object(context._peers, (socket.gethostname(), os.getpid()))
        return context

    def watch_for_dead_ranks(self, report: Callable[[str], None]) -> None:
        """Rank 0 under torchrun: ``report(text)`` names a rank that dies while the job runs (see
        :class:`DeadRankWatch`; the step is the first whose losses not every rank sent)."""
        if self.is_writer and self._peers:
            self._dead_watch = DeadRankWatch(self._peers, self.rank, self._unfinished_step, report)

    def _unfinished_step(self) -> int:
        """The first step whose losses not every rank sent, read once the exchange rank 0 is in, if any, has ended
        or has been blocked for EXCHANGE_WAIT_S. A rank that finished a step's exchange and then died had sent
        that step's loss before rank 0 noted the exchange done (CI named a rank killed as step 2 began "died at
        step 1"); an exchange its dead peer never joined stays blocked until it fails, and its step is the one."""
        if self._exchanging.acquire(timeout=EXCHANGE_WAIT_S):
            self._exchanging.release()
        return self.last_exchanged + 1

    @property
    def dead_rank_named(self) -> str | None:
        """What the dead-rank watch reported, if a rank died."""
        return None if self._dead_watch is None else self._dead_watch.check_now()

    @staticmethod
    def launched_as_other_rank() -> bool:
        """Whether torchrun started this process as a rank other than 0 (read from its environment, so it is
        known before the script joins the process group): such a process must not open the store."""
        return int(os.environ.get("RANK", "0")) != 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    @property
    def computes_stats(self) -> bool:
        """FSDP2: every rank counts its shard; otherwise rank 0 alone (DDP's gradients are the same everywhere)."""
        return self.is_writer or self.parallel == "fsdp"

    def run_fields(self) -> dict:
        """Run columns describing the job (none for one process)."""
        if not self.distributed:
            return {}
        return {"world_size": self.world_size, "backend": self.backend, "launch_command": launch_command()}

    def tensor_name(self, name: str) -> str:
        return name.removeprefix(DDP_PREFIX) if self._named_by_ddp else name

    def combine(self, pending: PendingStats) -> PendingStats | None:
        """FSDP2: the statistics of the full gradients from every rank's shard statistics, with one
        all_gather of the packed counts (no gradient values); None on ranks other than 0. Otherwise
        ``pending`` itself. The local statistics are read here (at once on the CPU; on a GPU this waits for
        them: the price of combining before the next step's collectives)."""
        if self.parallel != "fsdp":
            return pending
        local = pending.result()
        packed = torch.from_numpy(pack_stats(local))
        gathered = [torch.empty_like(packed) for _ in range(self.world_size)]
        dist.all_gather(gathered, packed.to(_collective_device(self.backend)))
        if not self.is_writer:
            return None
        combined = combine_packed(np.stack([g.cpu().numpy() for g in gathered]), local)
        return PendingStats(lambda _: combined)

    def global_norm(self, local: torch.Tensor, tensor_norms: torch.Tensor | None) -> torch.Tensor:
        """FSDP2: the L2 norm of the full gradients from this rank's shards' norms ``tensor_norms`` (one per
        gradient, stacked; None for none), taken as ``clip_grad_norm_`` over the DTensor gradients takes it, so
        bit for bit its value: each tensor's norm is its shards' squared norms summed over the ranks, then raised to
        1/2 (DTensor's ``_NormPartial``), and the global norm is the norm of those. One all_reduce of one value per
        gradient, no gradient values; every rank calls it at every step. (Summing the ranks' squared global norms in
        float64 differed from torch's in the 8th digit.) Otherwise ``local`` itself: DDP's gradients are the same
        on every rank, and rank 0's alone are recorded."""
        if self.parallel != "fsdp":
            return local
        device = _collective_device(self.backend)
        squared = tensor_norms.to(device) ** 2 if tensor_norms is not None else torch.zeros(0, device=device)
        dist.all_reduce(squared)
        return torch.linalg.vector_norm(squared ** 0.5, 2).to(local.device)

    def exchange_loss(self, step: int, loss: torch.Tensor | float) -> torch.Tensor | float:
        """Every rank's local loss and local inf/NaN count for ``step`` to rank 0 (one small all_gather,
        without waiting for the device); returns the mean of the ranks' losses, the job's loss."""
        if not self.distributed:
            return loss
        device = _collective_device(self.backend)
        local_loss = loss.detach().reshape(1).double().to(device) if torch.is_tensor(loss) else \
            torch.tensor([float(loss)], dtype=torch.float64, device=device)
        counted = self._counter.take().to(device) if self._counter is not None else \
            torch.full((1,), float("nan"), dtype=torch.float64, device=device)
        mine = torch.cat([local_loss, counted])
        everyone = torch.empty(self.world_size * 2, dtype=torch.float64, device=device)
        with self._exchanging:
            dist.all_gather_single(everyone, mine)
            self.last_exchanged = step
        everyone = everyone.view(self.world_size, 2)
        if self.is_writer:
            self._pending_rows.append((step, DeviceReadback(everyone)))
        return everyone[:, 0].mean()

    def take_rank_rows(self, wait: bool) -> list[tuple]:
        """(step, rank, loss, nonfinite) rows whose values reached the host (all of them with ``wait``)."""
        rows = []
        while self._pending_rows and (wait or self._pending_rows[0][1].ready()):
            step, readback = self._pending_rows.pop(0)
            for rank, (loss, nonfinite) in enumerate(readback.numpy()):
                rows.append((step, rank, float(loss) if np.isfinite(loss) else None,
                             None if np.isnan(nonfinite) else int(nonfinite)))
        return rows

    def close(self) -> None:
        if self._counter is not None:
            self._counter.remove()
        if self._dead_watch is not None:
            self._dead_watch.stop()


def _collective_device(backend: str | None) -> torch.device:
    """NCCL moves CUDA tensors (this rank's current device); gloo moves CPU tensors."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class NonfiniteCounter:
    """DDP: counts the inf/NaN values of this rank's own gradients before DDP's all-reduce.

    A post-accumulate-grad hook on every parameter sees ``.grad`` once autograd has accumulated this rank's
    gradient into it, before DDP's reducer (a hook on the same gradient accumulator, run after it) copies it
    into a bucket; the reduced values reach ``.grad`` only when the backward pass ends. Backward passes under
    ``no_sync()`` accumulate without an all-reduce and are not counted: the syncing pass sees the sum.
    This leaves DDP's communication hook (a user's, or none) untouched, so no hook is wrapped or refused,
    and adds no communication (the count travels in :meth:`RankContext.exchange_loss`'s all_gather)."""

    def __init__(self, ddp: DistributedDataParallel):
        self._ddp = ddp
        self._count: torch.Tensor | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._count_local)
                         for p in ddp.module.parameters() if p.requires_grad]

    def _count_local(self, param: torch.Tensor) -> None:
        if not self._ddp.require_backward_grad_sync:
            return
        bad = torch.count_nonzero(~torch.isfinite(param.grad))
        self._count = bad if self._count is None else self._count + bad

    def take(self) -> torch.Tensor:
        """This step's count (float64, one element), then start the next step's at zero."""
        count, self._count = self._count, None
        return torch.zeros(1, dtype=torch.float64) if count is None else count.reshape(1).double()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


# -- FSDP2 shard statistics: packed per tensor as int64, floats by their bits ---------------------------------
def pack_stats(stats: StepGradStats) -> np.ndarray:
    """One int64 row per tensor: histogram, every count (in sorted name order), then absmax, min_nonzero and
    the squared L2 norm as float64 bit patterns, so one all_gather carries them without rounding."""
    floats = np.stack([stats.absmax, stats.min_nonzero, stats.l2**2], axis=1).astype(np.float64)
    counts = np.stack([stats.counts[name] for name in sorted(stats.counts)], axis=1).astype(np.int64)
    return np.concatenate([stats.hist.astype(np.int64), counts, floats.view(np.int64)], axis=1)


def combine_packed(per_rank: np.ndarray, like: StepGradStats) -> StepGradStats:
    """The statistics of the full gradients from every rank's :func:`pack_stats` rows, shape (ranks, T,
    columns), counted under the names of ``like`` (this rank's own statistics): histograms and counts summed,
    absmax the max (NaN if any shard holds a NaN), min_nonzero the smallest (NaN only where no shard has a
    non-zero value: NaN marks 'none'), L2 the root of the summed squares."""
    names, bins = sorted(like.counts), like.hist.shape[1]
    ints = per_rank[:, :, : bins + len(names)].sum(axis=0)
    floats = np.ascontiguousarray(per_rank[:, :, bins + len(names) :]).view(np.float64)  # (ranks, T, 3)
    return StepGradStats(hist=ints[:, :bins], counts={name: ints[:, bins + k] for k, name in enumerate(names)},
                         absmax=floats[:, :, 0].max(axis=0), min_nonzero=np.fmin.reduce(floats[:, :, 1], axis=0),
                         l2=np.sqrt(floats[:, :, 2].sum(axis=0)), other_view=like.other_view)
