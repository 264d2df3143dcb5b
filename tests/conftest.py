import functools
import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Bytecode cached as Python does by default, in the tests and every process they start: an environment that sets
# PYTHONDONTWRITEBYTECODE (this project's machine image does) made each of the suite's ~400 Python processes (CLI
# commands, supervised runs, torchrun ranks, servers) compile mpdiag's 22,000 lines again, ~0.16 s of CPU each.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# torch on one thread in the tests and in every process they start (they inherit it): the suite runs as two xdist
# workers on CI's two cores, each worker's torch spinning threads of its own beside the other's and beside the
# runs they start. Measured on two busy cores: the bundled transformer_lm, 15 recorded steps at O1, 15-19 s of CPU
# (21-40 s wall) on torch's default threads against 10-11 s (14-18 s wall) on one; a 24-step run of the plan's
# 64-wide model 4.6 s against 0.5 s. The numbers tested do not depend on it: each is checked against ground truth
# computed in the same process. Set OMP_NUM_THREADS to run the tests on more.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# mpdiag's parallel numba kernels run on torch's thread count (mpdiag.numerics.cpu_kernel.on_torch_threads), so on
# one here too. Before they did, numba's OpenMP layer moved torch onto numba's count (the cores) at the first
# parallel launch, and every later test file of that xdist worker ran on 2 threads: cnn_digits at O1, 60 steps,
# 15.7 CPU-s after an O2 run against 2.5 s. tests/numerics/test_parallel_kernels.py runs them on two threads.
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "mpdiag" / "examples"
FIXTURES = ROOT / "tests" / "fixtures"  # stores, scripts, hostile code and public training code the tests use
#: where a device-parametrised test runs: the CPU, and the GPU where there is one (``pytest -k cuda`` picks those)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
sys.path.insert(0, str(ROOT))

from mpdiag.numerics.gradstats import DeviceReadback, PendingStats  # noqa: E402


def _scan_components_once():
    """Each AppTest run scans the metadata of every installed distribution for Streamlit components (0.65 s a
    run here, minutes over the suite's AppTest runs); nothing is installed while the tests run, so the first
    scan's answer stands (a copy each time: the caller may change its list)."""
    from streamlit.components.v2 import manifest_scanner

    first = functools.cache(manifest_scanner.scan_component_manifests)
    manifest_scanner.scan_component_manifests = lambda *args, **kwargs: list(first(*args, **kwargs))


_scan_components_once()


def pytest_unconfigure(config):
    """This process (each xdist worker, the controller) ends as mpdiag's own do (mpdiag.sandbox.shutdown): without
    the collector's passes over torch's, pandas' and Streamlit's objects at exit, ~1.2 s of CPU a process."""
    gc.freeze()


#: the test files that keep one worker longest (seconds on CI's two cores, from `--durations`; a rough guide, only
#: their order matters). xdist's ``--dist loadfile`` hands out the files with the most tests first, which put these
#: long files of few tests (Chromium, an installed package, the dashboard benches) among the last, where one worker
#: could still be running one of them after the other had run out of files. Handed out first, longest first, the
#: many short files fill in behind them on whichever worker is free (longest-processing-time-first scheduling).
LONG_FILES = {
    "tests/dashboard/test_every_run_kind.py": 300,
    "tests/e2e/test_distributed.py": 210,
    "tests/e2e/test_browser.py": 125,
    "tests/sandbox/test_hostile.py": 90,
    "tests/analysis/test_findings.py": 80,
    "tests/bench/test_training_benches.py": 75,
    "tests/e2e/test_install.py": 70,
    "tests/bench/test_dashboard_benches.py": 60,
    "tests/recording/test_events.py": 50,
    "tests/dashboard/test_app.py": 45,
    "tests/sandbox/test_upload_code.py": 40,
    "tests/training/test_watch.py": 40,
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own (it is registered after this file, and would be called first)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` handing out :data:`LONG_FILES` first (the longest first), then the other files in
    xdist's own order; every other mode is xdist's (None: the next implementation of this hook, xdist's own)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from collections import OrderedDict

    from xdist.scheduler import LoadFileScheduling

    class LongFilesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            if not getattr(self, "_long_first", False):  # the first hand-out: the queue is complete
                self._long_first = True
                order = sorted(self.workqueue, key=lambda scope: -LONG_FILES.get(scope, 0))  # stable for the rest
                self.workqueue = OrderedDict((scope, self.workqueue[scope]) for scope in order)
            super()._assign_work_unit(node)

    return LongFilesFirst(config, log)


@pytest.fixture
def store_path(tmp_path, monkeypatch):
    path = tmp_path / "runs.db"
    monkeypatch.setenv("MPDIAG_STORE", str(path))
    return path


GALLERY_STEPS = 20


@pytest.fixture(scope="session")
def gallery_runs(tmp_path_factory):
    """Every gallery script trained once for the session at its FAILING and at its FIXED settings (module
    constants; GALLERY_STEPS steps on the CPU) into one store: (store path, {script stem: (failing run id,
    fixed run id)}). Tests may add runs and probes to the store; these runs' rows stay as recorded."""
    import importlib

    from mpdiag.training.runner import RunConfig, train
    from mpdiag.training.script import ModelScript

    store = tmp_path_factory.mktemp("gallery") / "runs.db"
    ids = {}
    for path in sorted(EXAMPLES.glob("gallery_*.py")):
        module = importlib.import_module(f"mpdiag.examples.{path.stem}")
        script = ModelScript.from_path(path)
        ids[path.stem] = tuple(train(script, RunConfig(steps=GALLERY_STEPS, device="cpu").with_options(**options),
                                     store) for options in (module.FAILING, module.FIXED))
    return store, ids


PLAN_STEPS = 24


@pytest.fixture(scope="session")
def plan_runs(tmp_path_factory):
    """The precision plan's planted model (tests/fixtures/scripts/plan_planted.py) recorded once at O0 with every
    FP8 recipe (both per-tensor recipes, MXFP8 and NVFP4; every 4th step), its plan verified
    (mpdiag.analysis.plan_verify.verify: the source is its own FP32 reference) and an all-FP8 rerun (fp8-sim,
    current scaling everywhere): a namespace of store, source, reference, rounds and all_fp8."""
    from types import SimpleNamespace

    from mpdiag.analysis.plan_verify import verify
    from mpdiag.training.runner import RunConfig, rerun, train
    from mpdiag.training.script import ModelScript

    store = tmp_path_factory.mktemp("plan") / "runs.db"
    config = RunConfig(opt_level="O0", steps=PLAN_STEPS, every=4, device="cpu", fp8=True, fp8_recipe="both",
                       fp8_blocks="mxfp8,nvfp4")
    source = train(ModelScript.from_path(FIXTURES / "scripts" / "plan_planted.py"), config, store)
    reference, rounds = verify(store, source)
    all_fp8 = rerun(store, source, opt_level="fp8-sim", fp8=False, fp8_recipe="current")
    return SimpleNamespace(store=store, source=source, reference=reference, rounds=rounds, all_fp8=all_fp8)


@pytest.fixture(params=["at once", "late"])
def arrival(request, monkeypatch):
    """Values that reach the host at once (the CPU), or only when the Recorder waits for them at close (a
    GPU far behind the host): the stored rows must be the same."""
    if request.param == "late":
        monkeypatch.setattr(DeviceReadback, "ready", lambda self: False)
        monkeypatch.setattr(PendingStats, "ready", lambda self: False)
    return request.param


@pytest.fixture
def write_script(tmp_path):
    """Write a model script from dedented source and return its path."""

    def write(source: str, name: str = "model.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write


def run_cli(*args, cwd=None, timeout=300, env=None):
    """Run `python -m mpdiag ...` in a child process; returns CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "mpdiag", *map(str, args)],
        cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def damage_tables(path, tables=("runs", "scripts", "bundles")) -> list[int]:
    """Overwrite the root page of each of ``tables`` in the store at ``path`` with junk, its header and schema
    intact, so it opens and the first read of those tables meets the damage (the defaults: what every page reads
    first). Returns the pages overwritten (1-based) and the file's page count after them."""
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(path)) as conn:
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        marks = ", ".join("?" * len(tables))
        roots = [r for (r,) in conn.execute(f"SELECT rootpage FROM sqlite_master WHERE name IN ({marks})", tables)]
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
    data = bytearray(Path(path).read_bytes())
    for root in roots:
        data[(root - 1) * page : root * page] = bytes([0xA5]) * page
    Path(path).write_bytes(bytes(data))
    return [*roots, pages]


def imports_torch(code: str) -> bool:
    """Whether running ``code`` in a fresh interpreter (in the repository root) leaves torch imported: the
    check behind every "this part stays torch-free" test."""
    done = subprocess.run([sys.executable, "-c", f"{code}\nimport sys; print('torch' in sys.modules)"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1] == "True"


def disk_fills_after(monkeypatch, batches: int):
    """StoreWriter.write_batch fails as SQLite does on a full disk from its ``batches``+1-th call on."""
    import sqlite3

    from mpdiag.store import StoreWriter

    real, calls = StoreWriter.write_batch, []

    def write_batch(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > batches:
            raise sqlite3.OperationalError("database or disk is full")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(StoreWriter, "write_batch", write_batch)
