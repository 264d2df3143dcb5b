"""fp8-sim with a block-scaled recipe (--fp8-recipe mxfp8 / nvfp4): every GEMM of the simulated Linear against
torch's own F.linear / mm of torchao 0.18.0's reference casts (tests/ground_truth.py), bit for bit; its options;
and short seeded runs through the runner."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ground_truth import reference_mx_linear, reference_mxfp8, reference_nvfp4
from torch import nn
from torch.nn import functional as F

from mpdiag import Store
from mpdiag.numerics.fp8_recipes import Fp8Settings
from mpdiag.options import ConfigError, RunConfig
from mpdiag.training.fp8_sim import simulate_fp8
from mpdiag.training.policies import make_policy
from mpdiag.training.runner import train
from mpdiag.training.script import ModelScript

CPU = torch.device("cpu")
RECIPES = ("mxfp8", "nvfp4")


def reference(x: torch.Tensor, recipe: str) -> torch.Tensor:
    """torchao's dequantized x, blocked along its last dimension (zero-padded there, trimmed back)."""
    deq = (reference_mxfp8 if recipe == "mxfp8" else reference_nvfp4)(x)[2]
    return deq.reshape(-1, deq.shape[-1])[:, : x.shape[-1]].reshape(x.shape)


def operands(seed: int):
    """An input (2, 24, 40) and a weight (48, 40) with outliers and tiny values: neither 40 nor 24 * 2 = 48 rows
    is a multiple of 32, so padding is exercised; some blocks clip (MXFP8) or underflow (NVFP4)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 24, 40, generator=g) * torch.exp2(torch.randint(-12, 6, (2, 24, 40), generator=g).float())
    x[0, 3, 7] = 1.9 * 2.0**9  # mantissa 1.9: past 464 after MXFP8's FLOOR scale, clipped
    w = torch.randn(48, 40, generator=g) * 0.1
    w[5, 0] = -37.0
    return x, w


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("bias", [False, True])
def test_block_linear_forward_and_gradients_equal_the_reference_casts_gemms(recipe, bias):
    x, w = operands(3)
    layer = nn.Linear(40, 48, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(w)
    b = None if layer.bias is None else layer.bias.detach().clone()
    assert simulate_fp8(layer, Fp8Settings(recipe=recipe), CPU) == [""]
    x = x.requires_grad_()
    out = layer(x)
    want = F.linear(reference(x.detach(), recipe), reference(w, recipe))
    assert torch.equal(out.detach(), want if b is None else want + b)
    assert not torch.equal(want, F.linear(x.detach(), w))  # the casts changed something

    upstream = torch.randn(2, 24, 48, generator=torch.Generator().manual_seed(4)) * 1e-3
    out.backward(upstream)
    g = upstream.reshape(-1, 48)
    # dX = dY W: dY blocked along out, W re-blocked along out (W^T's last dimension)
    want_dx = (reference(g, recipe) @ reference(w.t().contiguous(), recipe).t()).reshape(x.shape)
    assert torch.equal(x.grad, want_dx)
    # dW = dY^T x: both blocked along the 48 rows
    want_dw = reference(g.t().contiguous(), recipe) @ reference(x.detach().reshape(-1, 40).t().contiguous(), recipe).t()
    assert torch.equal(layer.weight.grad, want_dw)
    if bias:
        assert torch.equal(layer.bias.grad, g.sum(0))  # the high-precision dY's sum, as torchao's bias outside mx_mm
    # W blocked along in (forward) is not W blocked along out (input gradient): the re-blocking matters
    assert not torch.equal(want_dx, (reference(g, recipe) @ reference(w, recipe)).reshape(x.shape))


def test_mxfp8_linear_equals_torchaos_mxfp8_training_gemms():
    """torchao's own MXFP8 training matmul (mx_mm, emulated on the CPU): output, input and weight gradients equal,
    bit for bit, on whole blocks (torchao refuses partial ones)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 32, 96, generator=g) * torch.exp2(torch.randint(-10, 6, (2, 32, 96), generator=g).float())
    w, upstream = torch.randn(64, 96, generator=g), torch.randn(2, 32, 64, generator=g) * 1e-4
    out, dx, dw = reference_mx_linear(x, w, upstream)
    layer = nn.Linear(96, 64, bias=False)
    with torch.no_grad():
        layer.weight.copy_(w)
    simulate_fp8(layer, Fp8Settings(recipe="mxfp8"), CPU)
    x = x.requires_grad_()
    mine = layer(x)
    mine.backward(upstream)
    assert torch.equal(mine, out) and torch.equal(x.grad, dx) and torch.equal(layer.weight.grad, dw)


def test_block_linear_under_autocast_hands_back_bf16_and_fp32_weight_gradients():
    layer = nn.Linear(32, 16)
    simulate_fp8(layer, Fp8Settings(recipe="mxfp8"), CPU)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(5), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert torch.isfinite(layer.weight.grad).all()


def test_block_recipe_options():
    RunConfig(opt_level="fp8-sim", fp8_recipe="mxfp8").validate()
    RunConfig(opt_level="fp8-sim", fp8_recipe="nvfp4", fp8=True, fp8_margin=2).validate()  # the recorded recipes'
    with pytest.raises(ConfigError, match="--fp8-blocks mxfp8"):
        RunConfig(opt_level="bf16", fp8=True, fp8_recipe="mxfp8").validate()
    with pytest.raises(ConfigError, match="does not use --fp8-history"):
        RunConfig(opt_level="fp8-sim", fp8_recipe="nvfp4", fp8_history=4).validate()
    with pytest.raises(ConfigError, match="mxfp8 or nvfp4"):
        RunConfig(opt_level="fp8-sim", fp8_recipe="mxfp4").validate()
    settings = RunConfig(opt_level="fp8-sim", fp8_recipe="nvfp4", fp8=True, fp8_blocks="mxfp8").fp8_settings()
    assert settings.recipes == ("current", "delayed") and settings.recorded_blocks == ("mxfp8", "nvfp4")
    assert make_policy(RunConfig(opt_level="fp8-sim", fp8_recipe="mxfp8"), CPU).fp8.is_block


TINY = """
import torch
from torch import nn

OUTLIER = {outlier}

def build(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(16, 64, 64, generator=g)
    ys = (xs @ torch.randn(64, 10, generator=g)).argmax(-1)  # a teacher's labels: learnable in a few steps
    xs[:, :, 5] *= OUTLIER  # one feature with huge values: every block's input shares one tensor scale (NVFP4)
    return {{"model": model, "optimizer": lambda p: torch.optim.Adam(p, lr=1e-2),
            "batches": lambda step: (xs[step % 16], ys[step % 16]),
            "loss_fn": lambda m, b: nn.functional.cross_entropy(m(b[0]).float(), b[1])}}
"""


def losses(store_path, run_id: int) -> np.ndarray:
    store = Store(store_path)
    assert store.run(run_id)["status"] == "finished"
    return store.steps(run_id)["loss"].to_numpy()


def test_an_mxfp8_run_trains_like_bf16_and_stores_its_recipe(store_path, write_script):
    script = ModelScript.from_path(write_script(TINY.format(outlier=1.0)))
    base = RunConfig(opt_level="bf16", steps=12, device="cpu")
    bf16 = losses(store_path, train(script, base, store_path))
    run_id = train(script, base.with_options(opt_level="fp8-sim", fp8_recipe="mxfp8"), store_path)
    mx = losses(store_path, run_id)
    assert np.isfinite(mx).all() and mx[-1] < 0.9 * mx[0] and bf16[-1] < 0.9 * bf16[0]  # both learn
    assert (np.abs(mx / bf16 - 1) < 0.02).all() and not np.array_equal(mx, bf16)  # within 2 %, every step
    assert Store(store_path).run(run_id)["config"]["run"]["fp8_recipe"] == "mxfp8"


def test_an_nvfp4_run_of_an_outlier_layer_records_what_its_scales_lose(store_path, write_script):
    """NVFP4's per-tensor scale is the tensor's amax over 448 * 6: an outlier feature (2^14 times the rest) pushes
    the other blocks' E4M3 scales to their floor, and their values underflow. It never clips: the largest scaled
    value is 6 over the E4M3 rounding of the block scale, at most 6 / (1 - 2^-4) = 6.4, below E2M1's edge, 7."""
    script = ModelScript.from_path(write_script(TINY.format(outlier=2.0**14)))
    config = RunConfig(opt_level="fp8-sim", fp8_recipe="nvfp4", steps=4, device="cpu", fp8=True)
    run_id = train(script, config, store_path)
    assert np.isfinite(losses(store_path, run_id)).all()
    rows = Store(store_path).fp8(run_id)
    assert set(rows["recipe"]) == {"current", "delayed", "nvfp4"}  # the simulated recipe, recorded as a block one
    nv = rows[(rows["recipe"] == "nvfp4") & (rows["role"] == "input")].groupby("module")[["underflow", "overflow",
                                                                                          "numel"]].sum()
    assert nv.loc["0", "underflow"] > 0.05 * nv.loc["0", "numel"]  # the outlier layer loses a share of its inputs
    assert nv.loc["0", "underflow"] > 10 * max(nv.loc["2", "underflow"], 1)
    assert (nv["overflow"] == 0).all()
    blocks = Store(store_path).fp8_blocks(run_id)
    assert (blocks["recipe"] == "nvfp4").all() and len(blocks)
    assert math.isfinite(float(rows["amax"].max()))


def test_a_rerun_with_a_block_recipe_is_named_after_it():
    from mpdiag.options import fix_text, rerun_name

    before = RunConfig(opt_level="bf16").to_dict()
    after = RunConfig(opt_level="fp8-sim", fp8_recipe="nvfp4").to_dict()
    assert rerun_name("m.py", before, after) == "m.py ↻ fp8-sim: NVFP4 blocks"
    assert fix_text({"opt_level": "fp8-sim", "fp8_recipe": "current"}) == "level fp8-sim, current scaling"


def test_the_fp8_page_says_a_block_recipe_was_simulated_and_what_was_recorded_beside_it():
    import pandas as pd

    from mpdiag.dashboard.fp8_model import Fp8Run

    settings = RunConfig(opt_level="fp8-sim", fp8_recipe="mxfp8", fp8=True).fp8_settings()
    page = Fp8Run(settings, pd.DataFrame({"step": [0, 1], "module": ["0", "0"]}), None, pd.DataFrame())
    assert page.recorded.startswith("Recorded recipe: MXFP8 simulated; current and delayed scaling recorded beside it")
    assert page.recorded.endswith("block-scaled too: MXFP8 (their table is at the end of the page).")


def test_the_cli_runs_a_block_recipe_and_watch_refuses_it(tmp_path, write_script):
    from conftest import run_cli

    script, db = write_script(TINY.format(outlier=1.0)), tmp_path / "cli.db"
    done = run_cli("run", script, "--opt-level", "fp8-sim", "--fp8-recipe", "mxfp8", "--steps", "3", "--device", "cpu",
                   "--store", db)
    assert done.returncode == 0, done.stderr
    run = Store(db).runs().iloc[-1]
    assert run["opt_level"] == "fp8-sim" and Store(db).run(int(run["run_id"]))["config"]["run"]["fp8_recipe"] == "mxfp8"
    with pytest.raises(ConfigError, match="use --fp8 --fp8-blocks nvfp4"):  # what `watch --fp8` checks its recipe with
        RunConfig(opt_level="O0", fp8=True, fp8_recipe="nvfp4").validate()


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_zero_initialised_layer_stays_finite(recipe):
    """torchao's NVFP4 cast of an all-zero tensor is NaN (tensor scale 0, 0 / 0): the simulation gives zeros, so a
    zero-initialised weight or a zero gradient does not end the run."""
    assert torch.isnan(reference(torch.zeros(2, 16), "nvfp4")).all()  # the reference's own behaviour
    layer = nn.Linear(16, 8)
    nn.init.zeros_(layer.weight)
    simulate_fp8(layer, Fp8Settings(recipe=recipe), CPU)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(7), requires_grad=True)
    out = layer(x)
    assert torch.equal(out, layer.bias.detach().expand(4, 8))
    out.backward(torch.zeros(4, 8))
    assert torch.equal(x.grad, torch.zeros(4, 16)) and torch.equal(layer.weight.grad, torch.zeros(8, 16))
