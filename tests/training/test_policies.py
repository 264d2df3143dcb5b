"""Opt-level semantics: what each level does to weights, gradients, updates and the loss scale."""

import math
import re

import pytest
import torch
from conftest import EXAMPLES
from torch import nn

from mpdiag import Store
from mpdiag.analysis.compare import first_divergence, loss_comparison, reference_run
from mpdiag.options import ConfigError, RunConfig
from mpdiag.training.policies import BF16Mixed, make_policy
from mpdiag.training.runner import model_state_bytes, rerun, train, train_pair
from mpdiag.training.script import ModelScript

CPU = torch.device("cpu")


def prepared(level, model, scaling=None, lr=0.1, opt=torch.optim.SGD):
    policy = make_policy(RunConfig(opt_level=level, **(scaling or {})), CPU)
    model, optimizer = policy.prepare(model, lambda params, originals=None: opt(params, lr=lr))
    return policy, model, optimizer


def one_step(policy, model, optimizer, loss_fn):
    policy.zero_grad(optimizer)
    with policy.autocast():
        loss = loss_fn(model)
    policy.backward(loss)
    policy.step(optimizer)
    return loss


def test_o2_keeps_fp32_masters_fp16_linear_and_fp32_batchnorm():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    policy, model, optimizer = prepared("O2", model)
    assert model[0].weight.dtype == torch.float16 and model[3].weight.dtype == torch.float16
    assert model[1].weight.dtype == torch.float32 and model[1].running_mean.dtype == torch.float32
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    assert masters == policy.master_params() and all(p.dtype == torch.float32 for p in masters)
    out = model(torch.randn(5, 4))
    assert out.dtype == torch.float32  # outputs cast back for an FP32 loss
    one_step(policy, model, optimizer, lambda m: m(torch.randn(5, 4)).pow(2).mean())
    assert model[0].weight.grad is None or model[0].weight.grad.dtype == torch.float16
    for (name, p), master in zip(model.named_parameters(), masters, strict=True):
        assert torch.equal(p.float(), master.to(p.dtype).float()), name  # model weights = rounded masters


def test_o3_is_fp16_everywhere_including_batchnorm():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    _, model, optimizer = prepared("O3", model)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert model[1].running_var.dtype == torch.float16
    assert all(p.dtype == torch.float16 for g in optimizer.param_groups for p in g["params"])


class Scalar(nn.Module):
    def __init__(self, value=1.0):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([value]))


def test_swamping_update_survives_o2_but_is_lost_in_o3():
    # |update| = 2^-12 * |w| < 2^-11 * |w|: below half an FP16 ulp of w = 1, so FP16 weights round it away.
    def loss_fn(model):
        return (model.w.float() * 2.0**-12).sum()

    results = {}
    for level in ("O2", "O3"):
        policy, model, optimizer = prepared(level, Scalar(1.0), {"loss_scale": 1.0}, lr=1.0)
        for _ in range(4):
            one_step(policy, model, optimizer, loss_fn)
        results[level] = (model.w.detach().float().item(), [m.item() for m in policy.master_params()])
    assert results["O3"][0] == 1.0  # every update lost
    assert results["O2"][1] == [1.0 - 4 * 2.0**-12]  # the FP32 master accumulates every update exactly
    assert results["O2"][0] == pytest.approx(1.0 - 2.0**-10)  # and the FP16 copy moves


class TinyGrad(nn.Module):
    """dL/dW = 2^-20 * 2^-8 = 2^-28 per element, computed by an FP16 matmul in backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1, bias=False)

    def forward(self, x):
        return self.lin(x)


def test_o3_without_scaling_loses_gradients_that_o1_keeps(store_path, write_script):
    path = write_script(
        """
        import torch
        from torch import nn

        def build(device):
            model = nn.Linear(4, 1, bias=False)
            return {"model": model, "optimizer": lambda p: torch.optim.SGD(p, lr=0.0),
                    "batches": lambda step: torch.full((1, 4), 2.0**-8),
                    "loss_fn": lambda m, x: m(x).float().sum() * 2.0**-20}
        """
    )
    script = ModelScript.from_path(path)
    stats = {}
    for level in ("O1", "O3"):
        run_id = train(script, RunConfig(opt_level=level, steps=2, device="cpu"), store_path)
        stats[level] = Store(store_path).tensor_stats(run_id, tensor="weight").iloc[0]
    assert stats["O3"]["zeros"] == 4  # 2^-28 underflowed to zero in the FP16 backward pass
    assert stats["O1"]["zeros"] == 0 and stats["O1"]["min_nonzero"] == 2.0**-28
    assert stats["O1"]["fp16_underflow"] == 4 and stats["O1"]["fp16_underflow_at_scale"] == 0


OVERFLOW_SCRIPT = """
import torch
from torch import nn

def build(device):
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    def batches(step):
        x = torch.ones(3, 4) * torch.arange(3.0)[:, None]
        return x * (float("inf") if step in (3, 4) else 1.0)
    return {"model": model, "optimizer": lambda p: torch.optim.SGD(p, lr=0.01),
            "batches": batches, "loss_fn": lambda m, x: m(x).float().pow(2).mean()}
"""


@pytest.mark.parametrize("level, scaling", [("O1", {}), ("O2", {}), ("O3", {"loss_scale": "dynamic"}),
                                            ("fp8-sim-fp16", {"fp8_modules": "0=current,2=bf16"})])
def test_overflow_skips_update_and_halves_scale_at_every_fp16_level(level, scaling, store_path, write_script):
    script = ModelScript.from_path(write_script(OVERFLOW_SCRIPT))
    config = RunConfig(opt_level=level, steps=7, device="cpu").with_options(init_scale=1024.0, **scaling)
    run_id = train(script, config, store_path)
    steps = Store(store_path).steps(run_id)
    assert Store(store_path).run(run_id)["status"] == "finished"
    assert steps["skipped"].tolist() == [0, 0, 0, 1, 1, 0, 0]
    assert steps["loss_scale"].tolist() == [1024.0, 1024.0, 1024.0, 1024.0, 512.0, 256.0, 256.0]
    assert steps["scale_after"].tolist()[3:5] == [512.0, 256.0]


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_moment_format_holds_the_optimizers_state_as_torchs_cast_of_it_after_every_step(fmt):
    """--moment-format: after each step, every moment equals torch's cast of the state the optimizer computed
    (bf16: to bfloat16 and back; fp8: E4M3 at 448 / the tensor's amax, in fp32); the step count is left alone."""
    def cast(t):
        if fmt == "bf16":
            return t.to(torch.bfloat16).float()
        scale = torch.tensor(448.0) / t.abs().amax()
        return (t * scale).to(torch.float8_e4m3fn).float() / scale

    torch.manual_seed(0)
    held, free = nn.Linear(16, 8), nn.Linear(16, 8)
    free.load_state_dict(held.state_dict())
    adam = lambda params, originals=None: torch.optim.Adam(params, lr=1e-2)  # noqa: E731
    policy = make_policy(RunConfig(opt_level="O0", moment_format=fmt), CPU)
    held, held_opt = policy.prepare(held, adam)
    plain = make_policy(RunConfig(opt_level="O0"), CPU)
    free, free_opt = plain.prepare(free, adam)
    for step in range(3):
        x = torch.randn(4, 16) * 10.0 ** (step - 1)
        one_step(policy, held, held_opt, lambda m, x=x: m(x).pow(2).mean())
        one_step(plain, free, free_opt, lambda m, x=x: m(x).pow(2).mean())
        for p_held, p_free in zip(held.parameters(), free.parameters(), strict=True):
            mine, theirs = held_opt.state[p_held], free_opt.state[p_free]
            assert float(mine["step"]) == step + 1
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(mine[key], cast(theirs[key])), (step, key)
                theirs[key].copy_(mine[key])  # the next step starts from the same (held) state
            p_free.data.copy_(p_held.data)


def test_static_scale_never_changes_but_still_skips_nonfinite(store_path, write_script):
    script = ModelScript.from_path(write_script(OVERFLOW_SCRIPT))
    run_id = train(script, RunConfig(opt_level="O1", steps=6, device="cpu").with_options(loss_scale=128.0), store_path)
    steps = Store(store_path).steps(run_id)
    assert set(steps["loss_scale"]) == {128.0} and steps["skipped"].tolist() == [0, 0, 0, 1, 1, 0]
    assert Store(store_path).run(run_id)["scaling"] == "static"


def test_min_and_max_scale_bound_the_dynamic_scale():
    policy, model, optimizer = prepared(
        "O1", nn.Linear(2, 1), {"init_scale": 8.0, "growth_interval": 1, "min_scale": 4.0, "max_scale": 16.0}
    )
    scales = []
    for step in range(6):
        bad = step in (3, 4)
        one_step(policy, model, optimizer, lambda m, bad=bad: m(torch.ones(1, 2)).sum() * (float("inf") if bad else 1.0))
        scales.append(policy.scaler.get_scale())
    assert scales == [16.0, 16.0, 16.0, 8.0, 4.0, 8.0]


@pytest.mark.parametrize(
    "scaling, match",
    [
        ({"loss_scale": 0.0}, "--loss-scale must be 'dynamic' or a finite number > 0, got 0.0"),
        ({"loss_scale": -5.0}, "--loss-scale must be 'dynamic' or a finite number > 0"),
        ({"loss_scale": "auto"}, "--loss-scale must be 'dynamic' or a finite number > 0, got 'auto'"),
        ({"loss_scale": math.inf}, "--loss-scale must be 'dynamic' or a finite number > 0, got inf"),
        ({"init_scale": -1.0}, "--init-scale must be a finite number > 0"),
        ({"init_scale": math.nan}, "--init-scale must be a finite number > 0, got nan"),
        ({"growth_factor": 0.5}, "--growth-factor must be a finite number > 1"),
        ({"growth_factor": math.inf}, "--growth-factor must be a finite number > 1, got inf"),
        ({"backoff_factor": 2.0}, "--backoff-factor must be a finite number between 0 and 1"),
        ({"growth_interval": 2.5}, "--growth-interval must be an integer >= 1"),
        ({"min_scale": 10.0, "max_scale": 1.0}, "--min-scale 10.0 is above --max-scale 1.0"),
    ],
)
def test_bad_scaling_is_refused(scaling, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        make_policy(RunConfig(opt_level="O2", **scaling), CPU)


@pytest.mark.parametrize("option", ["loss_scale", "init_scale", "min_scale"])
def test_scaling_on_a_level_without_it_is_refused(option):
    with pytest.raises(ConfigError, match=f"O0 does not scale the loss; drop --{option.replace('_', '-')}"):
        make_policy(RunConfig(opt_level="O0", **{option: 128.0}), CPU)


def test_bf16_on_hardware_without_it_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    with pytest.raises(ConfigError, match="Tesla V100 has no BF16 support"):
        BF16Mixed.check(torch.device("cuda"))


def test_o2_with_an_optimizer_that_cannot_be_rebuilt_fails_before_training(store_path, write_script):
    path = write_script(
        """
        import torch

        class Picky(torch.optim.SGD):
            def __init__(self, params, special):
                super().__init__(params, lr=0.1)

        def build(device):
            model = torch.nn.Linear(2, 1)
            return {"model": model, "optimizer": Picky(model.parameters(), special=3),
                    "batches": lambda s: torch.ones(1, 2), "loss_fn": lambda m, b: m(b).sum()}
        """
    )
    run_id = train(ModelScript.from_path(path), RunConfig(opt_level="O2", steps=3, device="cpu"), store_path)
    run = Store(store_path).run(run_id)
    assert run["status"] == "failed" and run["steps_done"] == 0
    assert "cannot rebuild Picky from its parameter groups over the FP32 master weights" in run["error"] and "lambda params" in run["error"]


def test_model_state_account_matches_the_level():
    sizes = {}
    for level in ("O0", "O2"):
        policy, model, optimizer = prepared(level, nn.Sequential(nn.Linear(10, 10), nn.LayerNorm(10)),
                                            opt=torch.optim.Adam, lr=1e-3)
        one_step(policy, model, optimizer, lambda m: m(torch.randn(3, 10)).float().pow(2).mean())
        sizes[level] = model_state_bytes(model, optimizer, policy)
    psi = 10 * 10 + 10 + 10 + 10
    assert sizes["O0"] == {"params": psi, "weights": 4 * psi, "gradients": 4 * psi, "master_weights": 0,
                           "optimizer_state": 8 * psi + 4 * 4}  # Adam: m and v, plus a 4-byte step per tensor
    # O2: Linear weights in FP16 (2 bytes), LayerNorm in FP32; FP32 masters with FP32 grads.
    assert sizes["O2"]["weights"] == 2 * 110 + 4 * 20
    assert sizes["O2"]["master_weights"] == 4 * psi
    assert sizes["O2"]["gradients"] == (2 * 110 + 4 * 20) + 4 * psi


def test_rerun_uses_the_stored_source_and_records_its_parent(store_path, write_script):
    path = write_script(OVERFLOW_SCRIPT)
    parent = train(ModelScript.from_path(path), RunConfig(opt_level="O1", steps=5, seed=3, device="cpu"), store_path)
    path.write_text("raise SystemExit('the file changed after the run')\n")
    child = rerun(store_path, parent, opt_level="O2", init_scale=64.0)
    store = Store(store_path)
    run = store.run(child)
    assert run["status"] == "finished", run["error"]
    assert run["parent_run_id"] == parent and run["opt_level"] == "O2" and run["init_scale"] == 64.0
    assert run["seed"] == 3 and run["steps"] == 5 and run["script_sha256"] == store.run(parent)["script_sha256"]
    assert store.steps(child)["loss_scale"].iloc[0] == 64.0
    o0 = rerun(store_path, parent, opt_level="O0")  # a level without scaling drops the parent's scale
    assert store.run(o0)["scaling"] == "none"


def test_rerun_of_an_unknown_run_names_it(store_path):
    from mpdiag.store import StoreError

    Store(store_path)
    with pytest.raises(StoreError, match="No run 99"):
        rerun(store_path, 99)


def test_pair_runs_an_fp32_twin_on_identical_weights_and_batches(store_path):
    script = ModelScript.from_path(EXAMPLES / "mlp_digits.py")
    mixed, fp32 = train_pair(script, RunConfig(opt_level="O1", steps=30, device="cpu"), store_path)
    store = Store(store_path)
    runs = store.runs()
    assert store.run(mixed)["pair_run_id"] == fp32 and store.run(fp32)["pair_run_id"] == mixed
    assert store.run(fp32)["opt_level"] == "O0"
    assert reference_run(runs, mixed) == fp32
    comparison = loss_comparison(store.steps(fp32), store.steps(mixed))
    assert len(comparison) == 30
    assert abs(comparison["rel_diff"].iloc[0]) < 1e-3  # same weights, same batch: FP16 rounding only
    assert first_divergence(comparison) is None  # a healthy model stays within 5 %
    # Without --pair, a later O0 run of the same script and seed is recognised as the reference.
    lone = train(script, RunConfig(opt_level="bf16", steps=3, device="cpu"), store_path)
    assert reference_run(store.runs(), lone) == fp32
    other_seed = train(script, RunConfig(opt_level="bf16", steps=3, seed=1, device="cpu"), store_path)
    assert reference_run(store.runs(), other_seed) is None


def test_first_divergence_counts_nonfinite_and_relative_gaps():
    import pandas as pd

    ref = pd.DataFrame({"step": [0, 1, 2, 3], "loss": [1.0, 1.0, 1.0, 1.0]})
    run = pd.DataFrame({"step": [0, 1, 2, 3], "loss": [1.01, 1.04, 1.2, 1.0]})
    assert first_divergence(loss_comparison(ref, run)) == 2
    run_nan = pd.DataFrame({"step": [0, 1, 2, 3], "loss": [1.0, math.nan, 1.0, 1.0]})
    assert first_divergence(loss_comparison(ref, run_nan)) == 1
