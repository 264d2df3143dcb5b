"""Training code uploaded in the browser (issue 14, item 2): several files or a .zip, checked in a child (compiled,
never run), run unmodified through ``mpdiag watch`` in a supervised child, recorded like any run; reruns of watched
runs from the app (uploaded code, or a script ``mpdiag watch`` ran from the command line). The numbers are checked
against what the uploaded loop computed itself (clip_grad_norm_'s norm, its GradScaler's state)."""

import io
import json
import math
import zipfile

import pytest
from app_helpers import app, confirm, runs_table, shown, texts, wait_for_runs
from conftest import ROOT

from mpdiag.sandbox.bundle import MAX_BUNDLE_BYTES, BundleRefused, bundle_from_uploads, check_bundle, command_line
from mpdiag.store import Store

AMP_LOOP = (ROOT / "tests" / "fixtures" / "scripts" / "amp_loop.py").read_bytes()
TRAINING_CODE = "Training code as it is (mpdiag watch)"


def zipped(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return out.getvalue()


#: a project folder as a user zips it: the loop, an entry script importing it from beside it, byte-code left in
PROJECT = {"proj/amp_loop.py": AMP_LOOP, "proj/launch.py": b"import amp_loop  # noqa: F401 - the loop runs on import\n",
           "proj/__pycache__/amp_loop.cpython-311.pyc": b"\x00junk", "proj/data/readme.txt": b"data beside the code\n"}


# -- the bundle: made and validated in the server, nothing executed ---------------------------------------------
def test_a_zipped_folder_becomes_its_files_without_the_folder_and_the_byte_code():
    bundle = bundle_from_uploads([("proj.zip", zipped(PROJECT))])
    assert [path for path, _ in bundle.files] == ["amp_loop.py", "data/readme.txt", "launch.py"]
    assert bundle.name == "proj.zip" and bundle.python_files() == ["amp_loop.py", "launch.py"]
    # the same files, zipped in another order or uploaded one by one, are the same bundle (the store's key)
    again = bundle_from_uploads([("other.zip", zipped(dict(reversed(list(PROJECT.items())))))])
    files = bundle_from_uploads([(name.removeprefix("proj/"), data) for name, data in PROJECT.items()])
    assert bundle.sha256 == again.sha256 == files.sha256


def test_a_file_with_a_main_block_or_a_training_name_is_offered_first():
    bundle = bundle_from_uploads([("a_utils.py", b"x = 1\n"), ("b.py", b"if __name__ == '__main__':\n    pass\n"),
                                  ("pkg/train_gpt.py", b"y = 2\n")])
    assert bundle.entry_points() == ["b.py", "pkg/train_gpt.py", "a_utils.py"]


def test_the_command_shown_is_what_a_shell_would_run():
    """The Upload page shows, and the watched run repeats, the command as a shell reads it: each argument one
    word again after shlex.split."""
    import shlex

    args = ["--lr=1e-3", "--name", "two words", "it's"]
    assert command_line("pkg/train.py", args) == "python pkg/train.py --lr=1e-3 --name 'two words' 'it'\"'\"'s'"
    assert command_line("pkg/train.py", args, as_module=True).startswith("python -m pkg.train --lr=1e-3 ")
    assert shlex.split(command_line("pkg/__init__.py", args, as_module=True)) == ["python", "-m", "pkg", *args]


@pytest.mark.parametrize("uploads, message", [
    ([("x.zip", zipped({"../evil.py": b""}))], "leaves the bundle"),
    ([("x.zip", zipped({"/etc/evil.py": b""}))], "an absolute path"),
    ([("x.zip", b"PK not really")], "x.zip is not a zip file."),
    ([("x.zip", zipped({"notes.txt": b"no code"}))], "no Python file to run"),
    ([("a.py", b""), ("b.zip", zipped({"c.py": b""}))], "upload a .zip on its own"),
    ([("a.py", b""), ("sub/../a.py", b"")], "leaves the bundle"),
    ([], "No files uploaded."),
    # what would pass these checks and then fail to be written out for the child: refused up front, by name
    ([("a", b""), ("a/b.py", b"")], "a is both a file and a folder of the upload."),
    ([("x.zip", zipped({"pkg": b"", "pkg/train.py": b""}))], "pkg is both a file and a folder"),
    ([("n" * 256 + ".py", b"")], "a name of 259 bytes; at most 255"),
    ([("x.zip", zipped({"/".join(["d" * 200] * 6) + "/t.py": b""}))], "a path of 1,210 bytes; at most 1,024"),
    ([("/".join("d" * 40) + "/t.py", b"")], "40 folders deep; at most 32"),
    ([(f"f{i}.py", b"") for i in range(2001)], "2,001 files uploaded; a bundle holds at most 2,000."),
])
def test_uploads_that_cannot_be_a_bundle_are_refused_with_the_reason(uploads, message):
    with pytest.raises(BundleRefused, match=message.replace(".", r"\.")):
        bundle_from_uploads(uploads)


def test_a_zip_that_unpacks_past_the_limit_is_refused_whatever_it_declares():
    bomb = zipped({"big.py": b"\0" * (MAX_BUNDLE_BYTES + 1)})  # about 20 KiB compressed
    assert len(bomb) < 100_000
    with pytest.raises(BundleRefused, match="unpacks to more than 20 MiB"):
        bundle_from_uploads([("bomb.zip", bomb)])


# -- the check: in a child, compiling and reading, running nothing ----------------------------------------------
def test_the_check_names_a_syntax_error_in_an_imported_file_and_a_missing_module(tmp_path):
    marker = tmp_path / "ran"
    bundle = bundle_from_uploads([
        ("train.py", f"import helper\nimport not_installed_anywhere\nopen({str(marker)!r}, 'w')\n".encode()),
        ("helper.py", b"def broken(:\n    pass\n")])
    report = check_bundle(bundle, "train.py", ["--x", "1"])
    assert not report.ready
    assert report.problems == ["helper.py, line 1: SyntaxError: invalid syntax"] or \
        report.problems[0].startswith("helper.py, line 1: SyntaxError")
    assert [str(w) for w in report.warnings] == [
        "train.py, line 2: imports not_installed_anywhere, which neither the bundle nor this Python provides "
        "(fine if the script guards that import)"]
    assert not marker.exists()  # the check compiled the entry point; it did not run it


def test_one_uploaded_file_is_named_once_in_its_report_and_each_warning():
    """A first-time user's one-file upload read 'train.py: train.py, line 48: train.py: .half() ...' (its name three
    times on each warning); a .zip's report names the bundle and the entry point, each warning its own file."""
    source = b"import torch\nm = torch.nn.Linear(2, 2).half()\nscaler = torch.amp.GradScaler(init_scale=1.0)\n"
    report = check_bundle(bundle_from_uploads([("train.py", source)]), "train.py", [])
    assert report.ready and report.filename == "train.py"
    assert [str(w).split(": ")[0] for w in report.warnings] == ["train.py, line 2", "train.py, line 3"]
    assert [str(w).count("train.py") for w in report.warnings] == [1, 1]
    project = {"train.py": b"import helper\n", "lib/helper.py": source}
    zipped_report = check_bundle(bundle_from_uploads([("proj.zip", zipped(project))]), "lib/helper.py", [])
    assert zipped_report.filename == "proj.zip: lib/helper.py"
    assert [str(w).split(": ")[0] for w in zipped_report.warnings] == ["lib/helper.py, line 2", "lib/helper.py, line 3"]


def test_the_check_of_good_code_says_what_will_run():
    report = check_bundle(bundle_from_uploads([("proj.zip", zipped(PROJECT))]), "launch.py", ["out.json"])
    assert report.ready and not report.problems, report.problems
    assert report.summary["command"] == "python launch.py out.json" and report.summary["Python files"] == 2


# -- the Upload page: upload, check, run, and the numbers are the loop's own ------------------------------------
def upload_code(at, name: str, data: bytes, entry: str, args: str):
    at.radio(key="kind").set_value(TRAINING_CODE).run()
    at.file_uploader(key="code_upload").set_value([(name, data, "application/zip")]).run()
    sha = at.selectbox(key="code").value
    at.selectbox(key=f"entry_{sha}").set_value(entry).run()
    at.text_input(key=f"args_{sha}").set_value(args).run()
    return confirm(at, "code_check")


def test_the_checks_confirmation_says_nothing_of_the_code_runs(tmp_path, monkeypatch):
    """The check of uploaded code compiles and reads it: its confirmation said "this runs the script below as
    Python", and a user took the check for a run. It says what the check does; starting the run still says it runs."""
    at = app("pages/4_Upload.py", tmp_path / "up.db", monkeypatch)
    at.radio(key="kind").set_value(TRAINING_CODE).run()
    at.file_uploader(key="code_upload").set_value([("proj.zip", zipped(PROJECT), "application/zip")]).run()
    sha = at.selectbox(key="code").value
    at.selectbox(key=f"entry_{sha}").set_value("launch.py").run()
    at.button(key="code_check").click().run()
    said = " ".join(m.value for m in at.markdown)
    assert "nothing of it runs" in said and "this runs the script below as Python" not in said


@pytest.mark.slow
def test_uploaded_code_runs_unmodified_and_records_what_the_loop_computed(tmp_path, monkeypatch):
    store, log_path = tmp_path / "up.db", tmp_path / "log.json"
    at = upload_code(app("pages/4_Upload.py", store, monkeypatch), "proj.zip", zipped(PROJECT), "launch.py",
                     f"{log_path} --steps 6 --accumulate 2")
    assert not at.exception and "proj.zip: launch.py: ready" in [shown(s.value) for s in at.success]
    assert f"python launch.py {log_path} --steps 6 --accumulate 2" in texts(at)
    confirm(at, "code_start")
    run = wait_for_runs(store, 1).iloc[0]
    assert run["status"] == "finished", run["error"]
    log, steps = json.loads(log_path.read_text()), Store(store).steps(int(run["run_id"]))
    assert steps["loss"].tolist() == pytest.approx(log["loss"], rel=1e-6)
    assert steps["loss_scale"].tolist() == log["scale"] and steps["scale_after"].tolist() == log["scale_after"]
    assert steps["skipped"].tolist() == [int(a < b) for b, a in zip(log["scale"], log["scale_after"], strict=True)]
    stats = Store(store).tensor_stats(int(run["run_id"]))
    for step, norm in enumerate(log["grad_norm"]):
        if math.isfinite(norm):
            assert math.sqrt((stats[stats["step"] == step]["l2"] ** 2).sum()) == pytest.approx(norm, rel=2e-6)
    settings = run["config"]["watch"]
    assert settings["argv"] == ["launch.py", str(log_path), "--steps", "6", "--accumulate", "2"]
    assert settings["cwd"] is None and settings["bundle"] == Store(store).bundles()["sha256"].iloc[0]
    assert run["script_path"] is None  # the child's temporary copy is not a path anyone can open
    home = app("app.py", store, monkeypatch)  # the runs table names the entry point it ran (item 9)
    assert runs_table(home).set_index("run").loc[int(run["run_id"]), "script"] == "launch.py (uploaded)"
    said = texts(at.run())
    assert "launch.py" in said and "finished" in said  # the page says what it started and how it ended


@pytest.mark.slow
def test_a_finding_on_uploaded_code_is_fixed_by_a_rerun_from_the_findings_page(tmp_path, monkeypatch):
    """Every step skipped at init scale 2^40: the Findings page reruns the uploaded code with its fix (a lower
    initial scale, which watch gives every GradScaler the script creates); the rerun no longer skips."""
    store, log_path = tmp_path / "up.db", tmp_path / "log.json"
    at = upload_code(app("pages/4_Upload.py", store, monkeypatch), "proj.zip", zipped(PROJECT), "launch.py",
                     f"{log_path} --steps 4 --init-scale 1099511627776")
    confirm(at, "code_start")
    parent = int(wait_for_runs(store, 1).iloc[0]["run_id"])
    assert Store(store).steps(parent)["skipped"].tolist() == [1, 1, 1, 1]
    at = app("pages/5_Findings.py", store, monkeypatch, run=str(parent))
    fixes = [b for b in at.button if b.label.startswith("Rerun with this fix")]
    assert fixes and not any(b.disabled for b in fixes), texts(at)
    confirm(at, fixes[0].key)
    child = wait_for_runs(store, 2).iloc[0]
    assert (int(child["parent_run_id"]), child["status"]) == (parent, "finished"), child["error"]
    fix = child["config"]["watch"]
    assert fix["argv"] == ["launch.py", str(log_path), "--steps", "4", "--init-scale", "1099511627776"]
    assert json.loads(log_path.read_text())["scale"][0] == fix["init_scale"] or fix["opt_level"] == "bf16"
    assert Store(store).steps(int(child["run_id"]))["skipped"].sum() < 4
    table = app("pages/5_Findings.py", store, monkeypatch, run=str(parent)).dataframe[0].value
    assert table.iloc[0]["run"] == parent  # the run itself first, whose loss the rerun's is read against
    rerun = table[table["run"] == int(child["run_id"])].iloc[0]
    assert rerun["still there"] == "none" and rerun["gone"].startswith("1 of")


@pytest.mark.slow
def test_a_command_line_watch_is_rerun_from_the_app_in_its_directory(tmp_path, monkeypatch):
    """A script mpdiag watch ran from the command line, which reads a file relative to where it ran: the Runs
    page's rerun form repeats it there at another level."""
    from conftest import run_cli

    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "steps.txt").write_text("3\n")
    (folder / "train.py").write_bytes(AMP_LOOP.replace(b'default=6', b'default=int(open("data/steps.txt").read())'))
    store, log_path = tmp_path / "s.db", tmp_path / "log.json"
    done = run_cli("watch", "--store", str(store), "train.py", str(log_path), cwd=folder)
    assert done.returncode == 0, done.stderr[-2000:]
    monkeypatch.chdir(tmp_path)  # the app serves from elsewhere
    at = app("app.py", store, monkeypatch)
    at.selectbox(key="rerun_watch_level").set_value("bf16").run()
    assert f"python train.py {log_path}" in texts(at) and str(folder) in texts(at)
    confirm(at, "rerun_start")
    child = wait_for_runs(store, 2).iloc[0]
    assert (child["status"], child["opt_level"], child["scaling"], child["steps_done"]) == ("finished", "bf16", "none", 3)
    assert child["config"]["watch"]["cwd"] == str(folder)


def test_the_command_line_does_not_rerun_uploaded_code_in_its_own_process(tmp_path):
    from conftest import run_cli

    from mpdiag.store import StoreWriter

    bundle = bundle_from_uploads([("train.py", b"print('hi')\n")])
    store = tmp_path / "s.db"
    with StoreWriter(store) as writer:
        sha = writer.add_bundle(bundle.name, bundle.to_zip())
        run_id = writer.create_run(name="train.py", opt_level="custom",
                                   config={"watch": {"argv": ["train.py"], "cwd": None, "bundle": sha}})
        writer.end_run(run_id, "finished")
    done = run_cli("rerun", str(run_id), "--opt-level", "bf16", "--store", str(store))
    assert done.returncode == 2 and "uploaded in the app; rerun it there" in done.stderr
    assert len(Store(store).runs()) == 1


@pytest.mark.slow
def test_uploaded_code_that_breaks_in_its_optimizer_step_gets_the_finding_from_its_child(tmp_path, monkeypatch):
    """The optimizer-step check runs in the supervised child: its record reaches the run through the supervisor
    (which keeps the run's watch settings), and Findings states it with no rerun it cannot do."""
    from loops import HALF_LOOP, first_broken_step

    store, truth_path = tmp_path / "up.db", tmp_path / "truth.json"
    at = upload_code(app("pages/4_Upload.py", store, monkeypatch), "half_loop.py", HALF_LOOP.encode(),
                     "half_loop.py", str(truth_path))
    confirm(at, "code_start")
    run = wait_for_runs(store, 1).iloc[0]
    assert run["status"] == "finished", run["error"]
    step, broken = first_broken_step(json.loads(truth_path.read_text()))
    event = run["config"]["optimizer_step_nonfinite"]
    assert (event["step"], set(event["tensors"])) == (step, set(broken))
    assert run["config"]["watch"]["bundle"] == Store(store).bundles()["sha256"].iloc[0]
    page = app("pages/5_Findings.py", store, monkeypatch, run=str(int(run["run_id"])))
    assert not page.exception and "The optimizer step made weights or optimizer state non-finite" in texts(page)
    assert not [b for b in page.button if b.label.startswith("Rerun with this fix") and not b.disabled]


def test_the_check_warns_of_a_small_initial_loss_scale_and_says_what_a_half_cast_changes():
    """A first-time user's FP16 script with GradScaler(init_scale=1.0) had 99.8 % of its gradients subnormal: the
    check said nothing of it, and told them to 'let the opt level decide (O2/O3)' of a .half() used only to count
    values (watch refuses O2/O3). The scale is named; the .half() warning says when it matters."""
    from mpdiag.sandbox.check import static_warnings

    source = ("import torch\nscaler = torch.amp.GradScaler('cpu', init_scale=1.0)\n"
              "big = torch.amp.GradScaler('cpu', init_scale=2.0**16)\nlost = (torch.ones(2).half() == 0).sum()\n")
    said = {w.line: w.message for w in static_warnings(source, cuda_available=False)}
    assert said[2].startswith("GradScaler(init_scale=1.0): gradient values below 2^-24 / 1.0 flush to zero")
    assert 3 not in said  # the default scale is no warning
    assert "a cast to measure something changes nothing" in said[4] and "O2/O3" in said[4]
