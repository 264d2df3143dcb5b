"""The Recorder's optional parts behind one protocol (mpdiag.recording.features): all of them on at once, each
part's rows reach the store at the steps its hooks were called for, and the end of the run takes every hook out."""

import math

import torch
from torch import nn

from mpdiag import Recorder, Store
from mpdiag.numerics.fp8_recipes import Fp8Settings

STEPS, EVERY, BROKEN_STEP = 5, 2, 4  # the last step's batch holds an inf: its loss is non-finite, it does not step


def _hook_counts(model: nn.Module, opt: torch.optim.Optimizer) -> list[int]:
    """Every hook a Recorder's parts may put on the model, its parameters and the optimizer."""
    counts = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    counts += [len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()]
    return counts + [len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)]


def test_every_optional_part_at_once_stores_its_rows_and_leaves_no_hook(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _hook_counts(model, opt)
    rec = Recorder(model, store=tmp_path / "runs.db", optimizer=opt, every=EVERY, trace_modules=True,
                   update_format="fp16", fp8=Fp8Settings(), check_optimizer_step=True, replay=True)
    for step in range(STEPS):
        opt.zero_grad()
        batch = torch.randn(16, 4)
        if step == BROKEN_STEP:
            batch[0, 0] = math.inf
        loss = model(batch).square().mean()
        loss.backward()
        rec.record(loss)
        if step % 2:  # the same gradients as the FP32 reference: they compare as equal
            rec.compare_gradients([p.grad.clone() for p in model.parameters()])
        if step != BROKEN_STEP:
            opt.step()
    rec.close()

    assert _hook_counts(model, opt) == before
    store = Store(tmp_path / "runs.db")
    modules = store.module_stats(rec.run_id)
    assert sorted(set(modules["step"])) == list(range(STEPS)) and len(modules) == 3 * STEPS  # every step
    multiples = list(range(0, STEPS, EVERY))
    assert sorted(set(store.fp8(rec.run_id)["step"])) == multiples  # the multiples of every
    # the update counts: the multiples of every whose optimizer stepped
    assert sorted(set(store.update_stats(rec.run_id)["step"])) == [s for s in multiples if s != BROKEN_STEP]
    shadow = store.shadow_stats(rec.run_id)
    assert sorted(set(shadow["step"])) == [1, 3] and len(shadow) == 2 * 4
    assert (shadow["rel_error"] == 0).all() and ((shadow["cosine"] - 1).abs() < 1e-12).all()
    replays = store.replays(rec.run_id)
    assert replays["step"].tolist() == [BROKEN_STEP] and rec.replayed.step == BROKEN_STEP
    assert rec.optimizer_step_nonfinite is None  # SGD over finite values never broke them
