"""O2 keeps a model's own normalization modules in FP32 (parameters and math), not the blocks they wrap."""

import torch
import torch.nn.functional as F
from torch import nn

from mpdiag import Store
from mpdiag.options import RunConfig
from mpdiag.training.policies import is_norm_module, make_policy
from mpdiag.training.runner import train
from mpdiag.training.script import ModelScript

CPU = torch.device("cpu")


class LayerNorm(nn.Module):
    """GPT codebases' LayerNorm: its own weight and bias through F.layer_norm (bias=None when bias=False)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(ndim)), nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, 1e-5)


class Scaled(nn.Module):
    """A functional RMS norm under a name that does not say so."""

    def __init__(self, ndim):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(ndim))

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.gain)


class PreNorm(nn.Module):
    """Normalizes with its own weight, then runs the wrapped block."""

    def __init__(self, ndim, fn):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.fn = fn

    def forward(self, x):
        return self.fn(F.layer_norm(x, (x.shape[-1],), self.weight))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = LayerNorm(8, bias=True)
        self.rms = Scaled(8)
        self.pre = PreNorm(8, nn.Linear(8, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.pre(self.rms(self.ln(x))))


def test_detection():
    block = Block()
    assert is_norm_module(block.ln) and is_norm_module(block.rms) and is_norm_module(block.pre)
    assert is_norm_module(nn.LayerNorm(3)) and is_norm_module(nn.RMSNorm(3))
    assert not is_norm_module(block.head) and not is_norm_module(block) and not is_norm_module(nn.ReLU())


def test_o2_keeps_norm_parameters_and_math_fp32_and_the_wrapped_block_fp16():
    torch.manual_seed(0)
    block = Block()
    reference = Block()
    reference.load_state_dict(block.state_dict())
    policy = make_policy(RunConfig(opt_level="O2", device="cpu"), CPU)
    model, _ = policy.prepare(block, lambda params, originals=None: torch.optim.SGD(params, lr=0.1))
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes == {"ln.weight": torch.float32, "ln.bias": torch.float32, "rms.gain": torch.float32,
                      "pre.weight": torch.float32, "pre.fn.weight": torch.float16, "pre.fn.bias": torch.float16,
                      "head.weight": torch.float16, "head.bias": torch.float16}
    seen = {}

    def note(name):
        def hook(module, args):
            seen[name] = args[0].dtype  # returns None: the input is left as it is
        return hook

    for name in ("ln", "rms", "pre", "pre.fn"):
        model.get_submodule(name).register_forward_pre_hook(note(name))
    x = torch.randn(4, 8)
    model(x).sum().backward()
    assert seen == {"ln": torch.float32, "rms": torch.float32, "pre": torch.float32, "pre.fn": torch.float16}
    # ground truth: the norm computed in FP32 on the FP16-rounded input, as nn.LayerNorm is at O2
    expected = F.layer_norm(x.half().float(), (8,), reference.ln.weight, reference.ln.bias, 1e-5).half()
    got = {}

    def keep(module, args, out):
        got["ln"] = out

    model.ln.register_forward_hook(keep)
    model(x)
    assert got["ln"].dtype == torch.float16 and torch.equal(got["ln"], expected)


def test_store_shows_fp32_norm_parameters(write_script, store_path):
    path = write_script(
        """
        import torch
        import torch.nn.functional as F

        class LayerNorm(torch.nn.Module):
            def __init__(self, ndim):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.ones(ndim))
                self.bias = torch.nn.Parameter(torch.zeros(ndim))

            def forward(self, x):
                return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)

        def build(device):
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), LayerNorm(8), torch.nn.Linear(8, 1))
            return {"model": model, "optimizer": lambda p: torch.optim.SGD(p, lr=0.1),
                    "batches": lambda s: torch.randn(4, 4), "loss_fn": lambda m, b: m(b).pow(2).mean()}
        """
    )
    run_id = train(ModelScript.from_path(path), RunConfig(opt_level="O2", steps=2, device="cpu"), store_path)
    store = Store(store_path)
    assert store.run(run_id)["status"] == "finished", store.run(run_id)["error"]
    dtypes = dict(zip(store.tensors(run_id)["name"], store.tensors(run_id)["param_dtype"], strict=True))
    assert dtypes == {"0.weight": "float16", "0.bias": "float16", "1.weight": "float32", "1.bias": "float32",
                      "2.weight": "float16", "2.bias": "float16"}
