"""A run's configuration is held once by its run handle (mpdiag/recording/run.py), which derives the row's columns
from it: on a run made by every path that creates one - a Recorder in a user's loop, ``mpdiag run`` and its FP32
twin, ``mpdiag watch``, the app launcher's queued rows (a run and its twin, a watched rerun) - the columns say what
the stored configuration says (a torchrun job: tests/e2e/test_distributed.py). The expectation is the documented
options' (tests/run_rows.py), read from the store file with sqlite3."""

from __future__ import annotations

import contextlib
import os
import sqlite3

import pytest
import torch
from conftest import ROOT
from run_rows import assert_columns_say_the_config, stored_row

from mpdiag import Store
from mpdiag.options import RunConfig
from mpdiag.recording.background import BackgroundWriter
from mpdiag.recording.recorder import Recorder
from mpdiag.recording.run import MpdiagConfig, Run
from mpdiag.sandbox.launch import plan
from mpdiag.training.runner import train, train_pair
from mpdiag.training.script import ModelScript
from mpdiag.training.watch import WatchConfig, watch

MLP = ROOT / "mpdiag" / "examples" / "mlp_digits.py"
AMP_LOOP = ROOT / "tests" / "fixtures" / "scripts" / "amp_loop.py"


def test_a_recorders_configuration_goes_to_its_columns_and_the_rest_to_json(store_path):
    """In a user's loop the configuration given to the Recorder is the user's: what names a run column is
    stored there, the rest as JSON; the scaling columns are the GradScaler's own state."""
    recorder = _record_three_steps(store_path, {"opt_level": "O1", "steps": 3, "seed": 7, "lr": 0.1})
    row = stored_row(store_path, recorder.run_id)
    assert (row["name"], row["opt_level"], row["steps"], row["seed"], row["every"]) == ("mine", "O1", 3, 7, 2)
    assert row["config"] == {"lr": 0.1}
    assert (row["scaling"], row["init_scale"], row["growth_interval"]) == ("dynamic", 1024.0, 7)


def _record_three_steps(store_path, config: dict) -> Recorder:
    """A user's loop: three dynamically scaled steps of a Linear, recorded by a Recorder given ``config``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    recorder = Recorder(model, store_path, name="mine", scaler=scaler, optimizer=optimizer, every=2, config=config)
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(torch.randn(8, 4)).square().mean()
        scaler.scale(loss).backward()
        recorder.record(loss)
        scaler.step(optimizer)
        scaler.update()
    recorder.close()
    return recorder


@pytest.mark.parametrize("config", [
    {"run": "baseline-3", "lr": 3e-4},
    {"run": {"opt_level": "O2", "steps": 7}},
    {"run": {"name": "x"}},
    {"watch": {"opt_level": "bf16", "every": 5, "init_scale": 8.0}},
], ids=["run-text", "run-options", "run-name", "watch-settings"])
def test_a_users_configuration_is_never_read_as_mpdiags(store_path, config):
    """A user's Recorder(config=...) whose keys happen to be mpdiag's own ("run", "watch") records normally and
    stores the configuration as given, those keys under "user": the run's columns are the Recorder's own (its name, every,
    no level: custom; the GradScaler's state), never derived from the user's dict, which mpdiag's runs alone
    state through an MpdiagConfig; and the pages that read a run's configuration read none of it as mpdiag's."""
    recorder = _record_three_steps(store_path, config)
    row = stored_row(store_path, recorder.run_id)
    assert (row["status"], row["error"]) == ("finished", None)
    with contextlib.closing(sqlite3.connect(store_path)) as conn:
        steps = [s for (s,) in conn.execute("SELECT step FROM steps WHERE run_id = ? ORDER BY step", (row["run_id"],))]
    assert steps == [0, 1, 2]
    reserved = {k: v for k, v in config.items() if k in ("run", "watch")}
    kept = {**{k: v for k, v in config.items() if k not in reserved}, "user": reserved}
    assert row["config"] == kept
    assert Store(store_path).run(recorder.run_id)["config"] == kept
    assert (row["name"], row["opt_level"], row["steps"], row["seed"], row["every"]) == ("mine", "custom", None,
                                                                                        None, 2)
    assert (row["scaling"], row["loss_scale"], row["init_scale"], row["growth_interval"]) == ("dynamic", None,
                                                                                              1024.0, 7)


@pytest.mark.parametrize("options", [
    {"opt_level": "O3", "seed": 4, "every": 2},  # a static scale, the level's own (1.0)
    {"opt_level": "O1", "loss_scale": 128.0, "name": "static"},  # a static scale given
    {"opt_level": "bf16"},  # no scaling
], ids=["O3", "O1-static", "bf16"])
def test_mpdiag_run(store_path, options):
    run_id = train(ModelScript.from_path(MLP), RunConfig(steps=2, device="cpu", **options), store_path)
    row = stored_row(store_path, run_id)
    assert row["status"] == "finished", row["error"]
    assert row["config"]["run"]["opt_level"] == options["opt_level"]
    assert_columns_say_the_config(row)


def test_mpdiag_run_pair(store_path):
    """A dynamically scaled run with bounds, and its FP32 twin."""
    config = RunConfig(opt_level="O1", steps=2, device="cpu", init_scale=256.0, min_scale=2.0, max_scale=2.0**20)
    for run_id in train_pair(ModelScript.from_path(MLP), config, store_path):
        assert_columns_say_the_config(stored_row(store_path, run_id))


def test_watch_and_the_app_launchers_queued_rows(store_path, tmp_path):
    """A watched run; then what the app's launcher queues for a watched rerun and for a run with its twin, as the
    planning process creates them (before a child fills them in)."""
    run_id, code = watch(WatchConfig(target=str(AMP_LOOP), args=(str(tmp_path / "log.json"), "--steps", "2"),
                                     opt_level="O1", init_scale=512.0, every=2), store_path)
    row = stored_row(store_path, run_id)
    assert code == 0 and row["scaling"] == "dynamic"
    assert_columns_say_the_config(row)

    rerun = plan({"kind": "rerun", "run_id": run_id, "options": {"opt_level": "bf16", "every": 3}}, str(store_path))
    fresh = plan({"kind": "run", "script": str(MLP), "options": {"opt_level": "O1", "steps": 5, "seed": 2,
                                                                 "pair": True}}, str(store_path))
    writer = BackgroundWriter(store_path, heartbeat=False)
    try:
        queued = rerun.queue(writer) + fresh.queue(writer)
    finally:
        writer.close()
    rows = [stored_row(store_path, queued_id) for queued_id in queued]
    assert [r["status"] for r in rows] == ["queued"] * 3
    assert rows[0]["config"]["watch"]["opt_level"] == "bf16" and rows[0]["parent_run_id"] == run_id
    assert [r["config"]["run"]["opt_level"] for r in rows[1:]] == ["O1", "O0"]
    assert rows[2]["name"] == os.path.basename(MLP) + " (FP32 twin)"
    for r in rows:
        assert_columns_say_the_config(r)


def test_a_column_the_configuration_states_is_given_by_it_only(store_path):
    """Run.create and describe refuse a column beside the configuration that states it (mpdiag's own, an
    MpdiagConfig); a configuration described anew rewrites its columns with it."""
    writer = BackgroundWriter(store_path, heartbeat=False)
    try:
        config = MpdiagConfig({"run": RunConfig(opt_level="O1", steps=3).to_dict()})
        with pytest.raises(ValueError, match="steps: stated by the run's configuration"):
            Run.create(writer, config=config, steps=4, script_path="x.py")
        run = Run.create(writer, config=config, default_name="x.py", script_path="x.py", device="cpu")
        with pytest.raises(ValueError, match="opt_level: stated by the run's configuration"):
            run.describe(opt_level="O2")
        run.describe(config=MpdiagConfig({"run": RunConfig(opt_level="O3", steps=3).to_dict()}), wait=True)
    finally:
        writer.close()
    row = stored_row(store_path, run.run_id)
    assert (row["opt_level"], row["scaling"], row["loss_scale"], row["init_scale"]) == ("O3", "static", 1.0, None)
    assert row["config"] == run.config
    assert_columns_say_the_config(row)


def test_pages_read_no_users_configuration_as_mpdiags(tmp_path, monkeypatch):
    """Every page renders a store holding users' own runs whose configuration has keys named like mpdiag's:
    recorded now (kept under "user") and as an older mpdiag kept them, at the top of the configuration (a
    ``run`` or ``watch`` that is no object, a configuration that is no object). The reader reads those as the
    user's, and none is offered for a rerun (no stored script to rerun, no command to repeat)."""
    from app_helpers import PAGES, app

    store_path = tmp_path / "runs.db"
    ids = [_record_three_steps(store_path, config).run_id
           for config in ({"run": "baseline-3"}, {"watch": {"opt_level": "bf16", "every": 5}})]
    older = {ids[0]: '{"run": "baseline-3", "lr": 0.0003}', ids[1]: '["not", "an", "object"]'}
    with contextlib.closing(sqlite3.connect(store_path)) as conn, conn:
        for run_id, text in older.items():
            conn.execute("UPDATE runs SET config = ? WHERE run_id = ?", (text, run_id))
    store = Store(store_path)
    assert store.run(ids[0])["config"] == {"lr": 0.0003, "user": {"run": "baseline-3"}}
    assert store.run(ids[1])["config"] == {"user": ["not", "an", "object"]}
    ids.append(_record_three_steps(store_path, {"watch": {"opt_level": "bf16", "every": 5}}).run_id)
    for page in PAGES:
        for run_id in ids:
            at = app(page, store_path, monkeypatch, run=str(run_id), runs=[str(i) for i in ids])
            assert not at.exception, (page, run_id, [e.value for e in at.exception])
    home = app("app.py", store_path, monkeypatch)
    assert "cannot be rerun from here" in " ".join(c.value for c in home.caption)
