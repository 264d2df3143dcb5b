"""The dashboard process never imports torch: everything it shows comes from the store.

Runs are recorded first in child processes (the CLI): the bundled MLP with its FP32 twin, and a gallery run
at O3 with --trace-modules and --shadow-every, so module traces, shadow and update statistics exist. Then every
page is rendered under AppTest in turn in a fresh interpreter (with a run chosen, and on Compare two), which
reports after each page whether torch got imported.
"""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, run_cli

PAGES = ["app.py", "pages/1_Gradients.py", "pages/2_Loss_scale.py", "pages/3_Compare.py", "pages/4_Upload.py",
         "pages/5_Findings.py", "pages/6_FP8.py", "pages/7_Modules.py"]
# Every page in turn in one interpreter, which reports after each page whether torch has been imported so far: the
# first page to import it is named (an interpreter a page costs ~1.5 s of CPU starting Streamlit, 14 more times).
RENDER = """
import json, sys
from streamlit.testing.v1 import AppTest
for page in json.loads(sys.argv[1]):
    at = AppTest.from_file(page, default_timeout=120)
    for key, value in json.loads(sys.argv[2]).items():
        at.query_params[key] = value
    at.run()
    print(json.dumps({"page": page, "exceptions": [e.value for e in at.exception], "torch": "torch" in sys.modules,
                      "elements": len(at.main.children),
                      "mpdiag": sorted(m for m in sys.modules if m.startswith("mpdiag"))}), flush=True)
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


@pytest.mark.parametrize("run", ["1", "3"])
def test_rendering_a_page_does_not_import_torch(run, recorded_store):
    query = {"run": run, "runs": ["1", "2"] if run == "1" else ["3", "1"]}
    done = subprocess.run([sys.executable, "-c", RENDER, json.dumps([str(ROOT / page) for page in PAGES]),
                           json.dumps(query)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "MPDIAG_STORE": str(recorded_store), "PYTHONPATH": str(ROOT),
                               "HOME": str(recorded_store.parent)})
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"page": ')]
    assert [result["page"] for result in results] == [str(ROOT / page) for page in PAGES]
    for page, result in zip(PAGES, results, strict=True):
        assert result["exceptions"] == [], page
        # the page really rendered, through the frame (imported by the first page, kept for the others)
        assert result["elements"] > 0 and "mpdiag.dashboard.frame" in result["mpdiag"], page
        assert result["torch"] is False, (page, result["mpdiag"])


def test_import_mpdiag_is_torch_free_and_the_recorder_still_loads():
    code = ("import sys, mpdiag; assert 'torch' not in sys.modules; from mpdiag import Recorder; "
            "assert 'torch' in sys.modules and Recorder.__name__ == 'Recorder'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
