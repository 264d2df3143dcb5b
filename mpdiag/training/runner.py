"""The training loop that runs a model script under a precision policy and records it.

Data path: script -> :func:`mpdiag.training.script.build_model` -> policy (:mod:`mpdiag.training.policies`) -> this loop ->
:class:`mpdiag.recording.recorder.Recorder` -> store. :func:`train` runs one configuration, :func:`train_pair` a mixed
run with its FP32 twin, :func:`rerun` a stored run's script again with options overridden (what it reruns is decided by
:mod:`mpdiag.training.planning`, torch-free, as the app's launcher plans it).

Owns the loop, device resolution and the Recorder's wiring (the run's :class:`mpdiag.recording.run.Run`, made
here or adopted from the distributed launcher, and the Recorder's optimizer-step check, set to every step). Must
not write the run row itself (the Run does), nor define or validate options (that is :mod:`mpdiag.options`'s;
:class:`RunConfig` is re-exported here for callers of :func:`train`).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import traceback
import warnings
from collections.abc import Callable, Iterable

import numpy as np
import torch

from mpdiag.numerics.nested import map_tensors
from mpdiag.numerics.shadow import Fp32Shadow, rng_state
from mpdiag.options import ConfigError, RunConfig
from mpdiag.recording.background import BackgroundWriter
from mpdiag.recording.console import OutputKeeper
from mpdiag.recording.distributed import DiscardingWriter, RankContext
from mpdiag.recording.nonfinite_step import optimizer_state_dtype
from mpdiag.recording.recorder import EVERY_STEP, Recorder, gpu_name
from mpdiag.recording.run import MpdiagConfig, Run
from mpdiag.training import distributed
from mpdiag.training.planning import fp32_twin_of, rerun_plan
from mpdiag.training.policies import PrecisionPolicy, make_policy
from mpdiag.training.script import ModelScript, ScriptError, build_model

ProgressFn = Callable[[int, int, float], None]  # (run id, step, loss): a --pair command prints two runs


class RunStopped(BaseException):
    """The run was asked to stop (SIGTERM; the dashboard's Stop button sends it). A BaseException, as
    KeyboardInterrupt is: raised inside the script's own code (its loss_fn, mostly), it is not the script's error,
    so no ``except Exception`` (script_errors', the script's own) turns it into one; the run's error is its words."""


def resolve_device(spec: str) -> torch.device:
    """``auto`` -> the CUDA GPU when there is one, else the CPU; ``cuda`` without a GPU is an error. (The
    configuration checks only the string; whether the device exists is known here, at run time.)"""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise ConfigError(f"--device {spec!r} is not a device; use auto, cpu or cuda[:N]") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: this machine has no CUDA GPU (torch.cuda.is_available() is False); use --device cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) present")
    elif device.type != "cpu":
        raise ConfigError(f"--device {spec!r}: mpdiag runs on cpu or cuda")
    return device


def seed_everything(seed: int) -> None:
    """Seed torch, numpy and random, so a seed fixes initial weights and batches under every opt level."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def to_device(batch, device: torch.device):
    """Move every tensor inside a (nested) batch to ``device``."""
    return map_tensors(lambda t: t.to(device, non_blocking=True), batch)


def batch_size_of(batch) -> int | None:
    """Leading dimension of the first tensor in a (nested) batch."""
    if torch.is_tensor(batch):
        return int(batch.shape[0]) if batch.dim() else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        size = batch_size_of(value)
        if size is not None:
            return size
    return None


def _nbytes(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, policy: PrecisionPolicy) -> dict:
    """Bytes actually allocated for weights, gradients (model and master), master weights and optimizer
    state, and the parameter count Psi; compare with the 16*Psi account for Adam (docs/background.md: memory account)."""
    params = list(model.parameters())
    masters = policy.master_params()
    return {
        "params": sum(p.numel() for p in params),
        "weights": _nbytes(params),
        "gradients": _nbytes(p.grad for p in params) + _nbytes(m.grad for m in masters),
        "master_weights": _nbytes(masters),
        "optimizer_state": _nbytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)),
    }


def _run_facts(script: ModelScript, device: torch.device) -> dict:
    """What a run's row says besides what its configuration states (:func:`mpdiag.recording.run.columns_from`):
    the script it runs, the device ``auto`` resolved to, and this process's torch."""
    return dict(
        default_name=os.path.basename(script.filename),
        script_path=script.filename,
        device=str(device),
        gpu_name=gpu_name(device),
        torch_version=torch.__version__,
    )


def _raise_stop(signum, frame):
    raise RunStopped(f"stopped by signal {signal.Signals(signum).name}")


def train(
    script: ModelScript, config: RunConfig, store_path: str | os.PathLike, progress: ProgressFn | None = None,
    run_id: int | None = None, console=None,
) -> int:
    """Run ``script`` under ``config``, record it into the store and return the run id.

    Raises ConfigError before anything is written when an option is invalid. Script problems do not raise:
    the run is recorded as ``failed`` with the message (read it from ``Store.run(run_id)['error']``).
    With ``config.nproc`` above 1 this launches the ranks (:mod:`mpdiag.training.distributed`), which run
    this function again with the ``run_id`` the launch created; rank 0 records, the others write nothing.
    ``console``: a :class:`~mpdiag.store.console.ConsoleCapture` of this process's output (``mpdiag run`` tees
    it), kept with the run: refreshed while it trains, final when it ends (not for a run of several processes).
    """
    return _train(script, config, store_path, progress, run_id, console)[0]


def _train(script: ModelScript, config: RunConfig, store_path: str | os.PathLike, progress: ProgressFn | None,
           run_id: int | None, console) -> tuple[int, bool]:
    """:func:`train`, and whether the run ended on a stop (SIGTERM, Ctrl-C): the process was asked to end."""
    config.validate()
    device = resolve_device(config.device)
    policy = make_policy(config, device)
    if config.nproc > 1 and run_id is None:
        return distributed.launch(script, config, store_path, _run_facts(script, device)), False
    job = distributed.RankJob.join(config.parallel, device) if config.nproc > 1 else None
    writer = BackgroundWriter(store_path) if job is None or job.is_writer else DiscardingWriter()
    try:
        if run_id is None:
            sha = writer.call(lambda w: w.add_script(os.path.basename(script.filename), script.source))
            run = Run.create(writer, config=MpdiagConfig({"run": config.to_dict()}), script_sha256=sha,
                             **_run_facts(script, device))
            output = None if console is None else OutputKeeper(writer, [run.run_id], console)
        else:  # a rank of a launched job: the launcher created the run
            run, output = Run.adopt(writer, run_id, config=MpdiagConfig({"run": config.to_dict()})), None
        with _stop_on_sigterm():
            stopped = _train_run(run, script, config, device, policy, job, progress)
        if output is not None:
            output.finish()
        return run.run_id, stopped
    finally:
        writer.close()  # a rank's process group is left as it is: see mpdiag.training.rank


@contextlib.contextmanager
def _stop_on_sigterm():
    """SIGTERM raises RunStopped while the run trains (from the main thread only, where signals arrive)."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_stop) if on_main_thread else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _train_run(run: Run, script: ModelScript, config: RunConfig, device: torch.device, policy: PrecisionPolicy,
               job: distributed.RankJob | None, progress: ProgressFn | None) -> bool:
    """Build, train and end the run; a failure of the script (``failed``) or a stop (``stopped``, the signal
    named) is recorded, never raised: by the Recorder once it exists (its rows flushed first), else by the run
    itself. Returns whether a stop ended it."""
    recorder = None
    try:
        seed_everything(config.seed + (job.rank if job else 0))  # each rank its own batches
        built = build_model(script, device)
        fp32_model = built.model.to(device)
        shadow = Fp32Shadow(fp32_model, built.loss_fn, device) if config.shadow_every else None
        model, optimizer = job.prepare(policy, fp32_model, built.make_optimizer) if job else \
            policy.prepare(fp32_model, built.make_optimizer)
        recorder = _recorder(run, model, optimizer, policy, config, job)
        note = _loop(built, model, optimizer, policy, recorder, config, device, progress, run, shadow)
        state = model_state_bytes(model, optimizer, policy)
        run.describe(model_state=state, params=state["params"],
                     config=_stored_config(config, optimizer, recorder.optimizer_step_nonfinite))
        recorder.close(note=note)
        return False
    except (Exception, KeyboardInterrupt, SystemExit, RunStopped) as exc:  # noqa: BLE001 - anything is recorded
        error = _failure_text(exc, script)
        if job is not None:  # every rank's error reaches the launching process, which names the first
            job.report_failure(error)
        stopped = isinstance(exc, (RunStopped, KeyboardInterrupt))  # asked to end: not the script's failure
        (recorder or run).fail(error, status="stopped" if stopped else "failed")
        return stopped


def _recorder(run: Run, model, optimizer, policy: PrecisionPolicy, config: RunConfig,
              job: distributed.RankJob | None) -> Recorder:
    """The run's Recorder: FP32 master weights (O2) as what the optimizer updates, the optimizer-step check at
    every step, the dead-rank watch left to mpdiag's launcher, the replays of the first inf/NaN step and the first
    loss spike where they cost no synchronisation (the script's model is mpdiag's to run: nothing pickles it with the hooks)."""
    sharded = job is not None and job.parallel == "fsdp"  # update tracking reads whole weights
    return Recorder(
        model, run=run, scaler=policy.scaler, optimizer=optimizer, every=config.every,
        trace_modules=config.trace_modules, update_format=None if sharded else policy.update_format,
        fp8=config.fp8_settings() if config.fp8 else None, check_optimizer_step=EVERY_STEP,
        update_targets=None if sharded else policy.master_params() or None, launcher_names_failures=job is not None,
        replay=None,
    )


def _failure_text(exc: BaseException, script: ModelScript) -> str:
    """How a failed run's error reads: the message of a script problem or a stop, else the traceback."""
    if isinstance(exc, (ScriptError, RunStopped)):
        return str(exc)
    if isinstance(exc, KeyboardInterrupt):
        return "stopped by keyboard interrupt (SIGINT)"
    if isinstance(exc, SystemExit):  # from the script's code: record it rather than vanish
        return f"{script.filename}: the script called sys.exit({exc.code!r})"
    return "".join(traceback.format_exception(exc))


def _stored_config(config: RunConfig, optimizer: torch.optim.Optimizer, found: dict | None) -> MpdiagConfig:
    """The run's stored configuration (mpdiag's: its options state the run's columns): its options, the
    optimizer's class and state dtype, and the first optimizer step that made weights or state non-finite from
    finite values (when there was one)."""
    stored = {"run": config.to_dict(),
              "optimizer": {"class": type(optimizer).__name__, "state_dtype": optimizer_state_dtype(optimizer)}}
    if found is not None:
        stored["optimizer_step_nonfinite"] = found
    return MpdiagConfig(stored)


class _BatchesRanOut(Exception):
    """The script's batches ended before ``config.steps``; the message is the run's note."""


def _loop(built, model, optimizer, policy, recorder, config, device, progress, run: Run,
          shadow: Fp32Shadow | None) -> str | None:
    """Train for config.steps optimizer steps of ``built.accumulate`` micro-batches each; returns a note when
    the batches ran out early."""
    # --stop-on, and one stderr line per event: rank 0's (under torchrun every rank saw the same event)
    recorder.events.configure(config.stop_on, announce=not RankContext.launched_as_other_rank())
    batches = built.batches()
    scheduler = built.make_scheduler(optimizer) if built.make_scheduler is not None else None
    reported = None  # the latest step given to progress
    for step in range(config.steps):
        shadow_step = shadow is not None and step % config.shadow_every == 0
        policy.zero_grad(optimizer)
        try:
            loss, reference = _forward_backward(built, model, policy, batches, device, step, config.steps, run,
                                                shadow if shadow_step else None)
        except _BatchesRanOut as out:
            return str(out)
        recorder.record(loss)
        if recorder.events.stop_reason is not None:  # --stop-on: this step is not stepped; close() says why
            return None
        if shadow_step:
            recorder.compare_gradients(reference)
        policy.step(optimizer, built.clip_grad_norm)  # the Recorder checks the optimizer step in its hooks
        found = recorder.optimizer_step_nonfinite
        if found is not None and "optimizer" not in run.config:
            # the whole stored configuration now, so a run that fails later still shows it with its optimizer
            run.describe(config=_stored_config(config, optimizer, found))
        if scheduler is not None:
            _advance(scheduler)
        if progress is not None and recorder.last_loss_step not in (None, reported):
            reported = recorder.last_loss_step  # on a GPU the loss arrives a step late: no extra sync
            progress(run.run_id, reported, recorder.last_loss)
    return None


def _forward_backward(built, model, policy, batches, device, step: int, steps: int, run: Run,
                      shadow: Fp32Shadow | None) -> tuple[torch.Tensor, list | None]:
    """Step ``step``'s forward and backward passes over its ``built.accumulate`` micro-batches; returns the
    step's loss (their mean) and, with ``shadow`` (a step compared with FP32), the FP32 gradient of the same
    batches. Raises _BatchesRanOut when the script's batches end first."""
    k = built.accumulate
    reference = None  # the FP32 shadow's gradient of this step (the mean over its micro-batches)
    losses = []
    for micro in range(k):
        try:
            batch = next(batches)
        except StopIteration:
            partial = f" (the {micro} micro-batches of step {step} were not stepped)" if micro else ""
            raise _BatchesRanOut(f"the script's batches ran out after {step} of {steps} steps{partial}") from None
        if step == 0 and micro == 0:
            run.describe(batch_size=batch_size_of(batch))
        batch = to_device(batch, device)
        state = rng_state(device) if shadow is not None else None
        with policy.autocast():
            loss = built.loss_fn(model, batch)
        policy.backward(loss / k if k > 1 else loss)  # accumulated gradients are those of the mean loss
        losses.append(loss.detach().float())
        if shadow is not None:
            reference = _add_mean(reference, shadow.gradients(model, batch, state), k)
    return (losses[0] if k == 1 else torch.stack(losses).mean()), reference


def _advance(scheduler) -> None:
    """Step the script's LR schedule once per optimizer step."""
    with warnings.catch_warnings():
        # a step GradScaler skipped still advances the schedule (LR at step t is the schedule's value t)
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        scheduler.step()


def _add_mean(total: list | None, grads: list, k: int) -> list:
    """``total`` plus ``grads / k``, elementwise (``None`` for a parameter without a gradient)."""
    parts = [None if g is None else g.detach() / k for g in grads]
    if total is None:
        return parts
    return [a if b is None else b if a is None else a + b for a, b in zip(total, parts, strict=True)]


def train_pair(
    script: ModelScript, config: RunConfig, store_path: str | os.PathLike, progress: ProgressFn | None = None,
    console=None,
) -> tuple[int, int]:
    """Run ``config`` and an O0 twin (same seed, hence same initial weights and batches) and link them.
    Returns (mixed run id, FP32 run id); raises RunStopped, its run recorded, when the first run was stopped.
    ``console`` (see :func:`train`): the twin's kept output is the command's, so it starts with the first run's."""
    twin = fp32_twin_of(script, config)
    mixed_id, stopped = _train(script, config, store_path, progress, None, console)
    if stopped:  # SIGTERM (the dashboard's Stop) or Ctrl-C ended the first run: end, not the twin
        raise RunStopped(f"stopped before the FP32 twin of run {mixed_id} started")
    fp32_id = train(script, twin, store_path, progress, console=console)
    writer = BackgroundWriter(store_path, heartbeat=False)
    try:
        Run.adopt(writer, mixed_id).describe(pair_run_id=fp32_id)
        Run.adopt(writer, fp32_id).describe(pair_run_id=mixed_id, wait=True)
    finally:
        writer.close()
    return mixed_id, fp32_id


def rerun(store_path: str | os.PathLike, run_id: int, pair: bool = False, progress: ProgressFn | None = None,
          **overrides) -> int:
    """Run a stored run's script source again (not the file's current content) with the same seed and
    steps unless overridden; returns the new run id (the mixed one when ``pair``)."""
    from mpdiag.store import Store  # (here: a training process only writes; reading imports pandas)

    script, config = rerun_plan(Store(store_path), run_id, **overrides)
    if pair:
        return train_pair(script, config, store_path, progress)[0]
    return train(script, config, store_path, progress)
