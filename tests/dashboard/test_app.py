"""Every page under streamlit's AppTest: selections, controls, starting runs, and bad stores."""

import json
import math
import re
import subprocess
import sys
import time

import pytest
from app_helpers import PAGES, app, confirm, runs_table, shown, texts, wait_for_runs
from conftest import EXAMPLES, ROOT

from mpdiag import Store
from mpdiag.analysis.findings import diagnose
from mpdiag.dashboard import actions
from mpdiag.dashboard.tables import TABLE_PX
from mpdiag.training.runner import RunConfig, train, train_pair
from mpdiag.training.script import ModelScript


@pytest.fixture(scope="module")
def filled_store(tmp_path_factory):
    """Runs 1+2: MLP at O1 with its FP32 twin; 3: MLP at O3 (NaN from step 1); 4: a run that crashed at
    step 0 (its process exited without closing it)."""
    path = tmp_path_factory.mktemp("store") / "runs.db"
    mlp = ModelScript.from_path(EXAMPLES / "mlp_digits.py")
    train_pair(mlp, RunConfig(opt_level="O1", steps=12, device="cpu"), path)
    train(mlp, RunConfig(opt_level="O3", steps=6, device="cpu"), path)
    subprocess.run([sys.executable, "-c", "import sys; from mpdiag.store import StoreWriter; "
                    "StoreWriter(sys.argv[1]).create_run(name='dies at step 0', opt_level='O1')", str(path)],
                   check=True, cwd=ROOT)
    return path


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_a_filled_store_without_exceptions(page, filled_store, monkeypatch):
    at = app(page, filled_store, monkeypatch)
    assert not at.exception, [e.value for e in at.exception]


def test_home_lists_runs_with_status_and_crashed_run_explained(filled_store, monkeypatch):
    at = app("app.py", filled_store, monkeypatch)
    table = at.dataframe[0].value
    assert table["status"].tolist() == ["crashed", "finished", "finished", "finished"]
    assert table["opt level"].tolist() == ["O1", "O3", "O0", "O1"]
    assert "exited without closing the run" in texts(at)


def test_a_run_that_recorded_no_step_shows_no_final_loss(tmp_path):
    """A script that failed before its first step read "NaN" as its final loss, a loss it never had."""
    from mpdiag.dashboard import runs_model
    from mpdiag.store import StoreWriter

    with StoreWriter(tmp_path / "runs.db", finish_runs=True) as writer:
        run_id = writer.create_run(name="crashed", opt_level="custom", device="cpu")
        writer.end_run(run_id, "failed", error="AttributeError: callback bug")
    store = Store(tmp_path / "runs.db")
    runs = store.runs()
    assert int(runs["steps_done"].iloc[0]) == 0
    assert runs_model.table(store, runs, runs).set_index("run").loc[run_id, "final loss"] == ""


def test_the_runs_view_model_reads_health_from_each_runs_findings_and_shows_a_notes_first_line(filled_store):
    """mpdiag.dashboard.runs_model without Streamlit: the table the Runs page draws, against diagnose itself and
    the store's own rows; the filters keep a subset, read from the same one read of the runs table."""
    from mpdiag.analysis.findings import diagnose
    from mpdiag.dashboard import runs_model

    store = Store(filled_store)
    runs = store.runs()
    table = runs_model.table(store, runs, runs).set_index("run")
    for run_id in (1, 2, 3):
        severities = [f.severity for f in diagnose(store, run_id)]
        assert table.loc[run_id, "health"].startswith("healthy") == (not {"error", "warning"} & set(severities))
    assert not table.loc[3, "health"].startswith("healthy")  # O3 goes NaN from step 1
    assert list(table.columns).index("tags") == list(table.columns).index("loss scale") + 1
    only_o3 = runs[runs["opt_level"] == "O3"]
    assert runs_model.table(store, runs, only_o3)["run"].tolist() == [3]
    assert runs_model.live_runs(store, runs) == []  # nothing running: no progress panel
    assert runs_model.note_preview(None) == runs_model.note_preview("") == ""
    assert runs_model.note_preview("short") == "short"
    assert runs_model.note_preview("first line\nsecond") == "first line…"
    assert runs_model.note_preview("x" * 70) == "x" * runs_model.NOTE_PREVIEW_CHARS + "…"


def test_the_management_view_model_starts_from_the_runs_row_and_refuses_deleting_a_live_run(filled_store, tmp_path):
    """runs_model.managed_run without Streamlit, against the store's own rows: the widgets' starting values,
    the store's known tags, what a delete removes, and why a run whose process may still write is not deleted."""
    import shutil

    from mpdiag.dashboard import runs_model
    from mpdiag.store import StoreWriter

    path = tmp_path / "runs.db"
    shutil.copy(filled_store, path)
    with StoreWriter(path) as w:
        w.set_tags(1, ["baseline", "lr 1e-3"])
        w.set_tags(3, ["nan"])
        w.set_user_note(1, "first line\nsecond")
    live = StoreWriter(path)  # a run of this (live) process, not ended
    live_id = live.create_run(name="still training", opt_level="O1")
    runs = Store(path).runs()
    row = runs.set_index("run_id").loc[1]
    first = runs_model.managed_run(runs, 1)
    assert (first.name, first.tags, first.note) == (row["name"], ["baseline", "lr 1e-3"], "first line\nsecond")
    assert first.known_tags == ["baseline", "lr 1e-3", "nan"] and first.delete_refused is None
    assert first.delete_summary == f"#1 · {row['name']} · O1 · finished, {int(row['steps_done'])} steps"
    assert runs_model.managed_run(runs, 2).delete_summary.endswith(" · FP32 twin of #1")
    assert runs_model.managed_run(runs, 2).note == ""
    running = runs_model.managed_run(runs, live_id)
    assert running.delete_refused.startswith(f"Run #{live_id} is running: it cannot be deleted")
    live.close()


def test_empty_store_offers_the_bundled_example(tmp_path, monkeypatch):
    at = app("app.py", tmp_path / "fresh.db", monkeypatch)
    assert "No runs in" in texts(at)
    assert any("Run the bundled example" in b.label for b in at.button)
    for page in PAGES[1:]:
        other = app(page, tmp_path / "fresh.db", monkeypatch)
        said = texts(other)
        assert not other.exception and any(m in said for m in ("No runs", "at least two runs",
                                                               "No training code uploaded"))


@pytest.mark.parametrize("page", PAGES)
def test_store_that_is_not_sqlite_is_explained(page, tmp_path, monkeypatch):
    bogus = tmp_path / "mpdiag_runs.db"
    bogus.write_text("this is not a database")
    at = app(page, bogus, monkeypatch)
    assert not at.exception
    assert "is not an SQLite database" in texts(at)


def test_sidebar_offers_the_store_files_beside_the_configured_one(filled_store, monkeypatch):
    other = filled_store.parent / "other.db"
    other.write_text("not a store")
    try:
        at = app("pages/1_Gradients.py", filled_store, monkeypatch)
        picker = at.sidebar.selectbox(key="store_file")
        assert picker.options == ["runs.db", "other.db"]  # the configured store first, then its neighbours
        picker.set_value(other).run()
        assert not at.exception and "is not an SQLite database" in texts(at)
    finally:
        other.unlink()


def test_gradients_deep_link_and_controls(filled_store, monkeypatch):
    at = app("pages/1_Gradients.py", filled_store, monkeypatch, run="1")
    assert at.selectbox(key="run").value == 1
    tensor = at.selectbox(key="tensor")
    assert tensor.value in {"1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"}
    at.radio(key="view").set_value("at the loss scale (S·g)").run()
    at.select_slider(key="whatif").set_value(0).run()
    assert not at.exception
    metrics = {m.label: m.value for m in at.metric}
    assert "fp16 underflow at 2^0" in metrics
    assert "fp16 underflow" in metrics


def shown_share(text: str) -> float:
    return float(text.rstrip("%")) / 100


def test_gradients_tiles_and_whatif_agree_at_the_runs_own_scale_with_the_store(filled_store, monkeypatch):
    """Issue 27: the exact tiles (in the S·g view; in the g view they are g's) and the what-if at the step's own
    loss scale (2^16, dynamic) are the same numbers, and both are the store's exact counts of S·g; the what-if at
    2^0 is the store's counts of g."""
    store = Store(filled_store)
    step = store.logged_steps(1)[-1]
    scale = float(store.steps(1).set_index("step").loc[step, "loss_scale"])
    k = round(math.log2(scale))
    assert 2.0**k == scale and k != 0
    for fmt in ("fp16", "bf16"):
        at = app("pages/1_Gradients.py", filled_store, monkeypatch, run="1", tensor="1.weight", fmt=fmt,
                 view="at the loss scale (S·g)")
        assert not at.exception, [e.value for e in at.exception]
        row = store.tensor_stats(1, "1.weight", step=step).iloc[0]
        denom = row["numel"] - row["zeros"] - row["nan"] - row["posinf"] - row["neginf"]
        metrics = {m.label: m.value for m in at.metric}
        assert at.select_slider(key="whatif").value == k
        for cat in ("underflow", "subnormal", "overflow"):
            truth = row[f"{fmt}_{cat}_at_scale"] / denom
            assert metrics[f"{fmt} {cat}"] == metrics[f"{fmt} {cat} at 2^{k}"]
            assert shown_share(metrics[f"{fmt} {cat}"]) == pytest.approx(truth, abs=5e-6)
        at.select_slider(key="whatif").set_value(0).run()
        metrics = {m.label: m.value for m in at.metric}
        for cat in ("underflow", "subnormal", "overflow"):
            assert shown_share(metrics[f"{fmt} {cat} at 2^0"]) == pytest.approx(row[f"{fmt}_{cat}"] / denom, abs=5e-6)
            assert f"{cat} {metrics[f'{fmt} {cat} at 2^0']}" in " ".join(c.value for c in at.caption)


def test_gradients_of_a_run_that_crashed_at_step_0(filled_store, monkeypatch):
    at = app("pages/1_Gradients.py", filled_store, monkeypatch, run="4")
    assert not at.exception
    assert "recorded no gradient statistics" in texts(at)


def test_loss_scale_of_a_nan_run(filled_store, monkeypatch):
    at = app("pages/2_Loss_scale.py", filled_store, monkeypatch, run="3")
    assert not at.exception
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["loss NaN/inf"] == "5 steps"  # O3 with Adam: NaN from the first update on
    assert "Static loss scale 1" in texts(at)


def test_compare_pair_reports_divergence(filled_store, monkeypatch):
    at = app("pages/3_Compare.py", filled_store, monkeypatch, runs=["1", "2"])
    assert not at.exception
    assert "versus its FP32 reference #2" in texts(at)


def test_start_a_run_and_rerun_it_from_the_home_page(tmp_path, monkeypatch):
    store = tmp_path / "ui.db"
    at = app("app.py", store, monkeypatch)
    at.number_input(key="new_steps").set_value(5).run()
    at.selectbox(key="new_level").set_value("bf16").run()
    confirm(at, "new_start")
    assert not at.exception
    runs = wait_for_runs(store, 1)
    assert runs.iloc[0]["status"] == "finished" and runs.iloc[0]["opt_level"] == "bf16"
    said = texts(at.run())
    assert "You started cnn_digits.py at bf16: #1 · cnn_digits.py · bf16, finished, 5 of 5 steps recorded." in said and "[Findings](/Findings?run=1)" in said

    at = app("app.py", store, monkeypatch)
    at.selectbox(key="rerun_level").set_value("O2").run()
    at.radio(key="rerun_mode").set_value("dynamic").run()
    confirm(at, "rerun_start")
    runs = wait_for_runs(store, 2)
    child = runs.iloc[0]
    assert child["parent_run_id"] == 1 and child["opt_level"] == "O2" and child["steps"] == 5


def test_a_started_run_can_be_stopped_with_a_click_and_keeps_what_it_recorded(tmp_path, monkeypatch):
    """A run started from the home page shows a Stop button while it goes; nothing stops until it is clicked;
    then the page says it is stopping, and the run ends itself on the SIGTERM, as mpdiag run records a stop by a
    signal (stopped, the signal named, as the CLI's own SIGTERM test reads it), its recorded steps kept."""
    store = tmp_path / "ui.db"
    at = app("app.py", store, monkeypatch)
    at.number_input(key="new_steps").set_value(100_000).run()
    confirm(at, "new_start")
    try:
        stops = [b for b in at.run().button if str(b.key).startswith("stop_")]
        assert [b.label for b in stops] == ["Stop"]  # one process started, still going
        deadline = time.time() + 90
        while time.time() < deadline:  # let it record a few steps first
            runs = Store(store).runs()
            if not runs.empty and (runs["steps_done"].fillna(0) >= 2).all():
                break
            time.sleep(0.3)
        assert Store(store).runs().iloc[0]["status"] == "running"  # loading pages stopped nothing
        stops[0].click().run()
        assert "Stopping: the run is sent SIGTERM" in texts(at)
    finally:  # a failure above must not leave a 100,000-step run training
        for proc, _ in at.session_state[actions._LAUNCHED]:
            proc.request_stop()
    [run] = wait_for_runs(store, 1).to_dict("records")
    assert (run["status"], run["error"]) == ("stopped", "stopped by signal SIGTERM")
    assert 2 <= run["steps_done"] < 100_000 and len(Store(store).steps(run["run_id"])) == run["steps_done"]


HOSTILE_DIR = ROOT / "tests" / "fixtures" / "hostile"


def upload(at, name, data):
    """Upload ``data`` as a model script named ``name`` and check it (a confirmed click)."""
    at.radio(key="kind").set_value("A model script (build(device))").run()
    at.file_uploader(key="upload").set_value((name, data, "text/x-python")).run()
    return confirm(at, "check")


def test_upload_check_and_run_a_good_script(tmp_path, monkeypatch):
    store = tmp_path / "up.db"
    at = app("pages/4_Upload.py", store, monkeypatch)
    assert "Uploading code means running it" in texts(at)
    upload(at, "../../etc/evil name.py", (EXAMPLES / "mlp_digits.py").read_bytes())
    assert not at.exception
    assert [shown(s.value) for s in at.success] == ["evil_name.py: ready"]  # no path from the user survives
    assert Store(store).scripts()["filename"].tolist() == ["evil_name.py"]
    at.number_input(key="upload_steps").set_value(4).run()
    confirm(at, "upload_start")
    runs = wait_for_runs(store, 1)
    assert runs.iloc[0]["status"] == "finished" and runs.iloc[0]["script_path"] == "evil_name.py"


@pytest.mark.parametrize("name, expected", [
    ("raises_in_build.py", "ZeroDivisionError"),
    ("loss_is_vector.py", "must return a scalar"),
    ("calls_os_exit.py", None),  # fails only during training; the check passes
    ("syntax_error.py", "syntax error"),
])
def test_upload_of_a_broken_script_is_explained_and_the_app_keeps_serving(name, expected, tmp_path, monkeypatch):
    store = tmp_path / "up.db"
    at = upload(app("pages/4_Upload.py", store, monkeypatch), name, (HOSTILE_DIR / name).read_bytes())
    assert not at.exception
    if expected is None:
        assert at.success
    else:
        assert not at.success and expected in texts(at)
    assert not app("app.py", store, monkeypatch).exception  # the app still serves


def test_upload_that_is_not_utf8_is_refused(tmp_path, monkeypatch):
    at = app("pages/4_Upload.py", tmp_path / "up.db", monkeypatch)
    at.radio(key="kind").set_value("A model script (build(device))").run()
    at.file_uploader(key="upload").set_value(("latin.py", "x = 'é'".encode("latin-1"), "text/x-python")).run()
    assert not at.exception and "latin.py is not UTF-8 text." in texts(at)


def test_findings_page_reruns_with_the_fix_and_says_the_finding_went_away(tmp_path, monkeypatch):
    store = tmp_path / "find.db"
    run_id = train(ModelScript.from_path(EXAMPLES / "gallery_activation_overflow.py"),
                   RunConfig(opt_level="O1", steps=6, device="cpu"), store)
    at = app("pages/5_Findings.py", store, monkeypatch, run=str(run_id))
    assert not at.exception
    said = texts(at)
    assert "Overflow in the forward pass" in said and "[See the evidence on the Loss scale page](/Loss_scale?run=1)" in said
    fix = [b for b in at.button if b.label.startswith("Rerun with this fix")][0]
    confirm(at, fix.key)
    runs = wait_for_runs(store, 3)  # the rerun and its FP32 twin (no FP32 reference existed)
    assert set(runs["opt_level"]) == {"O1", "bf16", "O0"}
    said = texts(at.run())  # feedback where the click was: the page says what started, how far, and links it
    assert "You started the fix of scale-collapse on #1 (level bf16): #2" in said
    assert "finished, 6 of 6 steps recorded." in said and "[Gradients](/Gradients?run=2)" in said
    at = app("pages/5_Findings.py", store, monkeypatch, run=str(run_id))
    element = at.dataframe[0]
    own, row = element.value.iloc[0], element.value.iloc[1]  # this run first, whose loss the rerun's is read against
    assert own["run"] == run_id and own["name"].startswith("this run: ") and (own["still there"], own["gone"]) == ("", "")
    rules = [f.rule for f in diagnose(Store(store), run_id)]  # the run's findings, a card each
    still = [r for r in rules if r in row["still there"].split(", ")]
    assert "scale-collapse" in rules and "scale-collapse" not in still  # the fix made it go away
    assert row["gone"] == f"{len(rules) - len(still)} of {len(rules)}" and (still or row["still there"] == "none")
    # at 1,280 px every column is on screen, what the table is for first: the loss against FP32 and the findings
    # still there (a column per finding, each with its long name, pushed them off); the run number pinned
    config = json.loads(element.proto.columns)
    assert element.value.columns.tolist() == ["run", "name", "status", "vs FP32", "final loss", "still there", "gone",
                                              "opt level", "FP32 final loss"]
    assert config["run"]["pinned"] is True and sum(c.get("width", 0) for c in config.values()) <= TABLE_PX
    assert all(config[c].get("help") for c in ("vs FP32", "final loss", "still there", "gone", "FP32 final loss"))
    # its losses read as every page writes them: the Runs page's text for the same runs
    home = runs_table(app("app.py", store, monkeypatch)).set_index("run")
    assert row["final loss"] == home.loc[row["run"], "final loss"] and own["final loss"] == home.loc[run_id, "final loss"]


def test_findings_page_shows_update_swamping_and_the_fp32_shadow_ranking(tmp_path, monkeypatch):
    store = tmp_path / "swamp.db"
    run_id = train(ModelScript.from_path(EXAMPLES / "gallery_swamped_updates.py"),
                   RunConfig(opt_level="O3", steps=6, device="cpu", shadow_every=2), store)
    at = app("pages/5_Findings.py", store, monkeypatch, run=str(run_id))
    assert not at.exception, [e.value for e in at.exception]
    said = texts(at)
    assert "Weight updates are lost: too small for FP16 weights" in said and "[See the evidence below](#updates)" in said
    assert [s.value for s in at.subheader][-2:] == ["Gradients against the FP32 shadow",
                                                    "Optimizer updates against the weight format"]
    shadow, updates = (d.value for d in at.dataframe[-2:])
    assert set(shadow["tensor"]) == set(Store(store).tensors(run_id)["name"]) and shadow["steps"].eq(3).all()
    # the shadow table reads in words, counts with separators (its columns were named median_rel_error, 8192)
    config = json.loads(at.dataframe[-2].proto.columns)
    assert {config[c]["label"] for c in ("numel", "steps", "median_rel_error", "max_rel_error", "min_cosine")} == {
        "values", "shadow steps", "median relative error", "largest relative error", "lowest cosine"}
    assert config["numel"]["type_config"]["format"] == "%,d"
    assert all(config[c].get("help") for c in ("numel", "steps", "median_rel_error", "max_rel_error", "min_cosine",
                                               "reference not negligible"))
    assert updates["unchanged_share"].max() > 0.5


def test_an_uploaded_script_never_runs_inside_the_server_process(tmp_path, monkeypatch):
    import os

    marker = tmp_path / "pids.txt"
    source = (EXAMPLES / "mlp_digits.py").read_text() + (
        f"\nimport os as _os\nwith open({str(marker)!r}, 'a') as _fh:\n    _fh.write(f'{{_os.getpid()}}\\n')\n"
    )
    at = upload(app("pages/4_Upload.py", tmp_path / "up.db", monkeypatch), "spy.py", source.encode())
    assert not at.exception and [shown(s.value) for s in at.success] == ["spy.py: ready"]
    pids = {int(p) for p in marker.read_text().split()}
    assert pids and os.getpid() not in pids  # AppTest runs the page in this process: the script ran elsewhere


def test_home_offers_a_stored_script_once_and_runs_it_only_after_its_check_passed(tmp_path, monkeypatch):
    """A stored copy of a bundled script is listed once (as bundled); an upload that failed its check, or was
    not checked in this session, is marked and its Start button disabled with the reason."""
    from mpdiag.dashboard.actions import store_upload

    store = tmp_path / "up.db"
    at = app("app.py", store, monkeypatch).switch_page("pages/4_Upload.py").run()  # one session, two pages
    at = upload(at, "raises_in_build.py", (HOSTILE_DIR / "raises_in_build.py").read_bytes())
    assert not at.success  # the check failed
    store_upload(Store(store), "copy_of_mlp.py", (EXAMPLES / "mlp_digits.py").read_bytes())
    store_upload(Store(store), "unchecked.py", (EXAMPLES / "mlp_digits.py").read_bytes() + b"\n# edited\n")
    at.switch_page("app.py").run()
    assert not at.exception
    scripts = at.selectbox(key="new_script").options
    assert "bundled: mlp_digits.py" in scripts and not any("copy_of_mlp" in s for s in scripts)
    for name, reason in (("raises_in_build.py", "failed its check"), ("unchecked.py", "has not been checked")):
        at.selectbox(key="new_script").set_value(next(s for s in scripts if name in s)).run()
        assert reason in texts(at) and at.button(key="new_start").disabled
    at.selectbox(key="new_script").set_value("bundled: mlp_digits.py").run()
    assert not at.button(key="new_start").disabled


def test_run_form_disables_what_does_nothing_and_says_why(tmp_path, monkeypatch):
    at = app("app.py", tmp_path / "s.db", monkeypatch)
    at.selectbox(key="new_level").set_value("bf16").run()
    assert "Loss scaling: not used at bf16" in texts(at)
    at.number_input(key="new_nproc").set_value(2).run()
    fp8 = next(c for c in at.checkbox if c.label.startswith("Record FP8"))
    assert fp8.disabled and "set Processes back to 1" in fp8.help
    at.selectbox(key="new_level").set_value("O0").run()
    twin = next(c for c in at.checkbox if c.label.startswith("Also run an FP32"))
    assert twin.disabled and "O0 is the FP32 run itself" in twin.help


def test_a_stalled_run_says_so_on_its_pages_with_its_last_step(tmp_path, monkeypatch):
    """A running run (this process: alive) whose last step was committed 10 minutes ago reads stalled, and each
    single-run page says how long it has been quiet and which step came last."""
    from mpdiag.store import StepRow, StoreWriter

    store = tmp_path / "stall.db"
    with StoreWriter(store) as writer:
        run_id = writer.create_run(name="stuck loop", opt_level="custom", scaling="none")
        writer.write_batch(run_id, [StepRow(step, 1.0 / (step + 1), 1.0, 0, None, 1.0, 0.05, 1000, 0)
                                    for step in range(3)], [])
        writer.update_run(run_id, heartbeat_at=time.time() - 600)
    run = Store(store).run(run_id)
    assert run["status"] == "stalled" and run["steps_done"] == 3
    for page in ("pages/1_Gradients.py", "pages/2_Loss_scale.py", "pages/5_Findings.py"):
        with StoreWriter(store) as writer:  # 10 minutes quiet as each page opens: a page's render takes seconds
            writer.update_run(run_id, heartbeat_at=time.time() - 600)
        at = app(page, store, monkeypatch, run=str(run_id))
        assert not at.exception, page
        said = texts(at)
        # 10.0 min, or 10.1 when the render itself took over 3 s (seen on a loaded CI machine)
        assert re.search(r"has recorded nothing for 10\.[01] min, since its last stored step \(2\)", said), (page, said)
        assert "its median step takes 0.05 s" in said, page


def test_an_older_store_is_upgraded_with_a_message(tmp_path, monkeypatch):
    """Opening a store of an older schema migrates it under a spinner naming the versions, and says it did."""
    import shutil

    from mpdiag.store import SCHEMA_VERSION

    store = tmp_path / "old.db"
    shutil.copy(ROOT / "tests" / "fixtures" / "data" / "store_v7.db", store)
    at = app("app.py", store, monkeypatch)
    assert not at.exception
    assert f"The store old.db was upgraded from schema 7 to {SCHEMA_VERSION} in" in texts(at)
    assert "upgraded" not in texts(app("app.py", store, monkeypatch))  # once
