"""`mpdiag watch`: an unmodified training script recorded as one run, checked against what the script itself
computes (clip_grad_norm_'s returned norm, GradScaler's own state, its accumulated loss), never against mpdiag."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import DEVICES, disk_fills_after
from conftest import ROOT as REPOSITORY

from mpdiag.analysis.findings import diagnose
from mpdiag.options import ConfigError
from mpdiag.store import Store
from mpdiag.training.watch import WatchConfig, optimized_parameters, watch

ROOT = os.fspath(REPOSITORY)
AMP_LOOP = os.path.join(ROOT, "tests", "fixtures", "scripts", "amp_loop.py")


def watched(store_path, target, *args, **options):
    run_id, code = watch(WatchConfig(target=str(target), args=tuple(map(str, args)), **options), store_path)
    return Store(store_path), run_id, code


def cli(*argv, cwd=None, **popen):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "mpdiag", *map(str, argv)], cwd=cwd or ROOT, env=env,
                          capture_output=True, text=True, timeout=300, **popen)


def test_amp_loop_norms_loss_and_scaler_trajectory_are_the_loops_own(store_path, tmp_path):
    log_path = tmp_path / "log.json"
    store, run_id, code = watched(store_path, AMP_LOOP, log_path, "--steps", 6, "--accumulate", 2)
    log = json.loads(log_path.read_text())
    assert code == 0
    run, steps = store.run(run_id), store.steps(run_id)
    assert (run["status"], run["scaling"], run["init_scale"]) == ("finished", "dynamic", 2.0**16)
    settings = run["config"]["watch"]  # what a rerun repeats: the command line and its directory
    assert settings["argv"] == [AMP_LOOP, str(log_path), "--steps", "6", "--accumulate", "2"]
    assert settings["cwd"] == os.getcwd()
    assert list(steps["step"]) == list(range(6))
    # the loss: the sum of the two micro-batch losses / 2 that backward was called on, unscaled
    assert steps["loss"].tolist() == pytest.approx(log["loss"], rel=1e-6)
    # the scaler's own trajectory, step by step, including the step it skipped (2)
    assert steps["loss_scale"].tolist() == log["scale"]
    assert steps["scale_after"].tolist() == log["scale_after"]
    assert steps["growth_tracker"].tolist() == log["tracker_after"]
    expected_skips = [int(after < before) for before, after in zip(log["scale"], log["scale_after"], strict=True)]
    assert expected_skips == [0, 0, 1, 0, 0, 0]
    assert steps["skipped"].tolist() == expected_skips
    # every step's gradients unscaled and before clipping: their global norm is what clip_grad_norm_ returned
    stats = store.tensor_stats(run_id)
    for step, norm in enumerate(log["grad_norm"]):
        rows = stats[stats["step"] == step]
        assert len(rows) == 6
        if math.isfinite(norm):
            assert math.sqrt((rows["l2"] ** 2).sum()) == pytest.approx(norm, rel=2e-6)
        else:
            assert (rows["nan"] + rows["posinf"] + rows["neginf"]).sum() > 0
    names = store.tensors(run_id)["name"].tolist()
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"]


@pytest.mark.parametrize("device", DEVICES)
def test_a_watched_run_names_the_device_and_gpu_it_trained_on(store_path, tmp_path, device):
    """The run row says where the script's parameters lived and, on a GPU, which one (it said gpu_name None
    for every watched run on an H200), with the scaler's own first scale."""
    store, run_id, code = watched(store_path, AMP_LOOP, tmp_path / "log.json", "--steps", 2, "--device", device)
    run = store.run(run_id)
    assert (code, run["status"], run["scaling"]) == (0, "finished", "dynamic")
    on_gpu = (f"cuda:{torch.cuda.current_device()}", torch.cuda.get_device_name()) if device == "cuda" else None
    assert (run["device"], run["gpu_name"]) == (on_gpu or ("cpu", None))
    assert store.steps(run_id)["loss_scale"].tolist()[0] == json.loads((tmp_path / "log.json").read_text())["scale"][0]


def test_fp32_loop_without_scaler_has_no_scaling_and_no_skips(store_path, tmp_path):
    log_path = tmp_path / "log.json"
    store, run_id, _ = watched(store_path, AMP_LOOP, log_path, "--steps", 4, "--dtype", "float32")
    log = json.loads(log_path.read_text())
    run, steps = store.run(run_id), store.steps(run_id)
    assert run["scaling"] == "none"
    assert steps["skipped"].tolist() == [0, 0, 0, 0]
    assert steps["loss_scale"].tolist() == [1.0] * 4
    assert steps["loss"].tolist() == pytest.approx(log["loss"], rel=1e-6)
    stats = store.tensor_stats(run_id)
    for step, norm in enumerate(log["grad_norm"]):
        assert math.sqrt((stats[stats["step"] == step]["l2"] ** 2).sum()) == pytest.approx(norm, rel=2e-6)


HALF_MODEL = '''
import json, sys
import torch

torch.manual_seed(0)
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[sys.argv[2]]
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(dtype)
opt = torch.optim.SGD(model.parameters(), lr=1e-4)  # updates far below BF16's and FP16's resolution at |w| ~ 0.1
own = {"updated": 0, "unchanged": 0}
for step in range(4):
    opt.zero_grad()
    loss = model(torch.randn(8, 16).to(dtype)).float().pow(2).mean()
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    for p, b in zip(model.parameters(), before):
        counted = p.grad.isfinite() & (p.grad != 0)
        own["updated"] += int(counted.sum())
        own["unchanged"] += int((counted & (p.detach() == b)).sum())
json.dump(own, open(sys.argv[1], "w"))
'''


@pytest.mark.parametrize("weights", ["bf16", "fp16", "fp32"])
def test_a_model_trained_in_half_precision_has_its_lost_updates_counted(store_path, write_script, tmp_path, weights):
    """A script that casts its model to BF16 or FP16 and steps it directly (no FP32 copy) loses the updates its
    format cannot hold; watch counted none of them (only mpdiag run's O3 and bf16-pure did). Truth: the script's
    own comparison of each weight before and after each step, over the values with a finite non-zero gradient."""
    log_path = tmp_path / "own.json"
    store, run_id, code = watched(store_path, write_script(HALF_MODEL, "half.py"), log_path, weights)
    assert code == 0
    own, run, updates = json.loads(log_path.read_text()), store.run(run_id), store.update_stats(run_id)
    if weights == "fp32":  # FP32 weights hold these updates: nothing is tracked
        assert run["update_format"] is None and updates.empty
        return
    assert run["update_format"] == weights and updates["step"].nunique() == 4
    assert (int(updates["updated"].sum()), int(updates["unchanged"].sum())) == (own["updated"], own["unchanged"])
    assert own["unchanged"] > 0.5 * own["updated"]  # planted: most updates lost
    found = {f.rule: f for f in diagnose(store, run_id)}["update-swamping"]
    assert f"{own['unchanged'] / own['updated']:.1%} of updates left the weight unchanged" in found.evidence
    assert found.fix is None and "torch.autocast" in found.recommendation  # no level to rerun a script's loop at


def test_a_half_model_too_large_to_copy_has_its_updates_left_uncounted_and_said(store_path, write_script, tmp_path,
                                                                                monkeypatch):
    """The count needs a copy of the weights: where it would take more than half the memory free (a half model that
    fills its GPU), watch takes none, counts nothing, and the run's note says why (the script must not run out of
    memory because watch looks at it)."""
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 1000})())
    store, run_id, code = watched(store_path, write_script(HALF_MODEL, "half.py"), tmp_path / "own.json", "bf16")
    run = store.run(run_id)
    assert code == 0 and run["update_format"] is None and store.update_stats(run_id).empty
    weights = (16 * 32 + 32 + 32 + 1) * 2  # the script's Linear(16, 32) and Linear(32, 1) in BF16
    assert f"a copy of the weights would take {weights / 2**30:.1f} GiB of the 0.0 GiB free" in run["note"]


def test_bf16_autocast_loop(store_path, tmp_path):
    log_path = tmp_path / "log.json"
    store, run_id, _ = watched(store_path, AMP_LOOP, log_path, "--steps", 3, "--dtype", "bfloat16")
    log = json.loads(log_path.read_text())
    steps, stats = store.steps(run_id), store.tensor_stats(run_id)
    assert store.run(run_id)["scaling"] == "none"
    assert steps["loss"].tolist() == pytest.approx(log["loss"], rel=1e-6)
    for step, norm in enumerate(log["grad_norm"]):
        assert math.sqrt((stats[stats["step"] == step]["l2"] ** 2).sum()) == pytest.approx(norm, rel=2e-6)


WRAPPED = '''
import torch
from torch import nn

class WrappedOptimizer:
    """Like Accelerate's AcceleratedOptimizer / Lightning's: not an Optimizer, it calls the real one's step."""
    def __init__(self, optimizer, scaler):
        self.optimizer, self.scaler = optimizer, scaler
    def step(self):
        self.scaler.step(self.optimizer)
        self.scaler.update()
    def zero_grad(self):
        self.optimizer.zero_grad()

torch.manual_seed(0)
model = nn.Linear(4, 2)
head = nn.Linear(2, 1)
head.weight = nn.Parameter(torch.ones(1, 2))
opt = WrappedOptimizer(torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1),
                       torch.amp.GradScaler("cpu", init_scale=8.0))
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = head(model(torch.randn(5, 4))).float().pow(2).mean()
    opt.scaler.scale(loss).backward()
    opt.step()
    opt.zero_grad()
'''


def test_wrapped_optimizer_and_two_modules(store_path, write_script):
    store, run_id, code = watched(store_path, write_script(WRAPPED, "wrapped.py"))
    assert code == 0
    steps = store.steps(run_id)
    assert len(steps) == 3 and steps["skipped"].tolist() == [0, 0, 0]
    assert steps["loss_scale"].tolist() == [8.0, 8.0, 8.0]
    assert store.tensors(run_id)["name"].tolist() == ["Linear0.weight", "Linear0.bias", "Linear1.weight", "Linear1.bias"]


COMPILED_STEP = '''
import json, sys
import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, enabled=sys.argv[2] == "scaled")
opt.step = torch.compile(opt.step, backend="eager")  # torch's "compiling the optimizer" recipe
own = {"loss": [], "grad_norm": []}
for step in range(3):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16, enabled=scaler.is_enabled()):
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    own["loss"].append(loss.item())
    own["grad_norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
    scaler.step(opt)
    scaler.update()
json.dump(own, open(sys.argv[1], "w"))
'''


@pytest.mark.parametrize("scaling", ["scaled", "fp32"])
def test_a_compiled_optimizer_step_is_recorded_as_the_loop_computes_it(store_path, write_script, tmp_path, scaling):
    """A compiled ``opt.step`` traces watch's step hooks (Dynamo failed inside the Recorder's optimizer-step check
    and the script died): each step is recorded, its loss and norm the loop's own."""
    out = tmp_path / "own.json"
    store, run_id, code = watched(store_path, write_script(COMPILED_STEP, "compiled_step.py"), out, scaling)
    assert code == 0 and store.run(run_id)["status"] == "finished"
    own, steps = json.loads(out.read_text()), store.steps(run_id)
    assert steps["loss"].tolist() == own["loss"]
    assert steps["grad_norm"].tolist() == own["grad_norm"]
    assert steps["skipped"].tolist() == [0, 0, 0]


UNFREEZING = '''
import json, sys
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
model[0].requires_grad_(False)
held = sys.argv[2] == "held"
opt = torch.optim.SGD(model.parameters() if held else model[2].parameters(), lr=0.1)
own = {"grad_norm": [], "tensors": []}
for step in range(5):
    if step == 2:  # gradual unfreezing
        model[0].requires_grad_(True)
        if not held:
            opt.add_param_group({"params": list(model[0].parameters())})
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 4))
    loss.backward()
    own["tensors"].append(sorted(n for n, p in model.named_parameters() if p.grad is not None))
    own["grad_norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
    opt.step()
json.dump(own, open(sys.argv[1], "w"))
'''


def test_a_layer_unfrozen_while_training_is_recorded_when_its_optimizer_held_it(store_path, write_script, tmp_path):
    """Gradual unfreezing under watch: a frozen layer the optimizer held from the start is recorded from its
    first gradient, the norm clip_grad_norm_'s own (it was left out, silently)."""
    out = tmp_path / "own.json"
    store, run_id, code = watched(store_path, write_script(UNFREEZING, "unfreezing.py"), out, "held")
    assert code == 0
    own, steps, stats = json.loads(out.read_text()), store.steps(run_id), store.tensor_stats(run_id)
    assert steps["grad_norm"].tolist() == own["grad_norm"]
    assert [sorted(stats[stats["step"] == step]["tensor"]) for step in range(5)] == own["tensors"]
    assert store.run(run_id)["note"] is None


def test_parameters_added_to_an_optimizer_after_recording_began_are_said_in_the_note(store_path, write_script,
                                                                                     tmp_path):
    """Watch records the parameters the optimizers held at the first step: a parameter group added later is not
    recorded, and the run's note says so (the norm left them out, silently)."""
    out = tmp_path / "own.json"
    store, run_id, code = watched(store_path, write_script(UNFREEZING, "unfreezing.py"), out, "added")
    assert code == 0
    assert store.run(run_id)["note"].startswith("2 parameter tensor(s) joined an optimizer after recording began "
                                                "(add_param_group or a new optimizer, first at step 2)")
    assert store.tensors(run_id)["name"].tolist() == ["2.weight", "2.bias"]


DROPPED_WINDOW = '''
import json, sys
import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
other = torch.nn.Linear(4, 2)  # a second model whose gradients the loop zeroes between backward and step
own = []
for step in range(3):
    opt.zero_grad()
    if step == 1:  # a window's backward whose gradients are then dropped without a step (an aborted window)
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.zero_grad()
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    other.zero_grad()  # leaves model's gradients, and this step's loss
    own.append(loss.item())
    opt.step()
json.dump(own, open(sys.argv[1], "w"))
'''


def test_a_loss_whose_gradients_were_dropped_without_a_step_is_no_steps_loss(store_path, write_script, tmp_path):
    """A backward whose gradients zero_grad drops before any step: its loss was added to the next step's (watch does
    not otherwise see that the gradients went). Each step's loss is the loop's own; zeroing another model's
    gradients between backward and step leaves it."""
    out = tmp_path / "own.json"
    store, run_id, code = watched(store_path, write_script(DROPPED_WINDOW, "dropped_window.py"), out)
    assert code == 0
    assert store.steps(run_id)["loss"].tolist() == json.loads(out.read_text())


def test_tied_weight_is_one_tensor_named_by_its_first_path():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.out = torch.nn.Linear(4, 10, bias=False)
            self.out.weight = self.embed.weight

    model = Tied()
    params = optimized_parameters([torch.optim.AdamW(model.parameters())])
    assert [n for n, _ in params.named_parameters()] == ["embed.weight"]


NO_OPTIMIZER = '''
import torch
w = torch.nn.Parameter(torch.ones(3))
for _ in range(3):
    (w * 2).sum().backward()
    with torch.no_grad():
        w -= 0.1 * w.grad
    w.grad = None
'''


def test_loop_without_optimizer_records_no_steps(store_path, write_script):
    store, run_id, code = watched(store_path, write_script(NO_OPTIMIZER, "by_hand.py"))
    run = store.run(run_id)
    assert (code, run["status"], run["steps_done"], run["scaling"]) == (0, "finished", 0, "none")
    assert "No optimizer step was observed" in run["note"] and "backward pass(es) ran" in run["note"]


FAILS_BEFORE_ITS_FIRST_STEP = '''
import torch
w = torch.nn.Parameter(torch.ones(3))
opt = torch.optim.SGD([w], lr=0.1)
(w * 2).sum().backward()
raise AttributeError("callback bug")
opt.step()
'''


def test_a_script_that_fails_before_its_first_step_is_not_said_to_train_without_an_optimizer(store_path, write_script):
    """A script whose backward ran but which raised before its optimizer's first step (a callback's bug): its error
    says why, and the note does not guess that it updates its weights by hand (it said so, under the traceback)."""
    store, run_id, code = watched(store_path, write_script(FAILS_BEFORE_ITS_FIRST_STEP, "crashes.py"))
    run = store.run(run_id)
    assert code != 0 and run["status"] == "failed" and "callback bug" in run["error"]
    assert run["note"] == "The script stopped before its first optimizer step: nothing was recorded."


def test_levels_override_the_scripts_settings(store_path, tmp_path):
    log = tmp_path / "log.json"
    store, o0, _ = watched(store_path, AMP_LOOP, log, "--steps", 3, opt_level="O0")
    assert store.run(o0)["scaling"] == "none" and store.run(o0)["opt_level"] == "O0"
    assert store.steps(o0)["skipped"].tolist() == [0, 0, 0]
    assert store.steps(o0)["loss_scale"].tolist() == [1.0] * 3
    assert store.tensors(o0)["grad_dtype"].tolist() == ["float32"] * 6
    _, o1, _ = watched(store_path, AMP_LOOP, log, "--steps", 3, "--dtype", "float32", opt_level="O1", init_scale=1024.0)
    assert store.run(o1)["scaling"] == "dynamic"
    assert not isinstance(store.run(o1)["note"], str)  # the loop autocasts: O1 set its regions to FP16
    assert store.steps(o1)["loss_scale"].tolist()[0] == 1024.0
    _, scaled, _ = watched(store_path, AMP_LOOP, log, "--steps", 3, init_scale=256.0)
    assert store.steps(scaled)["loss_scale"].tolist() == [256.0, 256.0, 256.0]
    assert store.steps(scaled)["scale_after"].tolist() == [256.0, 256.0, 128.0]  # step 2 overflows and backs off
    _, bf16, _ = watched(store_path, AMP_LOOP, log, "--steps", 3, opt_level="bf16")
    assert store.run(bf16)["scaling"] == "none" and store.steps(bf16)["skipped"].tolist() == [0, 0, 0]


def test_patches_are_restored_after_a_watch(store_path, write_script):
    originals = (torch.autograd.backward, torch.amp.GradScaler.step, torch.amp.GradScaler.__init__,
                 torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_value_,
                 torch.amp.autocast_mode.autocast.__init__, torch.optim.Optimizer.__init__)
    watched(store_path, write_script("raise ValueError('x')\n", "boom.py"), opt_level="O1")
    assert originals == (torch.autograd.backward, torch.amp.GradScaler.step, torch.amp.GradScaler.__init__,
                         torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_value_,
                         torch.amp.autocast_mode.autocast.__init__, torch.optim.Optimizer.__init__)


@pytest.mark.parametrize("level", ["O2", "O3", "bf16-pure"])
def test_weight_casting_levels_are_refused_before_anything_runs(store_path, level):
    with pytest.raises(ConfigError, match=f"{level} is refused"):
        watch(WatchConfig(target=AMP_LOOP, args=("x",), opt_level=level), store_path)
    assert not store_path.exists() or Store(store_path).runs().empty


def test_cli_exit_codes_and_statuses(tmp_path):
    db, log = tmp_path / "runs.db", tmp_path / "log.json"
    refused = cli("watch", "--store", db, "--opt-level", "O2", AMP_LOOP, log)
    assert refused.returncode == 2 and "O2 is refused" in refused.stderr and not log.exists()
    raised = cli("watch", "--store", db, AMP_LOOP, log, "--fail-at", 2)
    assert raised.returncode == 1 and "the loop broke at step 2" in raised.stderr
    exited = cli("watch", "--store", db, AMP_LOOP, log, "--exit-at", 3)
    assert exited.returncode == 3
    fine = cli("watch", "--store", db, "--name", "fine", AMP_LOOP, log, "--steps", 2)
    assert fine.returncode == 0 and "done 2 steps" in fine.stdout  # the script's output passes through
    runs = Store(db).runs().set_index("name")
    assert len(runs) == 3  # the refused level stored nothing
    failed = runs.loc["amp_loop.py"].sort_values("run_id")
    assert failed["status"].tolist() == ["failed", "failed"]
    assert "RuntimeError: the loop broke at step 2" in failed["error"].iloc[0]
    assert failed["error"].iloc[1] == "the script called sys.exit(3)"
    assert failed["steps_done"].tolist() == [2, 3]  # the steps before the failure are kept
    assert runs.loc["fine", "status"] == "finished"


def test_module_mode_runs_as_python_dash_m(tmp_path):
    pkg = tmp_path / "trainpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        "import sys, torch\nassert __name__ == '__main__'\nm = torch.nn.Linear(2, 1)\n"
        "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(int(sys.argv[1])):\n    m(torch.ones(1, 2)).sum().backward(); o.step(); o.zero_grad()\n")
    done = cli("watch", "--store", tmp_path / "runs.db", "-m", "trainpkg.train", "4", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert Store(tmp_path / "runs.db").runs()["steps_done"].tolist() == [4]


OS_EXIT = '''
import json, multiprocessing, os, sys, torch
def child():  # a forked process: multiprocessing ends it by os._exit, which must not end the run
    pass
m = torch.nn.Linear(4, 1)
o = torch.optim.SGD(m.parameters(), lr=0.1)
losses = []
for step in range(int(sys.argv[2])):
    if step == 1:
        worker = multiprocessing.get_context("fork").Process(target=child)
        worker.start()
        worker.join()
    loss = m(torch.full((2, 4), float(step))).pow(2).mean()
    losses.append(loss.item())
    loss.backward(); o.step(); o.zero_grad()
json.dump(losses, open(sys.argv[1], "w"))
os._exit(int(sys.argv[3]))
'''


@pytest.mark.parametrize("code", [0, 3])
def test_a_script_ending_by_os_exit_ends_its_run_with_every_step(tmp_path, code):
    """``os._exit`` (torchrun scripts' way around finalization hangs) ends the process without unwinding: the run
    was left open, read crashed, and its last rows were never committed (a DDP job kept none of its 40 steps). The
    run ends as a return or ``sys.exit(code)`` would, with every step the script took; the forked child's own
    ``os._exit`` does not end it."""
    script, losses, db = tmp_path / "exits.py", tmp_path / "losses.json", tmp_path / "runs.db"
    script.write_text(OS_EXIT)
    done = cli("watch", "--store", db, script, losses, 6, code)
    assert done.returncode == code, done.stderr
    run = Store(db).runs().iloc[0]
    assert (run["status"], run["error"]) == (("finished", None) if code == 0 else
                                             ("failed", "the script called os._exit(3)"))
    assert Store(db).steps(run["run_id"])["loss"].tolist() == json.loads(losses.read_text())


SLOW = '''
import time, torch
m = torch.nn.Linear(2, 1)
o = torch.optim.SGD(m.parameters(), lr=0.1)
for step in range(100000):
    m(torch.ones(1, 2)).sum().backward(); o.step(); o.zero_grad()
    if step == 2:
        print("ready", flush=True)
    time.sleep(0.05)
'''


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_script_leaves_the_run_stopped_and_a_killed_one_crashed(tmp_path, sig):
    """SIGTERM (the dashboard's Stop) asks the script to end: its run is stopped, the signal named, its steps kept;
    SIGKILL leaves no time to say anything: the run reads crashed once the process is gone."""
    script = tmp_path / "slow.py"
    script.write_text(SLOW)
    db = tmp_path / "runs.db"
    proc = subprocess.Popen([sys.executable, "-m", "mpdiag", "watch", "--store", str(db), str(script)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(sig)
    code = proc.wait(timeout=120)
    assert code == (143 if sig == signal.SIGTERM else -signal.SIGKILL)
    ended = "stopped" if sig == signal.SIGTERM else "crashed"
    for _ in range(100):  # a SIGKILLed process's run reads as crashed once the process is gone
        run = Store(db).runs().iloc[0]
        if run["status"] == ended:
            break
        time.sleep(0.1)
    assert run["status"] == ended
    if sig == signal.SIGTERM:
        assert run["error"] == "stopped by signal SIGTERM" and run["steps_done"] >= 3


def test_diagnose_of_a_watched_run_offers_its_rerun_and_probes_nothing(store_path, tmp_path, capsys):
    from mpdiag.cli import main

    _, run_id, _ = watched(store_path, AMP_LOOP, tmp_path / "log.json", "--steps", 6, init_scale=2.0**40)
    capsys.readouterr()
    assert main(["diagnose", str(run_id), "--store", str(store_path)]) == 0
    out = capsys.readouterr()
    assert "probing" not in out.err
    assert "[error]" in out.out or "[warning]" in out.out  # every step skipped: a scale finding is made
    assert f"python -m mpdiag rerun {run_id} " in out.out and "(repeats the watched command)" in out.out
    # and the change to make in the script itself (--opt-level bf16 is mpdiag's word for it, not the script's)
    assert f"rerun {run_id} --opt-level bf16" in out.out, out.out
    assert "in the script itself: compute in BF16 with no loss scaling: torch.autocast(device_type, " \
           'dtype=torch.bfloat16) and no GradScaler (Lightning: Trainer(precision="bf16-mixed")' in out.out
    from mpdiag import Store
    from mpdiag.dashboard import findings_model
    from mpdiag.options import fix_in_code

    runs = Store(store_path).runs()  # the Findings page's card says it under its rerun button
    cards = findings_model.findings(Store(store_path), runs[runs["run_id"] == run_id].iloc[0], True, runs).cards
    assert [c.in_code for c in cards if c.finding.fix] == [fix_in_code(c.finding.fix) for c in cards if c.finding.fix]
    assert any(c.in_code and "torch.bfloat16" in c.in_code for c in cards)


def test_rerun_of_a_watched_run_repeats_its_command_with_the_fix(store_path, tmp_path, monkeypatch):
    log = tmp_path / "log.json"
    store, parent, _ = watched(store_path, AMP_LOOP, log, "--steps", 4, init_scale=2.0**40)
    assert store.steps(parent)["skipped"].tolist() == [1, 1, 1, 1]
    monkeypatch.chdir(tmp_path)  # from anywhere: the rerun runs in the directory the command was watched from
    done = cli("rerun", parent, "--init-scale", 1024, "--store", store_path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    child = store.runs().iloc[0]  # newest first
    assert (int(child["parent_run_id"]), child["init_scale"], child["status"]) == (parent, 1024.0, "finished")
    assert child["config"]["watch"]["argv"] == [AMP_LOOP, str(log), "--steps", "4"]
    assert store.steps(int(child["run_id"]))["skipped"].tolist() == [0, 0, 1, 0]  # fixed; step 2 is the loop's planted overflow
    assert json.loads(log.read_text())["scale"][0] == 1024.0  # the script itself ran again, at the new scale
    refused = cli("rerun", parent, "--steps", 9, "--store", store_path)
    assert refused.returncode == 2 and "can change only --opt-level" in refused.stderr and "--steps" in refused.stderr


def test_rerun_of_a_watched_run_whose_script_is_gone_says_so(store_path, tmp_path, write_script):
    script = write_script("import torch\n", "gone.py")
    _, parent, _ = watched(store_path, script)
    os.remove(script)
    done = cli("rerun", parent, "--opt-level", "bf16", "--store", store_path)
    assert done.returncode == 2 and "that file is no longer there" in done.stderr, done.stderr
    assert len(Store(store_path).runs()) == 1  # nothing stored


SHADOW_LOOP = os.path.join(ROOT, "tests", "fixtures", "scripts", "shadow_loop.py")


@pytest.mark.parametrize(("where", "decorator"), [("inside", False), ("outside", False), ("inside", True)])
def test_shadow_every_stores_the_loops_own_fp32_comparison(store_path, tmp_path, where, decorator):
    """Every stored relative error and cosine equals the one the loop computes against its own FP32 copy (same
    weights, batch and dropout draws; two micro-batches summed). Step 0 runs before watch knows the model."""
    out = tmp_path / "own.json"
    store, run_id, code = watched(store_path, SHADOW_LOOP, out, "--steps", 4, "--loss", where,
                                  *(["--autocast-decorator"] if decorator else []), shadow_every=1)
    assert code == 0
    own, stored = json.loads(out.read_text()), store.shadow_stats(run_id)
    assert sorted(set(stored["step"])) == [1, 2, 3]
    for step in (1, 2, 3):
        rows = stored[stored["step"] == step].set_index("tensor")
        for i, name in enumerate(own["names"]):
            assert rows.loc[name, "rel_error"] == pytest.approx(own["rel_error"][step][i], rel=1e-9)
            assert rows.loc[name, "cosine"] == pytest.approx(own["cosine"][step][i], rel=1e-9)
    assert any(e > 0 for e in own["rel_error"][1])  # FP16 made a difference the comparison can see
    note = store.run(run_id)["note"] or ""
    assert ("loss head" in note) == (where == "outside")
    assert store.run(run_id)["config"]["watch"]["shadow_every"] == 1


def test_shadow_every_n_compares_only_every_nth_step(store_path, tmp_path):
    store, run_id, _ = watched(store_path, SHADOW_LOOP, tmp_path / "own.json", "--steps", 5, shadow_every=2)
    assert sorted(set(store.shadow_stats(run_id)["step"])) == [2, 4]


def test_shadow_of_a_loop_whose_model_is_never_called_says_so(store_path, write_script):
    path = write_script("""
        import torch
        layer = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            (torch.randn(2, 3) @ layer.weight.t()).sum().backward()  # the module's forward is never called
            optimizer.step()
    """, name="functional.py")
    store, run_id, code = watched(store_path, path, shadow_every=1)
    assert code == 0 and store.shadow_stats(run_id).empty
    assert "No step was compared with FP32" in store.run(run_id)["note"]


def test_a_full_disk_never_ends_the_watched_script(store_path, tmp_path, monkeypatch, capsys):
    """The script runs to its own end and exit code; watch says once that it stopped recording."""

    disk_fills_after(monkeypatch, batches=0)
    log_path = tmp_path / "log.json"
    store, run_id, code = watched(store_path, AMP_LOOP, log_path, "--steps", 6)
    assert code == 0 and len(json.loads(log_path.read_text())["loss"]) == 6
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mpdiag:")]
    assert len(said) == 1 and "database or disk is full" in said[0]
    assert store.run(run_id)["status"] == "failed"


SEVERAL_BACKWARDS = '''
import json, sys
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
own = {"loss": [], "grad_norm": [], "skipped": []}
for step in range(4):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(torch.randn(8, 8)).float()
        l1 = torch.nn.functional.mse_loss(out, torch.randn(8, 2))
        l2 = out.pow(2).mean() * (1e30 if step == 2 else 0.1)  # overflows FP16 at step 2: skipped
    if sys.argv[2] == "list":
        torch.autograd.backward([scaler.scale(l1), scaler.scale(l2)])
    else:
        scaler.scale(l1).backward(retain_graph=True)
        scaler.scale(l2).backward()
    scaler.unscale_(opt)
    own["loss"].append(l1.item() + l2.item())
    own["grad_norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
    scaler.step(opt)
    own["skipped"].append(int(sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0))
    scaler.update()
json.dump(own, open(sys.argv[1], "w"))
'''


@pytest.mark.parametrize("how", ["list", "calls"])
def test_several_losses_back_propagated_in_one_step_are_its_loss(store_path, write_script, tmp_path, how):
    """Two losses back-propagated in one step, by one ``torch.autograd.backward([l1, l2])`` (the step's loss was
    NaN, and a false non-finite event followed) or one ``backward`` each: the loss is their sum, unscaled, the
    norm ``clip_grad_norm_``'s, and the step GradScaler skipped is stored skipped, with no event."""
    out = tmp_path / "own.json"
    store, run_id, code = watched(store_path, write_script(SEVERAL_BACKWARDS, "several.py"), out, how)
    assert code == 0
    own, steps = json.loads(out.read_text()), store.steps(run_id)
    assert own["skipped"] == [0, 0, 1, 0] and steps["skipped"].tolist() == own["skipped"]
    assert steps["loss"].tolist() == own["loss"]
    stored = steps["grad_norm"].tolist()
    assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(stored, own["grad_norm"], strict=True))
    assert store.events(run_id).empty
