"""The pages tell the truth on hard runs (issue 15), checked under AppTest on runs recorded with the CLI."""

import json
import math
import subprocess
import sys

import pytest
from conftest import EXAMPLES, ROOT
from streamlit.testing.v1 import AppTest

TIMEOUT = 60
COLLAPSED_SCALE = 2.0**-83  # every scaled gradient underflows FP32 to exact zero


def record(store, script, *options):
    subprocess.run([sys.executable, "-m", "mpdiag", "run", str(EXAMPLES / script), "--device", "cpu",
                    "--store", str(store), *options], check=True, cwd=ROOT, capture_output=True)


@pytest.fixture(scope="module")
def truth_store(tmp_path_factory):
    """Run 1: gallery_underflow at O1 with a static scale of 2^-83 (every gradient recorded is zero); run 2:
    gallery_activation_overflow at O1 whose dynamic scale collapses by 1000x per step from 1e-20 (not a power of
    two, down to about 2^-106)."""
    path = tmp_path_factory.mktemp("truth") / "runs.db"
    record(path, "gallery_underflow.py", "--opt-level", "O1", "--loss-scale", repr(COLLAPSED_SCALE), "--steps", "3")
    record(path, "gallery_activation_overflow.py", "--opt-level", "O1", "--init-scale", "1e-20",
           "--backoff-factor", "0.001", "--steps", "5")
    return path


def page(name, store, monkeypatch, **query):
    monkeypatch.setenv("MPDIAG_STORE", str(store))
    at = AppTest.from_file(str(ROOT / "pages" / name), default_timeout=TIMEOUT)
    for key, value in query.items():
        at.query_params[key] = value
    return at.run()


def said(at) -> str:
    return "\n".join([c.value for c in at.caption] + [m.value for m in at.markdown] + [m.label for m in at.metric]
                     + [str(m.value) for m in at.metric])


def heatmap_spec(at) -> dict:
    charts = [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]
    return next(c for c in charts if any(layer.get("mark", {}).get("type") == "rect" for layer in c.get("layer", [])))


@pytest.mark.parametrize("run, steps", [(1, 3), (2, 5)])
def test_gradients_page_of_a_collapsed_loss_scale(run, steps, truth_store, monkeypatch):
    at = page("1_Gradients.py", truth_store, monkeypatch, run=str(run))
    assert not at.exception, [e.value for e in at.exception]
    whatif = at.select_slider(key="whatif")
    # the control covers 2^-40..2^40 and every scale the run used; it starts at the scale of the shown step
    exponents = [int(o[2:]) for o in whatif.options]
    assert exponents == list(range(exponents[0], exponents[-1] + 1))
    assert exponents[0] <= -40 and exponents[-1] >= 40
    smallest = -83 if run == 1 else round(math.log2(1e-20 * 1e-3 ** (steps - 1)))  # the last step's scale
    assert exponents[0] == smallest and whatif.value == smallest
    assert "nan%" not in said(at)
    assert "no finite non-zero values" in said(at)
    # every logged step stays on the heatmap's step axis even though no cell has a value
    heat = next(layer for layer in heatmap_spec(at)["layer"] if layer["mark"]["type"] == "rect")
    assert heat["encoding"]["x"]["scale"]["domain"] == [0, steps]
    for view in ("at the loss scale (S·g)", "unscaled g"):
        at.radio(key="view").set_value(view).run()
        at.select_slider(key="whatif").set_value(exponents[-1]).run()
        assert not at.exception, [e.value for e in at.exception]
        assert "nan%" not in said(at)
