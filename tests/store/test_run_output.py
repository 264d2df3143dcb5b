"""A run's console output kept with it (issue 27): bounded (the first HEAD_BYTES and the last TAIL_BYTES, one line
saying how many bytes were cut), refreshed while the run goes, final at its end; for ``mpdiag watch`` and ``mpdiag
run`` in a terminal (teed: the terminal still gets every byte) and for runs started from the app (written by the
supervisor from the child's pipe; a child cannot write it). Migrated in place, deleted with its run, exported.

Ground truth is what the scripts printed, built here byte for byte, and the store read with plain SQL.
"""

import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time

import pandas as pd
import pytest
from conftest import ROOT, run_cli

from mpdiag.numerics.formats import LOW_PRECISION
from mpdiag.recording.console import tee_console
from mpdiag.sandbox.launch import RunOwner, launch, watch_job
from mpdiag.store import SCHEMA_VERSION, Store, StoreWriter
from mpdiag.store.console import HEAD_BYTES, TAIL_BYTES, ConsoleCapture, cut_line
from mpdiag.store.export import run_tables

DATA = ROOT / "tests" / "fixtures" / "data"


def expected_kept(full: str) -> str:
    """What the store keeps of ``full`` (ASCII), built from the rule, not from ConsoleCapture."""
    data = full.encode()
    if len(data) <= HEAD_BYTES + TAIL_BYTES:
        return full
    head, tail = data[:HEAD_BYTES].decode(), data[-TAIL_BYTES:].decode()
    cut = len(data) - HEAD_BYTES - TAIL_BYTES
    return head + ("" if head.endswith("\n") else "\n") + cut_line(cut) + "\n" + tail


def raw_output(path) -> pd.DataFrame:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return pd.read_sql_query("SELECT * FROM run_output ORDER BY run_id", conn)


# -- the bound -------------------------------------------------------------------------------------------------
def test_the_capture_keeps_everything_up_to_the_bound_then_head_cut_line_and_tail():
    assert (HEAD_BYTES, TAIL_BYTES) == (64 * 1024, 448 * 1024)
    small = ConsoleCapture()
    small.add("a\n")
    small.add(b"b\n")
    assert small.snapshot() == ("a\nb\n", 4)
    exact = ConsoleCapture()
    exact.add("x" * (HEAD_BYTES + TAIL_BYTES))
    assert exact.snapshot() == ("x" * (HEAD_BYTES + TAIL_BYTES), HEAD_BYTES + TAIL_BYTES)  # fits: nothing cut
    lines = "".join(f"line {i:07d}\n" for i in range(200_000))  # 2.6 MB in many small writes
    capture = ConsoleCapture()
    for line in lines.splitlines(keepends=True):
        capture.add(line)
    text, total = capture.snapshot()
    assert total == len(lines) and text == expected_kept(lines)
    assert f"[... mpdiag cut {len(lines) - HEAD_BYTES - TAIL_BYTES:,} bytes of output here" in text
    assert text.endswith("line 0199999\n") and text.startswith("line 0000000\n")


def test_a_character_split_at_the_cut_reads_as_a_replacement_not_an_error():
    capture = ConsoleCapture(head_bytes=3, tail_bytes=3)
    capture.add("é" * 10)  # two bytes each: both cuts fall inside a character
    text, total = capture.snapshot()
    assert total == 20 and text.startswith("é\ufffd\n[... mpdiag cut 14 bytes") and text.endswith("\ufffdé")


def test_the_tee_passes_every_write_on_unchanged_and_keeps_them_in_order(capsys):
    terminal = sys.stdout
    with tee_console() as capture:
        assert sys.stdout is not terminal and sys.stdout.isatty() == terminal.isatty()  # the stream's own answer
        print("out 1")
        print("err 1", file=sys.stderr)
        sys.stdout.writelines(["out 2\n", "out 3\n"])
    print("after")  # the tee is gone
    said = capsys.readouterr()
    assert said.out == "out 1\nout 2\nout 3\nafter\n" and said.err == "err 1\n"
    assert capture.snapshot() == ("out 1\nerr 1\nout 2\nout 3\n", 24)


# -- the store ---------------------------------------------------------------------------------------------------
def test_a_schema_8_store_migrates_in_place_and_gains_an_empty_run_output(tmp_path):
    """A real schema-8 file (tests/fixtures/data/make_store_v8.py) opened by this mpdiag: stamped current, every row of
    every table it had kept, run_output there and empty; the migrated store keeps output and reads it back."""
    path = tmp_path / "v8.db"
    shutil.copy(DATA / "store_v8.db", path)
    with sqlite3.connect(path) as conn:
        before = {name: conn.execute(f"SELECT COUNT(*) FROM {name}").fetchone()[0] for (name,) in
                  conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "run_output" not in before
    store = Store(path)
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
        for name, count in before.items():
            if name == "representability":  # its rows became tensor_steps' columns (schema 17): one per format held
                formats_held = " + ".join(f"({fmt}_underflow IS NOT NULL)" for fmt in LOW_PRECISION)
                assert conn.execute(f"SELECT SUM({formats_held}) FROM tensor_steps").fetchone()[0] == count
                continue
            assert conn.execute(f"SELECT COUNT(*) FROM {name}").fetchone()[0] == count, name
    assert raw_output(path).empty and store.run_output(1) is None
    with StoreWriter(path) as writer:
        writer.set_run_output(1, "hello\n", 6)
        writer.set_run_output(1, "hello\nagain\n", 12)  # replaced, not added
    kept = Store(path).run_output(1)
    assert (kept["text"], kept["bytes_total"]) == ("hello\nagain\n", 12) and len(raw_output(path)) == 1


def test_deleting_a_run_deletes_its_output_and_export_includes_it(tmp_path):
    path = tmp_path / "runs.db"
    shutil.copy(DATA / "store_v8.db", path)
    with StoreWriter(path) as writer:
        for run_id in (1, 2):
            writer.set_run_output(run_id, f"run {run_id} said this\n", 17)
    exported = run_tables(Store(path), 1)["console_output"]
    assert exported[["text", "bytes_total"]].values.tolist() == [["run 1 said this\n", 17]]
    assert run_tables(Store(path), 3)["console_output"].empty  # none kept: no row, same columns
    with StoreWriter(path) as writer:
        deleted = writer.delete_run(1)
    assert deleted["run_output"] == 1 and raw_output(path)["run_id"].tolist() == [2]


def test_a_child_cannot_write_console_output():
    """Only the supervisor writes a run's output: the call is not among those a child's channel may make."""
    owner = RunOwner(writer=None, run_ids=[1], parent_run_id=None)
    with pytest.raises(PermissionError, match="set_run_output"):
        owner.apply("set_run_output", [1, "forged output", 13], {})


# -- mpdiag watch and mpdiag run in a terminal ---------------------------------------------------------------
FLOOD = 2 * 1024 * 1024

WATCHED = textwrap.dedent(f"""
    import os, sys, time
    import torch

    print("first line from stdout")
    print("first line from stderr", file=sys.stderr)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        print(f"step {{step}} done", flush=True)
    print("waiting for the go file", flush=True)
    deadline = time.time() + 60
    while not os.path.exists("go") and time.time() < deadline:
        time.sleep(0.1)
    sys.stdout.write("x" * {FLOOD} + "\\n")
    print("last line from stderr", file=sys.stderr)
    print("last line from stdout")
""")


def watched_output() -> str:
    """Every byte WATCHED prints, in the order it prints it."""
    return ("first line from stdout\nfirst line from stderr\n" + "".join(f"step {s} done\n" for s in range(3))
            + "waiting for the go file\n" + "x" * FLOOD + "\n" + "last line from stderr\nlast line from stdout\n")


def test_watch_keeps_the_scripts_output_bounded_refreshed_while_it_runs_and_shows_it_unchanged(tmp_path):
    (tmp_path / "train.py").write_text(WATCHED)
    store = tmp_path / "runs.db"
    proc = subprocess.Popen([sys.executable, "-m", "mpdiag", "watch", "--store", str(store), "train.py"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        # while the script waits, its output so far is already in the store (refreshed every few seconds)
        deadline, live = time.time() + 120, None
        while time.time() < deadline and proc.poll() is None:
            if store.exists() and "run_output" in {r[0] for r in sqlite3.connect(store).execute(
                    "SELECT name FROM sqlite_master")}:
                live = Store(store).run_output(1)
                if live is not None and "waiting for the go file" in live["text"]:
                    break
            time.sleep(0.2)
        assert live is not None and live["text"].endswith("waiting for the go file\n"), live
        assert Store(store).run(1)["status"] == "running"
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    # the terminal got every byte, unchanged (mpdiag's own closing line aside)
    assert out.decode() == ("first line from stdout\n" + "".join(f"step {s} done\n" for s in range(3))
                            + "waiting for the go file\n" + "x" * FLOOD + "\n" + "last line from stdout\n")
    assert err.decode().startswith("first line from stderr\nlast line from stderr\nmpdiag watch: run 1")
    kept = Store(store).run_output(1)
    assert kept["bytes_total"] == len(watched_output().encode())
    assert kept["text"] == expected_kept(watched_output())
    cut = len(watched_output()) - HEAD_BYTES - TAIL_BYTES
    assert f"\n[... mpdiag cut {cut:,} bytes of output here: it keeps the first 64 KiB and the last 448 KiB ...]\n" \
        in kept["text"]
    assert len(kept["text"].encode()) < HEAD_BYTES + TAIL_BYTES + 200


def test_run_keeps_the_model_scripts_output_and_its_progress(tmp_path):
    script = tmp_path / "noisy.py"
    script.write_text((ROOT / "mpdiag" / "examples" / "mlp_digits.py").read_text()
                      + "\nprint('noisy model script imported')\n")
    store = tmp_path / "runs.db"
    done = run_cli("run", script, "--steps", "3", "--device", "cpu", "--store", store, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    kept = Store(store).run_output(1)["text"]
    assert "noisy model script imported" in kept and "step      2/3" in kept
    assert "noisy model script imported" in done.stdout  # still on the terminal


# -- a run started from the app --------------------------------------------------------------------------------
HOSTILE = "<img src=x onerror=alert(1)> **bold** [link](http://evil) \x1b[31mred\x1b[0m"


def test_a_run_started_from_the_app_keeps_its_childs_output_written_by_the_supervisor(tmp_path):
    from mpdiag.dashboard.actions import store_code

    code = WATCHED.replace('while not os.path.exists("go")', 'while False').replace(
        'print("first line from stdout")', f'print("first line from stdout"); print({HOSTILE!r})')
    path = tmp_path / "runs.db"
    _, sha = store_code(Store(path), [("train.py", code.encode())])
    launched = launch(watch_job(sha, "train.py", [], False, {}), path, max_runs=1)
    deadline = time.time() + 180
    while launched.ending() is None and time.time() < deadline:
        time.sleep(0.3)
    assert launched.ending() == "the process exited normally", launched.log_tail()
    run_id, = launched.run_ids()
    kept = Store(path).run_output(run_id)
    full = watched_output().replace("first line from stdout\n", f"first line from stdout\n{HOSTILE}\n")
    # stdout and stderr share one pipe: the child's stdout is a pipe, so it is block-buffered and its lines may
    # reach the pipe after stderr's; every byte is there and the bound is exact
    assert kept["bytes_total"] == len(full.encode())
    assert f"[... mpdiag cut {len(full.encode()) - HEAD_BYTES - TAIL_BYTES:,} bytes of output here" in kept["text"]
    assert HOSTILE in kept["text"] and "last line from stdout" in kept["text"]


# -- the pages -----------------------------------------------------------------------------------------------
@pytest.fixture
def shown_store(tmp_path):
    """Run 1: a watched run whose kept output was cut and holds hostile text; run 2: a Recorder loop's run."""
    from mpdiag.training.watch import WatchConfig

    path = tmp_path / "runs.db"
    full = "start\n" + HOSTILE + "\n" + "y" * (HEAD_BYTES + TAIL_BYTES) + "\n 10%\r 50%\r100%\nthe end\n"
    capture = ConsoleCapture()
    capture.add(full)
    with StoreWriter(path) as writer:
        watched = writer.create_run(name="watched", opt_level="custom", config={"watch": WatchConfig(target="train.py", cwd=str(tmp_path)).settings()})
        writer.set_run_output(watched, *capture.snapshot())
        writer.end_run(watched, "finished")
        own = writer.create_run(name="own loop", opt_level="O1")
        writer.end_run(own, "finished")
    return path, full


def _codes(at) -> list[str]:
    return [c.value for c in at.code]


def test_the_findings_and_runs_pages_show_the_kept_output_as_text_with_its_cut_line(shown_store, monkeypatch):
    from streamlit.testing.v1 import AppTest

    path, full = shown_store
    monkeypatch.setenv("MPDIAG_STORE", str(path))
    cut = f"[... mpdiag cut {len(full) - HEAD_BYTES - TAIL_BYTES:,} bytes of output here"
    for page, select in (("pages/5_Findings.py", None), ("app.py", "output_run")):
        at = AppTest.from_file(str(ROOT / page), default_timeout=120)
        at.query_params["run"] = "1"
        at.run()
        if select:
            at.selectbox(key=select).set_value(1).run()
        assert not at.exception, [e.value for e in at.exception]
        code = next(c for c in _codes(at) if cut in c)
        # the ANSI escape written out, never acted on; the progress bar's last state; the HTML and Markdown as typed
        assert "<img src=x onerror=alert(1)> **bold** [link](http://evil) \\x1b[31mred\\x1b[0m" in code
        assert code.endswith("100%\nthe end")
        assert any("Console output" in e.label for e in at.expander)
        at = AppTest.from_file(str(ROOT / page), default_timeout=120)
        at.query_params["run"] = "2"
        at.run()
        if select:
            at.selectbox(key=select).set_value(2).run()
        assert any("Recorded by your own Recorder loop: mpdiag did not start this process, so it has no console "
                   "output." in c.value for c in at.caption), page
