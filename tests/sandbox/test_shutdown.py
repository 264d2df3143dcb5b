"""How an mpdiag process ends (mpdiag.sandbox.shutdown): everything a script relies on at exit still happens —
its exit status, its atexit handlers, buffered output written, files it left open flushed — and the collector
skips what was alive at the end."""

import subprocess
import sys
import textwrap

from conftest import ROOT

ENDING = textwrap.dedent("""\
    import atexit, gc, sys
    from mpdiag.sandbox.shutdown import exit_without_collecting

    log = open(sys.argv[1], "w")  # left open and unflushed, held by this module: teardown closes it
    log.write("written before the end")
    atexit.register(lambda: print(f"atexit ran, {gc.get_freeze_count()} objects frozen", flush=True))
    sys.stdout.write("buffered, never flushed by the script")
    exit_without_collecting(3)
""")


def test_a_process_ending_so_keeps_its_status_atexit_handlers_and_buffered_writes(tmp_path):
    log = tmp_path / "log.txt"
    done = subprocess.run([sys.executable, "-c", ENDING, str(log)], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith("buffered, never flushed by the script"), done.stdout
    frozen = int(done.stdout.split("atexit ran, ")[1].split()[0])
    assert frozen > 1000, done.stdout  # the interpreter's own objects at least: the collector skips them
    assert log.read_text() == "written before the end"
