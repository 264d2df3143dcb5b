"""A check's verdict comes over the child channel, never from the script's output: a script that prints a fake
verdict (at import, or at exit after the real one), prints garbage that looks like a verdict, or ends the
process early with status 0 gets the true verdict and no traceback. (On the old code, which read the last
``MPDIAG-CHECK-REPORT:`` line of the script's stdout, each of these fails.)"""

import textwrap

import pytest
from conftest import EXAMPLES

from mpdiag.sandbox.check import check_script
from mpdiag.sandbox.supervisor import Limits

GOOD = (EXAMPLES / "mlp_digits.py").read_text()
FAKE_READY = 'MPDIAG-CHECK-REPORT:{"ready": true, "problems": [], "summary": {"name": "forged"}, "warnings": []}'
FAKE_NOT_READY = 'MPDIAG-CHECK-REPORT:{"ready": false, "problems": ["forged problem"], "summary": {}}'
LIMITS = Limits(wall_s=60, memory_mb=3000, log_bytes=100_000)

HOSTILE = {
    # claims ready at import, then never defines build(): the truth is "not ready"
    "fake_ready_at_import": (f"print({FAKE_READY!r}, flush=True)\n", False, "defines no function build(device)"),
    # a good script that prints a fake failure when the process exits, after the real verdict
    "fake_verdict_at_exit": (GOOD + textwrap.dedent(f"""
        import atexit
        atexit.register(lambda: print("\\n" + {FAKE_NOT_READY!r}, flush=True))
        """), True, None),
    # output that looks like the old verdict but is not JSON, and one that is JSON with the wrong keys
    "garbage_verdicts": (GOOD + textwrap.dedent("""
        print("MPDIAG-CHECK-REPORT:{not json at all", flush=True)
        print('MPDIAG-CHECK-REPORT:{"nothing": 1}', flush=True)
        print("\\x00\\xff binary-ish noise", flush=True)
        """), True, None),
    # prints a fake ready verdict, then ends the process with status 0 before build() returns
    "exits_zero_early": (f"print({FAKE_READY!r}, flush=True)\n" + textwrap.dedent("""
        import os
        def build(device):
            os._exit(0)
        """), False, "the check did not complete: the process exited normally"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_printed_verdicts_are_ignored(name):
    source, ready, expected = HOSTILE[name]
    report = check_script(f"{name}.py", source, device="cpu", limits=LIMITS)
    assert report.ready is ready, report.text()
    assert report.summary.get("name") != "forged" and not any(p.startswith("forged") for p in report.problems)
    if expected is not None:
        assert any(expected in p for p in report.problems), report.problems
    else:
        assert report.summary["name"] == "MLP on digits" and not report.problems


def test_a_second_verdict_written_to_the_channel_voids_the_result():
    """A script that finds the channel fd and writes its own verdict after mpdiag's does not get it through."""
    source = GOOD + textwrap.dedent("""
        import atexit, json, os, struct

        def _forge():
            body = json.dumps({"kind": "verdict", "verdict": {"ready": True, "problems": [], "summary": {},
                                                              "warnings": []}}).encode()
            for fd in os.listdir("/proc/self/fd"):  # every pipe it holds: only the channel's reader parses it
                try:
                    if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                        os.write(int(fd), struct.pack(">I", len(body)) + body)
                except OSError:
                    pass

        def build(device, _build=build):
            _forge()  # before the real verdict: the real one then makes two
            return _build(device)
        """)
    report = check_script("forger.py", source, device="cpu", limits=LIMITS)
    assert not report.ready and report.problems, report.text()
