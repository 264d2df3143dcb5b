"""A file that is not a healthy SQLite store, or one another program holds locked, gives one clear StoreError,
and mpdiag never writes to it."""

import contextlib
import shutil
import sqlite3
import subprocess

import pytest
from app_helpers import PAGES, shown
from conftest import FIXTURES, ROOT, damage_tables, run_cli
from streamlit.testing.v1 import AppTest

from mpdiag.options import RunConfig
from mpdiag.store import Store, StoreError, StoreWriter
from mpdiag.training.runner import train
from mpdiag.training.script import ModelScript


def _unwritten(path, before: bytes | None) -> bool:
    """The file holds exactly ``before`` (None: it is still not there) and no write-ahead log beside it holds
    anything: a read-only connection may leave an empty -wal and a -shm (SQLite's sharing index), never a frame
    of data."""
    wal = path.with_name(path.name + "-wal")
    held = path.read_bytes() if path.exists() else None
    return held == before and (not wal.exists() or wal.stat().st_size == 0)


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


def test_the_store_and_the_cli_on_a_locked_store_say_so_in_one_line(tmp_path):
    """The store says it is locked (it once waited out every read and then showed the main file without its
    write-ahead log, which may lack the newest steps); the CLI too, in one line; nothing is written. Every page
    on it: test_every_page_on_a_bad_store_says_the_clis_line_and_writes_nothing."""
    path = tmp_path / "runs.db"
    with StoreWriter(path, finish_runs=True) as writer:
        writer.create_run(name="a run")
    before = path.read_bytes()
    with _held_locked(path):
        with pytest.raises(StoreError, match="is locked by another program"):
            Store(path)
        result = run_cli("runs", "--store", path, cwd=ROOT)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert "is locked by another program" in result.stderr
    assert _unwritten(path, before)


def _recorded(path, script_lines: int = 20000):
    """A healthy store: one finished run and a stored script long enough to span many pages."""
    with StoreWriter(path, finish_runs=True) as writer:
        writer.create_run(name="a run")
        writer.add_script("big.py", "x = 1\n" * script_lines)


@contextlib.contextmanager
def _immutable(path):
    """``path`` (a file or a folder) flagged immutable, which not even root may write: what a store or its folder
    is to a user without write permission (the tests run as root)."""
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("this file system cannot flag a file immutable (chattr +i)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@contextlib.contextmanager
def _damaged(path):
    """Bytes in the middle of the file overwritten: the root pages of the tables every page reads first (runs;
    Upload's scripts and bundles), the header and the schema intact, so the store opens and its first read
    meets the damage."""
    _recorded(path)
    *roots, pages = damage_tables(path)
    assert len(roots) == 3 and 1 < min(roots) and max(roots) < pages // 2  # the middle, not the header or the end
    yield


@contextlib.contextmanager
def _truncated(path):
    """A store's second half cut off."""
    _recorded(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    yield


@contextlib.contextmanager
def _newer_schema(path):
    """A store stamped with a schema version from the future."""
    _recorded(path)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.close()  # the last connection: its WAL is checkpointed now, not whenever it is collected
    yield


@contextlib.contextmanager
def _older_read_only(path):
    """A real store of schema version 13 that cannot be written, so it cannot be migrated to be read."""
    shutil.copyfile(FIXTURES / "data" / "store_v13.db", path)
    with _immutable(path):
        yield


@contextlib.contextmanager
def _locked(path):
    _recorded(path, script_lines=1)
    with _held_locked(path):
        yield


@contextlib.contextmanager
def _written(path, content: bytes):
    path.write_bytes(content)
    yield


@contextlib.contextmanager
def _missing(path):
    """No store file, in a folder where none can be created."""
    with _immutable(path.parent):
        yield


#: each kind of bad store, made at a path (whose folder exists) and held bad while the context is open
BAD_STORES = {
    "damaged": _damaged, "truncated": _truncated,
    "not SQLite": lambda path: _written(path, b"hello, not a database"),
    "newer schema": _newer_schema, "older, read-only": _older_read_only, "locked": _locked,
    "empty": lambda path: _written(path, b""), "missing": _missing,
}


def _bad_store_at(folder):
    (folder / "store").mkdir()
    return folder / "store" / "runs.db"


@pytest.fixture(scope="module")
def cli_says(tmp_path_factory):
    """What the CLI says of each kind of bad store, in one line, its path written ``{store}``: ``diagnose``, which
    reads a store that must be there (``runs`` creates a missing or empty one to list it)."""
    said = {}

    def says(kind: str) -> str:
        if kind not in said:
            path = _bad_store_at(tmp_path_factory.mktemp("cli"))
            with BAD_STORES[kind](path):
                result = run_cli("diagnose", "1", "--no-probe", "--store", path, cwd=ROOT)
            assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
            said[kind] = result.stderr.strip().removeprefix("mpdiag: ").replace(str(path), "{store}")
        return said[kind]
    return says


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("kind", list(BAD_STORES))
def test_every_page_on_a_bad_store_says_the_clis_line_and_writes_nothing(kind, page, tmp_path, monkeypatch, cli_says):
    """One st.error, in the CLI's words, as plain text; no exception element; the file byte for byte as it was
    (or still not there): no page writes, creates or migrates a store it cannot read."""
    path = _bad_store_at(tmp_path)
    monkeypatch.setenv("MPDIAG_STORE", str(path))
    with BAD_STORES[kind](path):
        before = path.read_bytes() if path.exists() else None
        at = AppTest.from_file(str(ROOT / page), default_timeout=120).run()
        assert not at.exception, (kind, page, [e.value for e in at.exception])
        said = [shown(e.value).replace(str(path), "{store}") for e in at.error]
        assert _unwritten(path, before)
    cli = cli_says(kind)
    assert len(said) == 1, said
    if kind == "missing":  # the page tries to create the server's store (`diagnose` does not): it says why not
        assert said[0].startswith(cli.split(":")[0] + ", and mpdiag cannot create one there: "), (said, cli)
    else:
        assert said[0] == cli, (said, cli)


def test_a_store_removed_after_a_page_opened_it_is_said_in_the_clis_line(tmp_path):
    """A store file removed between a page's opening it and its reads (a person clearing the folder while a live
    page refreshes): each read, cached or not, raises the CLI's one line for a missing store, not an OSError or
    SQLite's "unable to open database file"; nothing is created in its place."""
    from mpdiag.dashboard import reads

    path = tmp_path / "runs.db"
    _recorded(path, script_lines=1)
    store = Store(path, create=False)
    path.unlink()
    expected = f"No store at {path}: run `python -m mpdiag run SCRIPT` to create one."
    for read in (store.runs, lambda: reads.steps(store, 1, True), lambda: reads.steps(store, 1, False)):
        with pytest.raises(StoreError) as said:
            read()
        assert str(said.value) == expected
    assert not path.exists()
