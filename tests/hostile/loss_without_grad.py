# check: the loss does not require grad
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
    with torch.no_grad():
        return m(b).mean()
def build(device):
    return _spec(loss_fn=loss)
