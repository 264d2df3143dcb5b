"""The FP32 shadow: gradients of the same weights and batch computed entirely in FP32, for comparison.

Every N steps (``--shadow-every N``) the runner copies the mixed-precision model's current weights and buffers
into an FP32 copy of the script's model, recomputes the step's loss and gradients there without autocast,
and hands them to :meth:`mpdiag.recording.recorder.Recorder.compare_gradients`. The difference is then what the
precision policy did to the gradients (rounding, underflow, overflow), and nothing else:

* the weights are the same values (FP16/BF16 weights are exactly representable in FP32);
* the batch is the same object, and the random number generators are restored to their state before the
  mixed forward, so dropout draws the same numbers (for ops whose draws do not depend on the dtype);
* the shadow has no precision hooks: it is a deep copy of the script's model taken before the policy
  converted it.

Cost: one FP32 copy of the model and its gradients (8 bytes per parameter) and one FP32 forward and backward
per shadow step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch


def rng_state(device: torch.device) -> tuple:
    """The CPU (and, on a GPU, that device's) random number generator state, to replay a forward pass."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class Fp32Shadow:
    """An FP32 twin of ``model``, taken before any precision policy touched it."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, device: torch.device):
        self.model = copy.deepcopy(model).float()
        self.loss_fn = loss_fn
        self.device = device
        self._params = [p for p in self.model.parameters() if p.requires_grad]

    def gradients(self, weights_from: torch.nn.Module, batch, state: tuple) -> list[torch.Tensor | None]:
        """FP32 gradients (one per trainable parameter, in order) of ``loss_fn`` on ``batch`` at the weights
        and buffers of ``weights_from``, with the random generators set to ``state`` (from :func:`rng_state`)
        for the pass and restored afterwards."""
        with torch.no_grad():
            mine = self.model.state_dict()
            for name, value in weights_from.state_dict().items():
                mine[name].copy_(value)  # FP16/BF16 -> FP32 is exact
        self.model.zero_grad(set_to_none=True)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            cpu, cuda = state
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self.device)
            self.loss_fn(self.model, batch).float().backward()
        return [p.grad for p in self._params]
