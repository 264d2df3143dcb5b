"""mpdiag: diagnostics for mixed-precision (FP16/BF16) training in PyTorch.

Public API: :class:`Store` reads a run store as DataFrames; :class:`Recorder` records a training loop.
``import mpdiag`` must stay cheap and torch-free (the dashboard imports it and never loads torch): the Store is
imported eagerly (it is torch-free), the Recorder only when first asked for.
"""

from mpdiag.store import Store

__all__ = ["Recorder", "Store"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # PEP 562: ``mpdiag.Recorder`` imports the recording layer (and so torch) on first use only.
    if name == "Recorder":
        from mpdiag.recording.recorder import Recorder

        return Recorder
    raise AttributeError(f"module 'mpdiag' has no attribute {name!r}")
