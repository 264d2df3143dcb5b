# check: ready
# run: finished
import torch


def _spec(model=None, batches=None, loss_fn=None, optimizer=None):
    model = model or torch.nn.Linear(4, 1)
    return {
        "model": model,
        "optimizer": optimizer or (lambda params: torch.optim.SGD(params, lr=0.01)),
        "batches": batches or (lambda step: torch.ones(8, 4)),
        "loss_fn": loss_fn or (lambda m, b: m(b).pow(2).mean()),
    }

def loss(m, b):
    out = m(b).pow(2).mean()
    return out * float('inf') if m.weight.grad is not None and m.weight.grad.abs().sum() > 0 else out
def build(device):
    return _spec(loss_fn=loss)
