"""The dashboard and store benches (page times on large stores, the app's start, an event's way to the browser)
run at their smallest settings and write their JSON. Their numbers are for the docs, never asserted here."""

import pytest
from bench_helpers import DASHBOARD_BENCHES, smoke

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script", list(DASHBOARD_BENCHES))
def test_bench_runs(script, tmp_path):
    smoke(script, DASHBOARD_BENCHES[script], tmp_path)
