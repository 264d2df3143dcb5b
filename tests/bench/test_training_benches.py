"""The training benches (the Recorder's cost against a plain loop, per feature and per number of tensors) run at
their smallest settings and write their JSON. Their numbers are for the docs, never asserted here; every script in
bench/ is run by this file or tests/bench/test_dashboard_benches.py."""

import pytest
from bench_helpers import DASHBOARD_BENCHES, NOT_BENCHES, OTHER_BENCHES, ROOT, TRAINING_BENCHES, run_bench, smoke

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script", list(TRAINING_BENCHES))
def test_bench_runs(script, tmp_path):
    smoke(script, TRAINING_BENCHES[script], tmp_path)


def test_distributed_bench_runs_both_parallelisms(tmp_path):
    results = run_bench("distributed_overhead", ["--steps", "2", "--width", "16", "--out-dir", str(tmp_path)], tmp_path)
    assert sorted(r["parallel"] for r in results) == ["ddp", "fsdp"]


def test_every_bench_script_is_run_by_a_test():
    scripts = {path.stem for path in (ROOT / "bench").glob("*.py")} - NOT_BENCHES
    assert scripts == set(TRAINING_BENCHES) | set(DASHBOARD_BENCHES) | OTHER_BENCHES
