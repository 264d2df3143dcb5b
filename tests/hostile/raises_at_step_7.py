# check: ready
# run: raise RuntimeError("corrupt batch at step 7")
import torch


def _spec(model=None, batches=None, loss_fn=None, optimizer=None):
    model = model or torch.nn.Linear(4, 1)
    return {
        "model": model,
        "optimizer": optimizer or (lambda params: torch.optim.SGD(params, lr=0.01)),
        "batches": batches or (lambda step: torch.ones(8, 4)),
        "loss_fn": loss_fn or (lambda m, b: m(b).pow(2).mean()),
    }

def batches(step):
    if step == 7:
        raise RuntimeError("corrupt batch at step 7")
    return torch.ones(8, 4)
def build(device):
    return _spec(batches=batches)
