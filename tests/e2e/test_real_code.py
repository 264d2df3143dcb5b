"""Real public training code, unmodified, through `mpdiag watch`, copied byte for byte with their licences:
nanoGPT's train.py (tests/fixtures/real_code/nanogpt/, karpathy/nanoGPT at 3adf61e, MIT) and PyTorch's
word_language_model example (tests/fixtures/real_code/word_language_model/, pytorch/examples at 77f55b9, BSD-3); and
Hugging Face's Trainer (with Accelerate, from requirements-dev) driving a user's script, tests/fixtures/scripts/hf_trainer.py.

Each runs on the CPU with a tiny config given on its own command line and synthetic data. Ground truth is the script's own: the norm its ``clip_grad_norm_`` call returned
(seen through a wrapper installed before watch patches anything), its parameter list, its iteration count.
"""

import json
import math
import os
import pickle
import shutil
import sys

import numpy as np
import pytest
import torch
from conftest import FIXTURES

from mpdiag.store import Store
from mpdiag.training.watch import WatchConfig, watch

pytestmark = pytest.mark.slow

REAL_CODE = os.fspath(FIXTURES / "real_code")
NANOGPT = os.path.join(REAL_CODE, "nanogpt")
WORD_LANGUAGE_MODEL = os.path.join(REAL_CODE, "word_language_model")
MAX_ITERS = 5  # nanoGPT stops after iteration max_iters, so it steps max_iters + 1 times
TINY = ["--dataset=synthetic", "--device=cpu", "--compile=False", "--n_layer=2", "--n_head=2", "--n_embd=32",
        "--block_size=32", "--batch_size=4", f"--max_iters={MAX_ITERS}", "--lr_decay_iters=5",
        "--warmup_iters=2", "--eval_interval=1000", "--eval_iters=1", "--log_interval=1",
        "--gradient_accumulation_steps=2", "--dropout=0.0", "--dtype=float32", "--grad_clip=0.1"]


WLM_TINY = ("--data", "corpus", "--epochs", "1", "--emsize", "8", "--nhid", "8", "--nlayers", "1", "--bptt", "5",
            "--batch_size", "4", "--lr", "0.01", "--clip", "0.1", "--dropout", "0", "--save", "model.pt")


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
    forget_modules(monkeypatch, "model")
    return tmp_path


def forget_modules(monkeypatch, *names):
    """Both projects import their own top-level ``model`` (and ``data``): in one test process, each must import
    its own, as it would in the fresh process ``python SCRIPT`` gives it."""
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)


@pytest.fixture
def word_language_model_dir(tmp_path, monkeypatch):
    """A copy of the example with a small synthetic corpus (train/valid/test.txt) as the working directory."""
    for name in ("main.py", "model.py", "data.py"):
        shutil.copy(os.path.join(WORD_LANGUAGE_MODEL, name), tmp_path / name)
    corpus, rng = tmp_path / "corpus", np.random.default_rng(0)
    corpus.mkdir()
    for split, lines in (("train", 60), ("valid", 10), ("test", 10)):
        words = rng.integers(0, 30, size=(lines, 8))
        (corpus / f"{split}.txt").write_text("".join(" ".join(f"w{w}" for w in line) + "\n" for line in words))
    monkeypatch.chdir(tmp_path)
    forget_modules(monkeypatch, "model", "data")
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


def test_nanogpt_at_o1_on_the_cpu_says_its_forward_pass_stayed_fp32(store_path, nanogpt_dir):
    # nanoGPT autocasts only on CUDA (nullcontext on the CPU): O1 can switch its GradScaler on, not its dtype
    args = tuple(a for a in TINY if not a.startswith("--max_iters")) + ("--max_iters=1",)
    run_id, code = watch(WatchConfig(target=str(nanogpt_dir / "train.py"), args=args, opt_level="O1"), store_path)
    run = Store(store_path).run(run_id)
    assert (code, run["status"], run["scaling"]) == (0, "finished", "dynamic")
    assert "entered no autocast region" in run["note"] and "computed in FP32, not FP16" in run["note"]


def test_nanogpt_fp32_shadow_replays_its_forward_which_returns_the_loss(store_path, nanogpt_dir):
    """nanoGPT computes its loss inside GPT.forward and accumulates 2 micro-batches; on the CPU its forward is
    FP32 (nullcontext), with a GradScaler at O1. Replaying both calls in FP32 must give back its own gradients:
    any misstep (a micro-batch lost, the scale not divided out, the loss counted twice through the logits)
    would show as an error of order 1, not of FP32 rounding."""
    run_id, code = watch(WatchConfig(target=str(nanogpt_dir / "train.py"), args=tuple(TINY), opt_level="O1",
                                     shadow_every=2), store_path)
    store = Store(store_path)
    run, shadow = store.run(run_id), store.shadow_stats(run_id)
    assert (code, run["status"], run["scaling"]) == (0, "finished", "dynamic")
    assert sorted(set(shadow["step"])) == [2, 4]
    assert set(shadow["tensor"]) == set(store.tensors(run_id)["name"])
    assert (shadow["rel_error"] < 1e-5).all() and (shadow["cosine"] > 1 - 1e-9).all(), shadow
    assert "loss head" not in (run["note"] or "")


def test_word_language_model_with_its_optimizer(store_path, word_language_model_dir, clip_norms):
    args = (*WLM_TINY, "--use-optimizer")
    run_id, code = watch(WatchConfig(target=str(word_language_model_dir / "main.py"), args=args), store_path)
    assert code == 0
    store = Store(store_path)
    assert not isinstance(store.run(run_id)["note"], str)
    steps, tensors, stats = store.steps(run_id), store.tensors(run_id), store.tensor_stats(run_id)
    assert store.run(run_id)["status"] == "finished"
    assert len(steps) == len(clip_norms) > 10  # one step per batch (AdamW.step), training batches only
    assert set(tensors["name"]) == {"encoder.weight", "rnn.weight_ih_l0", "rnn.weight_hh_l0", "rnn.bias_ih_l0",
                                    "rnn.bias_hh_l0", "decoder.weight", "decoder.bias"}
    assert min(clip_norms) > 0.1  # --clip 0.1 really clips every step
    for step, norm in enumerate(clip_norms):
        rows = stats[stats["step"] == step]
        assert math.sqrt((rows["l2"] ** 2).sum()) == pytest.approx(norm, rel=2e-6), step


def test_word_language_model_updating_by_hand_is_explained(store_path, word_language_model_dir):
    # without --use-optimizer it updates with p.data.add_: there is no optimizer step for watch to see
    run_id, code = watch(WatchConfig(target=str(word_language_model_dir / "main.py"), args=WLM_TINY), store_path)
    run = Store(store_path).run(run_id)
    assert (code, run["status"], run["steps_done"]) == (0, "finished", 0)
    assert "No optimizer step was observed" in run["note"] and "p.data.add_" in run["note"]


@pytest.mark.parametrize(("bf16", "shadow_every"), [(False, 0), (True, 0), (True, 1)],
                         ids=["fp32", "bf16", "bf16-shadow"])
def test_hugging_face_trainer_unmodified(store_path, tmp_path, bf16, shadow_every):
    """With the FP32 shadow on, the Trainer's own logs must be unchanged (the shadow wraps the model's outputs,
    a ModelOutput the Trainer reads by attribute, in identity views) and the loss, computed inside GPT-2's
    forward from its labels, makes the replay the whole step."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    script = os.path.join(os.path.dirname(REAL_CODE), "scripts", "hf_trainer.py")
    args = (str(tmp_path), *(["--bf16"] if bf16 else []))
    run_id, code = watch(WatchConfig(target=script, args=args, shadow_every=shadow_every), store_path)
    assert code == 0
    store = Store(store_path)
    run, steps, tensors, stats = (store.run(run_id), store.steps(run_id), store.tensors(run_id),
                                  store.tensor_stats(run_id))
    log = [entry for entry in json.loads((tmp_path / "log_history.json").read_text()) if "grad_norm" in entry]
    assert (run["status"], run["scaling"]) == ("finished", "none")
    assert len(steps) == len(log) == 4 and (steps["skipped"] == 0).all()
    assert len(tensors) == 16  # GPT-2's tied token embedding / LM head once
    # the Trainer's own logs: the loss it reports (mean over its 2 accumulated micro-batches) and the norm that
    # Accelerate's clip_grad_norm_ returned (max_grad_norm 0.05, so clipping changed every step's gradients)
    assert steps["loss"].tolist() == pytest.approx([entry["loss"] for entry in log], rel=1e-6)
    for step, entry in enumerate(log):
        assert entry["grad_norm"] > 0.05
        rows = stats[stats["step"] == step]
        assert math.sqrt((rows["l2"] ** 2).sum()) == pytest.approx(entry["grad_norm"], rel=2e-6), step
    # the per-step columns against the Trainer's own log: the norm its clip returned that step (before clipping)
    # and the learning rate that step used (this transformers logs the rate from before its scheduler.step())
    assert steps["grad_norm"].tolist() == pytest.approx([entry["grad_norm"] for entry in log], rel=2e-6)
    assert steps["lr"].tolist() == [entry["learning_rate"] for entry in log] == [1e-3, 7.5e-4, 5e-4, 2.5e-4]
    if shadow_every:
        shadow = store.shadow_stats(run_id)
        assert sorted(set(shadow["step"])) == [1, 2, 3] and "loss head" not in (run["note"] or "")
        assert (shadow["cosine"] > 0.99).all() and (shadow["rel_error"] > 0).any()  # BF16 differs from FP32
