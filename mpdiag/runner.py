"""The training loop that runs a model script under a precision policy and records it.

Data path: script -> :func:`mpdiag.script.build_model` -> policy (:mod:`mpdiag.policies`) -> this loop ->
:class:`mpdiag.recorder.Recorder` -> store.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from mpdiag.policies import ConfigError, ScalingConfig, make_policy
from mpdiag.recorder import Recorder
from mpdiag.script import ModelScript, ScriptError, build_model
from mpdiag.writer import BackgroundWriter

ProgressFn = Callable[[int, float], None]


class RunStopped(Exception):
    """The run was asked to stop (SIGTERM or SIGINT)."""


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run besides its script. Validated by :meth:`validate`."""

    opt_level: str = "O1"
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    steps: int = 200
    seed: int = 0
    every: int = 1
    device: str = "auto"
    name: str | None = None
    parent_run_id: int | None = None

    def validate(self) -> torch.device:
        """Check every option and return the device to run on; raises ConfigError with the fix."""
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.every < 1:
            raise ConfigError(f"--every must be >= 1, got {self.every}")
        device = resolve_device(self.device)
        make_policy(self.opt_level, device, self.scaling)
        return device


def resolve_device(spec: str) -> torch.device:
    """``auto`` -> the CUDA GPU when there is one, else the CPU; ``cuda`` without a GPU is an error."""
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
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def _run_fields(script: ModelScript, config: RunConfig, device: torch.device, sha: str) -> dict:
    fields = dict(
        name=config.name or os.path.basename(script.filename),
        script_path=script.filename,
        script_sha256=sha,
        opt_level=config.opt_level,
        seed=config.seed,
        steps=config.steps,
        every=config.every,
        device=str(device),
        gpu_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        torch_version=torch.__version__,
        parent_run_id=config.parent_run_id,
        config={"run": {k: v for k, v in asdict(config).items() if k != "scaling"}},
    )
    if make_policy(config.opt_level, device, config.scaling).scales_loss:
        fields.update(asdict(config.scaling))
    return fields


def _raise_stop(signum, frame):
    raise RunStopped(f"stopped by signal {signal.Signals(signum).name}")


def train(
    script: ModelScript, config: RunConfig, store_path: str | os.PathLike, progress: ProgressFn | None = None
) -> int:
    """Run ``script`` under ``config``, record it into the store and return the run id.

    Raises ConfigError before anything is written when an option is invalid. Script problems do not raise:
    the run is recorded as ``failed`` with the message (read it from ``Store.run(run_id)['error']``).
    """
    device = config.validate()
    policy = make_policy(config.opt_level, device, config.scaling)
    writer = BackgroundWriter(store_path)
    recorder = None
    try:
        sha = writer.call(lambda w: w.add_script(os.path.basename(script.filename), script.source))
        run_id = writer.call(lambda w: w.create_run(**_run_fields(script, config, device, sha)))
        previous = signal.signal(signal.SIGTERM, _raise_stop) if _main_thread() else None
        try:
            seed_everything(config.seed)
            built = build_model(script, device)
            model = built.model.to(device)
            model, optimizer = policy.prepare(model, built.make_optimizer)
            recorder = Recorder(
                model, scaler=policy.scaler, optimizer=optimizer, every=config.every, run_id=run_id, writer=writer
            )
            note = _loop(built, model, optimizer, policy, recorder, config, device, progress)
            recorder.close(note=note)
        except (ScriptError, RunStopped) as exc:
            _fail(writer, recorder, run_id, str(exc))
        except KeyboardInterrupt:
            _fail(writer, recorder, run_id, "stopped by keyboard interrupt (SIGINT)")
        except Exception:  # noqa: BLE001 - anything else is recorded, never lost
            _fail(writer, recorder, run_id, traceback.format_exc())
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        return run_id
    finally:
        writer.close()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _fail(writer: BackgroundWriter, recorder: Recorder | None, run_id: int, error: str) -> None:
    if recorder is not None:
        recorder.fail(error)
    else:
        writer.submit(lambda w: w.update_run(run_id, status="failed", error=error, finished_at=time.time()))


def _loop(built, model, optimizer, policy, recorder, config: RunConfig, device, progress) -> str | None:
    """Train for config.steps steps; returns a note when the batches ran out early."""
    batches = built.batches()
    for step in range(config.steps):
        try:
            batch = next(batches)
        except StopIteration:
            return f"the script's batches ran out after {step} of {config.steps} steps"
        batch = to_device(batch, device)
        optimizer.zero_grad(set_to_none=True)
        with policy.autocast():
            loss = built.loss_fn(model, batch)
        policy.backward(loss)
        recorder.record(loss)
        policy.step(optimizer)
        if progress is not None:
            progress(step, float(loss.detach()))
    return None
