"""The events banner: on the Runs page (its live part) and on a run's own pages, each event as text with the link
to its evidence; a run's name is shown as text, never as Markdown; the view-model without Streamlit."""

import json

from app_helpers import app, step_slider, texts

from mpdiag.dashboard import events_model
from mpdiag.dashboard import frame as ui
from mpdiag.store import StepRow, Store, StoreWriter

HOSTILE = "**bold** [x](http://example.org)"


def _store(path):
    with StoreWriter(path) as writer:
        quiet = writer.create_run(name="quiet", opt_level="O1")
        noisy = writer.create_run(name=HOSTILE, opt_level="O1")
        for run_id in (quiet, noisy):
            writer.write_batch(run_id, [StepRow(s, 1.0, 1.0, 0, 0, 1.0, 0.1, 0, 1, 1e-3, 1.0, 0.1) for s in range(50)],
                               [])
            writer.end_run(run_id, "finished")
        writer.add_events(noisy, [(40, "nonfinite", json.dumps({"summary": "first non-finite loss: loss nan"}), 1.0),
                                  (45, "grad-norm-spike", json.dumps({"summary": "gradient norm 40 above"}), 2.0)])
    return quiet, noisy


def test_the_view_model_lists_runs_with_events_and_links_each_to_its_evidence(tmp_path):
    quiet, noisy = _store(tmp_path / "runs.db")
    store = Store(tmp_path / "runs.db")
    runs = store.runs()
    banners = events_model.runs_banners(store, runs)
    assert [b.run_id for b in banners] == [noisy]
    banner = banners[0]
    assert banner.heading.endswith("2 events while training") and banner.more == 0
    assert [(line.step, line.kind, line.link) for line in banner.lines] == [
        (40, "nonfinite", f"/Loss_scale?run={noisy}&step=40"), (45, "grad-norm-spike", f"/Gradients?run={noisy}&step=45")]
    assert events_model.run_banner(store, runs[runs["run_id"] == quiet].iloc[0]) is None


def test_runs_page_and_the_runs_own_page_show_the_banner_as_text(tmp_path, monkeypatch):
    _, noisy = _store(tmp_path / "runs.db")
    for page, query in (("app.py", {}), ("pages/2_Loss_scale.py", {"run": str(noisy)})):
        at = app(page, tmp_path / "runs.db", monkeypatch, **query)
        assert not at.exception, [e.value for e in at.exception]
        said = texts(at)
        assert "Step 40: nonfinite: first non-finite loss: loss nan" in said, page
        assert f"(/Loss_scale?run={noisy}&step=40)" in said and f"(/Gradients?run={noisy}&step=45)" in said
        heading = [w.value for w in at.warning if "events while training" in w.value][0]
        assert "\\*\\*bold\\*\\*" in heading and "](http" not in heading  # the name is inert text
    # on the Runs page the events of finished runs are folded away: five runs' events hid the runs table
    [folded] = [e for e in app("app.py", tmp_path / "runs.db", monkeypatch).expander
                if e.label.startswith("Events while training")]
    assert folded.label == "Events while training: 1 of the newest runs raised some" and not folded.proto.expanded


def test_an_event_committed_while_the_runs_page_is_open_shows_at_its_next_live_refresh(tmp_path, monkeypatch):
    path = tmp_path / "runs.db"
    with StoreWriter(path) as writer:
        run_id = writer.create_run(name="live", opt_level="O1")
    at = app("app.py", path, monkeypatch)
    assert "events while training" not in texts(at)
    with StoreWriter(path) as writer:
        writer.add_events(run_id, [(3, "skips", json.dumps({"summary": "5 optimizer steps skipped in a row"}), 1.0)])
    at.run()  # what the live fragment does every LIVE_REFRESH_S: it reads the events afresh
    assert "Step 3: skips: 5 optimizer steps skipped in a row" in texts(at)
    assert [e.proto.expanded for e in at.expander if e.label.startswith("Events while training")] == [True]  # going
    assert ui.LIVE_REFRESH_S + 0.5 <= 3.0  # a refresh, plus the Recorder's commit interval, within ~3 s


def test_an_evidence_link_opens_the_gradients_page_at_the_events_step(tmp_path, monkeypatch):
    from conftest import EXAMPLES

    from mpdiag.training.runner import RunConfig, train
    from mpdiag.training.script import ModelScript

    run_id = train(ModelScript.from_path(EXAMPLES / "mlp_digits.py"), RunConfig(opt_level="O1", steps=6, every=2,
                                                                                  device="cpu"), tmp_path / "runs.db")
    at = app("pages/1_Gradients.py", tmp_path / "runs.db", monkeypatch, run=str(run_id), step="3")
    assert not at.exception, [e.value for e in at.exception]
    assert step_slider(at, "step").value in (2, 4)  # logged every 2: the nearest logged step
    at = app("pages/1_Gradients.py", tmp_path / "runs.db", monkeypatch, run=str(run_id))
    assert step_slider(at, "step").value == 4  # without a link: the last logged step
    for crafted in ("9" * 5000, "²", "-1", "1e9", "3 "):  # a hand-made URL: ignored, the page as without a link
        at = app("pages/1_Gradients.py", tmp_path / "runs.db", monkeypatch, run=str(run_id), step=crafted)
        assert not at.exception and not at.error, crafted
        assert step_slider(at, "step").value == 4, crafted


def test_a_stopped_runs_page_says_why_once_in_its_banner(tmp_path, monkeypatch):
    """A run ended by --stop-on: its banner's heading names the option; the reason is not said again above it.
    A stopped run without a stored event (none to show) still says why on its own."""
    path = tmp_path / "runs.db"
    reason = "--stop-on nonfinite: nonfinite at step 40: first non-finite loss: loss nan"
    with StoreWriter(path) as writer:
        stopped = writer.create_run(name="stopped", opt_level="O1")
        bare = writer.create_run(name="stopped, no event kept", opt_level="O1")
        for run_id in (stopped, bare):
            writer.write_batch(run_id, [StepRow(s, 1.0, 1.0, 0, 0, 1.0, 0.1, 0, 1, 1e-3, 1.0, 0.1) for s in range(42)],
                               [])
            writer.end_run(run_id, "stopped", error=reason)
        writer.add_events(stopped, [(40, "nonfinite", json.dumps({"summary": "first non-finite loss: loss nan"}), 1.0)])
    runs = Store(path).runs()
    banner = events_model.run_banner(Store(path), runs[runs["run_id"] == stopped].iloc[0])
    assert banner.heading.endswith("1 event while training; stopped by --stop-on nonfinite")
    at = app("pages/2_Loss_scale.py", path, monkeypatch, run=str(stopped))
    assert not at.exception and "was stopped; why:" not in texts(at)
    assert sum("stopped by" in w.value and "nonfinite" in w.value for w in at.warning) == 1  # plain() escapes "-"
    at = app("pages/2_Loss_scale.py", path, monkeypatch, run=str(bare))
    assert not at.exception and "was stopped; why:" in texts(at) and reason in texts(at)
    # the home page: both runs say why (its banners are folded once the runs ended)
    at = app("app.py", path, monkeypatch)
    assert not at.exception and texts(at).count("was stopped; why:") == 2 and reason in texts(at)
