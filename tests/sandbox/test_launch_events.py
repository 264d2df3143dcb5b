"""Runs the app starts record events too: the supervised child's Recorder forwards ``add_events`` to the
supervisor by name (mpdiag.sandbox.launch.ALLOWED_CALLS), which writes them for the child's own run."""

import pytest
from test_launch import stored_upload, wait_final

from mpdiag.sandbox import launch as launching
from mpdiag.store import Store

pytestmark = pytest.mark.slow

NAN_AT_2 = """
import torch
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    x = torch.ones(4, 3) * (float("nan") if step == 2 else 1.0)
    opt.zero_grad(); model(x).sum().backward(); opt.step()
"""


def test_an_uploaded_run_records_its_events_through_the_supervisor(tmp_path):
    store_path = tmp_path / "runs.db"
    sha = stored_upload(store_path, NAN_AT_2)
    proc = launching.launch(launching.watch_job(sha, "train.py", [], False, {}), store_path)
    run = wait_final(store_path, proc)
    assert run["status"] == "finished" and run["steps_done"] == 5
    events = Store(store_path).events(int(run["run_id"]))
    assert events[["step", "kind"]].values.tolist() == [[2, "nonfinite"]]
