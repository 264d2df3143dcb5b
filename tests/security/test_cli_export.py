"""`export`: never writes into a folder that holds other files without --force, names a path it cannot write
(no traceback), and creates nothing for a run that does not exist."""

import pytest

from mpdiag.cli import main
from mpdiag.store import StoreWriter


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "runs.db"
    StoreWriter(path).create_run(name="one run", opt_level="O1")
    return path


def test_export_refuses_a_folder_that_is_not_empty_and_leaves_it_unchanged(store, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "run1_steps.csv").write_text("not an export")
    code = main(["export", "1", "--out", str(out), "--store", str(store)])
    err = capsys.readouterr().err
    assert code == 2 and "is not empty" in err and "--force" in err and err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "run1_steps.csv"]
    assert (out / "run1_steps.csv").read_text() == "not an export"
    assert main(["export", "1", "--out", str(out), "--store", str(store), "--force"]) == 0
    assert (out / "notes.txt").read_text() == "my notes" and (out / "run1_steps.parquet").exists()


def test_export_names_a_path_it_cannot_write_without_a_traceback(store, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = blocker / "export"  # below a file: no folder can be made there (even for root)
    code = main(["export", "1", "--out", str(out), "--store", str(store)])
    err = capsys.readouterr().err
    assert code == 2 and err == f"mpdiag: cannot write the export to {out}: Not a directory\n"


def test_export_of_an_unknown_run_creates_nothing(store, tmp_path, capsys):
    out = tmp_path / "new"
    code = main(["export", "42", "--out", str(out), "--store", str(store)])
    assert code == 2 and "No run 42" in capsys.readouterr().err
    assert not out.exists()
