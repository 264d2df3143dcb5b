"""Running the model-script runner on several processes: ``python -m mpdiag run SCRIPT --nproc N``.

Owns: the launch (torch's own elastic launcher, the one behind ``torchrun``, starting
:mod:`mpdiag.training.rank` in every rank), each rank's setup (process group, DDP or FSDP2 wrapping,
ShardedGradScaler, the seed offset by the rank), and the end of a job whose rank crashed or was killed (the run becomes ``crashed``,
its error naming the rank). Must not: record anything itself (the Recorder does, on rank 0, see
:mod:`mpdiag.recording.distributed`) or open the store on a rank other than 0.

The launching process creates the run row before any rank starts (so ranks never race to create the store)
and owns it: while it lives the run is ``running``; when the job ends it is ended by rank 0's Recorder, or
here when a rank died.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mpdiag.recording.background import BackgroundWriter
from mpdiag.recording.run import MpdiagConfig, Run
from mpdiag.training.policies import LossScaler, PrecisionPolicy
from mpdiag.training.script import ModelScript

#: opt levels FSDP2 runs (O2's FP32 master copies and O3's FP16 optimizer are not sharded here)
#: the environment variable naming the launch spec a rank reads (see :func:`launch`)
SPEC_ENV = "MPDIAG_DISTRIBUTED_SPEC"
#: every rank's entry point (it imports the runner, which imports this module)
RANK_ENTRY = "mpdiag.training.rank"
#: the folder holding the mpdiag package, put on the ranks' PYTHONPATH so they import this same mpdiag
ROOT = str(Path(__file__).resolve().parents[2])


def exit_skipping_finalization(code: int) -> None:
    """End a rank process now, once its work is flushed: run the atexit handlers (the script's own included)
    and exit without interpreter finalization. gloo's worker threads outlive destroy_process_group() and may
    still be releasing a finished collective's tensors, which needs the GIL; during finalization that aborts
    the process (std::terminate, SIGABRT: seen under CPU load with FSDP2, reproduced without mpdiag), and the
    launcher would report a job that ended well as failed."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def launched_by_torchrun() -> bool:
    """Whether torch's elastic launcher (torchrun) started this process as one of several ranks."""
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


# -- in each rank -------------------------------------------------------------------------------------------
@dataclass
class RankJob:
    """This rank's part of a job launched by :func:`launch`."""

    rank: int
    world_size: int
    parallel: str

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(cls, parallel: str, device: torch.device) -> RankJob:
        """Join the job's process group (torchrun's environment names the rank and the rendezvous)."""
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend_for(device))
        return cls(dist.get_rank(), dist.get_world_size(), parallel)

    def prepare(self, policy: PrecisionPolicy, model: torch.nn.Module, make_optimizer):
        """(model, optimizer) wrapped for data-parallel training, from weights equal on every rank (rank 0's:
        each rank built its own from its own seed)."""
        with torch.no_grad():
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)
        model, optimizer = policy.prepare(model, make_optimizer)
        if self.parallel == "ddp":
            return torch.nn.parallel.DistributedDataParallel(model), optimizer
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # the policy's autocast does the per-op casting; gradients are reduced in FP32
        fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        if policy.scaler is not None:
            policy.scaler = sharded_loss_scaler()(policy.device.type, policy.config, policy.scaler.static,
                                                  policy.scaler.allow_fp16_grads)
        return model, make_optimizer(model.parameters())  # fully_shard replaced the parameters

    def report_failure(self, error: str) -> None:
        """Leave this rank's error, timed, beside the launch spec for the launching process, which names the
        rank that failed first (the others usually fail afterwards, in a collective their peer left). Ranks
        other than 0 cannot write the store, and their exit code says nothing: the runner records the error
        and the rank exits normally."""
        report = {"rank": self.rank, "time": time.time(), "error": error}
        with open(os.path.join(os.path.dirname(os.environ[SPEC_ENV]), f"rank-{self.rank}.failure.json"), "w") as f:
            json.dump(report, f)



@functools.cache
def sharded_loss_scaler() -> type[LossScaler]:
    """The opt levels' LossScaler (static scale, scale bounds) over FSDP's ShardedGradScaler, which finds
    inf/NaN in every rank's shard and agrees on skipping the step across ranks. A class made on first use:
    importing FSDP adds ~1 s to the start of every training process, most of which never shard."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return type("ShardedLossScaler", (LossScaler, ShardedGradScaler), {"__doc__": sharded_loss_scaler.__doc__})


# -- in the launching process -------------------------------------------------------------------------------
def launch(script: ModelScript, config, store_path: str | os.PathLike, run_facts: dict) -> int:
    """Run ``script`` under ``config`` on ``config.nproc`` processes through torch's elastic launcher; returns
    the run id. ``run_facts``: what the run row says besides what ``config`` states (see ``runner._run_facts``)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    device = torch.device(run_facts["device"])
    writer = BackgroundWriter(store_path)
    try:
        sha = writer.call(lambda w: w.add_script(os.path.basename(script.filename), script.source))
        run_id = Run.create(writer, config=MpdiagConfig({"run": config.to_dict()}), **run_facts, script_sha256=sha,
                            world_size=config.nproc, backend=backend_for(device),
                            launch_command=shlex.join(sys.orig_argv)).run_id  # running from now on: rank 0 adopts it
    finally:
        writer.close()
    with tempfile.TemporaryDirectory(prefix="mpdiag-job-") as folder:
        spec = os.path.join(folder, "spec.json")
        with open(spec, "w") as f:
            json.dump({"filename": script.filename, "source": script.source, "config": config.to_dict(),
                       "store": str(Path(store_path).absolute()), "run_id": run_id}, f)
        launcher = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=config.nproc, rdzv_backend="c10d",
                                rdzv_endpoint="localhost:0", run_id=f"mpdiag-{run_id}", max_restarts=0,
                                monitor_interval=0.5)
        saved = {name: os.environ.get(name) for name in (SPEC_ENV, "PYTHONPATH")}
        os.environ[SPEC_ENV] = spec  # the ranks inherit this process's environment
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, saved["PYTHONPATH"]) if p)
        try:
            elastic_launch(launcher, entrypoint=sys.executable)("-m", RANK_ENTRY)
        except ChildFailedError as exc:
            _mark_crashed(store_path, run_id, exc.failures)
        else:  # every rank exited normally; a script error is in the run and the ranks' reports
            _name_first_failure(store_path, run_id, folder)
        finally:
            for name, value in saved.items():
                os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    return run_id


def _name_first_failure(store_path, run_id: int, folder: str) -> None:
    """When ranks reported errors (:meth:`RankJob.report_failure`) and the first was not rank 0's, the run's
    error names that rank and its error: rank 0 ended the run with its own, usually the collective that broke
    when its peer left, which points away from the cause."""
    reports = []
    for name in os.listdir(folder):
        if name.startswith("rank-") and name.endswith(".failure.json"):
            with open(os.path.join(folder, name)) as f:
                reports.append(json.load(f))
    if not reports:
        return
    first = min(reports, key=lambda r: r["time"])
    if first["rank"] == 0:
        return
    rank0 = next((r["error"].strip().splitlines()[-1] for r in reports if r["rank"] == 0), None)
    error = f"rank {first['rank']} failed first: {first['error'].rstrip()}"
    if rank0:
        error += f"\n(rank 0 then failed too: {rank0})"
    writer = BackgroundWriter(store_path)
    try:
        Run.adopt(writer, run_id).describe(error=error, wait=True)
    finally:
        writer.close()


def _mark_crashed(store_path, run_id: int, failures: dict) -> None:
    """The run is ``crashed`` (unless rank 0 had already ended it: ``finished``, then a note; ``stopped``, left
    so), its error naming each rank that died and the step it had not finished recording (one past its last row
    that reached rank_steps; rank 0 writes those rows, so if rank 0 was killed too, rows it had not flushed make
    this step earlier). The launcher stops the surviving ranks with
    SIGTERM once one fails, so ranks that ended by SIGTERM are named as the cause only when all did; a rank killed by
    another signal is named before those that exited with an error code."""
    from mpdiag.store import Store  # (here: the ranks, which import this module, never read the store)

    rank_steps = Store(store_path).rank_steps(run_id)

    def at_step(rank: int) -> int:
        done = rank_steps.loc[rank_steps["rank"] == rank, "step"]
        return 0 if done.empty else int(done.max()) + 1

    def how(failure) -> str:
        return failure.signal_name() if failure.exitcode < 0 else f"exit code {failure.exitcode}"

    stopped = {rank for rank, failure in failures.items() if failure.signal_name() == "SIGTERM"}
    # a rank killed by a signal first: it did not end on an error of its own, and a peer that then exits with an
    # error code usually saw its collective break (rank 0 "exit code 1" was named before rank 1's SIGKILL)
    causes = sorted(set(failures) - stopped, key=lambda rank: (failures[rank].exitcode >= 0, rank)) or sorted(stopped)
    parts = [f"rank {rank} died ({how(failures[rank])}) at step {at_step(rank)}" for rank in causes]
    parts += [f"rank {rank} was then stopped by the launcher (SIGTERM)" for rank in sorted(set(failures) - set(causes))]
    status = Store(store_path).run(run_id)["status"]
    if status == "stopped":  # rank 0 ended it on a stop (the dashboard's Stop, Ctrl-C): the ranks exited as asked
        return
    writer = BackgroundWriter(store_path)
    try:
        run = Run.adopt(writer, run_id)
        if status == "finished":
            # rank 0 had recorded every step and ended the run: a rank failing while exiting loses nothing
            run.describe(note=f"After the run ended, {'; '.join(parts)}.", wait=True)
        else:
            run.end("crashed", error="; ".join(parts), wait=True)
    finally:
        writer.close()
