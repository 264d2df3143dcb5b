"""A file that is not a healthy SQLite store gives one clear StoreError, and mpdiag never writes to it."""

import sqlite3

import pytest
from conftest import ROOT, run_cli

from mpdiag.store import Store, StoreError, StoreWriter


def _unwritten(path, before: bytes) -> bool:
    """The file holds exactly ``before`` and no write-ahead log beside it holds anything: a read-only
    connection may leave an empty -wal and a -shm (SQLite's sharing index), never a frame of data."""
    wal = path.with_name(path.name + "-wal")
    return path.read_bytes() == before and (not wal.exists() or wal.stat().st_size == 0)


def _damaged_store(path, first_damaged_page: int):
    """A real store with many pages whose pages from ``first_damaged_page`` (0-based; negative counts from the
    end) on are overwritten, with
    the header intact, so SQLite opens it and meets the damage only when it reads those pages."""
    with StoreWriter(path, finish_runs=True) as writer:
        run_id = writer.create_run(name="soon damaged")
        writer.add_script("big.py", "x = 1\n" * 20000)
    with sqlite3.connect(path) as conn:
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        assert pages > 20
    data = bytearray(path.read_bytes())
    for offset in range(first_damaged_page % pages * page, len(data), page):
        data[offset : offset + page] = bytes([0xA5]) * page
    path.write_bytes(bytes(data))
    assert data.startswith(b"SQLite format 3\x00")
    return run_id


@pytest.mark.parametrize("content", [b"hello, not a database", b"SQLite format 3\x00" + b"\xff" * 4000],
                         ids=["text", "bad header fields"])
def test_non_sqlite_file_is_refused_unchanged(tmp_path, content):
    path = tmp_path / "notes.db"
    path.write_bytes(content)
    with pytest.raises(StoreError, match=r"notes\.db is not an SQLite database"):
        StoreWriter(path)
    with pytest.raises(StoreError, match=r"notes\.db is not an SQLite database"):
        Store(path)
    assert _unwritten(path, content)


@pytest.mark.parametrize("where", ["schema pages", "data pages"])
def test_damaged_pages_behind_an_intact_header_are_refused_before_any_write(tmp_path, where):
    path = tmp_path / "runs.db"
    # From page 2 on, the schema itself is unreadable and Store() refuses the file; the last pages hold only
    # the script's text, which Store() does not read on opening, so a read (through pandas) meets the damage.
    run_id = _damaged_store(path, first_damaged_page=2 if where == "schema pages" else -10)
    before = path.read_bytes()
    with pytest.raises(StoreError, match=r"runs\.db is damaged .*mpdiag did not write to it"):
        StoreWriter(path)
    with pytest.raises(StoreError, match=r"runs\.db is damaged .*mpdiag did not write to it"):
        store = Store(path)
        store.runs(), store.steps(run_id)
        store.script_source(store.scripts()["sha256"].iloc[0])
    assert _unwritten(path, before)


def test_cli_on_a_bad_store_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not a database at all" * 10)
    result = run_cli("runs", "--store", bad, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "bad.db is not an SQLite database" in result.stderr
    assert "Traceback" not in result.stderr
