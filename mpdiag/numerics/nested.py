"""Walking nested batches (tensors inside lists, tuples, named tuples and dicts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor inside it; containers keep their types."""
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_tensors(fn, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        mapped = [map_tensors(fn, v) for v in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else type(value)(mapped)
    return value
