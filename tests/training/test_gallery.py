"""Gallery scripts reproduce their documented failure at FAILING and not at FIXED (their module constants),
judged by the evidence recorded in the store, as each docstring says a user would see it."""

import importlib
import math

import pytest
from conftest import EXAMPLES, GALLERY_STEPS

from mpdiag import Store
from mpdiag.analysis.summaries import nonzero_finite


@pytest.fixture(scope="module")
def runs(gallery_runs):
    """name -> (failing run id, fixed run id) in one store (the session's gallery runs, GALLERY_STEPS steps)."""
    store, ids = gallery_runs
    return Store(store), ids


def evidence(store, run_id):
    steps, stats = store.steps(run_id), store.tensor_stats(run_id)
    return steps, stats, store.run(run_id)


def share(stats, column, denominator="nonzero"):
    denom = nonzero_finite(stats).sum() if denominator == "nonzero" else stats["numel"].sum()
    return stats[column].sum() / denom


def test_every_gallery_script_documents_its_settings():
    paths = sorted(EXAMPLES.glob("gallery_*.py"))
    assert len(paths) == 6
    for path in paths:
        module = importlib.import_module(f"mpdiag.examples.{path.stem}")
        assert "Failing:" in module.__doc__ and "Fixed:" in module.__doc__ and "What you should see" in module.__doc__
        assert module.FAILING != module.FIXED


def test_underflow_gradients_vanish_without_scaling_and_survive_with_it(runs):
    store, ids = runs
    (_, fail, _), (_, fix, _) = (evidence(store, i) for i in ids["gallery_underflow"])
    assert share(fail, "zeros", "all") > share(fix, "zeros", "all") + 0.1  # vanished to exact zeros
    assert share(fix, "fp16_underflow") > 0.1  # the true gradients would underflow unscaled...
    assert share(fix, "fp16_underflow_at_scale") < 0.005  # ...but not at the loss scale


def test_activation_overflow_collapses_the_scale_and_bf16_fixes_it(runs):
    store, ids = runs
    (fail, _, _), (fix, _, _) = (evidence(store, i) for i in ids["gallery_activation_overflow"])
    assert (fail["skipped"] == 1).all() and not fail["loss"].map(math.isfinite).any()
    assert fail["scale_after"].iloc[-1] == 2.0**16 * 0.5**GALLERY_STEPS  # halved at every step
    assert (fix["skipped"] == 0).all() and fix["loss"].map(math.isfinite).all()
    assert fix["loss"].iloc[-1] < fix["loss"].iloc[0]


def test_ignored_grad_output_makes_gradients_scale_times_too_small(runs):
    store, ids = runs
    (fail, fail_stats, _), (fix, fix_stats, _) = (evidence(store, i) for i in ids["gallery_ignored_grad_output"])
    scale = fail["loss_scale"].iloc[0]
    first = lambda stats: stats[(stats["step"] == 0) & (stats["tensor"] == "0.weight")]["l2"].iloc[0]  # noqa: E731
    ratio = first(fail_stats) / first(fix_stats)  # same weights and batch at step 0
    assert ratio == pytest.approx(1 / scale, rel=0.05)
    assert fix["loss"].iloc[-1] < fail["loss"].iloc[-1] * 0.8  # the failing run barely learns


def test_bf16_range_weights_overflow_fp16_but_not_bf16(runs):
    store, ids = runs
    (fail, _, _), (fix, _, _) = (evidence(store, i) for i in ids["gallery_bf16_range_weights"])
    assert not math.isfinite(fail["loss"].iloc[0]) and (fail["skipped"] == 1).all()
    assert fix["loss"].map(math.isfinite).all() and (fix["skipped"] == 0).all()
    assert fix["loss"].iloc[-1] < fix["loss"].iloc[0]


def test_frozen_batchnorm_statistics_break_in_pure_fp16_only(runs):
    store, ids = runs
    (fail, fail_stats, _), (fix, fix_stats, _) = (evidence(store, i) for i in ids["gallery_frozen_batchnorm_fp16"])
    conv_fail = fail_stats[fail_stats["tensor"] == "conv.weight"]
    assert (conv_fail["zeros"] == conv_fail["numel"]).all()  # the network sees nothing
    assert abs(fail["loss"].iloc[-1] - math.log(10)) < 0.05
    conv_fix = fix_stats[fix_stats["tensor"] == "conv.weight"]
    assert share(conv_fix, "zeros", "all") < 0.05 and fix["loss"].iloc[-1] < 1.5


def test_swamped_updates_are_lost_in_pure_fp16_and_kept_by_masters(runs):
    store, ids = runs
    fail_id, fix_id = ids["gallery_swamped_updates"]
    lost = {i: store.update_stats(i)[["updated", "below_resolution", "unchanged"]].sum() for i in (fail_id, fix_id)}
    assert lost[fail_id]["unchanged"] > 0.5 * lost[fail_id]["updated"]  # most updates rounded away at O3
    assert lost[fix_id]["below_resolution"] > 0.5 * lost[fix_id]["updated"]  # the same updates at O2...
    assert lost[fix_id]["unchanged"] < 0.01 * lost[fix_id]["updated"]  # ...kept by the FP32 masters
