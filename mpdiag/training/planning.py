"""What a run will run, decided before torch is imported: a rerun's stored script and configuration
(:func:`rerun_plan`) and a ``--pair`` twin's configuration (:func:`fp32_twin_of`).

Torch-free on purpose: the app's launcher plans every job it starts in a short-lived process
(:mod:`mpdiag.sandbox.launch`, ``--plan``) that stores the script and queues the run rows; that process then
exits without having imported torch (~1.5-2 s of CPU a job). The training itself (:mod:`mpdiag.training.runner`)
uses the same two functions, so what is planned is what runs.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from mpdiag.options import TWIN_LABEL, ConfigError, RunConfig, rerun_name
from mpdiag.training.script_source import ModelScript

if TYPE_CHECKING:
    from mpdiag.store import Store


def fp32_twin_of(script: ModelScript, config: RunConfig) -> RunConfig:
    """The configuration of ``config``'s FP32 twin (``--pair``), named after the run it is the twin of."""
    return config.fp32_twin(name=(config.name or os.path.basename(script.filename)) + TWIN_LABEL)


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
