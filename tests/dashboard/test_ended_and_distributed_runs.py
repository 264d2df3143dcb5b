"""What the pages say of runs that ended early and of distributed runs (a screenshot review at 1,280 px): no success
box under a crashed run's red one, its reason wrapped, the ended runs the home page does not explain counted, a
step count in the singular, a watched run's rerun naming what runs in place of a hash it has none of, each rank of
a distributed run visible in its inf/NaN panel and its rank count in the runs table. Stores are written with
StoreWriter (no training), so each test takes a page render or two."""

import pandas as pd
from app_helpers import app, runs_table, texts

from mpdiag.dashboard import actions, charts, runs_model
from mpdiag.store import StepRow, StoreWriter

LONG_REASON = ("--stop-on nonfinite: nonfinite at step 0: first non-finite loss: loss nan, gradient norm nan; "
               "training stopped at step 1 (recorded, its update not applied)")


def _steps(n, nan_at=()):
    return [StepRow(s, float("nan") if s in nan_at else 1.0 / (s + 1), 1.0, 0, None, 1.0, 0.05, 1000, 0)
            for s in range(n)]


def _ended(writer, status, error, name="ended", steps=3, **fields):
    run_id = writer.create_run(name=name, opt_level="custom", scaling="none", **fields)
    writer.write_batch(run_id, _steps(steps), [])
    writer.end_run(run_id, status, error)
    return run_id


def test_a_crashed_run_without_findings_says_so_neutrally_not_as_a_success(tmp_path, monkeypatch):
    store = tmp_path / "c.db"
    with StoreWriter(store) as writer:
        crashed = _ended(writer, "crashed", "the training process exited without closing the run", steps=26)
        stopped = _ended(writer, "stopped", "stopped by SIGTERM", steps=1)
    at = app("pages/5_Findings.py", store, monkeypatch, run=str(crashed))
    assert not at.exception, [e.value for e in at.exception]
    assert not at.success, [s.value for s in at.success]
    assert any("in the 26 steps recorded before it crashed" in i.value for i in at.info), [i.value for i in at.info]
    at = app("pages/5_Findings.py", store, monkeypatch, run=str(stopped))
    assert not at.success and "in the 1 step recorded before it was stopped" in texts(at)


def test_home_wraps_an_ended_runs_reason_and_counts_the_ended_runs_it_does_not_explain(tmp_path, monkeypatch):
    store = tmp_path / "h.db"
    with StoreWriter(store) as writer:
        ids = [_ended(writer, "failed" if i % 2 else "stopped", LONG_REASON, name=f"r{i}") for i in range(5)]
    at = app("app.py", store, monkeypatch)
    assert not at.exception, [e.value for e in at.exception]
    reasons = [c for c in at.code if LONG_REASON in c.value]
    assert len(reasons) == 3 and all(c.proto.wrap_lines for c in reasons)
    older = ids[:2]  # the newest three are explained
    assert (f"2 more runs ended early (#{older[1]}, #{older[0]}): why each ended is at the top of its own pages"
            in texts(at))


def test_the_loss_scale_page_counts_one_nan_loss_in_the_singular(tmp_path, monkeypatch):
    store = tmp_path / "n.db"
    with StoreWriter(store) as writer:
        run_id = writer.create_run(name="one nan", opt_level="custom", scaling="none")
        writer.write_batch(run_id, _steps(5, nan_at={3}), [])
        writer.end_run(run_id, "finished")
    at = app("pages/2_Loss_scale.py", store, monkeypatch, run=str(run_id))
    assert not at.exception, [e.value for e in at.exception]
    assert [m.value for m in at.metric if m.label == "loss NaN/inf"] == ["1 step"]


def test_a_watched_runs_rerun_says_what_runs_instead_of_a_hash_it_has_none_of():
    watched = pd.Series({"name": "loader fails", "script_path": "/work/x/train.py", "script_sha256": float("nan"),
                         "config": {"watch": {"argv": ["train.py", "0.25"], "cwd": "/work/x", "opt_level": None}}})
    text = actions.rerun_pending("Rerun #2 with the fix for loss-scale", watched, {"opt_level": "bf16"}).text()
    assert "nan" not in text.replace("bf16", "")
    assert text.splitlines() == ["Rerun #2 with the fix for loss-scale",
                                 "command: python train.py 0.25 (as it was watched)", "from: /work/x",
                                 "script: the file as it is now (a watched run keeps no copy, so there is no hash "
                                 "to show)", "opt-level: bf16"]
    stored = watched.copy()
    stored["script_sha256"], stored["config"] = "ab12", {"run": {}}
    assert actions.rerun_pending("Rerun #2", stored).text().splitlines()[1:] == ["script: /work/x/train.py",
                                                                                 "sha256: ab12"]


def test_a_distributed_runs_inf_nan_per_rank_shows_small_counts_and_every_rank():
    rows = pd.DataFrame([dict(step=s, rank=r, loss=1.0, nonfinite=float({(2, 0): 1, (2, 1): 4, (20, 1): 5121}.get(
        (s, r), 0))) for s in range(40) for r in (0, 1)])
    spec = charts.rank_panel(rows, 2).to_dict()
    lower = spec["vconcat"][1]["layer"][0]
    y = lower["encoding"]["y"]
    assert y["scale"]["type"] == "symlog" and y["axis"]["values"] == [0, 1, 10, 100, 1_000, 10_000]
    drawn = pd.DataFrame(spec["datasets"][lower["data"]["name"]])
    at = drawn.set_index(["step", "rank"])["drawn_at"]
    assert at[(2, "rank 0")] < 2 < at[(2, "rank 1")]  # two ranks at a step: side by side, not on one another
    assert (drawn.groupby("step")["drawn_at"].nunique() == 2).all()
    assert lower["encoding"]["x"]["title"] == "step"  # the tooltip gives the step itself
    assert {"field": "step", "type": "quantitative"} in lower["encoding"]["tooltip"]
    # FSDP2 records no count: the losses are drawn, the counts' chart is empty (its first version raised, the
    # offsets of no rows being strings, as the store's arrow-typed columns hold them)
    fsdp = rows.assign(step=rows["step"].astype("int64[pyarrow]"), nonfinite=pd.Series(
        [None] * len(rows), dtype="double[pyarrow]"))
    assert charts.rank_panel(fsdp, None).to_dict()["vconcat"][0]


def test_the_runs_table_shows_a_distributed_runs_ranks_beside_its_level(tmp_path, monkeypatch):
    store = tmp_path / "d.db"
    with StoreWriter(store) as writer:
        one = _ended(writer, "finished", None, name="one process")
        two = writer.create_run(name="ddp", opt_level="O1", world_size=2)
        writer.write_batch(two, _steps(3), [])
        writer.end_run(two, "finished")
    at = app("app.py", store, monkeypatch)
    assert not at.exception, [e.value for e in at.exception]
    level = runs_table(at).set_index("run")["opt level"]
    assert (level[two], level[one]) == ("O1 ×2", "custom")
    assert "opt level" in runs_model.TABLE_COLUMNS  # on screen, not only in the folded settings table


def test_a_watched_torchrun_job_is_not_rerun_as_one_process_but_told_how_to_repeat_it(tmp_path, monkeypatch):
    """A rerun starts one process: a watched torchrun job's rerun waited in init_process_group for ranks that never
    came and failed with 0 steps, yet Modules, Findings and `mpdiag rerun` offered it. Each says the torchrun command
    instead (with the rerun's flags), and the Runs page's rerun button is disabled for it."""
    from conftest import run_cli

    from mpdiag.analysis.findings import fix_not_rerunnable

    store = tmp_path / "t.db"
    watched = {"watch": {"argv": ["train.py", "--epochs", "1"], "cwd": "/work/x", "opt_level": None}}
    with StoreWriter(store) as writer:
        job = _ended(writer, "finished", None, name="ddp job", world_size=2, config=watched)
    said = fix_not_rerunnable(watched, {"loss_scale": "dynamic", "init_scale": 1024.0}, 2)
    assert said.endswith("torchrun --nproc_per_node 2 -m mpdiag watch --init-scale 1024.0 train.py --epochs 1.")
    assert fix_not_rerunnable(watched, {"init_scale": 1024.0}, 1) is None  # one process: watch repeats it
    refused = run_cli("rerun", str(job), "--init-scale", "1024", "--store", str(store))
    assert refused.returncode == 2 and "torchrun --nproc_per_node 2 -m mpdiag watch --init-scale 1024" in refused.stderr
    at = app("pages/7_Modules.py", store, monkeypatch, run=str(job))
    assert not at.exception and "mpdiag watch --trace-modules train.py --epochs 1" in texts(at)
    at = app("app.py", store, monkeypatch)
    assert "a torchrun job of 2 ranks" in texts(at)
    assert at.button(key="rerun_start").disabled
