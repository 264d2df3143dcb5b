"""An ``optimizer`` instance in a model script: used as is where the model's weights are trained, rebuilt over
O2's FP32 masters with every parameter group, its hyper-parameters and its parameters mapped by identity."""

import pytest
import torch
from torch import nn

from mpdiag import Store
from mpdiag.options import RunConfig
from mpdiag.training.policies import make_policy
from mpdiag.training.runner import train
from mpdiag.training.script import ModelScript, _rebuild_optimizer

CPU = torch.device("cpu")
SKIPPED = {
    "LBFGS": "needs a closure, which GradScaler.step refuses",
    "SparseAdam": "refuses the dense gradients a dense model produces",
}
OPTIMIZERS = sorted(
    name for name in dir(torch.optim)
    if isinstance(getattr(torch.optim, name), type) and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
    and name != "Optimizer"
)


def grouped(cls):
    """Three matrices (Muon takes only 2-D ones) in two groups listed out of model order, each with its own lr."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False), nn.Linear(4, 1, bias=False))
    layers = list(model)
    optimizer = cls([
        {"params": [layers[2].weight], "lr": 0.003},
        {"params": [layers[1].weight, layers[0].weight], "lr": 0.007},
    ])
    return model, optimizer


def test_every_optimizer_is_covered():
    assert {"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "ASGD"} <= set(OPTIMIZERS)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_o2_rebuilds_groups_over_masters(name):
    if name in SKIPPED:
        pytest.skip(SKIPPED[name])
    model, optimizer = grouped(getattr(torch.optim, name))
    expected = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    originals = [[p for p in g["params"]] for g in optimizer.param_groups]
    policy = make_policy(RunConfig(opt_level="O2", device="cpu"), CPU)
    model, rebuilt = policy.prepare(model, _rebuild_optimizer(optimizer, "model.py"))
    master_of = {id(p): m for p, m in policy._pairs}
    assert type(rebuilt) is type(optimizer) and rebuilt is not optimizer
    assert [{k: v for k, v in g.items() if k != "params"} for g in rebuilt.param_groups] == expected
    assert [g["lr"] for g in rebuilt.param_groups] == [0.003, 0.007]
    for group, params in zip(rebuilt.param_groups, originals, strict=True):
        assert [id(p) for p in group["params"]] == [id(master_of[id(p)]) for p in params]
        assert all(p.dtype == torch.float32 for p in group["params"])
    # it steps through GradScaler: the masters move, the FP16 weights follow them
    before = [m.detach().clone() for _, m in policy._pairs]
    policy.zero_grad(rebuilt)
    policy.backward(model(torch.ones(2, 4)).float().pow(2).mean())
    policy.step(rebuilt)
    assert any(not torch.equal(b, m) for b, (_, m) in zip(before, policy._pairs, strict=True))
    assert all(torch.equal(p, m.half()) for p, m in policy._pairs)


@pytest.mark.parametrize("level", ["O0", "O1", "bf16"])
def test_instance_itself_is_used_where_weights_are_trained(level):
    model, optimizer = grouped(torch.optim.AdamW)
    policy = make_policy(RunConfig(opt_level=level, device="cpu"), CPU)
    _, used = policy.prepare(model, _rebuild_optimizer(optimizer, "model.py"))
    assert used is optimizer


def test_plain_adamw_instance_trains_at_o2(write_script, store_path):
    path = write_script(
        """
        import torch
        def build(device):
            model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
            return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2),
                    "batches": lambda step: torch.randn(4, 3), "loss_fn": lambda m, b: m(b).pow(2).mean()}
        """
    )
    run_id = train(ModelScript.from_path(path), RunConfig(opt_level="O2", steps=5, device="cpu"), store_path)
    run = Store(store_path).run(run_id)
    assert run["status"] == "finished", run["error"]
    losses = Store(store_path).steps(run_id)["loss"]
    assert len(losses) == 5 and losses.iloc[-1] < losses.iloc[0]
