"""The dashboard and store benches (page times on large stores, the app's start, an event's way to the browser)
run at their smallest settings and write their JSON. Their numbers are for the docs, never asserted here."""

import pytest
from bench_helpers import DASHBOARD_BENCHES, run_bench

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script", list(DASHBOARD_BENCHES))
def test_bench_runs(script, tmp_path):
    out = tmp_path / "out.json"
    (result,) = run_bench(script, [*DASHBOARD_BENCHES[script], "--out", str(out)], out)
    assert result
