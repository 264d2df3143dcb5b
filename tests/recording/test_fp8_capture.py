"""FP8 capture on a model with planted inputs, weights and output gradients: the records equal counts
computed here by casting the tensors the test holds itself, at scales computed here in fp32."""

from __future__ import annotations

import math

import numpy as np
import torch
from ground_truth import by_casting, exponent_histogram
from torch import nn

from mpdiag.numerics.fp8 import EXP_MIN
from mpdiag.numerics.fp8_recipes import FP8_FORMATS, Fp8Settings
from mpdiag.recording.fp8_capture import RECORD_COLUMNS, Fp8Capture

FMAX = {name: np.float32(fmt.max_finite) for name, fmt in FP8_FORMATS.items()}


def planted_model() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.linspace(-1, 1, 24).reshape(4, 6) * 2.0 ** torch.arange(-20, 4).reshape(4, 6))
        model[0].bias.zero_()
        model[1].weight.copy_(torch.tensor([[3.0, 1e-9, -0.5, 2.0], [7.0, 1e-3, 0.25, -4.0], [1.0, 1.0, 1.0, 1e-30]]))
    return model


def planted_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input x: ordinary values plus ones far below the rest (underflow E4M3 at the current scale); the jump
    at step 2 (x 8 times larger) overflows the delayed scale. G: the planted output gradient of the last
    layer, with a spread wider than E5M2's."""
    x = torch.tensor([[1.0, -2.0, 3.0, 1e-6, -3e-7, 0.0], [0.5, 4.0, -1e-8, 2.0, 0.125, 1.0]]) * (8.0 if step == 2 else 1.0)
    g = torch.tensor([[1.0, -2.0 ** -30, 3.0], [2.0 ** -12, 0.0, -2.0 ** -40]]) * 2.0 ** -step
    return x, g


def planted_step(model, optimizer, step: int, loss_scale: float, backward) -> tuple[torch.Tensor, dict]:
    """One step's forward and ``backward(loss)`` (which scales by ``loss_scale``) of the planted model; returns
    the loss and the tensors an FP8 recipe casts, by (module, role), the output gradients unscaled."""
    x, g = planted_batch(step)
    optimizer.zero_grad()
    hidden = model[0](x)
    hidden.retain_grad()
    loss = (model[1](hidden) * g).sum()
    backward(loss)
    return loss, {("0", "input"): x, ("0", "weight"): model[0].weight.detach().clone(),
                  ("0", "grad_output"): hidden.grad / loss_scale,
                  ("1", "input"): hidden.detach(), ("1", "weight"): model[1].weight.detach().clone(),
                  ("1", "grad_output"): g}


def expected_scale(recipe: str, amaxes: list[float], fmt: str, history: int) -> np.float32:
    """The recipe's scale at the last of ``amaxes``: current from its own amax; delayed from the largest of the
    ``history`` finite amaxes before it (a skipped step's inf never enters), its own while there are none;
    1 where that reference is not finite."""
    before = [a for a in amaxes[:-1] if math.isfinite(a)]
    reference = amaxes[-1] if recipe == "current" or not before else max(before[-history:])
    return FMAX[fmt] / np.float32(reference) if math.isfinite(reference) else np.float32(1)


def test_records_equal_casting_of_the_planted_tensors_under_both_recipes():
    loss_scale = 2.0**10
    settings = Fp8Settings(recipe="both", history=2)
    model = planted_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    capture = Fp8Capture(model, settings)
    seen: dict[tuple[str, str], list[float]] = {}
    for step in range(4):
        _, truth = planted_step(model, optimizer, step, loss_scale, lambda loss: (loss * loss_scale).backward())
        if step == 1:
            capture.skip()  # not a recorded step: neither counted nor in the delayed history
            optimizer.step()
            continue
        result = capture.take(step, loss_scale=loss_scale)
        optimizer.step()  # after take: the records hold the weights this forward pass used
        rows = [dict(zip(RECORD_COLUMNS, r, strict=True)) for r in result.records]
        assert len(rows) == 2 * 3 * 2
        for (module, role), tensor in truth.items():
            fmt = "fp8_e5m2" if role == "grad_output" else "fp8_e4m3"
            amax = float(tensor.abs().max())
            seen.setdefault((module, role), []).append(amax)
            for recipe in ("current", "delayed"):
                row = next(r for r in rows if (r["module"], r["role"], r["recipe"]) == (module, role, recipe))
                scale = expected_scale(recipe, seen[(module, role)], fmt, settings.history)
                assert row["fmt"] == fmt and row["step"] == step
                assert row["scale"] == float(scale) and row["amax"] == amax and row["numel"] == tensor.numel()
                assert (row["underflow"], row["subnormal"], row["overflow"]) == by_casting(tensor, float(scale), fmt), \
                    (step, module, role, recipe)
            hist = {e: c for s, m, r, e, c in result.histograms if (m, r) == (module, role)}
            expected = exponent_histogram(tensor)
            assert hist == {EXP_MIN + b: int(expected[b]) for b in np.flatnonzero(expected)}
    assert capture.take(9).records == []  # nothing captured since: no rows


def test_planted_effects_are_visible_and_evaluation_passes_are_not_captured():
    settings = Fp8Settings(recipe="both", history=4)
    model = planted_model()
    capture = Fp8Capture(model, settings)
    by_step = {}
    for step in range(3):
        x, g = planted_batch(step)
        (model(x) * g).sum().backward()
        with torch.no_grad():
            model(torch.full((5, 6), 1e9))  # an evaluation pass: not what the recipe casts in training
        by_step[step] = {(r[1], r[2], r[4]): dict(zip(RECORD_COLUMNS, r, strict=True))
                         for r in capture.take(step).records}
    x_current = by_step[0][("0", "input", "current")]
    assert x_current["underflow"] == 3 and x_current["numel"] == 12  # 1e-6, 3e-7, 1e-8 times 448 / 4: below 2^-10
    jump = by_step[2][("0", "input", "delayed")]
    assert jump["overflow"] > 0 and by_step[2][("0", "input", "current")]["overflow"] == 0
    assert jump["amax"] == 32.0 and jump["scale"] == float(np.float32(448) / np.float32(4))
    grad = by_step[0][("1", "grad_output", "current")]
    assert grad["underflow"] == 1 and grad["fmt"] == "fp8_e5m2"  # 2^-40 * 57344 / 3 is below 2^-17
    capture.remove()
    (model(planted_batch(0)[0]) * planted_batch(0)[1]).sum().backward()
    assert capture.take(5).records == []


def test_a_deep_copy_of_the_model_is_not_captured():
    """A copy made with ``copy.deepcopy`` after the capture hooked in (an EMA or teacher model) carries its
    hooks; its passes, even with gradients enabled, are not the recorded model's tensors."""
    import copy

    model = planted_model()
    capture = Fp8Capture(model, Fp8Settings(recipe="current"))
    teacher = copy.deepcopy(model)
    x, g = planted_batch(0)
    (model(x) * g).sum().backward()
    (teacher(torch.full((5, 6), 1e9)) * 1e9).sum().backward()
    rows = {(r[1], r[2]): dict(zip(RECORD_COLUMNS, r, strict=True)) for r in capture.take(0).records}
    assert rows[("0", "input")]["amax"] == float(x.abs().max()) and rows[("0", "input")]["numel"] == x.numel()
    assert rows[("1", "grad_output")]["amax"] == float(g.abs().max())
