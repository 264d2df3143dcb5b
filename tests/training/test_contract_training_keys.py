"""The optional contract keys clip_grad_norm, scheduler and accumulate: checked with clear errors, and the runner
does what a hand-written loop does with them."""

import math

import pytest
import torch

from mpdiag import Store
from mpdiag.options import RunConfig
from mpdiag.training.runner import seed_everything, train
from mpdiag.training.script import ModelScript, ScriptError, build_model

CPU = torch.device("cpu")

SCRIPT = """
import torch

DATA = torch.linspace(-1, 1, 64 * 5).reshape(64, 5)

def build(device):
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def batches(i):
        rows = (torch.arange(4) * 7 + i * 3) % 64
        x = DATA[rows] * (1 + (i % 3))
        return x, torch.sin(x.sum(dim=1, keepdim=True))

    def loss_fn(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x).float(), y)

    return {"model": model, "optimizer": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
            "batches": batches, "loss_fn": loss_fn, EXTRA}
"""


def script(write_script, extra: str, name="keys.py") -> ModelScript:
    return ModelScript.from_path(write_script(SCRIPT.replace("EXTRA", extra), name=name))


@pytest.mark.parametrize(("extra", "message"), [
    ('"clip_grad_norm": 0', "'clip_grad_norm' is 0; it must be a finite number > 0"),
    ('"clip_grad_norm": float("nan")', "'clip_grad_norm' is nan"),
    ('"clip_grad_norm": "1"', "'clip_grad_norm' is '1'"),
    ('"accumulate": 0', "'accumulate' is 0; it must be an integer >= 1"),
    ('"accumulate": 2.0', "'accumulate' is 2.0"),
    ('"accumulate": True', "'accumulate' is True"),
    ('"scheduler": 3', "'scheduler' is a int; it must be a callable optimizer -> LRScheduler"),
])
def test_bad_values_are_refused_with_the_key_named(write_script, extra, message):
    with pytest.raises(ScriptError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_model(script(write_script, extra), CPU)


@pytest.mark.parametrize(("extra", "message"), [
    ('"scheduler": lambda opt: 5', "the 'scheduler' callable returned int"),
    ('"scheduler": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt)', "ReduceLROnPlateau, whose step"),
    ('"scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), 2)',
     "a scheduler over another optimizer"),
])
def test_bad_schedulers_fail_the_run_with_the_reason(write_script, store_path, extra, message):
    run = Store(store_path).run(train(script(write_script, extra), RunConfig(steps=2, device="cpu"), store_path))
    assert run["status"] == "failed" and message in run["error"]


def hand_loop(source: ModelScript, steps: int, k: int, clip: float | None, gamma: float) -> list[float]:
    """The plain PyTorch loop a user would write: FP32, k micro-batches per step, clip, StepLR after each step."""
    seed_everything(0)
    spec = source.load_module().build(CPU)
    model, batches, loss_fn = spec["model"], spec["batches"], spec["loss_fn"]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=gamma)
    losses, micro = [], 0
    for _ in range(steps):
        optimizer.zero_grad()
        step_losses = []
        for _ in range(k):
            loss = loss_fn(model, batches(micro))
            micro += 1
            (loss / k).backward()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / k)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
    return losses


def test_accumulate_clip_and_scheduler_match_a_hand_written_loop(write_script, store_path):
    source = script(write_script, '"accumulate": 3, "clip_grad_norm": 0.05, '
                                  '"scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)')
    run_id = train(source, RunConfig(opt_level="O0", steps=6, seed=0, device="cpu"), store_path)
    store = Store(store_path)
    assert store.run(run_id)["status"] == "finished", store.run(run_id)["error"]
    steps = store.steps(run_id)
    assert list(steps["step"]) == list(range(6))  # one row per optimizer step, 18 micro-batches consumed
    expected = hand_loop(source, steps=6, k=3, clip=0.05, gamma=0.8)
    assert steps["loss"].tolist() == pytest.approx(expected, rel=1e-6)
    # without the keys the losses differ: the test would notice any of them being ignored
    plain = hand_loop(source, steps=6, k=1, clip=None, gamma=1.0)
    assert steps["loss"].tolist() != pytest.approx(plain, rel=1e-3)


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_stored_gradient_norm_is_the_norm_before_clipping(write_script, store_path, monkeypatch, level):
    returned = []
    clip = torch.nn.utils.clip_grad_norm_

    def spy(*args, **kwargs):
        norm = clip(*args, **kwargs)
        returned.append(float(norm))
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    source = script(write_script, '"clip_grad_norm": 0.01')
    run_id = train(source, RunConfig(opt_level=level, steps=4, seed=0, device="cpu"), store_path)
    store = Store(store_path)
    stats = store.tensor_stats(run_id)
    stored = [math.sqrt((group["l2"] ** 2).sum()) for _, group in stats.groupby("step")]
    assert len(returned) == 4 and len(stored) == 4
    assert all(n > 0.01 for n in returned)  # the bound bites, so clipping changed the gradients
    # at O2 the clipped gradients are the FP32 masters, the stored ones the FP16 model gradients
    assert stored == pytest.approx(returned, rel=1e-6 if level != "O2" else 2e-3)


def test_scheduler_steps_after_every_optimizer_step_skipped_ones_included(write_script, store_path, tmp_path):
    log = tmp_path / "lr.txt"
    source = ModelScript.from_path(write_script(SCRIPT.replace("EXTRA", '"scheduler": schedule').replace(
        "    def batches(i):\n",
        f"    def batches(i):\n        if OPT: open({str(log)!r}, 'a').write(f\"{{OPT[0].param_groups[0]['lr']!r}}\\n\")\n",
    ).replace("def build(device):", """OPT = []

def schedule(opt):
    OPT.append(opt)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 ** t)

def build(device):""")))
    # a scale of 2**60 overflows FP16 gradients: the first steps are skipped while the scale backs off
    run_id = train(source, RunConfig(opt_level="O2", steps=8, init_scale=2.0**60, device="cpu"), store_path)
    store = Store(store_path)
    assert store.run(run_id)["status"] == "finished", store.run(run_id)["error"]
    assert store.steps(run_id)["skipped"].iloc[:2].tolist() == [1.0, 1.0]
    lrs = [float(line) for line in log.read_text().split()]
    assert lrs == [0.05 * 0.5 ** t for t in range(8)]


@pytest.mark.parametrize(("extra", "problem"), [
    ('"scheduler": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt)', "ReduceLROnPlateau, whose step"),
    ('"clip_grad_norm": 0.5, "accumulate": 2, "scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1)', None),
])
def test_the_check_takes_one_step_with_the_keys(write_script, extra, problem):
    # the check's trial step builds the scheduler and clips as a run would, so a bad scheduler fails the check,
    # not the run after it
    from mpdiag.sandbox.check import check_script

    path = write_script(SCRIPT.replace("EXTRA", extra), name="keys.py")
    report = check_script(str(path), open(path).read(), device="cpu")
    if problem is None:
        assert report.ready, report.problems
        assert {k: report.summary[k] for k in ("clip grad norm", "scheduler", "accumulate")} == \
            {"clip grad norm": 0.5, "scheduler": "StepLR", "accumulate": 2}
    else:
        assert not report.ready and any(problem in p for p in report.problems), report.problems
