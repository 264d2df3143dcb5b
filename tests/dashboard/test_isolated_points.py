"""Lone finite values on the line charts over steps: a line needs two consecutive drawable values for a segment, so
a finite value between NaN/inf ones (steps alternating skipped and applied, the first or last value beside a gap)
was not drawn at all. Each is a point in its line's colour, with its tooltip; a run of finite values gets none."""

from __future__ import annotations

import numpy as np
import pandas as pd
from chart_check import _frame, _views

from mpdiag.dashboard import charts

#: steps 20..54 alternate skipped (even: grad norm inf or NaN, loss NaN) and applied (odd: finite); 0..19 and
#: 55..70 are applied in a row, 71 skipped, 72 (the last) applied
STEPS = np.arange(73)
ALTERNATING = (STEPS >= 20) & (STEPS <= 54)
SKIPPED = (ALTERNATING & (STEPS % 2 == 0)) | (STEPS == 71)
LONE = [int(s) for s in STEPS if not SKIPPED[s] and (ALTERNATING[s] or s == 72)]
NORM = np.where(SKIPPED, np.where(STEPS % 4 == 0, np.inf, np.nan), 0.1 + STEPS * 1e-3)
LOSS = np.where(SKIPPED, np.nan, 3.0 - STEPS * 1e-2)


def _steps() -> pd.DataFrame:
    n = len(STEPS)
    return pd.DataFrame({"step": STEPS, "loss_scale": np.where(SKIPPED, 2.0**15, 2.0**16), "skipped": SKIPPED.astype(int),
                         "scale_after": np.full(n, 2.0**16), "growth_tracker": np.arange(n) % 5, "loss": LOSS,
                         "lr": np.full(n, 1e-3), "grad_norm": NORM, "wall_time_s": STEPS * 0.1})


def _point_layers(chart, y: str) -> list[tuple[dict, pd.DataFrame]]:
    """(view, its data) for every point mark of ``chart`` encoding ``y`` on its y axis, but markers of their own
    shape (the Loss scale page's skipped steps, triangles)."""
    spec = chart.to_dict()
    named = {k: pd.DataFrame(v) for k, v in spec.get("datasets", {}).items()}
    found = []
    for view, where in _views(spec, {}):
        mark = view["mark"]["type"] if isinstance(view["mark"], dict) else view["mark"]
        shaped = isinstance(view["mark"], dict) and "shape" in view["mark"]
        if mark == "point" and not shaped and view.get("encoding", {}).get("y", {}).get("field") == y:
            found.append((view, _frame(where["data"], named)))
    return found


def _line_layer(chart, y: str) -> dict:
    lines = [view for view, _ in _views(chart.to_dict(), {})
             if (view["mark"]["type"] if isinstance(view["mark"], dict) else view["mark"]) == "line"
             and view.get("encoding", {}).get("y", {}).get("field") == y]
    assert len(lines) == 1, lines
    return lines[0]


def _assert_lone_points(chart, y: str, values, run: str | None = None, colour: str | None = None):
    """One point layer for ``y`` holding exactly the lone steps with their values, in the line's colour and with
    the line's tooltip."""
    (view, data), = _point_layers(chart, y)
    if run is not None:
        data = data[data["run"] == run]
    assert data["step"].astype(int).tolist() == LONE
    assert data[y].astype(float).tolist() == [float(values[s]) for s in LONE]  # exact values, as recorded
    line = _line_layer(chart, y)
    assert view["encoding"]["tooltip"] == line["encoding"]["tooltip"]
    assert view["encoding"]["x"] == line["encoding"]["x"] and view["encoding"]["y"] == line["encoding"]["y"]
    assert view["mark"].get("filled") is True
    if colour is not None:
        assert view["mark"].get("color") == colour == line["mark"].get("color")
    else:  # the run's colour, the legend the line's alone (merged with the points', its symbols were dots)
        assert view["encoding"]["color"] == {**line["encoding"]["color"], "legend": None}


def test_the_gradient_norm_panel_draws_each_lone_finite_norm_as_a_point():
    _assert_lone_points(charts.grad_norm_panel(_steps()), "grad_norm", NORM, colour="#9467bd")


def test_the_loss_scale_pages_loss_line_draws_each_lone_finite_loss_as_a_point():
    panel = charts.loss_scale_panel(_steps())
    _assert_lone_points(panel, "loss", LOSS, colour="#1f77b4")
    _assert_lone_points(panel, "grad_norm", NORM, colour="#9467bd")  # the gradient norm panel beneath it
    # the loss scale (finite at every step) and the growth tracker draw lines alone
    assert not _point_layers(panel, "loss_scale") and not _point_layers(panel, "growth_tracker")


def _runs() -> pd.DataFrame:
    """Run "a" as the steps above; run "b" applied every step."""
    a = pd.DataFrame({"run": "a", "step": STEPS, "loss": LOSS, "grad_norm": NORM})
    b = pd.DataFrame({"run": "b", "step": STEPS, "loss": 2.0 - STEPS * 1e-2, "grad_norm": 0.2 + STEPS * 1e-3})
    return pd.concat([a, b], ignore_index=True)


def test_the_compare_pages_loss_and_gradient_norm_lines_draw_lone_finite_values_of_a_run_as_points():
    runs, domain = _runs(), ["a", "b"]
    for y, values, kwargs in (("loss", LOSS, {}), ("loss", LOSS, {"log": True, "log_base": 10}),
                              ("grad_norm", NORM, {"log": True, "log_base": 10})):
        chart = charts.runs_overlay(runs, y, y, domain, **kwargs)
        _assert_lone_points(chart, y, values, run="a")
        (_, data), = _point_layers(chart, y)
        assert set(data["run"]) == {"a"}, (y, kwargs)  # run b, finite throughout, is a line without points
        assert "strokeDash" not in _point_layers(chart, y)[0][0]["encoding"]  # the dashes' legend stays the line's
    smoothed = _runs().assign(loss_smoothed=lambda d: d["loss"])
    chart = charts.runs_overlay(smoothed, "loss", "loss", domain, smooth=True)
    _assert_lone_points(chart, "loss", LOSS, run="a")
    (_, data), = _point_layers(chart, "loss_smoothed")
    assert data["step"].astype(int).tolist() == LONE


def test_lines_of_consecutive_finite_values_get_no_points():
    """A point at every step of a long run would bury the line: finite values in a row draw none, whatever the
    gaps elsewhere."""
    steady = _steps().assign(loss=3.0 - STEPS * 1e-2, grad_norm=0.1 + STEPS * 1e-3)
    panel = charts.loss_scale_panel(steady)
    assert not any(_point_layers(panel, y) for y in ("loss_scale", "growth_tracker", "loss", "lr", "grad_norm"))
    gaps = steady.assign(loss=np.where(STEPS % 10 < 3, np.nan, steady["loss"]))  # gaps of 3, runs of 7 finite
    panel = charts.loss_scale_panel(gaps)
    assert not _point_layers(panel, "loss") and not _point_layers(panel, "grad_norm")
    runs = _runs().assign(loss=lambda d: np.where(d["step"] % 2 == 0, np.nan, 1.0))  # both runs lone everywhere
    (_, data), = _point_layers(charts.runs_overlay(runs, "loss", "loss", ["a", "b"]), "loss")
    assert len(data) == 2 * len(STEPS[1::2])


def test_a_lone_value_is_judged_within_its_own_run_in_the_order_of_the_x_axis():
    """Neighbours are the previous and next rows of the same run along x (rows may come in any order), not the
    previous and next steps: a thinned run's finite values 10 steps apart are still a line."""
    rows = pd.DataFrame({"run": ["a", "b", "a", "b", "a", "b"], "step": [20, 0, 10, 10, 0, 20],
                         "loss": [np.nan, 1.0, 2.0, 1.5, np.nan, 3.0]})
    assert charts._lone_rows(rows, "loss", by="run").to_dict("list") == {"run": ["a"], "step": [10], "loss": [2.0]}
    assert charts._lone_rows(rows.assign(loss=1.0), "loss", by="run").empty


def test_vega_draws_one_point_per_lone_value_and_none_on_a_steady_run():
    """As Vega renders it (vl-convert): the gradient-norm panel draws a point at each lone norm, none on a run of
    finite norms in a row."""
    import vl_convert

    def points(chart) -> int:
        return vl_convert.vegalite_to_svg(chart.to_dict()).count('aria-roledescription="point"')

    assert points(charts.grad_norm_panel(_steps())) == len(LONE)
    assert points(charts.grad_norm_panel(_steps().assign(grad_norm=0.1 + STEPS * 1e-3))) == 0
