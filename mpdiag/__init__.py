"""mpdiag: diagnostics for mixed-precision (FP16/BF16) training in PyTorch.

Public API: :class:`Store` reads a run store as DataFrames; :class:`Recorder` records a training loop.
Both are imported on first use, so importing a torch-free module below this package (the run configuration,
which the dashboard validates its form with) does not load torch through this file.
"""

__all__ = ["Recorder", "Store"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Recorder":
        from mpdiag.recording.recorder import Recorder

        return Recorder
    if name == "Store":
        from mpdiag.store import Store

        return Store
    raise AttributeError(f"module 'mpdiag' has no attribute {name!r}")
