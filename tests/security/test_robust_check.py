"""Pathological uploads are parsed and checked in the supervised child, never in the server: each gets a
message from the same function the Upload page calls, in this (the server's) process, and no exception.
(On the old code the static checks parsed the source in the calling process: deep nesting raised
RecursionError there, and bytes that are not text could not be handed over at all.)"""

import pytest

from mpdiag.sandbox.check import check_script
from mpdiag.sandbox.supervisor import Limits

LIMITS = Limits(wall_s=60, memory_mb=3000, log_bytes=50_000)

PATHOLOGICAL = {
    "deep_expression.py": ("x = " + "1 + " * 200_000 + "1\n", "could not be analysed"),
    "deep_brackets.py": ("x = " + "[" * 5_000 + "]" * 5_000 + "\n", "syntax error"),
    "huge.py": ("# padding\n" * 600_000 + "def build(device):\n    return {}\n", "without 'model'"),
    "binary.py": (bytes(range(256)) * 64, "is not UTF-8 text"),
    "latin1.py": ("x = 'é'\n".encode("latin-1"), "is not UTF-8 text"),
    "null_bytes.py": ("x = 1\x00\ny = 2\n", "null bytes"),
    "lone_surrogate.py": ("x = '\ud800'\n", "is not UTF-8 text"),
}


@pytest.mark.parametrize("name", list(PATHOLOGICAL))
def test_a_pathological_file_gets_a_message_and_the_server_is_unharmed(name):
    source, expected = PATHOLOGICAL[name]
    report = check_script(name, source, device="cpu", limits=LIMITS)
    assert not report.ready
    assert any(expected in problem for problem in report.problems), report.problems
