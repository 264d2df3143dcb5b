"""Run management: rename, tags, notes and delete, in the store, from `mpdiag runs` and on the Runs page; the run a
page opens on; what a rerun is called.

Ground truth is the store file read with plain SQL (every table, every row), never the page's or the CLI's own
code: a delete must remove the run's rows in every table and leave every other row as it was.
"""

import shutil
import sqlite3
import subprocess
import sys

import pandas as pd
import pytest
from app_helpers import runs_table
from conftest import EXAMPLES, ROOT, run_cli

from mpdiag import Store
from mpdiag.store import MAX_NAME_CHARS, MAX_NOTE_CHARS, MAX_TAG_CHARS, MAX_TAGS, RunBusy, RunTextRefused, StoreWriter

DATA = ROOT / "tests" / "fixtures" / "data"


def tables(path) -> dict[str, pd.DataFrame]:
    """Every table of the store with a run_id column, read with plain SQL, in a fixed order."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        out = {}
        for name in names:
            df = pd.read_sql_query(f"SELECT * FROM {name}", conn)
            out[name] = df.sort_values(list(df.columns)).reset_index(drop=True) if len(df) else df
        return out


@pytest.fixture
def three_runs(tmp_path):
    """A copy of the schema-7 store (runs 1 at O1 and 2 its FP32 twin, 3 a rerun of 1; rows in every per-run
    table), migrated, with tags and notes on every run."""
    path = tmp_path / "runs.db"
    shutil.copy(DATA / "store_v7.db", path)
    with StoreWriter(path) as writer:
        for run_id in (1, 2, 3):
            writer.tag_run(run_id, [f"t{run_id}", "shared"])
            writer.set_user_note(run_id, f"note {run_id}")
    return path


# -- the store ----------------------------------------------------------------------------------------------

def test_delete_removes_the_runs_rows_in_every_table_and_touches_nothing_else(three_runs):
    before = tables(three_runs)
    per_run = {t for t, df in before.items() if "run_id" in df and (df["run_id"] == 1).any()}
    assert {"runs", "steps", "tensors", "tensor_steps", "representability_totals",
            "tensor_totals", "hist_totals", "modules", "module_steps", "update_steps", "shadow_steps", "rank_steps",
            "fp8_steps", "fp8_histograms", "probes", "run_tags"} <= per_run  # the fixture has rows everywhere
    with StoreWriter(three_runs) as writer:
        deleted = writer.delete_run(1)
    after = tables(three_runs)
    assert set(after) == set(before)
    for table, old in before.items():
        if "run_id" in old:
            assert deleted[table] == int((old["run_id"] == 1).sum()), table
            assert not (after[table]["run_id"] == 1).any(), table
            old = old[old["run_id"] != 1].reset_index(drop=True)
        pd.testing.assert_frame_equal(after[table], old, obj=table)  # other runs, scripts, bundles: as they were
    runs = Store(three_runs).runs().set_index("run_id")
    assert list(runs.index) == [3, 2]
    # links to the deleted run read as none, though the rows holding them were not changed
    assert pd.isna(runs.loc[2, "pair_run_id"]) and pd.isna(runs.loc[3, "parent_run_id"])
    assert runs.loc[2, "tags"] == ["shared", "t2"] and runs.loc[3, "user_note"] == "note 3"


def test_a_running_run_cannot_be_deleted_and_a_dead_one_can(tmp_path):
    path = tmp_path / "runs.db"
    writer = StoreWriter(path)
    live = writer.create_run(name="still going", opt_level="O1")  # owned by this (alive) process
    before = tables(path)
    with pytest.raises(RunBusy, match=r"Run 1 is still running \(process \d+ on .*\).*Stop it or wait until it ends"):
        writer.delete_run(live)
    assert {k: v.to_dict() for k, v in tables(path).items()} == {k: v.to_dict() for k, v in before.items()}
    writer.close()
    subprocess.run([sys.executable, "-c", "import sys; from mpdiag.store import StoreWriter; "
                    "StoreWriter(sys.argv[1]).create_run(name='died', opt_level='O1')", str(path)], check=True, cwd=ROOT)
    assert Store(path).run(2)["status"] == "crashed"
    with StoreWriter(path) as w:
        assert w.delete_run(2)["runs"] == 1
    assert Store(path).runs()["run_id"].tolist() == [1]


@pytest.mark.parametrize("call, message", [
    (lambda w: w.rename_run(1, "   "), "A run name cannot be empty."),
    (lambda w: w.rename_run(1, "x" * (MAX_NAME_CHARS + 1)),
     f"A run name is at most {MAX_NAME_CHARS} characters; this one has {MAX_NAME_CHARS + 1}."),
    (lambda w: w.rename_run(1, "bell\x07"), r"A run name cannot contain control characters \(found U\+0007\)."),
    (lambda w: w.rename_run(1, "evil\u202egnp.py"), r"control characters \(found U\+202E\)"),  # a bidi override
    (lambda w: w.rename_run(1, "two\nlines"), r"found U\+000A"),
    (lambda w: w.tag_run(1, ["t" * (MAX_TAG_CHARS + 1)]), f"A tag is at most {MAX_TAG_CHARS} characters"),
    (lambda w: w.tag_run(1, [""]), "A tag cannot be empty."),
    (lambda w: w.tag_run(1, ["tab\there"]), r"A tag cannot contain control characters \(found U\+0009\)."),
    (lambda w: w.tag_run(1, [f"tag{i}" for i in range(MAX_TAGS)]), f"A run holds at most {MAX_TAGS} tags"),
    (lambda w: w.set_tags(1, [f"tag{i}" for i in range(MAX_TAGS + 1)]), f"at most {MAX_TAGS} tags"),
    (lambda w: w.set_user_note(1, "n" * (MAX_NOTE_CHARS + 1)), f"A note is at most {MAX_NOTE_CHARS:,} characters"),
    (lambda w: w.set_user_note(1, "nul\x00"), r"A note cannot contain control characters \(found U\+0000\)."),
])
def test_bad_names_tags_and_notes_are_refused_with_one_message_and_change_nothing(three_runs, call, message):
    before = tables(three_runs)
    with StoreWriter(three_runs) as writer, pytest.raises(RunTextRefused, match=message):
        call(writer)
    assert all(tables(three_runs)[t].equals(df) for t, df in before.items())


def test_rename_tags_and_notes_are_stored_as_given_and_read_back(three_runs):
    with StoreWriter(three_runs) as writer:
        assert writer.rename_run(1, "  baseline 🚀 fp16  ") == "baseline 🚀 fp16"
        assert writer.tag_run(1, ["fp16", " lr-sweep ", "fp16"]) == ["fp16", "lr-sweep", "shared", "t1"]
        assert writer.untag_run(1, ["t1", "not there"]) == ["fp16", "lr-sweep", "shared"]
        assert writer.set_user_note(1, "lr 3e-4\n\tbatch 64") == "lr 3e-4\n\tbatch 64"
        assert writer.set_tags(2, ["only"]) == ["only"]
        assert writer.set_user_note(3, "") == ""
        with pytest.raises(Exception, match="No run 42"):
            writer.rename_run(42, "x")
    with sqlite3.connect(three_runs) as conn:
        assert conn.execute("SELECT name, user_note, note FROM runs WHERE run_id = 1").fetchone() == \
            ("baseline 🚀 fp16", "lr 3e-4\n\tbatch 64", None)
        assert conn.execute("SELECT user_note FROM runs WHERE run_id = 3").fetchone() == (None,)
        assert conn.execute("SELECT run_id, tag FROM run_tags ORDER BY run_id, tag").fetchall() == [
            (1, "fp16"), (1, "lr-sweep"), (1, "shared"), (2, "only"), (3, "shared"), (3, "t3")]
    store = Store(three_runs)
    assert store.tags().to_dict("records") == [{"tag": "fp16", "runs": 1}, {"tag": "lr-sweep", "runs": 1},
                                               {"tag": "only", "runs": 1}, {"tag": "shared", "runs": 2},
                                               {"tag": "t3", "runs": 1}]


# -- the run a page opens on, and what a rerun is called ----------------------------------------------------

SINGLE_RUN_PAGES = ["pages/1_Gradients.py", "pages/2_Loss_scale.py", "pages/5_Findings.py", "pages/6_FP8.py",
                    "pages/7_Modules.py"]


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory):
    """The README Quick start's store shape: gallery_underflow at O1 with a static scale of 1 and an FP32 shadow,
    then its FP32 twin (--pair), recorded after it, so the twin is the newest run."""
    from mpdiag.training.runner import RunConfig, train_pair
    from mpdiag.training.script import ModelScript

    path = tmp_path_factory.mktemp("quick") / "runs.db"
    train_pair(ModelScript.from_path(EXAMPLES / "gallery_underflow.py"),
               RunConfig(opt_level="O1", loss_scale=1.0, steps=20, shadow_every=10, device="cpu"), path)
    return path


def app(page, store, monkeypatch, **query):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("MPDIAG_STORE", str(store))
    at = AppTest.from_file(str(ROOT / page), default_timeout=120)
    for key, value in query.items():
        at.query_params[key] = value
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def said(at) -> str:
    import re

    parts = [m.value for m in at.markdown] + [c.value for c in at.caption] + [i.value for i in at.info]
    parts += [w.value for w in at.warning] + [e.value for e in at.error] + [s.value for s in at.success]
    return re.sub(r"\\(.)", r"\1", "\n".join(parts))


@pytest.mark.parametrize("page", SINGLE_RUN_PAGES)
def test_a_page_opens_on_the_failing_run_not_its_newer_fp32_twin(page, quick_start, monkeypatch):
    from mpdiag.analysis.findings import diagnose

    store = Store(quick_start)
    runs = store.runs().set_index("run_id")
    # the store's truth: the newest run is the O0 twin of run 1, and run 1 is the one with findings
    assert runs.index[0] == 2 and runs.loc[2, "opt_level"] == "O0" and runs.loc[2, "pair_run_id"] == 1
    assert {f.severity for f in diagnose(store, 1)} & {"error", "warning"} and not diagnose(store, 2)
    at = app(page, quick_start, monkeypatch)
    assert at.selectbox(key="run").value == 1 and at.query_params["run"] == "1"
    if page.endswith("Findings.py"):
        assert "No findings" not in said(at)
        assert all(f.title in said(at) for f in diagnose(store, 1))  # the findings the store's run 1 has
    # an explicit ?run= wins, and so does the user's own choice, on every later rerun of the page
    assert app(page, quick_start, monkeypatch, run="2").selectbox(key="run").value == 2
    at.selectbox(key="run").set_value(2).run()
    assert at.run().selectbox(key="run").value == 2 and at.query_params["run"] == "2"


def test_likely_run_rule():
    from mpdiag.analysis.run_choice import likely_run

    def runs(*rows):  # newest first: (run_id, opt_level, status)
        return pd.DataFrame(rows, columns=["run_id", "opt_level", "status"])

    with_findings = {3}.__contains__
    assert likely_run(runs(), with_findings) is None
    assert likely_run(runs((4, "O0", "finished"), (3, "O1", "finished")), with_findings) == 3  # twin skipped
    assert likely_run(runs((4, "O0", "finished"), (2, "O0", "finished")), with_findings) == 4  # only references
    assert likely_run(runs((5, "bf16", "finished"), (4, "O0", "finished"), (3, "O1", "finished")), with_findings) == 3
    assert likely_run(runs((5, "bf16", "finished"), (4, "O1", "finished")), with_findings) == 5  # none: the newest
    assert likely_run(runs((5, "bf16", "running"), (3, "O1", "finished")), with_findings) == 5  # being watched


def test_a_rerun_of_the_fp32_twin_is_named_after_what_changed(quick_start):
    from mpdiag.training.runner import rerun_plan

    store = Store(quick_start)
    assert store.run(2)["name"] == "gallery_underflow.py (FP32 twin)"
    cases = [({"opt_level": "bf16"}, "gallery_underflow.py ↻ bf16"),
             ({"opt_level": "O1", "loss_scale": "dynamic", "init_scale": 256.0},
              "gallery_underflow.py ↻ O1: dynamic scaling, initial scale 2^8"),
             ({"opt_level": "O0", "steps": 50}, "gallery_underflow.py ↻ O0: 50 steps"),
             ({"opt_level": "bf16", "name": "mine"}, "mine")]
    for overrides, expected in cases:
        assert rerun_plan(store, 2, **overrides)[1].name == expected
    # a rerun of the O1 run at bf16: the scale it no longer uses is not called a change
    assert rerun_plan(store, 1, opt_level="bf16")[1].name == "gallery_underflow.py ↻ bf16"


def test_the_rerun_form_offers_the_failing_run_and_names_a_rerun_of_the_twin_by_its_change(quick_start, tmp_path,
                                                                                            monkeypatch):
    import time

    path = tmp_path / "runs.db"
    shutil.copy(quick_start, path)
    at = app("app.py", path, monkeypatch)
    assert at.selectbox(key="rerun_of").value == 1  # not the newer FP32 twin
    at.selectbox(key="rerun_of").set_value(2).run()
    assert at.text_input(key="rerun_name").value == ""  # never the parent's name (with its twin label)
    at.selectbox(key="rerun_level").set_value("bf16").run()
    at.number_input(key="rerun_steps").set_value(3).run()
    assert "Empty: this rerun is named “gallery_underflow.py ↻ bf16: 3 steps”." in said(at)
    at.button(key="rerun_start").click().run()
    assert "name: gallery_underflow.py ↻ bf16: 3 steps" in at.text[-1].value  # the confirmation names it
    at.button(key="rerun_start_confirm").click().run()
    deadline = time.time() + 180
    while time.time() < deadline:
        runs = Store(path).runs()
        if len(runs) == 3 and runs.iloc[0]["status"] not in ("queued", "running"):
            break
        time.sleep(0.5)
    child = Store(path).runs().iloc[0]
    assert (child["run_id"], child["parent_run_id"], child["opt_level"], child["status"]) == (3, 2, "bf16", "finished")
    assert child["name"] == "gallery_underflow.py ↻ bf16: 3 steps"
    at.text_input(key="rerun_name").set_value("sneaky\x1b[31m").run()
    assert "A run name cannot contain control characters (found U+001B)." in said(at)
    assert at.button(key="rerun_start").disabled


# -- the Runs page ------------------------------------------------------------------------------------------

def test_runs_page_renames_tags_notes_and_filters_on_click_only(three_runs, monkeypatch):
    before = tables(three_runs)
    at = app("app.py", three_runs, monkeypatch)
    at.selectbox(key="manage_run").set_value(1).run()
    at.text_input(key="manage_name_1").set_value("baseline fp16").run()
    at.multiselect(key="manage_tags_1").set_value(["shared", "fp16", "lr 3e-4"]).run()
    at.text_area(key="manage_note_1").set_value("scale 1 underflows\nsee step 40").run()
    assert all(tables(three_runs)[t].equals(df) for t, df in before.items())  # typing writes nothing
    at.button(key="manage_rename").click().run()
    at.button(key="manage_tag").click().run()
    at.button(key="manage_note").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Run #1's note saved." in said(at)
    with sqlite3.connect(three_runs) as conn:
        assert conn.execute("SELECT name, user_note FROM runs WHERE run_id = 1").fetchone() == \
            ("baseline fp16", "scale 1 underflows\nsee step 40")
        assert [t for (t,) in conn.execute("SELECT tag FROM run_tags WHERE run_id = 1 ORDER BY tag")] == \
            ["fp16", "lr 3e-4", "shared"]
    table = runs_table(at).set_index("run")
    assert table.loc[1, "name"] == "baseline fp16" and table.loc[1, "tags"] == "fp16, lr 3e-4, shared"
    assert table.loc[1, "note"] == "scale 1 underflows…" and table.loc[2, "tags"] == "shared, t2"
    at.multiselect(key="filter_tag").set_value(["fp16", "t3"]).run()  # any of the tags
    assert at.dataframe[0].value["run"].tolist() == [3, 1]
    at.multiselect(key="filter_status").set_value(["finished"]).run()
    assert at.dataframe[0].value["run"].tolist() == [3, 1]
    at.multiselect(key="filter_tag").set_value([]).run()
    at.multiselect(key="filter_script").set_value(["tiny.py"]).run()
    assert at.dataframe[0].value["run"].tolist() == [3, 2, 1]
    at.multiselect(key="filter_tag").set_value(["fp16"]).run()
    at.multiselect(key="filter_opt level").set_value(["O0"]).run()  # no run matches: an empty table, no error
    assert not at.exception and at.dataframe[0].value.empty


@pytest.mark.parametrize("widget, value, button, message", [
    ("manage_name_1", "   ", "manage_rename", "A run name cannot be empty."),
    ("manage_name_1", "bell\x07", "manage_rename", "A run name cannot contain control characters (found U+0007)."),
    ("manage_tags_1", ["t" * 41], "manage_tag", "A tag is at most 40 characters; this one has 41."),
    ("manage_note_1", "nul\x00", "manage_note", "A note cannot contain control characters (found U+0000)."),
])
def test_runs_page_refuses_bad_input_with_one_message(three_runs, monkeypatch, widget, value, button, message):
    before = tables(three_runs)
    at = app("app.py", three_runs, monkeypatch)
    at.selectbox(key="manage_run").set_value(1).run()
    element = {"name": at.text_input, "tags": at.multiselect, "note": at.text_area}[widget.split("_")[1]]
    element(key=widget).set_value(value).run()
    at.button(key=button).click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert [e.value.replace("\\", "") for e in at.error] == [message]  # one message, as typed (unescaped)
    assert all(tables(three_runs)[t].equals(df) for t, df in before.items())


def test_runs_page_deletes_a_run_after_a_confirming_click_and_nothing_else(three_runs, monkeypatch):
    before = tables(three_runs)
    at = app("app.py", three_runs, monkeypatch)
    at.selectbox(key="manage_run").set_value(2).run()
    at.button(key="manage_delete").click().run()  # asks, naming the run
    assert at.text[-1].value == "#2 · tiny.py (FP32 twin) · O0 · finished, 3 steps · FP32 twin of #1"
    assert all(tables(three_runs)[t].equals(df) for t, df in before.items())
    at.button(key="manage_delete_cancel").click().run()
    assert not any(b.key == "manage_delete_confirm" for b in at.button)  # answered: the panel is gone
    at.button(key="manage_delete").click().run()
    at.selectbox(key="manage_run").set_value(3).run()  # choosing another run drops the request
    assert not any(b.key == "manage_delete_confirm" for b in at.button)
    at.selectbox(key="manage_run").set_value(2).run()
    at.button(key="manage_delete").click().run()
    at.button(key="manage_delete_confirm").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Deleted run #2:" in said(at)
    after = tables(three_runs)
    for table, old in before.items():
        if "run_id" in old:
            assert not (after[table]["run_id"] == 2).any(), table
            old = old[old["run_id"] != 2].reset_index(drop=True)
        pd.testing.assert_frame_equal(after[table], old, obj=table)
    assert at.dataframe[0].value["run"].tolist() == [3, 1]


@pytest.mark.parametrize("page", [*SINGLE_RUN_PAGES, "pages/3_Compare.py"])
def test_pages_of_a_run_whose_fp32_twin_was_deleted_still_render(page, quick_start, tmp_path, monkeypatch):
    path = tmp_path / "runs.db"
    shutil.copy(quick_start, path)
    with StoreWriter(path) as writer:
        writer.delete_run(2)
    assert pd.isna(Store(path).run(1)["pair_run_id"])
    at = app(page, path, monkeypatch)  # no exception (asserted in app)
    if page != "pages/3_Compare.py":
        assert at.selectbox(key="run").value == 1


def test_a_running_run_offers_no_delete_and_says_why(tmp_path, monkeypatch):
    path = tmp_path / "runs.db"
    writer = StoreWriter(path)
    writer.create_run(name="going", opt_level="O1")  # this process is alive: the run is running
    at = app("app.py", path, monkeypatch)
    assert at.button(key="manage_delete").disabled
    assert "Run #1 is running: it cannot be deleted while its process may still write to the store." in said(at)
    writer.close()


# -- mpdiag runs ----------------------------------------------------------------------------------------------

def cli(*args, capsys=None):
    from mpdiag.cli import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_runs_rename_tag_untag_note_list_and_filter(three_runs, capsys):
    store = ("--store", three_runs)
    assert cli("runs", "rename", 1, "baseline fp16", *store, capsys=capsys)[:2] == \
        (0, "run 1 (tiny.py) renamed to baseline fp16\n")
    assert cli("runs", *store, "tag", 1, "fp16", "sweep", capsys=capsys)[1] == \
        "run 1 (baseline fp16) tags: fp16, shared, sweep, t1\n"  # --store before the action works too
    assert cli("runs", "untag", 1, "t1", "sweep", *store, capsys=capsys)[1] == "run 1 (baseline fp16) tags: fp16, shared\n"
    assert cli("runs", "note", 2, "the reference", *store, capsys=capsys)[1] == \
        "run 2 (tiny.py (FP32 twin)) note saved\n"
    with sqlite3.connect(three_runs) as conn:
        assert conn.execute("SELECT name FROM runs WHERE run_id = 1").fetchone() == ("baseline fp16",)
        assert conn.execute("SELECT user_note FROM runs WHERE run_id = 2").fetchone() == ("the reference",)
        assert conn.execute("SELECT tag FROM run_tags WHERE run_id = 1 ORDER BY tag").fetchall() == [("fp16",),
                                                                                                   ("shared",)]
    code, out, _ = cli("runs", *store, capsys=capsys)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 4 and "baseline fp16" in lines[3] and "fp16,shared" in lines[3]
    assert "the reference" in lines[2]
    assert not any(word in out for word in ("NaN", "nan", "<NA>", "None"))  # an O0 twin has no scale: blank
    with sqlite3.connect(three_runs) as conn:
        for run_id, final_loss in conn.execute("SELECT run_id, loss FROM steps s WHERE step = "
                                               "(SELECT MAX(step) FROM steps WHERE run_id = s.run_id)"):
            row = next(line for line in lines[1:] if line.split()[0] == str(run_id))
            assert format(final_loss, ".6g") in row.split()  # significant digits, not 0.000064
    out = cli("runs", "--tag", "fp16", "--tag", "t3", *store, capsys=capsys)[1]
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["3", "1"]
    out = cli("runs", "list", "--status", "finished", "--script", "tiny.py", *store, capsys=capsys)[1]
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["3", "2", "1"]
    assert cli("runs", "--status", "crashed", *store, capsys=capsys)[1] == \
        "no run matches these filters (3 runs in the store)\n"


def test_cli_refuses_bad_input_and_unknown_runs_with_exit_2(three_runs, capsys):
    before = tables(three_runs)
    store = ("--store", three_runs)
    for args, message in [
        (("rename", 1, ""), "mpdiag: A run name cannot be empty.\n"),
        (("tag", 1, "x" * 41), "mpdiag: A tag is at most 40 characters; this one has 41.\n"),
        (("note", 1, "a\x1b[2Jb"), "mpdiag: A note cannot contain control characters (found U+001B).\n"),
        (("rename", 9, "x"), f"mpdiag: No run 9 in {three_runs}. `python -m mpdiag runs` lists the runs.\n"),
        (("delete", 9, "--yes"), f"mpdiag: No run 9 in {three_runs}. `python -m mpdiag runs` lists the runs.\n"),
    ]:
        assert cli("runs", *args, *store, capsys=capsys) == (2, "", message)
    assert all(tables(three_runs)[t].equals(df) for t, df in before.items())


def test_cli_delete_asks_first_and_refuses_a_running_run(three_runs, tmp_path):
    before = tables(three_runs)
    refused = run_cli("runs", "delete", "2", "--store", three_runs)  # stdin is not a terminal: nothing to confirm
    assert refused.returncode == 2 and refused.stderr == (
        "mpdiag: run 2 (tiny.py (FP32 twin)) was not deleted: not at a terminal, so nothing can be confirmed; pass "
        "--yes to delete it\n")
    assert all(tables(three_runs)[t].equals(df) for t, df in before.items())
    done = run_cli("runs", "delete", "2", "--yes", "--store", three_runs)
    assert done.returncode == 0 and done.stdout.startswith("deleted run 2 (tiny.py (FP32 twin)): ")
    assert not any((df["run_id"] == 2).any() for df in tables(three_runs).values() if "run_id" in df)
    # a run whose process is alive (this test's): refused, with why
    live_store = tmp_path / "live.db"
    writer = StoreWriter(live_store)
    writer.create_run(name="going", opt_level="O1")
    busy = run_cli("runs", "delete", "1", "--yes", "--store", live_store)
    assert busy.returncode == 2 and "Run 1 is still running" in busy.stderr and "Stop it or wait" in busy.stderr
    assert Store(live_store).runs()["run_id"].tolist() == [1]
    writer.close()


def test_cli_listing_shows_control_characters_escaped(tmp_path, capsys):
    """A run name written by a script (not through rename, which refuses them) with a terminal escape
    sequence is printed escaped, so listing runs cannot drive the terminal."""
    path = tmp_path / "runs.db"
    with StoreWriter(path, finish_runs=True) as writer:
        writer.create_run(name="evil\x1b[2J\x1b]0;title\x07", opt_level="O1")
    out = cli("runs", "--store", path, capsys=capsys)[1]
    assert "\x1b" not in out and "\x07" not in out and "evil\\x1b[2J\\x1b]0;title\\x07" in out
