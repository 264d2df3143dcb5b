"""The FP8 page under AppTest on every kind of run, and what each FP8 finding says visible where it links."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit

import pytest
from conftest import EXAMPLES
from test_app import app, texts

from mpdiag import Store
from mpdiag.analysis.findings import diagnose, evidence_link
from mpdiag.store import StoreWriter
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript


@pytest.fixture(scope="module")
def fp8_store(tmp_path_factory):
    """1: bf16 recorded with --fp8 under both recipes (the amax jump); 2: fp8-sim delayed recorded with --fp8;
    3: fp8-sim without --fp8; 4: O1 without --fp8; 5: a run still running with --fp8 and no rows yet;
    6: a failed --fp8 run (its script raised before the first step)."""
    from mpdiag.examples.fp8_amax_jump import JUMP

    path = tmp_path_factory.mktemp("fp8") / "runs.db"
    script = ModelScript.from_path(EXAMPLES / "fp8_amax_jump.py")
    base = RunConfig(steps=JUMP + 4, device="cpu")
    train(script, base.with_options(opt_level="bf16", fp8=True, fp8_recipe="both"), path)
    train(script, base.with_options(opt_level="fp8-sim", fp8=True), path)
    train(script, base.with_options(opt_level="fp8-sim"), path)
    train(script, base.with_options(opt_level="O1", steps=4), path)
    with StoreWriter(path) as w:
        w.create_run(name="still running", opt_level="bf16", config={"run": {"fp8": True}})
    broken = ModelScript(filename="broken.py", source="def build(device):\n    raise RuntimeError('no data')\n")
    train(broken, RunConfig(steps=3, device="cpu", fp8=True), path)
    return path


def page(store, monkeypatch, **query):
    at = app("pages/6_FP8.py", store, monkeypatch, **query)
    assert not at.exception, [e.value for e in at.exception]
    return at


@pytest.mark.parametrize("run_id, says", [
    (3, "ran with FP8 simulated (fp8-sim) but did not record FP8 statistics"),
    (4, "recorded without FP8 statistics"),
    (5, "No FP8 statistics recorded yet"),
    (6, "was started with FP8 statistics but recorded none: it ended (failed)"),
])
def test_runs_without_fp8_rows_say_why_and_how_to_get_them(fp8_store, monkeypatch, run_id, says):
    at = page(fp8_store, monkeypatch, run=str(run_id))
    assert says in texts(at)
    assert not at.get("vega_lite_chart") and not at.get("arrow_vega_lite_chart")


@pytest.mark.parametrize("run_id", [1, 2])
def test_every_fp8_finding_is_visible_where_it_links(fp8_store, monkeypatch, run_id):
    store = Store(fp8_store)
    findings = [f for f in diagnose(store, run_id) if f.page == "FP8"]
    assert findings  # both runs see the amax jump at the head's input under delayed scaling
    for finding in findings:
        link = urlsplit(evidence_link(finding, run_id))
        assert link.path == "/FP8"
        query = dict(parse_qsl(link.query))
        at = page(fp8_store, monkeypatch, **query)
        said = texts(at)
        assert finding.title in said  # the finding itself, on the page it links to
        assert at.selectbox(key="layer").value == query["layer"]
        assert at.radio(key="role").value == query["role"] and at.radio(key="recipe").value == query["recipe"]
        overflowing = store.fp8(run_id)
        overflowing = overflowing[(overflowing["module"] == query["layer"]) & (overflowing["role"] == query["role"])
                                  & (overflowing["recipe"] == query["recipe"]) & (overflowing["overflow"] > 0)]
        # the amax chart's caption counts the same overflowing steps the finding's evidence rests on
        assert f"{len(overflowing)} of " in said and f"first at step {int(overflowing['step'].min())}" in said


def test_whatif_controls_change_the_counts_and_the_recorded_settings_give_the_recorded_count(fp8_store, monkeypatch):
    from mpdiag.examples.fp8_amax_jump import JUMP

    at = page(fp8_store, monkeypatch, run="1", layer="head", role="input", recipe="delayed")
    rows = Store(fp8_store).fp8(1)
    rows = rows[(rows["module"] == "head") & (rows["role"] == "input") & (rows["recipe"] == "delayed")]
    assert f"the recorded count is exactly {int((rows['underflow'] + rows['overflow']).sum())}" in texts(at)
    before = [c.value for c in at.caption]
    at.number_input(key="whatif_margin").set_value(9).run()  # 2^9 > the jump's ratio: underflow instead
    said = texts(at)
    assert "recorded count is exactly" not in said and [c.value for c in at.caption] != before
    at.radio(key="whatif_recipe").set_value("current").run()
    assert not at.exception and "current scaling:" in texts(at)
    assert JUMP  # the store's runs cover the jump


def test_a_runs_data_downloads_from_any_run_page_after_a_click(fp8_store, monkeypatch):
    import io
    import zipfile

    import pandas as pd

    def run_download(at):  # the run's zip, not the charts' PNG/SVG buttons (those render only on their click)
        return [b for b in at.get("download_button") if b.key == "download_zip"]

    at = page(fp8_store, monkeypatch, run="1")
    assert not run_download(at)  # nothing is prepared by loading the page
    at.button(key="download_prepare").click().run()
    assert not at.exception and run_download(at)
    data = at.session_state[f"download:{Store(fp8_store).path}:1"]
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = set(archive.namelist())
        steps = pd.read_csv(archive.open("run1_steps.csv"))
        fp8 = pd.read_parquet(io.BytesIO(archive.read("run1_fp8.parquet")))
    assert {"run1_run.csv", "run1_tensor_stats.parquet", "run1_fp8_histograms.csv"} <= names
    store = Store(fp8_store)
    assert len(steps) == len(store.steps(1)) and len(fp8) == len(store.fp8(1))


def test_the_banner_and_the_layer_table_count_the_same_steps_as_the_store(fp8_store, monkeypatch):
    """Issue 27: each fp8-lost-values banner's "N of M recorded steps" equals the layer table's count for the
    same layer, role and recipe, and both equal the steps counted from the store's FP8 rows."""
    import re

    import numpy as np

    at = page(fp8_store, monkeypatch, run="1")
    table = at.dataframe[0].value.set_index(["module", "role", "recipe"])
    rows = Store(fp8_store).fp8(1)
    banners = [w.value.replace("\\", "") for w in at.warning if "loses values of" in w.value]
    assert banners
    for banner in banners:
        recipe, module, role = re.search(r"FP8 \((\w+) scaling\) loses values of (.+)'s (\w+)\.", banner).groups()
        counted, recorded = (int(n.replace(",", "")) for n in re.search(r"([\d,]+) of ([\d,]+) recorded steps", banner).groups())
        one = rows[(rows["module"] == module) & (rows["role"] == role) & (rows["recipe"] == recipe)]
        truth = int(((one["underflow"] / one["numel"] > 0.01) | (one["overflow"] > 0)).sum())
        assert counted == truth == table.loc[(module, role, recipe), "steps the finding counts"]
        assert recorded == len(one) == table.loc[(module, role, recipe), "recorded steps"]
        assert table.loc[(module, role, recipe), "steps losing any value"] == int(
            (one["underflow"] + one["overflow"] > 0).sum())
    assert not any(v in ("None", "nan") for v in table.astype(str).to_numpy().ravel() if isinstance(v, str))
    assert np.isfinite(table["recorded steps"].astype(float)).all()
