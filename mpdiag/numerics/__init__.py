"""Numerics: number formats and their limits, exact per-tensor gradient statistics (CPU kernel and torch
backend), weight-update resolution counts and FP32 shadow gradients.

The bottom layer: it imports nothing else from mpdiag and knows nothing of stores, runs or pages."""
