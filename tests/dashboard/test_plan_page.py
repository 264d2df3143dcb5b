"""The Plan page under AppTest on the planted model's store (conftest.plan_runs): the plan's table, savings and
config, the verify round against FP32 with readable charts, the next round offered only on a confirmed click,
and a run without FP8 statistics told how to get them."""

import json

from app_helpers import app, confirm, texts
from chart_check import page_chart_problems
from conftest import imports_torch

from mpdiag import Store
from mpdiag.analysis.plan import plan_run
from mpdiag.dashboard import actions, plan_model
from mpdiag.dashboard.tables import TABLE_PX
from mpdiag.dashboard.untrusted import plain


def test_the_page_shows_the_plan_its_savings_and_the_verified_round(plan_runs, monkeypatch):
    at = app("pages/8_Plan.py", plan_runs.store, monkeypatch, run=str(plan_runs.source))
    assert not at.exception, [e.value for e in at.exception]
    said = texts(at)
    assert "Run: BF16." in said and "Optimizer moments: BF16." in said and "Verified: the last round tracks FP32." in said
    table = at.dataframe[0].value
    assert dict(zip(table["layer"], table["choice"], strict=True)) == {"head": "FP8 current", "outlier": "BF16",
                                                                       "tiny": "BF16"}
    # at 1,280 px every column is on screen: the choice and its savings; each Linear's evidence, sentences a cell
    # cut, is said in full beneath the table (open for a few Linears)
    assert table.columns.tolist() == list(plan_model.LINEAR_COLUMNS)
    store = Store(plan_runs.store)
    runs = store.runs()
    view = plan_model.plan_view(store, runs[runs["run_id"] == plan_runs.source].iloc[0], runs)
    assert view.evidence_expanded and [e.proto.expanded for e in at.expander][0]
    for row in view.table.to_dict("records"):
        assert f"{row['layer']}: {row['choice']}. {row['evidence']}" in said, row["layer"]
        assert f"Rejected: {row['rejected']}" in said, row["layer"]
    rounds = at.dataframe[1].value
    assert rounds.columns.tolist() == list(plan_model.ROUND_COLUMNS)  # what ran and was predicted: said beneath
    assert rounds["run"].tolist() == [plan_runs.rounds[0].run_id] and rounds["verdict"].iloc[0].startswith("tracks")
    assert f"Round 1: run {plan_runs.rounds[0].run_id} tracks FP32" in said and "Predicted: the loss tracks FP32" in said
    for element in at.dataframe[:2]:
        config = json.loads(element.proto.columns)
        assert sum(c.get("width", 0) for c in config.values()) <= TABLE_PX
        assert all(config[c].get("help") for c in config if config[c].get("label") not in (None, c))  # short headers
    assert "--fp8-modules head=current,outlier=bf16,tiny=bf16" in said and "Float8CurrentScaling()" in said
    assert len(at.get("arrow_vega_lite_chart") or at.get("vega_lite_chart")) == 3  # memory, GEMM bytes, losses
    assert not page_chart_problems(at)


def test_the_verification_is_offered_and_starts_only_on_a_confirmed_click(plan_runs, monkeypatch):
    """Without its verify round, the source offers the whole verification from round 1 with the plan's recipes; a
    click arms it, the confirmation starts it in the background (the job itself: test_verify_job.py)."""
    store = Store(plan_runs.store)
    runs = store.runs()
    runs = runs[runs["run_id"] != plan_runs.rounds[0].run_id]
    view = plan_model.plan_view(store, runs[runs["run_id"] == plan_runs.source].iloc[0], runs)
    assert view.verify.next_options["fp8_modules"] == plan_run(store, plan_runs.source).module_flag()
    assert view.verify.next_options["name"].endswith("↻ plan round 1")
    started = []
    monkeypatch.setattr(actions, "start_verify", lambda store, run_id, first, modules, what:
                        started.append((run_id, first, modules)))
    monkeypatch.setattr(plan_model, "verify_rounds", lambda runs, source: runs.iloc[0:0].assign(fp8_modules=""))
    at = app("pages/8_Plan.py", plan_runs.store, monkeypatch, run=str(plan_runs.source))
    assert not started
    confirm(at, f"plan_verify_{plan_runs.source}")
    assert started == [(plan_runs.source, 1, view.verify.next_options["fp8_modules"])]


def test_a_run_without_fp8_statistics_says_how_to_record_them(plan_runs, monkeypatch):
    at = app("pages/8_Plan.py", plan_runs.store, monkeypatch, run=str(plan_runs.all_fp8))
    assert not at.exception and "recorded no FP8 statistics: record one with --fp8" in texts(at)


def test_the_view_model_does_not_import_torch():
    assert not imports_torch("import mpdiag.dashboard.plan_model")


class RunningJob:
    """A verification this session started, still running (actions.verification's answer)."""

    job = {"kind": "verify"}

    def is_alive(self):
        return True

    def ending(self):
        return None


def test_while_the_verification_runs_the_section_shows_its_round_and_offers_nothing(plan_runs, monkeypatch):
    """A round still running (its row as the store holds it mid-run): the progress bar names the round, its run and
    its step, the table lists it as running, and no Verify button is offered while the job lives."""
    rounds = plan_model.verify_rounds

    def mid_run(runs, source):
        found = rounds(runs, source)
        return found.assign(status="running", steps_done=12)

    monkeypatch.setattr(plan_model, "verify_rounds", mid_run)
    monkeypatch.setattr(actions, "verification", lambda run_id: RunningJob())
    at = app("pages/8_Plan.py", plan_runs.store, monkeypatch, run=str(plan_runs.source))
    assert not at.exception, [e.value for e in at.exception]
    round_id = plan_runs.rounds[0].run_id
    progress = [p.proto.text for p in at.get("progress")]
    assert progress == [plain(f"Verifying in the background: round 1 (run #{round_id}) is running: 12 of 24 steps recorded.")]
    assert at.dataframe[1].value["status"].tolist() == ["running"]
    assert not [b for b in at.button if b.label == "Verify the plan"]


def test_a_run_without_fp8_statistics_offers_the_rerun_that_records_them_on_a_confirmed_click(plan_runs, monkeypatch):
    """The page says why there is no plan, the shell command, and offers the rerun recording every recipe a Linear
    can be planned in; it starts only once confirmed."""
    started = []
    monkeypatch.setattr(actions, "start_rerun", lambda store, run_id, options, what: started.append((run_id, options)))
    at = app("pages/8_Plan.py", plan_runs.store, monkeypatch, run=str(plan_runs.all_fp8))
    assert f"rerun {plan_runs.all_fp8} --opt-level O0 --fp8 --fp8-recipe both --fp8-blocks mxfp8,nvfp4" in texts(at)
    assert not started
    confirm(at, f"plan_record_{plan_runs.all_fp8}")
    assert started == [(plan_runs.all_fp8, {"opt_level": "O0", "fp8": True, "fp8_recipe": "both",
                                            "fp8_blocks": "mxfp8,nvfp4"})]
    # what it starts is a valid rerun of that (fp8-sim) run: its options validate against the stored parent's
    from mpdiag.training.runner import rerun_plan

    rerun_plan(Store(plan_runs.store), plan_runs.all_fp8, **started[0][1])[1].validate()


def test_a_run_from_the_users_own_loop_is_told_why_no_rerun_is_offered(plan_runs):
    """A run recorded by a Recorder in the user's own loop (no launcher config) without FP8 statistics: nothing to
    rerun, so no rerun is offered and the page says what to do instead."""
    store = Store(plan_runs.store)
    run = store.run(plan_runs.all_fp8).copy()
    run["config"] = {"optimizer": {"class": "Adam"}}
    view = plan_model.plan_view(store, run, store.runs())
    assert view.plan is None and view.record_refused.startswith("mpdiag cannot rerun this run with them: record it "
                                                                "again with Recorder(..., fp8=Fp8Settings(")
    # a watched run: its rerun cannot add FP8 statistics (the CLI refuses --fp8 there), a new watch can; the page said
    # watch "cannot apply" them (a user's trial)
    run["config"] = {"watch": {"argv": ["train.py", "--lr", "3e-4"], "cwd": "/home/me/proj"}}
    refused = plan_model.plan_view(store, run, store.runs()).record_refused
    assert refused.endswith("from /home/me/proj: python -m mpdiag watch --opt-level O0 --fp8 --fp8-recipe both "
                            "--fp8-blocks mxfp8,nvfp4 train.py --lr 3e-4."), refused
    launched = store.run(plan_runs.all_fp8)
    assert plan_model.plan_view(store, launched, store.runs()).record_refused is None


def test_a_watched_runs_plan_offers_no_verification_and_says_why(plan_runs, monkeypatch):
    """A watched run with FP8 statistics has a plan, but its rounds set per-Linear FP8 recipes (--fp8-modules,
    fp8-sim), which a rerun of a watched command cannot: Verify was offered, and its job failed at once (a user's
    trial). The page says why instead; the same run recorded by mpdiag run is offered it."""
    monkeypatch.setattr(plan_model, "verify_rounds", lambda runs, source: runs.iloc[0:0].assign(fp8_modules=""))
    store = Store(plan_runs.store)
    run = store.run(plan_runs.source).copy()
    run["config"] = {"watch": {"argv": ["train.py"], "cwd": "/tmp", "opt_level": "O0", "init_scale": None,
                               "every": 4, "trace_modules": False, "shadow_every": 0, "stop_on": "", "fp8": None}}
    view = plan_model.plan_view(store, run, store.runs())
    assert view.plan is not None and view.verify.next_options is None
    assert view.verify.refused.startswith("mpdiag watch cannot apply"), view.verify.refused
    offered = plan_model.plan_view(store, store.run(plan_runs.source), store.runs()).verify
    assert offered.refused is None and offered.next_options is not None
