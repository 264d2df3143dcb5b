"""``Trainer(callbacks=[MpdiagTrainerCallback()])``: a Hugging Face ``Trainer.train()`` recorded as one mpdiag run.

Owns the mapping from the Trainer's callback events to a watch session (:class:`mpdiag.training.watch.WatchSession`).
The Trainer's callbacks see neither the loss it back-propagates nor its gradients before it clips them
(``on_pre_optimizer_step`` comes after the clip), so the callback does not guess them from what it sees: from
``on_train_begin`` to ``on_train_end`` it runs watch's own interception over the Trainer's optimizer, which reads
each step exactly as ``mpdiag watch`` does (unscaled, before clipping, after the last micro-batch's backward), and
the run repeats under ``mpdiag rerun`` as a watched one (the process's command line and directory). If ``train()``
raises, the Trainer calls no callback: the run is marked crashed once this process ends.
"""

from __future__ import annotations

import os
import sys

from transformers import TrainerCallback

from mpdiag.options import WATCH_OPTIONS
from mpdiag.recording.recorder import torch_optimizer
from mpdiag.store import DEFAULT_STORE
from mpdiag.training.watch import WatchConfig, WatchSession


class MpdiagTrainerCallback(TrainerCallback):
    """Records ``trainer.train()`` into ``store`` (default ``MPDIAG_STORE`` or ``mpdiag_runs.db``) as run ``name``
    (default: the script's file name), with watch's ``every``, ``trace_modules`` and ``shadow_every``."""

    def __init__(self, store: str | os.PathLike | None = None, name: str | None = None,
                 every: int | None = WATCH_OPTIONS["every"].default, *,
                 trace_modules: bool = WATCH_OPTIONS["trace_modules"].default,
                 shadow_every: int | None = WATCH_OPTIONS["shadow_every"].default):
        self.store = store or os.environ.get("MPDIAG_STORE") or DEFAULT_STORE
        self.config = dict(name=name, every=every, trace_modules=trace_modules, shadow_every=shadow_every)
        self.session: WatchSession | None = None

    @property
    def run_id(self) -> int | None:
        return None if self.session is None else self.session.run_id

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        if WatchSession.active is not None:
            return  # `mpdiag watch` records this script already
        if sys.argv and os.path.isfile(sys.argv[0]):  # a script: its rerun repeats its command line
            target = dict(target=sys.argv[0], args=tuple(sys.argv[1:]))
        else:  # a notebook or an embedding process: nothing a rerun could repeat
            target = dict(target="__main__", module=True)
        self.session = WatchSession(WatchConfig(**target, **self.config), self.store,
                                    optimizers=[torch_optimizer(optimizer)] if optimizer is not None else [])

    def on_train_end(self, args, state, control, **kwargs):
        if self.session is not None:
            self.session.end("finished", None)
