"""A Recorder loop whose optimizer steps cannot be seen stores 'skipped' as unknown (NULL), never as skipped; a
loop without a scaler stores scaling 'none', skipped 0, and gets no loss-scale findings."""

import numpy as np
import torch

from mpdiag import Store
from mpdiag.analysis.findings import diagnose
from mpdiag.recording.recorder import Recorder


def data():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1), torch.randn(8, 4)


def test_hand_written_update_leaves_skipped_unknown(store_path):
    model, x = data()
    with Recorder(model, store=store_path) as rec:
        for _ in range(4):
            model.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            rec.record(loss)
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad  # no torch.optim optimizer: nothing to observe
    store = Store(store_path)
    assert store.run(rec.run_id)["scaling"] == "none"
    steps = store.steps(rec.run_id)
    assert len(steps) == 4 and steps["skipped"].isna().all()
    rules = {f.rule for f in diagnose(store, rec.run_id)}
    assert not rules & {"scale-collapse", "scale-ignored"}


def test_optimizer_seen_without_being_given_and_without_scaler(store_path):
    model, x = data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, store=store_path) as rec:  # no optimizer=: its steps are seen through the global hook
        for _ in range(4):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            rec.record(loss)
            opt.step()
    store = Store(store_path)
    assert store.run(rec.run_id)["scaling"] == "none"
    assert store.steps(rec.run_id)["skipped"].tolist() == [0, 0, 0, 0]


def test_overflowing_loop_without_scaler_gets_no_scale_findings(store_path):
    model, x = data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, store=store_path, optimizer=opt) as rec:
        for _ in range(6):
            opt.zero_grad()
            loss = model(x * 1e30).pow(2).mean()  # inf loss and gradients every step; nothing scales them
            loss.backward()
            rec.record(loss)
            opt.step()
    store = Store(store_path)
    steps = store.steps(rec.run_id)
    assert not np.isfinite(steps["loss"]).any() and steps["skipped"].tolist() == [0] * 6
    rules = {f.rule for f in diagnose(store, rec.run_id)}
    assert not rules & {"scale-collapse", "scale-ignored"}
