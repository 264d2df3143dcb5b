"""The pages tell the truth on hard runs (issue 15), checked under AppTest on runs recorded with the CLI."""

import json
import logging
import math
import re
import subprocess
import sys

import pandas as pd
import pyarrow as pa
import pytest
from app_helpers import runs_table
from conftest import EXAMPLES, ROOT
from streamlit.testing.v1 import AppTest

from mpdiag.analysis.compare import COUNTED_PART, FLUSHED_PART
from mpdiag.dashboard.tables import TABLE_PX

TIMEOUT = 60
COLLAPSED_SCALE = 2.0**-83  # every scaled gradient underflows FP32 to exact zero


def record(store, script, *options):
    subprocess.run([sys.executable, "-m", "mpdiag", "run", str(EXAMPLES / script), "--device", "cpu",
                    "--store", str(store), *options], check=True, cwd=ROOT, capture_output=True)


@pytest.fixture(scope="module")
def truth_store(tmp_path_factory):
    """Run 1: gallery_underflow at O1 with a static scale of 2^-83 (every gradient recorded is zero); run 2:
    gallery_activation_overflow at O1 whose dynamic scale collapses by 1000x per step from 1e-20 (not a power of
    two, down to about 2^-106); runs 3 and 4: the README's example, gallery_underflow at O1 with a static scale of
    1, and its FP32 twin (--pair)."""
    path = tmp_path_factory.mktemp("truth") / "runs.db"
    record(path, "gallery_underflow.py", "--opt-level", "O1", "--loss-scale", repr(COLLAPSED_SCALE), "--steps", "3")
    record(path, "gallery_activation_overflow.py", "--opt-level", "O1", "--init-scale", "1e-20",
           "--backoff-factor", "0.001", "--steps", "5")
    record(path, "gallery_underflow.py", "--opt-level", "O1", "--loss-scale", "1", "--steps", "8", "--pair")
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
    # no cell has a value: a sentence says so instead of an empty heatmap (issue 27: never an empty chart)
    assert not [c for c in at.get("vega_lite_chart") if "click a column" in c.proto.spec]
    assert "nothing to place on the exponent axis" in " ".join(i.value for i in at.info).replace("\\", "")
    for view in ("at the loss scale (S·g)", "unscaled g"):
        at.radio(key="view").set_value(view).run()
        at.select_slider(key="whatif").set_value(exponents[-1]).run()
        assert not at.exception, [e.value for e in at.exception]
        assert "nan%" not in said(at)


def chart_data(at, title: str) -> pd.DataFrame:
    """The data of the chart titled ``title`` on a rendered page (its datasets, concatenated)."""
    chart = next(c for c in at.get("vega_lite_chart") if json.loads(c.proto.spec).get("title") == title)
    return pd.concat([pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in chart.proto.datasets])


def test_compare_tells_final_losses_apart_and_charts_step_times_as_stored(truth_store, monkeypatch):
    """Final losses to as many digits as tell them apart, each the store's; every stored step time after step
    0 is either drawn or listed as an outlier, never silently dropped or drawn when the caption says not."""
    from mpdiag import Store

    store = Store(truth_store, create=False)
    at = page("3_Compare.py", truth_store, monkeypatch, runs=["3", "4"])
    assert not at.exception, [e.value for e in at.exception]
    table = at.dataframe[0].value
    stored = store.runs().set_index("run_id").loc[[3, 4], "final_loss"].astype(float).to_numpy()
    shown = table["final loss"].tolist()
    assert [float(v) for v in shown] == pytest.approx(stored, rel=1e-3)
    assert (shown[0] != shown[1]) == (stored[0] != stored[1])
    assert not any(v in ("None", "nan") for v in table.astype(str).to_numpy().ravel())
    drawn = chart_data(at, "step time (s), from step 1")
    captions = " ".join(c.value for c in at.caption)
    for run in (3, 4):
        steps = store.steps(run)
        label = drawn["run"].str.startswith(f"#{run} ")
        for step, seconds in zip(steps["step"], steps["step_time_s"], strict=True):
            if step == 0:
                assert step not in set(drawn.loc[label, "step"])
                continue
            if step in set(drawn.loc[label, "step"]):
                assert drawn.loc[label & (drawn["step"] == step), "step_time_s"].iloc[0] == pytest.approx(seconds)
            else:
                assert f"step {step:,} {seconds:,.3g} s" in captions, (run, step)


def percent_after(text: str, pattern: str) -> float:
    return float(re.search(pattern, text).group(1)) / 100


def test_flushed_share_agrees_between_gradients_findings_and_compare(truth_store, monkeypatch):
    from mpdiag import Store

    store = Store(truth_store, create=False)
    totals, twin = store.tensor_totals(3), store.tensor_totals(4)
    # ground truth from the two records: zeros the FP16 run has beyond the FP32 twin's, per tensor
    expected = {r.tensor: max(0.0, r.zeros / r.numel - t.zeros / t.numel)
                for r, t in zip(totals.itertuples(), twin.set_index("tensor").loc[totals["tensor"]].itertuples(), strict=True)}
    assert expected["1.weight"] > 0.05  # the example really flushes gradients (the exact counts show 0 underflow)

    grads = page("1_Gradients.py", truth_store, monkeypatch, run="3", tensor="1.weight")
    assert not grads.exception, [e.value for e in grads.exception]
    line = next(c.value for c in grads.caption if c.value.startswith("1\\.weight"))
    shown = percent_after(line, r"([0-9.]+)% of all values flushed to zero before recording \(underflow\)")
    assert shown == pytest.approx(expected["1.weight"], abs=5e-5)
    metrics = {m.label: m.value for m in grads.metric}
    assert "fp16 flushed to zero" in metrics
    assert metrics["fp16 flushed to zero"].endswith("%")

    findings = page("5_Findings.py", truth_store, monkeypatch, run="3")
    assert not findings.exception, [e.value for e in findings.exception]
    evidence = said(findings).replace("\\", "")
    assert "flushed to zero before recording (underflow)" in evidence
    assert abs(percent_after(evidence, r"1\.weight: ([0-9.]+)%") - shown) <= 0.01

    compare = page("3_Compare.py", truth_store, monkeypatch, runs=["3", "4"])
    assert not compare.exception, [e.value for e in compare.exception]
    bars = chart_data(compare, "FP16 underflow, share of all values")
    # the FP16 run's bars are what its backward pass flushed (zeros in its record), the twin's what FP16 would
    # have lost of its FP32 gradient: each against the store, so the healthy twin no longer reads as the broken run
    flushed = bars[bars["run"].str.startswith("#3 ") & (bars["part"] == FLUSHED_PART)].set_index("tensor")["share"]
    assert len(flushed) and all(flushed[t] == pytest.approx(expected[t], abs=1e-9) for t in flushed.index)
    counted = bars[bars["run"].str.startswith("#4 ") & (bars["part"] == COUNTED_PART)].set_index("tensor")["share"]
    truth = (twin["fp16_underflow_at_scale"] / twin["numel"]).set_axis(twin["tensor"])
    assert len(counted) and all(counted[t] == pytest.approx(truth[t], abs=1e-12) for t in counted.index)
    assert not (bars["run"].str.startswith("#4 ") & (bars["part"] == FLUSHED_PART)).any()  # FP32 flushes nothing


def test_compare_keeps_what_tells_runs_apart_in_view_at_1280_px(truth_store, monkeypatch):
    """The gallery's screenshots at 1,280 px (issue 27): the underflow bars' solid/light legend ran past the
    chart's right edge beside the runs' legend, and the cost table's whole run labels pushed the final loss and
    skipped steps off screen."""
    compare = page("3_Compare.py", truth_store, monkeypatch, runs=["3", "4"])
    assert not compare.exception, [e.value for e in compare.exception]
    chart = next(json.loads(c.proto.spec) for c in compare.get("vega_lite_chart")
                 if json.loads(c.proto.spec).get("title") == "FP16 underflow, share of all values")
    assert chart["encoding"]["opacity"]["legend"]["orient"] == "bottom"
    assert chart["encoding"]["color"]["legend"]["orient"] == "top"
    cost = next(d for d in compare.dataframe if "median step time" in d.value.columns)
    config = json.loads(cost.proto.columns)
    assert config["run"]["pinned"] is True
    assert cost.value.columns.tolist()[:3] == ["run", "final loss", "skipped steps"]
    # at 1,280 px every column is on screen: short headers, the long explanation on hover, widths that fit
    assert sum(c.get("width", 0) for c in config.values()) <= TABLE_PX and config["median step time"]["label"] == "step time"
    histograms = next(d for d in compare.dataframe if "NaN / inf" in d.value.columns)
    assert json.loads(histograms.proto.columns)["run"]["pinned"] is True


def test_a_static_scale_draws_no_flat_growth_tracker(truth_store, monkeypatch):
    """Run 3's scale is static: GradScaler's recorded tracker is a flat line that says nothing (issue 27's gallery
    showed an empty-looking panel), so there is no panel and the page says why, as it does for O0."""
    at = page("2_Loss_scale.py", truth_store, monkeypatch, run="3")
    assert not at.exception, [e.value for e in at.exception]
    specs = [c.proto.spec for c in at.get("vega_lite_chart")]
    assert specs and not any("growth tracker" in s for s in specs)
    assert "No growth-tracker panel: a static scale never grows or backs off." in said(at).replace("\\", "")
    dynamic = page("2_Loss_scale.py", truth_store, monkeypatch, run="2")  # a dynamic scale keeps its panel
    assert any("growth tracker" in c.proto.spec for c in dynamic.get("vega_lite_chart"))


def test_without_a_twin_the_flushed_share_is_said_to_be_unknowable(truth_store, monkeypatch):
    at = page("1_Gradients.py", truth_store, monkeypatch, run="1")
    text = said(at)
    assert "cannot be known from this run" in text and "--pair" in text
    assert {m.label: m.value for m in at.metric}["fp16 flushed to zero"] == "unknown"


def test_runs_table_for_triage(truth_store, monkeypatch):
    monkeypatch.setenv("MPDIAG_STORE", str(truth_store))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=TIMEOUT).run()
    # the store holds a static-scale run: its rerun form (static scale picker beside the mode radio) renders
    assert not at.exception, [e.value for e in at.exception]
    table = runs_table(at).set_index("run")
    assert table.loc[2, "final loss"] == "NaN"  # the activation-overflow run's loss was NaN to the end
    assert table.loc[2, "skipped"] == "5 of 5" and table.loc[1, "skipped"] == "0 of 3"
    assert (table["ranks"] == "1").all()  # one process each
    assert table.loc[4, "related"] == "FP32 twin of #3" and table.loc[3, "related"] == "its FP32 twin: #4"
    assert table.loc[1, "related"] == ""  # nothing, not "None"
    assert table.loc[3, "static scale"] == "1" and table.loc[4, "static scale"] == ""  # blank, not "None"
    assert all(re.fullmatch(r"NaN|-?[0-9.]+(e[-+][0-9]+)?", v) and len(v.replace("-", "").replace(".", "")) <= 9
               for v in table["final loss"])
    # the badge counts the findings the Findings page lists for that run
    from mpdiag import Store
    from mpdiag.analysis.findings import diagnose

    store = Store(truth_store, create=False)
    for run in table.index:
        severities = [f.severity for f in diagnose(store, int(run))]
        badge = table.loc[run, "health"]
        if "error" in severities:
            assert badge.startswith(f"{severities.count('error')} error")
        elif "warning" in severities:
            assert badge.startswith(f"{severities.count('warning')} warning")
        else:  # with the steps GradScaler skipped, too few for a finding, beside it
            skipped = int(store.run(int(run))["skipped_steps"] or 0)
            assert badge == ("healthy" if not skipped else f"healthy, {skipped} skip{'s' if skipped > 1 else ''}")
    assert not table.loc[3, "health"].startswith("healthy")  # the README's failing example has gradient-underflow
    assert table.loc[3, "findings"] == "/Findings?run=3"
    assert table.loc[3, "gradients"] == "/Gradients?run=3" and table.loc[3, "loss scale"] == "/Loss_scale?run=3"
    at.multiselect(key="filter_script").set_value(["gallery_activation_overflow.py"]).run()
    assert at.dataframe[0].value["run"].tolist() == [2]
    at.multiselect(key="filter_script").set_value([]).run()
    at.multiselect(key="filter_opt level").set_value(["O0"]).run()
    assert at.dataframe[0].value["run"].tolist() == [4]


@pytest.mark.parametrize("name", ["1_Gradients.py", "2_Loss_scale.py", "5_Findings.py"])
def test_the_url_names_the_run_shown(name, truth_store, monkeypatch):
    at = page(name, truth_store, monkeypatch)
    assert not at.exception, [e.value for e in at.exception]
    # the default (run 3, the README's failing example, not its newer FP32 twin 4) is in the URL too
    assert at.query_params["run"] == "3"
    at.selectbox(key="run").set_value(4).run()
    assert at.query_params["run"] == "4"
    assert page(name, truth_store, monkeypatch, run="1").selectbox(key="run").value == 1


def test_compare_url_names_the_runs_shown_without_a_session_state_warning(truth_store, monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("streamlit"), "propagate", True)  # its warnings reach caplog
    at = page("3_Compare.py", truth_store, monkeypatch, runs=["3", "4"])
    assert not at.exception, [e.value for e in at.exception]
    assert at.multiselect(key="runs").value == [3, 4] and at.query_params["runs"] == ["3", "4"]
    at.multiselect(key="runs").set_value([1, 3]).run()
    assert at.query_params["runs"] == ["1", "3"]
    assert "created with a default value but also had its value set" not in caplog.text
