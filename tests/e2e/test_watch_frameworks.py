"""`mpdiag watch` on the frameworks people train with, each unmodified and checked against its own numbers.

Every script in tests/fixtures/scripts/frameworks/ writes its framework's own truth (Lightning's tensors handed to its
hooks, the loop's own closure evaluation, Accelerate's gradients before its clip, a GAN's per-model gradients)
to a JSON file; the run watch stored must hold exactly those: one step per optimizer step, the loss the
framework back-propagated, per tensor the L2 norm of the gradient the optimizer stepped with (unscaled, before
clipping), under the user's own parameter names. docs/watch.md's conformance table cites these tests
(tests/test_docs.py checks that every test it names exists).
"""

import json
import math
import os

import pytest
from conftest import FIXTURES

from mpdiag.store import Store
from mpdiag.training.watch import WatchConfig, watch

pytestmark = pytest.mark.slow

FRAMEWORKS = os.fspath(FIXTURES / "scripts" / "frameworks")


def watched_truth(store_path, tmp_path, script, *args, **options):
    truth_path = tmp_path / "truth.json"
    run_id, code = watch(WatchConfig(target=os.path.join(FRAMEWORKS, script), args=(str(truth_path), *args),
                                     **options), store_path)
    assert code == 0
    return Store(store_path), run_id, json.loads(truth_path.read_text())


def assert_steps_are_the_frameworks(store, run_id, truth, rel=1e-6):
    """One stored step per optimizer step, with the framework's loss and gradient norms, nothing else."""
    run, steps, stats = store.run(run_id), store.steps(run_id), store.tensor_stats(run_id)
    assert run["status"] == "finished" and not run["note"], run["note"]
    assert store.tensors(run_id)["name"].tolist() == truth["names"]
    assert len(steps) == len(truth["loss"])
    assert steps["loss"].tolist() == pytest.approx(truth["loss"], rel=rel)
    for step, norms in enumerate(truth["norms"]):
        rows = stats[stats["step"] == step].set_index("tensor")["l2"]
        assert sorted(rows.index) == sorted(truth["names"])
        assert [rows[name] for name in truth["names"]] == pytest.approx(norms, rel=rel), f"step {step}"


@pytest.mark.parametrize("args", [
    ("--precision", "32-true"),
    ("--precision", "32-true", "--clip", "0.5"),
    ("--precision", "32-true", "--accumulate", "3", "--clip", "0.1"),
    ("--precision", "bf16-mixed", "--accumulate", "2"),
    ("--precision", "bf16-mixed", "--clip", "0.5"),
    ("--precision", "16-mixed", "--accumulate", "2", "--clip", "0.1"),
    ("--precision", "cpu-fp16", "--accumulate", "2", "--clip", "0.1"),
    ("--precision", "cpu-fp16", "--manual"),
    ("--manual",),
], ids=["32-true", "32-clip", "32-accumulate3-clip", "bf16-accumulate2", "bf16-clip", "16-mixed-as-bf16-on-cpu",
        "16-mixed-scaled", "16-mixed-scaled-manual", "manual"])
def test_lightning_trainer(store_path, tmp_path, args):
    """Automatic optimization runs ``optimizer.step(closure)`` (forward and backward inside the step); AdamW with
    two parameter groups and a per-step scheduler; max_steps."""
    store, run_id, truth = watched_truth(store_path, tmp_path, "lightning_trainer.py", *args, "--max-steps", "4")
    assert_steps_are_the_frameworks(store, run_id, truth)
    assert store.tensors(run_id)["name"].tolist()[0] == "body.0.weight"  # the LightningModule's own names


def test_lightning_at_watchs_o1_records_the_scalers_own_trajectory(store_path, tmp_path):
    """--opt-level O1 makes Lightning's autocast FP16; Lightning makes no GradScaler on the CPU, so the run is
    unscaled, and says nothing was skipped."""
    store, run_id, truth = watched_truth(store_path, tmp_path, "lightning_trainer.py", "--precision", "bf16-mixed",
                                         "--max-steps", "3", opt_level="O1")
    assert_steps_are_the_frameworks(store, run_id, truth, rel=1e-5)
    assert store.steps(run_id)["skipped"].tolist() == [0, 0, 0]


@pytest.mark.parametrize("args", [
    ("--optimizer", "sgd"),
    ("--optimizer", "lbfgs"),
    ("--optimizer", "lbfgs", "--max-iter", "5"),
    ("--optimizer", "lbfgs", "--max-iter", "5", "--line-search"),
], ids=["sgd", "lbfgs-1", "lbfgs-5", "lbfgs-5-strong-wolfe"])
def test_optimizer_step_with_a_closure(store_path, tmp_path, args):
    """The recorded evaluation is the closure's first: the gradients and loss at the weights the step starts
    from, the loss LBFGS's step returns; its later evaluations (other weights) are no step's."""
    store, run_id, truth = watched_truth(store_path, tmp_path, "closure_loop.py", *args)
    assert_steps_are_the_frameworks(store, run_id, truth)
    assert truth["returned"] == pytest.approx(truth["loss"])


@pytest.mark.parametrize("mixed_precision, clip", [("no", "every"), ("no", "guarded"), ("bf16", "every"),
                                                   ("bf16", "guarded"), ("no", "none")])
def test_accelerate_accumulation_whatever_the_clipping(store_path, tmp_path, mixed_precision, clip):
    """A clip on every micro-batch (Accelerate skips the optimizer step on those that do not sync): the step's
    gradients are those before the clip that precedes the optimizer step, its loss the whole window's."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton; each script is a new process
    store, run_id, truth = watched_truth(store_path, tmp_path, "accelerate_loop.py", "--mixed-precision",
                                         mixed_precision, "--clip", clip, "--accumulate", "2")
    assert_steps_are_the_frameworks(store, run_id, truth)


@pytest.mark.parametrize("args", [(), ("--accumulate", "2", "--clip", "0.5"), ("--clip-mode", "value", "--clip", "0.05")],
                         ids=["no-clip", "accumulate2-clip-norm", "clip-value"])
def test_timm_native_scaler_cosine_scheduler_and_accumulation(store_path, tmp_path, args):
    """timm's own NativeScaler, dispatch_clip_grad and CosineLRScheduler in train.py's loop, FP16 autocast: each
    optimizer step with the loss timm back-propagated, the gradients as timm's clip received them (unscaled), the
    learning rate the step used, GradScaler's scale and its skipped steps (one overflows at 2^16)."""
    store, run_id, truth = watched_truth(store_path, tmp_path, "timm_loop.py", *args)
    run, steps, stats = store.run(run_id), store.steps(run_id), store.tensor_stats(run_id)
    assert run["status"] == "finished" and not run["note"], run["note"]
    assert store.tensors(run_id)["name"].tolist() == truth["names"]
    assert steps["loss"].tolist() == pytest.approx(truth["loss"], rel=1e-6)
    assert steps["lr"].tolist() == truth["lr"]
    assert steps["loss_scale"].tolist() == truth["scale"]
    assert (steps["skipped"] == 1).tolist() == truth["skipped"]
    for step, norms in enumerate(truth["norms"]):
        rows = stats[stats["step"] == step].set_index("tensor")["l2"]
        recorded = [rows[name] for name in truth["names"]]
        if all(map(math.isfinite, norms)):
            assert recorded == pytest.approx(norms, rel=1e-6), f"step {step}"
        else:  # an overflowing step: the same tensors non-finite
            assert [math.isfinite(v) for v in recorded] == [math.isfinite(v) for v in norms], f"step {step}"


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_runs_and_keeps_the_models_own_names(store_path, tmp_path, backend):
    store, run_id, truth = watched_truth(store_path, tmp_path, "compiled_loop.py", "--backend", backend)
    assert_steps_are_the_frameworks(store, run_id, truth, rel=1e-5)
    assert not any("_orig_mod" in name for name in truth["names"])


def test_a_dead_weak_proxy_in_the_heap_does_not_kill_the_script(store_path, write_script):
    """isinstance() on a dead weakref.proxy raises ReferenceError: watch's scan of the heap must not."""
    script = write_script("""
import weakref
import torch
class Holder: pass
holder = Holder()
dead = weakref.proxy(holder)
del holder
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    opt.zero_grad(); model(torch.ones(2, 3)).sum().backward(); opt.step()
""", name="proxy_loop.py")
    run_id, code = watch(WatchConfig(target=str(script)), store_path)
    assert code == 0 and len(Store(store_path).steps(run_id)) == 2


def test_gan_steps_record_only_the_stepping_models_gradients_under_stable_names(store_path, tmp_path):
    """DCGAN's pattern with AMP: each optimizer step is a step of its own, holding only the tensors of the model
    that stepped (the generator's backward also writes into the discriminator, whose optimizer does not step
    then), unscaled; the two root modules are named by class, the same in every run."""
    store, run_id, truth = watched_truth(store_path, tmp_path, "gan_loop.py")
    _, second_run, _ = watched_truth(store_path, tmp_path, "gan_loop.py")
    names = store.tensors(run_id)["name"].tolist()
    assert names == store.tensors(second_run)["name"].tolist()
    assert names == [f"Discriminator.main.{i}.{kind}" for i in (0, 2) for kind in ("weight", "bias")] + \
        [f"Generator.main.{i}.{kind}" for i in (0, 2) for kind in ("weight", "bias")]
    steps, stats = store.steps(run_id), store.tensor_stats(run_id)
    assert steps["loss"].tolist() == pytest.approx(truth["loss"], rel=1e-6)
    for step, norms in enumerate(truth["norms"]):
        rows = stats[stats["step"] == step].set_index("tensor")["l2"]
        assert sorted(rows.index) == sorted(norms), f"step {step} ({truth['model'][step]})"
        finite = {name: norm for name, norm in norms.items() if math.isfinite(norm)}
        assert [rows[name] for name in finite] == pytest.approx(list(finite.values()), rel=1e-6)


def test_clipping_with_get_total_norm_and_clip_grads_with_norm(store_path, write_script, tmp_path):
    """torch's two-part clip (Hugging Face's Trainer uses it for gradients on several meshes): the recorded
    gradients are those before ``clip_grads_with_norm_``, whose global norm is what ``get_total_norm`` returned."""
    norms_path = tmp_path / "norms.json"
    script = write_script(f"""
import json
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
norms = []
for _ in range(3):
    opt.zero_grad()
    (model(torch.randn(16, 4)) * 100).square().mean().backward()
    grads = [p.grad for p in model.parameters()]
    total = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.01, total)
    norms.append(float(total))
    opt.step()
json.dump(norms, open({str(norms_path)!r}, "w"))
""", name="two_part_clip.py")
    run_id, code = watch(WatchConfig(target=str(script)), store_path)
    assert code == 0
    stats, norms = Store(store_path).tensor_stats(run_id), json.loads(norms_path.read_text())
    recorded = stats.groupby("step")["l2"].apply(lambda l2: math.sqrt((l2 ** 2).sum())).tolist()
    assert recorded == pytest.approx(norms, rel=1e-5) and min(norms) > 1  # far above the clip: before it


def test_lightning_fabric_keeps_the_models_own_names(store_path, write_script, tmp_path):
    """``fabric.setup(model)`` wraps the model (its parameters under ``_forward_module.``): the tensors are named as
    the script's model names them. Truth: the model's own names and gradient norms before each step."""
    script = write_script("""
import json, sys
import torch
from lightning_fabric import Fabric
torch.manual_seed(0)
fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
truth = {"names": [n for n, _ in model.named_parameters()], "loss": [], "norms": []}
model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for _ in range(3):
    opt.zero_grad()
    loss = model(torch.randn(8, 4)).square().mean()
    fabric.backward(loss)
    truth["loss"].append(float(loss))
    truth["norms"].append([float(p.grad.double().norm()) for p in model.parameters()])
    opt.step()
json.dump(truth, open(sys.argv[1], "w"))
""", name="fabric_loop.py")
    truth_path = tmp_path / "truth.json"
    run_id, code = watch(WatchConfig(target=str(script), args=(str(truth_path),)), store_path)
    assert code == 0
    assert_steps_are_the_frameworks(Store(store_path), run_id, json.loads(truth_path.read_text()))


def test_a_closure_the_optimizer_never_calls_is_named_not_guessed(store_path, write_script):
    """An optimizer whose step ignores its closure: watch cannot see that step's gradients, so it stores no step
    for it and the run's note says so."""
    script = write_script("""
import torch
class Ignoring(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):  # updates from the gradients already there; the closure is never called
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])
model = torch.nn.Linear(3, 1)
opt = Ignoring(model.parameters())
for _ in range(2):
    def closure():
        opt.zero_grad(); loss = model(torch.ones(2, 3)).sum(); loss.backward(); return loss
    closure()
    opt.step(closure)
""", name="ignoring.py")
    run_id, code = watch(WatchConfig(target=str(script)), store_path)
    run = Store(store_path).run(run_id)
    assert code == 0 and run["note"].startswith("2 optimizer step(s) were given a closure they never called")
    assert Store(store_path).steps(run_id).empty
