"""mpdiag: diagnostics for mixed-precision (FP16/BF16) training in PyTorch.

Public API: :class:`Store` reads a run store as DataFrames; :class:`Recorder` records a training loop.
``import mpdiag`` must stay cheap and torch-free (the dashboard imports it and never loads torch), and light:
every ``python -m mpdiag.*`` process imports it first, a supervisor waiting for a run slot included. So both are
imported when first asked for: the Store (pandas) and the Recorder (torch).
"""

__all__ = ["Recorder", "Store"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # PEP 562: ``mpdiag.Recorder`` imports the recording layer (and so torch) on first use only; ``mpdiag.Store``
    # the store's reader (pandas).
    if name == "Recorder":
        from mpdiag.recording.recorder import Recorder

        return Recorder
    if name == "Store":
        from mpdiag.store import Store

        return Store
    raise AttributeError(f"module 'mpdiag' has no attribute {name!r}")
