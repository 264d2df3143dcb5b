"""mpdiag: diagnostics for mixed-precision (FP16/BF16) training in PyTorch.

Public API: :class:`Store` reads a run store as DataFrames; :class:`Recorder` records a training loop.
"""

from mpdiag.recording.recorder import Recorder
from mpdiag.store import Store

__all__ = ["Recorder", "Store"]
__version__ = "0.1.0"
