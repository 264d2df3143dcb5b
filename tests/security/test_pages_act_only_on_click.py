"""No action from a URL: loading any page, with any query parameters, starts, checks, probes, reruns, renames,
tags, notes or deletes nothing.

The store holds a script that writes a marker file whenever it is executed, and a finished run of it that the
Findings page could probe and the home page could rerun. Every page is loaded with hostile query parameters
(the store named in the URL, run ids, the script's hash, action-sounding names), with that store configured
as MPDIAG_STORE and with it only named in the URL. Child processes are recorded by patching subprocess.Popen
and the dashboard's action functions; the marker must not appear.
"""

import subprocess
import textwrap

import pytest
from conftest import EXAMPLES, ROOT
from streamlit.testing.v1 import AppTest

from mpdiag import Store
from mpdiag.dashboard import actions
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript

PAGES = ["app.py", "pages/1_Gradients.py", "pages/2_Loss_scale.py", "pages/3_Compare.py", "pages/4_Upload.py",
         "pages/5_Findings.py", "pages/6_FP8.py", "pages/8_Plan.py"]


@pytest.fixture(scope="module")
def marker_store(tmp_path_factory):
    """(store, marker): one finished O1 run (dynamic scaling, so probe-able) of a script that appends to
    ``marker`` every time build() runs; the marker is removed after recording."""
    folder = tmp_path_factory.mktemp("marker")
    marker = folder / "EXECUTED"
    source = (EXAMPLES / "mlp_digits.py").read_text() + textwrap.dedent(f"""

        _original_build = build


        def build(device):
            with open({str(marker)!r}, "a") as fh:
                fh.write("executed\\n")
            return _original_build(device)
        """)
    store = folder / "runs.db"
    train(ModelScript(filename="marker.py", source=source), RunConfig(opt_level="O1", steps=3, device="cpu"), store)
    assert marker.exists()  # the script does write it when executed
    marker.unlink()
    return store, marker


@pytest.fixture
def spawned(monkeypatch):
    """Every attempt to start a process or an action, recorded instead of done."""
    calls = []

    def record(name):
        def fake(*args, **kwargs):
            calls.append((name, args))
            raise AssertionError(f"{name} was called by loading a page")
        return fake

    monkeypatch.setattr(subprocess, "Popen", record("subprocess.Popen"))
    for name in ("start_run", "start_rerun", "start_verify", "check_upload", "probe", "store_upload", "rename_run",
                 "set_tags", "set_note", "delete_run"):
        monkeypatch.setattr(actions, name, record(f"actions.{name}"))
    return calls


def hostile_query(store, sha):
    return {"store": str(store), "run": "1", "runs": ["1", "1"], "script": sha, "tensor": "0.weight", "check": "1",
            "probe": "1", "start": "1", "rerun": "1", "fix": "1", "confirm": "1", "new_start": "1",
            "upload_start": "1", "first_example": "1", "check_confirm": "1", "probe_1_confirm": "1",
            "manage_run": "1", "manage_rename": "1", "manage_name_1": "renamed", "manage_tag": "1", "tags": "x",
            "manage_note": "1", "note": "x", "manage_delete": "1", "manage_delete_confirm": "1", "delete": "1",
            "plan_verify_1": "1", "plan_verify_1_confirm": "1", "verify": "1"}


@pytest.mark.parametrize("configured", [True, False], ids=["configured-store", "store-only-in-url"])
@pytest.mark.parametrize("page", PAGES)
def test_loading_a_page_with_hostile_query_parameters_executes_nothing(page, configured, marker_store, spawned,
                                                                       tmp_path, monkeypatch):
    store, marker = marker_store
    sha = Store(store).scripts()["sha256"].iloc[0]
    monkeypatch.setenv("MPDIAG_STORE", str(store if configured else tmp_path / "empty.db"))
    at = AppTest.from_file(str(ROOT / page), default_timeout=60)
    for key, value in hostile_query(store, sha).items():
        at.query_params[key] = value
    at.run()
    at.run()  # a second script run (as a refresh or a fragment rerun would) starts nothing either
    assert not at.exception, [e.value for e in at.exception]
    assert spawned == []
    assert not marker.exists()
    run = Store(store).run(1)  # nothing renamed, tagged, noted or deleted either
    assert (run["name"], run["tags"], run["user_note"]) == ("marker.py", [], None)
    if not configured:  # the URL cannot point the app at a store: the configured (empty) one is shown
        assert Store(tmp_path / "empty.db").runs().empty
        assert all(str(s.value) != str(store) for s in at.sidebar.selectbox)


def test_the_probe_runs_only_after_a_click_and_its_confirmation(marker_store, tmp_path, monkeypatch):
    """The positive side: the same page does probe once the user clicks and confirms (the probe executes the
    stored script in a child, which writes the marker)."""
    store, marker = marker_store
    copy = tmp_path / "runs.db"
    copy.write_bytes(store.read_bytes())
    monkeypatch.setenv("MPDIAG_STORE", str(copy))
    at = AppTest.from_file(str(ROOT / "pages/5_Findings.py"), default_timeout=120)
    at.query_params["run"] = "1"
    at.run()
    at.button(key="probe_1").click().run()
    assert not marker.exists() and at.button(key="probe_1_confirm")  # armed, shown, not run
    at.button(key="probe_1_confirm").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert marker.exists() and Store(copy).probe(1, "scale-linearity") is not None
    marker.unlink()
