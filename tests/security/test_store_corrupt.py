"""A file that is not a healthy SQLite store, or one another program holds locked, gives one clear StoreError,
and mpdiag never writes to it."""

import contextlib
import sqlite3

import pytest
from conftest import ROOT, run_cli
from streamlit.testing.v1 import AppTest

from mpdiag.options import RunConfig
from mpdiag.store import Store, StoreError, StoreWriter
from mpdiag.training.runner import train
from mpdiag.training.script import ModelScript

PAGES = ["app.py", "pages/1_Gradients.py", "pages/2_Loss_scale.py", "pages/3_Compare.py", "pages/4_Upload.py",
         "pages/5_Findings.py", "pages/6_FP8.py", "pages/7_Modules.py"]


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


@pytest.fixture(scope="module")
def store_damaged_inside(tmp_path_factory):
    """Two recorded runs whose middle third of pages is overwritten, the header and schema intact: the store
    opens and lists its runs; a page meets the damage when it reads a run's rows."""
    path = tmp_path_factory.mktemp("damaged") / "runs.db"
    script = ModelScript.from_path(ROOT / "mpdiag" / "examples" / "gallery_underflow.py")
    for level in ("O1", "O0"):
        train(script, RunConfig(opt_level=level, steps=6, device="cpu"), path)
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
    data = bytearray(path.read_bytes())
    for offset in range(pages // 3 * page, 2 * pages // 3 * page, page):
        data[offset : offset + page] = bytes([0xA5]) * page
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("name", PAGES)
def test_every_page_on_a_store_damaged_inside_says_so_in_one_line_and_writes_nothing(name, store_damaged_inside,
                                                                                       monkeypatch):
    """The damage is met while the page reads (not when the store opens): mpdiag's one line, as the CLI says
    it, not Streamlit's redacted traceback; said once on the page; the file untouched."""
    monkeypatch.setenv("MPDIAG_STORE", str(store_damaged_inside))
    before = store_damaged_inside.read_bytes()
    at = AppTest.from_file(str(ROOT / name), default_timeout=120).run()
    assert not at.exception, [e.value for e in at.exception]
    damaged = [e.value for e in at.error if "is damaged" in e.value]
    if name != "pages/4_Upload.py":  # Upload reads only the stored scripts' list, which the damage spares
        assert len(damaged) == 1 and "mpdiag did not write to it" in damaged[0], [e.value for e in at.error]
    assert len(damaged) <= 1
    assert _unwritten(store_damaged_inside, before)


def _store_refused_at_opening(path, kind: str):
    """A recorded store made unopenable: its second half cut off, or stamped with a schema version from the future."""
    with StoreWriter(path, finish_runs=True) as writer:
        writer.create_run(name="a run")
        writer.add_script("big.py", "x = 1\n" * 20000)
    if kind == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        conn = sqlite3.connect(path)
        with conn:
            conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
        conn.close()  # the last connection: its WAL is checkpointed now, not whenever it is collected


@pytest.mark.parametrize("kind", ["truncated", "newer schema"])
def test_every_page_on_a_store_it_cannot_open_says_why_in_one_line(kind, tmp_path, monkeypatch):
    path = tmp_path / "runs.db"
    _store_refused_at_opening(path, kind)
    before = path.read_bytes()
    monkeypatch.setenv("MPDIAG_STORE", str(path))
    expected = "newer than this mpdiag's version" if kind == "newer schema" else "is damaged"
    for name in PAGES:
        at = AppTest.from_file(str(ROOT / name), default_timeout=120).run()
        assert not at.exception, (name, [e.value for e in at.exception])
        said = [e.value for e in at.error]
        assert len(said) == 1 and expected in said[0].replace("\\", ""), (name, said)
    assert path.read_bytes() == before


@contextlib.contextmanager
def _held_locked(path):
    """Another program holding the store in a write transaction under exclusive locking, as an sqlite3 shell
    does after ``PRAGMA locking_mode=EXCLUSIVE; BEGIN EXCLUSIVE; UPDATE ...``."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA locking_mode=EXCLUSIVE")
    conn.execute("BEGIN EXCLUSIVE")
    conn.execute("UPDATE runs SET name = name")
    try:
        yield
    finally:
        conn.execute("ROLLBACK")
        conn.close()


def test_every_page_and_the_cli_on_a_locked_store_say_so_in_one_line(tmp_path, monkeypatch):
    """Each page says the store is locked in one line (it once waited out every read and then showed the main
    file without its write-ahead log, which may lack the newest steps); the CLI too; nothing is written."""
    path = tmp_path / "runs.db"
    with StoreWriter(path, finish_runs=True) as writer:
        writer.create_run(name="a run")
    before = path.read_bytes()
    monkeypatch.setenv("MPDIAG_STORE", str(path))
    with _held_locked(path):
        with pytest.raises(StoreError, match="is locked by another program"):
            Store(path)
        for name in PAGES:
            at = AppTest.from_file(str(ROOT / name), default_timeout=120).run()
            assert not at.exception, (name, [e.value for e in at.exception])
            said = [e.value for e in at.error]
            assert len(said) == 1 and "is locked by another program" in said[0], (name, said)
        result = run_cli("runs", "--store", path, cwd=ROOT)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert "is locked by another program" in result.stderr
    assert _unwritten(path, before)
