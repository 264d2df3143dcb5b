"""The dashboard process never imports torch: everything it shows comes from the store.

Runs are recorded first in child processes (the CLI): the bundled MLP with its FP32 twin, and a gallery run
at O3 with --trace-modules and --shadow-every, so module traces, shadow and update statistics exist. Then each
page is rendered under AppTest in a fresh interpreter (with a run chosen, and on Compare two), and
that interpreter reports whether torch got imported.
"""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, run_cli

PAGES = ["app.py", "pages/1_Gradients.py", "pages/2_Loss_scale.py", "pages/3_Compare.py", "pages/4_Upload.py",
         "pages/5_Findings.py", "pages/6_FP8.py", "pages/7_Modules.py"]
RENDER = """
import json, sys
from streamlit.testing.v1 import AppTest
at = AppTest.from_file(sys.argv[1], default_timeout=120)
for key, value in json.loads(sys.argv[2]).items():
    at.query_params[key] = value
at.run()
print(json.dumps({"exceptions": [e.value for e in at.exception], "torch": "torch" in sys.modules,
                  "mpdiag": sorted(m for m in sys.modules if m.startswith("mpdiag"))}))
"""


@pytest.fixture(scope="module")
def recorded_store(tmp_path_factory):
    store = tmp_path_factory.mktemp("no-torch") / "runs.db"
    for args in (["mpdiag/examples/mlp_digits.py", "--opt-level", "O1", "--steps", "4", "--pair"],
                 ["mpdiag/examples/gallery_swamped_updates.py", "--opt-level", "O3", "--steps", "4", "--trace-modules",
                  "--shadow-every", "2"]):
        done = run_cli("run", *args, "--device", "cpu", "--store", store)
        assert done.returncode == 0, done.stderr[-2000:]
    return store


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("run", ["1", "3"])
def test_rendering_a_page_does_not_import_torch(page, run, recorded_store):
    query = {"run": run, "runs": ["1", "2"] if run == "1" else ["3", "1"]}
    done = subprocess.run([sys.executable, "-c", RENDER, str(ROOT / page), json.dumps(query)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "MPDIAG_STORE": str(recorded_store), "PYTHONPATH": str(ROOT),
                               "HOME": str(recorded_store.parent)})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["exceptions"] == []
    assert "mpdiag.dashboard.frame" in result["mpdiag"]  # the page really rendered through the frame
    assert result["torch"] is False, result["mpdiag"]


def test_import_mpdiag_is_torch_free_and_the_recorder_still_loads():
    code = ("import sys, mpdiag; assert 'torch' not in sys.modules; from mpdiag import Recorder; "
            "assert 'torch' in sys.modules and Recorder.__name__ == 'Recorder'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
