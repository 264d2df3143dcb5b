"""Run options on the command line: bad numbers are refused before any file exists; dash-led values are values.

In-process through ``mpdiag.cli.main``: a traceback would surface here as an exception.
"""

import pytest
from conftest import EXAMPLES

from mpdiag import Store
from mpdiag.cli import main

BAD_OPTIONS = [
    ("--growth-factor", "inf"), ("--growth-factor", "nan"), ("--growth-factor", "0"), ("--growth-factor", "1"),
    ("--init-scale", "-1"), ("--init-scale", "inf"), ("--init-scale", "0"), ("--loss-scale", "0"),
    ("--loss-scale", "nan"), ("--loss-scale", "-inf"), ("--backoff-factor", "1.5"), ("--backoff-factor", "nan"),
    ("--backoff-factor", "0"), ("--min-scale", "0"), ("--max-scale", "inf"), ("--growth-interval", "0"),
    ("--steps", "0"), ("--every", "0"), ("--shadow-every", "-1"), ("--seed", "-1"), ("--device", "tpu"),
]


@pytest.mark.parametrize("command", ["run", "rerun"])
@pytest.mark.parametrize("flag, value", BAD_OPTIONS)
def test_bad_scales_and_factors_exit_2_in_one_line_and_create_nothing(command, flag, value, tmp_path, capsys,
                                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "runs.db"
    if command == "rerun":  # a store with one run to rerun: it must be left as it was
        Store(store)
        before = store.read_bytes()
    target = [str(EXAMPLES / "mlp_digits.py")] if command == "run" else ["1"]
    code = main([command, *target, flag, value, "--store", str(store)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"mpdiag: {flag} must be ") and err.count("\n") == 1, err
    if command == "run":
        assert list(tmp_path.iterdir()) == []  # no store, nothing else
    else:
        assert store.read_bytes() == before


def test_a_name_starting_with_a_dash_is_a_name(tmp_path, capsys):
    store = tmp_path / "runs.db"
    code = main(["run", str(EXAMPLES / "mlp_digits.py"), "--name", "-x", "--steps", "2", "--device", "cpu",
                 "--store", str(store)])
    assert code == 0, capsys.readouterr().err
    assert Store(store).run(1)["name"] == "-x"
