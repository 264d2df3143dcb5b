"""The numba kernels' work items on two threads at once. The suite runs torch on one thread (tests/conftest.py), and
mpdiag launches its parallel kernels on torch's thread count; a kernel's items, each writing its own row, must give
the same counts when they do run in parallel: the tests of the parallel kernels, against casting and float64
arithmetic, rerun here in a child process with torch and numba on two threads (numba fixes its threads when it
loads; the conftest's OMP_NUM_THREADS is a default the child's environment overrides)."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

from mpdiag.numerics.gradstats import NUMBA_AVAILABLE

TWO_THREADS = {"NUMBA_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"}
# the child pytest without this run's PYTEST_ADDOPTS: a plugin named there (-p) is found on a PYTHONPATH it replaces
OUTER_ENV = {name: value for name, value in os.environ.items() if name != "PYTEST_ADDOPTS"}
PARALLEL_KERNEL_TESTS = [
    "tests/numerics/test_gradstats.py::test_tensors_split_into_work_items_still_equal_casting[numba-True]",
    "tests/numerics/test_updates_and_shadow.py::test_update_counts_equal_float64_arithmetic",
]


@pytest.mark.skipif(not NUMBA_AVAILABLE, reason="numba's own threads")
def test_the_parallel_kernels_equal_the_ground_truth_on_two_threads():
    done = subprocess.run([sys.executable, "-c", "import numba; print('numba threads:', numba.get_num_threads())"],
                          env={**os.environ, **TWO_THREADS}, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "numba threads: 2"
    done = subprocess.run([sys.executable, "-m", "pytest", *PARALLEL_KERNEL_TESTS, "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, env={**OUTER_ENV, **TWO_THREADS, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "7 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
