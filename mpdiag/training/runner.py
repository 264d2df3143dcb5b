"""The training loop that runs a model script under a precision policy and records it.

Data path: script -> :func:`mpdiag.training.script.build_model` -> policy (:mod:`mpdiag.training.policies`) -> this loop ->
:class:`mpdiag.recording.recorder.Recorder` -> store. :func:`train` runs one configuration, :func:`train_pair` a mixed
run with its FP32 twin, :func:`rerun` a stored run's script again with options overridden.

Owns the loop, device resolution and the Recorder's wiring. Must not define or validate options (that is
:mod:`mpdiag.options`'s; :class:`RunConfig` is re-exported here for callers of :func:`train`).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import traceback
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from mpdiag.numerics.nested import map_tensors
from mpdiag.numerics.shadow import Fp32Shadow, rng_state
from mpdiag.options import ConfigError, RunConfig, rerun_name
from mpdiag.recording.background import BackgroundWriter
from mpdiag.recording.console import OutputKeeper
from mpdiag.recording.distributed import DiscardingWriter
from mpdiag.recording.nonfinite_step import NonfiniteStepCheck
from mpdiag.recording.recorder import Recorder, RunnerAttachment
from mpdiag.store import StoreWriter
from mpdiag.training import distributed
from mpdiag.training.policies import PrecisionPolicy, make_policy
from mpdiag.training.script import ModelScript, ScriptError, build_model

if TYPE_CHECKING:
    from mpdiag.store import Store

ProgressFn = Callable[[int, int, float], None]  # (run id, step, loss): a --pair command prints two runs


class RunStopped(Exception):
    """The run was asked to stop (SIGTERM)."""


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


def _run_fields(script: ModelScript, config: RunConfig, device: torch.device, sha: str, policy) -> dict:
    fields = dict(
        name=config.name or os.path.basename(script.filename),
        script_path=script.filename,
        script_sha256=sha,
        opt_level=config.opt_level,
        scaling=policy.scaling_mode,
        seed=config.seed,
        steps=config.steps,
        every=config.every,
        device=str(device),
        gpu_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        torch_version=torch.__version__,
        parent_run_id=config.parent_run_id,
        config={"run": config.to_dict()},
    )
    if policy.scaling_mode == "dynamic":
        fields.update({k: getattr(config, k) for k in ("init_scale", "growth_factor", "backoff_factor",
                                                        "growth_interval", "min_scale", "max_scale")})
    elif policy.scaling_mode == "static":
        fields.update(loss_scale=policy.scaler.static)
    return fields


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
    config.validate()
    device = resolve_device(config.device)
    policy = make_policy(config, device)
    if config.nproc > 1 and run_id is None:
        return distributed.launch(script, config, store_path, _run_fields(script, config, device, None, policy))
    job = distributed.RankJob.join(config.parallel, device) if config.nproc > 1 else None
    writer = BackgroundWriter(store_path) if job is None or job.is_writer else DiscardingWriter()
    recorder = output = None
    on_main_thread = threading.current_thread() is threading.main_thread()
    try:
        if run_id is None:
            sha = writer.call(lambda w: w.add_script(os.path.basename(script.filename), script.source))
            run_id = writer.call(lambda w: w.create_run(**_run_fields(script, config, device, sha, policy)))
            output = None if console is None else OutputKeeper(writer, [run_id], console)
        previous = signal.signal(signal.SIGTERM, _raise_stop) if on_main_thread else None
        try:
            seed_everything(config.seed + (job.rank if job else 0))  # each rank its own batches
            built = build_model(script, device)
            fp32_model = built.model.to(device)
            shadow = Fp32Shadow(fp32_model, built.loss_fn, device) if config.shadow_every else None
            model, optimizer = job.prepare(policy, fp32_model, built.make_optimizer) if job else \
                policy.prepare(fp32_model, built.make_optimizer)
            sharded = job is not None and job.parallel == "fsdp"  # update tracking reads whole weights
            attachment = RunnerAttachment(run_id=run_id, writer=writer,
                                          update_targets=None if sharded else policy.master_params() or None,
                                          launcher_names_failures=job is not None)
            recorder = Recorder.attached(
                model, attachment, scaler=policy.scaler, optimizer=optimizer, every=config.every,
                trace_modules=config.trace_modules, update_format=None if sharded else policy.update_format,
                fp8=config.fp8_settings() if config.fp8 else None,
            )
            check = NonfiniteStepCheck.of_model(model, optimizer, policy.master_params() or None)
            note = _loop(built, model, optimizer, policy, recorder, config, device, progress, writer, run_id, shadow,
                         check)
            state = model_state_bytes(model, optimizer, policy)
            stored = _stored_config(config, check)
            writer.submit(lambda w: w.update_run(run_id, model_state=state, params=state["params"], config=stored))
            recorder.close(note=note)
        except (ScriptError, RunStopped) as exc:
            _fail(writer, recorder, run_id, str(exc), job)
        except KeyboardInterrupt:
            _fail(writer, recorder, run_id, "stopped by keyboard interrupt (SIGINT)", job)
        except SystemExit as exc:  # from the script's code: record it rather than vanish
            _fail(writer, recorder, run_id, f"{script.filename}: the script called sys.exit({exc.code!r})", job)
        except Exception:  # noqa: BLE001 - anything else is recorded, never lost
            _fail(writer, recorder, run_id, traceback.format_exc(), job)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        if output is not None:
            output.finish()
        return run_id
    finally:
        writer.close()  # a rank's process group is left as it is: see mpdiag.training.rank


def _fail(writer: BackgroundWriter, recorder: Recorder | None, run_id: int, error: str,
          job: distributed.RankJob | None) -> None:
    if job is not None:  # every rank's error reaches the launching process, which names the first
        job.report_failure(error)
    if recorder is not None:
        recorder.fail(error)
    else:
        writer.submit(lambda w: w.end_run(run_id, "failed", error=error))


def _stored_config(config: RunConfig, check: NonfiniteStepCheck) -> dict:
    """The run's stored configuration: its options, the optimizer's class and state dtype, and the first
    optimizer step that made weights or state non-finite from finite values (when there was one)."""
    stored = {"run": config.to_dict(),
              "optimizer": {"class": type(check.optimizer).__name__, "state_dtype": check.state_dtype()}}
    if check.found is not None:
        stored["optimizer_step_nonfinite"] = check.found
    return stored


def _loop(built, model, optimizer, policy, recorder, config, device, progress, writer, run_id,
          shadow: Fp32Shadow | None, check: NonfiniteStepCheck) -> str | None:
    """Train for config.steps optimizer steps of ``built.accumulate`` micro-batches each; returns a note when
    the batches ran out early."""
    recorder.events.configure(config.stop_on, announce=True)  # --stop-on, and one stderr line per event
    batches = built.batches()
    scheduler = built.make_scheduler(optimizer) if built.make_scheduler is not None else None
    k = built.accumulate
    reported = None  # the latest step given to progress
    for step in range(config.steps):
        shadow_step = shadow is not None and step % config.shadow_every == 0
        reference = None  # the FP32 shadow's gradient of this step (the mean over its micro-batches)
        losses = []
        policy.zero_grad(optimizer)
        for micro in range(k):
            try:
                batch = next(batches)
            except StopIteration:
                partial = f" (the {micro} micro-batches of step {step} were not stepped)" if micro else ""
                return f"the script's batches ran out after {step} of {config.steps} steps{partial}"
            if step == 0 and micro == 0:
                size = batch_size_of(batch)
                writer.submit(lambda w, size=size: w.update_run(run_id, batch_size=size))
            batch = to_device(batch, device)
            state = rng_state(device) if shadow_step else None
            with policy.autocast():
                loss = built.loss_fn(model, batch)
            policy.backward(loss / k if k > 1 else loss)  # accumulated gradients are those of the mean loss
            losses.append(loss.detach().float())
            if shadow_step:
                reference = _add_mean(reference, shadow.gradients(model, batch, state), k)
        loss = losses[0] if k == 1 else torch.stack(losses).mean()
        recorder.record(loss)
        if recorder.events.stop_reason is not None:  # --stop-on: this step is not stepped; close() says why
            return None
        if shadow_step:
            recorder.compare_gradients(reference)
        check.before(loss)
        policy.step(optimizer, built.clip_grad_norm)
        if check.after(step) is not None:
            stored = _stored_config(config, check)  # now, so a run that fails later still shows it
            writer.submit(lambda w, stored=stored: w.update_run(run_id, config=stored))
        if scheduler is not None:
            with warnings.catch_warnings():
                # a step GradScaler skipped still advances the schedule (LR at step t is the schedule's value t)
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
                scheduler.step()
        if progress is not None and recorder.last_loss_step not in (None, reported):
            reported = recorder.last_loss_step  # on a GPU the loss arrives a step late: no extra sync
            progress(run_id, reported, recorder.last_loss)
    return None


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
    Returns (mixed run id, FP32 run id). ``console`` (see :func:`train`): the twin's kept output is the
    command's, so it starts with the first run's."""
    twin = config.fp32_twin(name=f"{config.name or os.path.basename(script.filename)} (FP32 twin)")
    mixed_id = train(script, config, store_path, progress, console=console)
    fp32_id = train(script, twin, store_path, progress, console=console)
    with StoreWriter(store_path) as writer:
        writer.update_run(mixed_id, pair_run_id=fp32_id)
        writer.update_run(fp32_id, pair_run_id=mixed_id)
    return mixed_id, fp32_id


def rerun_plan(store: Store, run_id: int, **overrides) -> tuple[ModelScript, RunConfig]:
    """The stored script source of ``run_id`` and its configuration with ``overrides`` applied; the new run
    records ``run_id`` as its parent. Raises StoreError / ConfigError naming what is wrong."""
    parent = store.run(run_id)
    stored = parent["config"].get("run")
    if not stored:
        raise ConfigError(f"run {run_id} was recorded by a Recorder in a user's loop; only runs started by mpdiag can be rerun")
    filename, source = store.script_source(parent["script_sha256"])
    base = RunConfig.from_dict(stored)
    config = base.with_options(parent_run_id=int(run_id), **overrides)  # drops what the new level does not use
    if overrides.get("name") is None:  # none typed: say what changed, never the parent's twin label
        config = config.with_options(name=rerun_name(parent["name"], base.to_dict(), config.to_dict()))
    config.validate()
    return ModelScript(filename=parent["script_path"] or filename, source=source), config


def rerun(store_path: str | os.PathLike, run_id: int, pair: bool = False, progress: ProgressFn | None = None,
          **overrides) -> int:
    """Run a stored run's script source again (not the file's current content) with the same seed and
    steps unless overridden; returns the new run id (the mixed one when ``pair``)."""
    from mpdiag.store import Store  # (here: a training process only writes; reading imports pandas)

    script, config = rerun_plan(Store(store_path), run_id, **overrides)
    if pair:
        return train_pair(script, config, store_path, progress)[0]
    return train(script, config, store_path, progress)
