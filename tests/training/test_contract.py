"""Model-script contract: every violation fails with a message naming the file and the problem."""

import pytest

from mpdiag import Store
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript, ScriptError

GOOD_TAIL = """
import torch
def _model():
    return torch.nn.Linear(3, 1)
"""

CASES = {
    "no_build": ("import torch\nx = 1\n", "defines no function build"),
    "returns_list": ("def build(device):\n    return [1, 2]\n", "returned list; it must return a dict"),
    "missing_keys": (
        GOOD_TAIL + "def build(device):\n    return {'model': _model()}\n",
        "without 'optimizer', 'batches', 'loss_fn'",
    ),
    "model_not_module": (
        GOOD_TAIL + "def build(device):\n    return {'model': 3, 'optimizer': None, 'batches': [], 'loss_fn': None}\n",
        "'model' is a int",
    ),
    "optimizer_wrong": (
        GOOD_TAIL + "def build(device):\n    return {'model': _model(), 'optimizer': 'adam', 'batches': [], 'loss_fn': len}\n",
        "'optimizer' is a str",
    ),
    "batches_wrong": (
        GOOD_TAIL + "def build(device):\n    return {'model': _model(), 'optimizer': lambda p: torch.optim.SGD(p, lr=0.1), 'batches': 5, 'loss_fn': len}\n",
        "'batches' is a int",
    ),
    "vector_loss": (
        GOOD_TAIL
        + "def build(device):\n    return {'model': _model(), 'optimizer': lambda p: torch.optim.SGD(p, lr=0.1),\n"
        "            'batches': lambda s: torch.ones(4, 3), 'loss_fn': lambda m, b: m(b).squeeze(1)}\n",
        "loss_fn returned a tensor of shape [4]; it must return a scalar",
    ),
    "float_loss": (
        GOOD_TAIL
        + "def build(device):\n    return {'model': _model(), 'optimizer': lambda p: torch.optim.SGD(p, lr=0.1),\n"
        "            'batches': lambda s: torch.ones(4, 3), 'loss_fn': lambda m, b: 1.0}\n",
        "loss_fn returned float",
    ),
    "factory_returns_junk": (
        GOOD_TAIL
        + "def build(device):\n    return {'model': _model(), 'optimizer': lambda p: 'sgd',\n"
        "            'batches': lambda s: torch.ones(4, 3), 'loss_fn': lambda m, b: m(b).mean()}\n",
        "the 'optimizer' callable returned str",
    ),
    "syntax_error": ("def build(device)\n    return {}\n", "line 1: syntax error"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_contract_violation_is_named(case, write_script, store_path):
    source, expected = CASES[case]
    path = write_script(source, name=f"{case}.py")
    run_id = train(ModelScript.from_path(path), RunConfig(steps=2, device="cpu"), store_path)
    run = Store(store_path).run(run_id)
    assert run["status"] == "failed"
    assert str(path) in run["error"] and expected in run["error"], run["error"]


def test_exception_in_script_shows_its_own_lines(write_script, store_path):
    path = write_script(
        """
        import torch

        def helper(step):
            if step == 3:
                raise ValueError("bad batch at step 3")
            return torch.ones(2, 3)

        def build(device):
            return {"model": torch.nn.Linear(3, 1), "optimizer": lambda p: torch.optim.SGD(p, lr=0.1),
                    "batches": helper, "loss_fn": lambda m, b: m(b).mean()}
        """
    )
    run_id = train(ModelScript.from_path(path), RunConfig(steps=10, device="cpu"), store_path)
    store = Store(store_path)
    run = store.run(run_id)
    assert run["status"] == "failed"
    assert 'raise ValueError("bad batch at step 3")' in run["error"]
    assert f'File "{path}", line 6, in helper' in run["error"]
    assert "ValueError: bad batch at step 3" in run["error"]
    assert len(store.steps(run_id)) == 3  # the steps before the failure are kept


def test_finite_batches_end_the_run_early_and_say_so(write_script, store_path):
    path = write_script(
        """
        import torch
        def build(device):
            model = torch.nn.Linear(3, 1)
            return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
                    "batches": [torch.ones(2, 3)] * 4, "loss_fn": lambda m, b: m(b).mean()}
        """,
        name="finite.py",
    )
    run = Store(store_path).run(train(ModelScript.from_path(path), RunConfig(steps=10, device="cpu"), store_path))
    assert run["status"] == "finished" and run["steps_done"] == 4
    assert run["note"] == "the script's batches ran out after 4 of 10 steps"


def test_not_a_python_file(tmp_path):
    path = tmp_path / "model.txt"
    path.write_text("x")
    with pytest.raises(ScriptError, match=r"model.txt: a model script must be a \.py file"):
        ModelScript.from_path(path)
    with pytest.raises(ScriptError, match="no such file"):
        ModelScript.from_path(tmp_path / "missing.py")


def test_same_seed_same_start_under_every_level(store_path):
    from conftest import EXAMPLES

    script = ModelScript.from_path(EXAMPLES / "mlp_digits.py")
    losses = {}
    for level in ("O0", "O1", "bf16"):
        run_id = train(script, RunConfig(opt_level=level, steps=1, seed=7, device="cpu"), store_path)
        losses[level] = Store(store_path).steps(run_id)["loss"].iloc[0]
    # Same weights and batch: the step-0 losses differ only by the precision of the forward pass.
    assert losses["O1"] == pytest.approx(losses["O0"], rel=1e-2)
    assert losses["bf16"] == pytest.approx(losses["O0"], rel=3e-2)
    other = train(script, RunConfig(opt_level="O0", steps=1, seed=8, device="cpu"), store_path)
    assert Store(store_path).steps(other)["loss"].iloc[0] != losses["O0"]
