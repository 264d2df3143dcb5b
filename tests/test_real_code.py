"""Real public training code, unmodified, through `mpdiag watch`: nanoGPT's train.py (tests/real_code/nanogpt/,
copied byte for byte from karpathy/nanoGPT at 3adf61e, MIT licence alongside).

It runs on the CPU with a tiny config given on its own command line and a synthetic token file, as its
README's CPU example does. Ground truth is the script's own: the norm its ``clip_grad_norm_`` call returned
(seen through a wrapper installed before watch patches anything), its parameter list, its iteration count.
"""

import math
import os
import pickle
import shutil

import numpy as np
import pytest
import torch

from mpdiag.store import Store
from mpdiag.training.watch import WatchConfig, watch

pytestmark = pytest.mark.slow

NANOGPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "real_code", "nanogpt")
MAX_ITERS = 5  # nanoGPT stops after iteration max_iters, so it steps max_iters + 1 times
TINY = ["--dataset=synthetic", "--device=cpu", "--compile=False", "--n_layer=2", "--n_head=2", "--n_embd=32",
        "--block_size=32", "--batch_size=4", f"--max_iters={MAX_ITERS}", "--lr_decay_iters=5",
        "--warmup_iters=2", "--eval_interval=1000", "--eval_iters=1", "--log_interval=1",
        "--gradient_accumulation_steps=2", "--dropout=0.0", "--dtype=float32", "--grad_clip=0.1"]


@pytest.fixture
def nanogpt_dir(tmp_path, monkeypatch):
    """A copy of nanoGPT with a synthetic dataset, as the working directory (train.py reads configurator.py and
    data/ relative to it)."""
    for name in ("train.py", "model.py", "configurator.py"):
        shutil.copy(os.path.join(NANOGPT, name), tmp_path / name)
    data = tmp_path / "data" / "synthetic"
    data.mkdir(parents=True)
    tokens = np.random.default_rng(0).integers(0, 64, size=8192, dtype=np.uint16)
    tokens.tofile(data / "train.bin")
    tokens[::-1].copy().tofile(data / "val.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 64}, f)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def clip_norms(monkeypatch):
    """The norms nanoGPT's own clip_grad_norm_ calls return, step by step."""
    norms, original = [], torch.nn.utils.clip_grad_norm_

    def recording(*args, **kwargs):
        norm = original(*args, **kwargs)
        norms.append(float(norm))
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording)
    return norms


def test_nanogpt_train_py_unmodified(store_path, nanogpt_dir, clip_norms):
    run_id, code = watch(WatchConfig(target=str(nanogpt_dir / "train.py"), args=tuple(TINY)), store_path)
    assert code == 0
    store = Store(store_path)
    run, steps, tensors, stats = (store.run(run_id), store.steps(run_id), store.tensors(run_id),
                                  store.tensor_stats(run_id))
    assert run["status"] == "finished"
    assert len(steps) == MAX_ITERS + 1 == len(clip_norms)
    assert steps["loss"].notna().all() and (steps["skipped"] == 0).all()
    # one tensor per distinct parameter: the tied token embedding / LM head once, no biases (bias=False)
    assert len(tensors) == 2 + 6 * 2 + 1
    assert "transformer.wte.weight" in set(tensors["name"]) and "lm_head.weight" not in set(tensors["name"])
    # the gradients as clip_grad_norm_ saw them: their global norm is the one it returned
    assert min(clip_norms) > 0.1  # grad_clip=0.1 really clips: gradients read after it would differ
    for step, norm in enumerate(clip_norms):
        rows = stats[stats["step"] == step]
        assert math.sqrt((rows["l2"] ** 2).sum()) == pytest.approx(norm, rel=2e-6), step
