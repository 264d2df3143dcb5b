"""A hand-made URL: a run id or step that is not a plain number of a sane length is ignored, the page opening as
without it, never an error (str.isdigit alone let "²" and 5,000 digits through to int(), which raised)."""

from app_helpers import app

from mpdiag.dashboard.untrusted import url_count
from mpdiag.store import StepRow, StoreWriter

CRAFTED = ("9" * 5000, "²", "٣", "-1", "1e9", " 1", "")


def test_url_count_takes_ascii_digits_of_a_sane_length_only():
    assert url_count("40") == 40 and url_count("0") == 0 and url_count("9" * 12) == 10**12 - 1
    assert [url_count(text) for text in (*CRAFTED, "9" * 13, None)] == [None] * (len(CRAFTED) + 2)


def test_a_crafted_run_id_opens_the_page_on_its_default_run(tmp_path, monkeypatch):
    path = tmp_path / "runs.db"
    with StoreWriter(path) as writer:
        for name in ("first", "second"):
            run_id = writer.create_run(name=name, opt_level="O1")
            writer.write_batch(run_id, [StepRow(s, 1.0, 1.0, 0, 0, 1.0, 0.1, 0, 1, 1e-3, 1.0, 0.1) for s in range(5)],
                               [])
            writer.end_run(run_id, "finished")
    for crafted in CRAFTED:
        at = app("pages/2_Loss_scale.py", path, monkeypatch, run=crafted)
        assert not at.exception and not at.error, crafted
        assert at.selectbox(key="run").value == 2, crafted  # the newest: as with no ?run=
    assert app("pages/2_Loss_scale.py", path, monkeypatch, run="1").selectbox(key="run").value == 1
