"""Every chart downloadable as PNG and SVG (issue 27): rendered by vl-convert in the server, only on a click (the
buttons carry a function, not bytes). Checked here: the files are what they claim (a PNG's header and size, an
SVG that parses and holds the chart's title), a chart that fills its container gets a fixed width, and the pages
put two download buttons under each of their charts."""

import struct
import time
import xml.etree.ElementTree as ET

import altair as alt
import numpy as np
import pandas as pd
import pytest
from conftest import ROOT
from streamlit.testing.v1 import AppTest

from mpdiag.dashboard import charts
from mpdiag.dashboard.chart_files import EXPORT_WIDTH, chart_png, chart_svg, file_stem
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript

TITLE = "loss per step <of run> & \"friends\""


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def svg_root(text: str) -> ET.Element:
    return ET.fromstring(text)


def svg_size(root: ET.Element) -> tuple[float, float]:
    return float(root.get("width")), float(root.get("height"))


@pytest.fixture
def chart():
    steps = pd.DataFrame({"step": np.arange(50), "loss": np.linspace(3, 1, 50)})
    return alt.Chart(steps).mark_line().encode(x="step:Q", y="loss:Q").properties(title=TITLE, width=400, height=300)


def test_the_svg_parses_and_holds_the_title_and_the_png_is_the_same_picture_at_twice_its_size(chart):
    root = svg_root(chart_svg(chart))
    assert root.tag.endswith("svg")
    texts = ["".join(node.itertext()) for node in root.iter() if node.tag.endswith("text")]
    assert TITLE in texts  # as SVG text, escaped by the XML, read back as typed
    width, height = svg_size(root)
    assert 400 < width < 520 and 300 < height < 380  # the plot's size plus its axes, title and padding
    assert png_size(chart_png(chart)) == (round(2 * width), round(2 * height))
    assert png_size(chart_png(chart, scale=1)) == (round(width), round(height))


def test_a_chart_that_fills_its_container_is_drawn_at_the_export_width():
    steps = pd.DataFrame({"step": np.arange(20), "loss": np.linspace(3, 1, 20)})
    live = charts.live_loss(steps)  # no width of its own: the page's container gives it one
    width, _ = svg_size(svg_root(chart_svg(live)))
    assert EXPORT_WIDTH <= width < EXPORT_WIDTH + 20
    part = alt.Chart(steps).mark_line().encode(x="step:Q", y="loss:Q")
    stacked = alt.vconcat(*(part.properties(width="container", height=220) for _ in range(2)))  # as the pages stack
    width, height = svg_size(svg_root(chart_svg(stacked)))
    assert EXPORT_WIDTH <= width < EXPORT_WIDTH + 150 and height > 400


def test_file_names_come_from_the_title_letters_and_digits_only(chart):
    assert file_stem(chart, "fallback") == "loss_per_step_of_run_friends"
    assert file_stem(alt.Chart(pd.DataFrame({"a": [1]})).mark_point(), "fallback") == "fallback"


def test_rendering_costs_more_than_a_page_load_may_pay_so_it_waits_for_a_click(chart):
    """Why the buttons carry a function: a small chart takes tens of milliseconds to render (the first one in a
    process far more), which a page of several charts would pay on every rerun."""
    chart_svg(chart)  # the first call starts vl-convert's engine
    start = time.perf_counter()
    chart_png(chart)
    assert time.perf_counter() - start > 0.005


@pytest.fixture(scope="module")
def one_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("charts") / "runs.db"
    script = ModelScript.from_path(ROOT / "mpdiag" / "examples" / "mlp_digits.py")
    train(script, RunConfig(opt_level="O1", steps=6, device="cpu"), path)
    return path


@pytest.mark.parametrize("page, charts_drawn", [("pages/2_Loss_scale.py", 1), ("pages/1_Gradients.py", 3)])
def test_every_chart_on_a_page_has_png_and_svg_download_buttons(page, charts_drawn, one_run, monkeypatch):
    monkeypatch.setenv("MPDIAG_STORE", str(one_run))
    at = AppTest.from_file(str(ROOT / page), default_timeout=120)
    at.query_params["run"] = "1"
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    drawn = at.get("vega_lite_chart")
    buttons = at.get("download_button")
    labels = [b.proto.label for b in buttons]
    assert len(drawn) == charts_drawn and labels.count("PNG") == labels.count("SVG") == charts_drawn, labels
