"""Data shaping and chart specs: numbers against ground truth, charts by their Vega-Lite specs."""

import json
import math
import re

import numpy as np
import pandas as pd
import pytest
import torch

from mpdiag.analysis import summaries
from mpdiag.dashboard import charts
from mpdiag.numerics.formats import BF16, EXP_MIN, FP16, N_EXP_BINS
from mpdiag.numerics.gradstats import GradStatsComputer, category_counts_by_casting


def lognormal_grads(n=50_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.exp2(torch.randn(n, generator=g, dtype=torch.float64) * 8 - 20)).float()


@pytest.mark.parametrize("fmt", [FP16, BF16])
def test_whatif_bounds_contain_the_exact_share_at_every_power_of_two(fmt):
    g = lognormal_grads()
    hist = GradStatsComputer([g.numel()]).compute([g], 1.0).hist[0]
    total = int((g != 0).sum())
    for k in range(-20, 40, 3):
        exact = category_counts_by_casting(g.double() * 2.0**k, fmt)  # ground truth: cast the scaled values
        shares = summaries.whatif_shares(hist, k, fmt)
        for cat, n in exact.items():
            lo, hi = shares[cat]
            assert lo - 1e-12 <= n / total <= hi + 1e-12, (k, cat, lo, n / total, hi)


def test_whatif_is_exact_when_no_value_sits_in_an_edge_bin():
    hist = np.zeros(N_EXP_BINS, dtype=np.int64)
    hist[-30 - EXP_MIN] = 10  # values in [2^-30, 2^-29)
    hist[-10 - EXP_MIN] = 30
    assert summaries.whatif_shares(hist, 0)["underflow"] == (0.25, 0.25)
    assert summaries.whatif_shares(hist, 8)["underflow"] == (0.0, 0.0)  # 2^-22: subnormal now
    assert summaries.whatif_shares(hist, 8)["subnormal"] == (0.25, 0.25)
    assert summaries.whatif_shares(hist, 27)["overflow"] == (0.75, 0.75)  # 2^17: above 65504
    assert all(math.isnan(v) for v in summaries.whatif_shares(np.zeros(N_EXP_BINS), 0)["overflow"])


def test_heatmap_cells_stay_under_the_mark_budget_and_keep_every_count():
    rng = np.random.default_rng(0)
    steps = 10_000
    counts = np.zeros((steps, N_EXP_BINS), dtype=np.int64)
    counts[:, 100:160] = rng.integers(0, 50, size=(steps, 60))
    index = pd.DataFrame({"step": np.arange(steps), "tensor": "w"})
    cells = summaries.heatmap_cells(index, counts)
    assert len(cells) <= summaries.MAX_MARKS
    assert cells["count"].sum() == counts.sum()
    assert cells["step_start"].min() == 0 and cells["step_end"].max() == steps


def test_heatmap_at_scale_moves_bins_by_log2_scale():
    counts = np.zeros((2, N_EXP_BINS), dtype=np.int64)
    counts[:, -30 - EXP_MIN] = 5
    index = pd.DataFrame({"step": [0, 1], "tensor": "w"})
    steps = pd.DataFrame({"step": [0, 1], "loss_scale": [2.0**16, 2.0**15]})
    cells = summaries.heatmap_cells(index, counts, steps, at_scale=True)
    assert sorted(cells["log2_lo"]) == [-15.0, -14.0]


def test_step_histogram_regions_follow_fp16_limits():
    hist = np.zeros(N_EXP_BINS, dtype=np.int64)
    for e in (-30, -25, -20, -15, 0, 15, 16):
        hist[e - EXP_MIN] = 1
    bars = summaries.step_histogram(hist, {"zero": 3, "NaN": 0, "+inf": 1, "-inf": 0}, FP16)
    regions = dict(zip(bars["label"], bars["region"], strict=True))
    assert regions == {
        "2^-30": "underflow", "2^-25": "subnormal (edge bin)", "2^-20": "subnormal", "2^-15": "subnormal (edge bin)",
        "2^0": "normal", "2^15": "normal (edge bin)", "2^16": "overflow", "zero": "zero / non-finite",
        "+inf": "zero / non-finite",
    }


def test_scale_events_and_thinning_keep_what_matters():
    steps = pd.DataFrame({
        "step": np.arange(12_000), "loss": np.ones(12_000), "loss_scale": 1024.0, "scale_after": 1024.0,
        "skipped": 0.0, "growth_tracker": 0.0,
    })
    steps.loc[7777, ["skipped", "scale_after"]] = [1.0, 512.0]
    steps.loc[100, "scale_after"] = 2048.0
    steps.loc[5001, "loss"] = np.nan
    events = summaries.scale_events(steps)
    assert (events["skips"], events["backoffs"], events["growths"]) == (1, 1, 1)
    thin = summaries.thin_steps(steps)
    assert len(thin) <= 5002 and {7777, 5001} <= set(thin["step"])


def test_tensor_ranking_sorts_worst_first_with_exact_shares():
    totals = pd.DataFrame({
        "tensor": ["a", "b"], "numel_per_step": [10, 10], "numel": [100, 100], "zeros": [0, 20], "nan": [0, 0],
        "posinf": [0, 0], "neginf": [0, 0],
        **{f"fp16_{c}": [1, 8] if c == "underflow" else [0, 0] for c in ("underflow", "subnormal", "overflow")},
    })
    ranked = summaries.tensor_ranking(totals)
    assert ranked["tensor"].tolist() == ["b", "a"]
    assert ranked["underflow_share"].tolist() == [8 / 80, 1 / 100]


def test_heatmap_spec_draws_fp16_limits_on_a_log_colour_scale():
    cells = pd.DataFrame({"step_start": [0], "step_end": [1], "log2_lo": [-20.0], "log2_hi": [-19.0], "count": [5]})
    spec = charts.exponent_heatmap(cells, summaries.format_lines(("fp16",)), (0, 4)).to_dict()
    heat, rules = spec["layer"]
    assert heat["mark"]["type"] == "rect" and heat["encoding"]["color"]["scale"]["type"] == "log"
    assert heat["encoding"]["x"]["scale"]["domain"] == [0, 4]  # steps 1..3 hold no cell and still show
    datasets = spec["datasets"]
    limits = datasets[rules["data"]["name"]]
    assert sorted(round(r["log2"], 4) for r in limits) == [-24, -14, round(math.log2(65504), 4)]


def test_loss_scale_panel_uses_log2_axis_and_marks_skips():
    steps = pd.DataFrame({"step": [0, 1, 2], "loss": [1.0, np.inf, 0.5], "loss_scale": [8.0, 8.0, 4.0],
                          "scale_after": [8.0, 4.0, 4.0], "skipped": [0.0, 1.0, 0.0], "growth_tracker": [1, 0, 1],
                          "lr": [0.1] * 3, "grad_norm": [1.0, np.inf, 2.0]})  # Store.steps' columns
    spec = charts.loss_scale_panel(steps).to_dict()
    scale_layer = spec["vconcat"][0]["layer"]
    scale = scale_layer[0]["encoding"]["y"]["scale"]
    # log2, padded by a binade each side: the scale 8 at step 0 and its marker lie inside the plot, not on its edge
    assert (scale["type"], scale["base"], scale["domain"], scale["nice"]) == ("log", 2, [2.0, 16.0], False)
    ticks = scale_layer[0]["encoding"]["y"]["axis"]["values"]
    assert ticks == [2.0, 4.0, 8.0, 16.0]
    skipped_rows = spec["datasets"][scale_layer[1]["data"]["name"]]
    assert [r["step"] for r in skipped_rows] == [1]
    # the step axis ends at the first and last step with room for a marker there (the zoom clips marks: a skipped
    # step 0's marker was cut in half), not rounded out past the last step
    assert scale_layer[0]["encoding"]["x"]["scale"] == {"padding": 6, "nice": False, "zero": False}


def _loss_panel(losses) -> dict:
    """The loss panel of the Loss scale page's chart over ``losses`` (one a step), as Vega-Lite."""
    n = len(losses)
    steps = pd.DataFrame({"step": range(n), "loss": losses, "loss_scale": [1.0] * n, "scale_after": [1.0] * n,
                          "skipped": [0.0] * n, "growth_tracker": [np.nan] * n, "lr": [np.nan] * n,
                          "grad_norm": [np.nan] * n})
    spec = charts.loss_scale_panel(steps).to_dict()
    panel = next(p for p in spec["vconcat"] if p.get("title") == "loss" or str(p.get("title")).startswith("loss ("))
    return {**(panel["layer"][0] if "layer" in panel else panel), "title": panel["title"]}


def test_the_loss_panel_is_on_a_log_axis_where_the_losses_span_decades_and_never_writes_a_small_one_as_0():
    """The review's run: its loss fell from 1.7e-4 to 1.6e-7 (three decades); on Vega's linear axis, labelled
    0.00000, 0.00005 ..., 120 of its 150 steps read as 0. Over a span of more than LOG_LOSS_SPAN the panel is a log10
    one whose domain holds every loss; within it, a linear one whose ticks are short exponents."""
    falling = [1.6e-6, 1.7e-4, 3e-5, *np.geomspace(2e-6, 1.6e-7, 147)]
    assert max(falling) / min(falling) > charts.LOG_LOSS_SPAN
    view = _loss_panel(falling)
    scale = view["encoding"]["y"]["scale"]
    assert scale["type"] == "log" and scale["domain"][0] <= min(falling) and scale["domain"][1] >= max(falling)
    assert view["title"] == "loss (log axis)"
    near = [8e-5, 5e-5, 2e-5]  # 4x: linear, each tick a short exponent (8e-5), 0 as "0", never 0.00000
    view = _loss_panel(near)
    assert "scale" not in view["encoding"]["y"] or view["encoding"]["y"]["scale"].get("type") != "log"
    assert view["encoding"]["y"]["axis"]["labelExpr"] == "datum.value == 0 ? '0' : format(datum.value, '.2~e')"
    assert not charts.losses_far_apart([0.0, 2.0, -1.0, float("nan")]) and not charts.losses_far_apart([3e-5])


def test_log10_axes_end_a_decade_beyond_the_data_and_tick_only_inside():
    """A loss or gradient-norm axis on log10: its largest and smallest values lie inside the plot, not on its
    border (Vega's default domain ends exactly at them), and a value that is itself a power of ten gets a
    decade beyond it."""
    losses = pd.DataFrame({"step": [0, 1, 2, 0], "loss": [5.0, 0.3, 1e-3, 2.0], "run": ["a", "a", "a", "b"]})
    y = charts.runs_overlay(losses, "loss", "loss", ["a", "b"], log=True, log_base=10).to_dict()["layer"][0][
        "encoding"]["y"]
    assert y["scale"] == {"type": "log", "domain": [1e-4, 10.0], "nice": False}
    assert y["axis"]["values"] == [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]
    steps = pd.DataFrame({"step": [0, 1, 2], "grad_norm": [0.02, 0.7, 0.0], "wall_time_s": [0.0, 0.1, 0.2]})
    spec = charts.grad_norm_panel(steps).to_dict()
    norm_y = spec["layer"][0]["encoding"]["y"]
    assert norm_y["scale"]["domain"] == [1e-2, 1.0]  # 0.02 and 0.7 both inside; the 0 is a grey rule
    assert min(norm_y["scale"]["domain"]) < 0.02 and 0.7 < max(norm_y["scale"]["domain"])
    # a value just above a power of ten (the shadow page's 0.1003) gets a decade beyond it too: on the axis from
    # 0.1 its marker was drawn half cut by the plot's edge
    near = pd.DataFrame({"step": [0, 1, 2], "grad_norm": [0.1003, 0.5, 9.8], "wall_time_s": [0.0, 0.1, 0.2]})
    assert charts.grad_norm_panel(near).to_dict()["layer"][0]["encoding"]["y"]["scale"]["domain"] == [1e-2, 100.0]


def test_a_linear_axis_of_tiny_values_reads_as_short_exponents():
    """A loss of 8e-5 on a linear axis: ticks 0, 2e-5 ... 8e-5 as Vega draws them, not 0.00008 beside 0.00000;
    an axis with ordinary values keeps plain numbers with separators."""
    import vl_convert

    tiny = pd.DataFrame({"step": [0, 1, 2], "loss": [8e-5, 4e-5, 1.5e-5], "run": ["a"] * 3})
    svg = vl_convert.vegalite_to_svg(charts.runs_overlay(tiny, "loss", "loss", ["a"]).properties(width=300).to_dict())
    labels = re.findall(r"<text[^>]*>([^<]+)</text>", svg)
    assert "8e-5" in labels and "2e-5" in labels and not any(label.startswith("0.0000") for label in labels), labels
    plain = charts.runs_overlay(tiny.assign(loss=[2500.0, 40.0, 3.5]), "loss", "loss", ["a"]).to_dict()
    assert plain["layer"][0]["encoding"]["y"]["axis"]["format"] == charts.PLAIN_FORMAT


def test_shadow_error_chart_labels_its_threshold_and_spans_it():
    shadow = pd.DataFrame({"step": [0, 10, 20], "tensor": ["w"] * 3, "rel_error": [0.01, 0.05, 0.5],
                           "cosine": [1.0, 0.99, 0.9]})
    spec = charts.shadow_error_lines(shadow, ["w"], 0.2).to_dict()
    line, rule, label = spec["layer"]
    lo, hi = line["encoding"]["y"]["scale"]["domain"]
    assert lo < 0.01 and 0.5 < hi and line["encoding"]["y"]["scale"] == rule["encoding"]["y"]["scale"]
    assert spec["datasets"][label["data"]["name"]][0]["label"] == "finding's threshold: 0.2"
    only_small = charts.shadow_error_lines(shadow.assign(rel_error=[1e-4, 2e-4, 3e-4]), ["w"], 0.2).to_dict()
    assert only_small["layer"][0]["encoding"]["y"]["scale"]["domain"][1] >= 0.2  # the rule is on the plot


def test_run_colours_are_fixed_by_selection_order():
    df = pd.DataFrame({"step": [0, 0], "loss": [1.0, 2.0], "run": ["b", "a"]})
    spec = charts.runs_overlay(df, "loss", "loss", ["a", "b"]).to_dict()
    colour = spec["layer"][0]["encoding"]["color"]["scale"]
    assert colour["domain"] == ["a", "b"] and colour["range"] == charts.RUN_COLOURS[:2]
    # and a dash each, so a run whose curve lies on another's (a fix on its FP32 twin) still shows
    dash = spec["layer"][0]["encoding"]["strokeDash"]["scale"]
    assert dash["domain"] == ["a", "b"] and dash["range"] == charts.RUN_DASHES[:2] and len(set(map(str, dash["range"]))) == 2


def test_whatif_exponents_cover_every_scale_the_run_used_and_2_to_the_plus_minus_40():
    steps = pd.DataFrame({"loss_scale": [2.0**-83, 3e-20, 0.0, np.inf, 2.0**50]})
    exponents = summaries.whatif_exponents(steps)
    assert exponents == list(range(-83, 51))
    assert summaries.log2_exponent(3e-20) in exponents and summaries.log2_exponent(3e-20) == round(math.log2(3e-20))
    assert summaries.log2_exponent(0.0) is None and summaries.log2_exponent(np.inf) is None
    assert summaries.whatif_exponents(pd.DataFrame({"loss_scale": [1.0]})) == list(range(-40, 41))


def test_tensor_summary_line_never_reads_nan_percent():
    totals = pd.DataFrame({
        "tensor": ["zeros only"], "numel_per_step": [8], "numel": [16], "zeros": [16], "nan": [0], "posinf": [0],
        "neginf": [0], **{f"fp16_{c}": [0] for c in ("underflow", "subnormal", "overflow")},
    })
    line = summaries.tensor_summary_line(summaries.tensor_ranking(totals).iloc[0], "fp16")
    assert "nan" not in line.lower().replace("nan/inf", "")
    assert "no finite non-zero values" in line and "zeros 100.00%" in line


def test_health_badge_counts_errors_and_warnings():
    assert summaries.health([]) == "healthy"
    assert summaries.health(["info"]) == "healthy"
    assert summaries.health([], "crashed") == "did not finish" and summaries.health([], "running") == "no findings yet"
    assert summaries.health(["error"], "failed") == "1 error"
    assert summaries.health(["warning", "warning", "info"]) == "2 warnings"
    assert summaries.health(["warning", "error"]) == "1 error, 1 warning"
    # a skipped step too few for a finding (a bad batch's NaN loss) is said beside "healthy"
    assert summaries.health([], "finished", 1) == "healthy, 1 skip" and summaries.health(["info"], skipped=3) == \
        "healthy, 3 skips"
    assert summaries.health(["warning"], skipped=3) == "1 warning" and summaries.health([], "running", 2) == \
        "no findings yet"


def test_a_heatmap_click_picks_the_first_logged_step_of_its_column():
    logged = [0, 10, 20, 30]
    assert summaries.picked_step([], logged) is None and summaries.picked_step([{}], logged) is None
    assert summaries.picked_step([{"step_start": 10}], logged) == 10
    assert summaries.picked_step([{"step_start": 11.0}], logged) == 20  # a merged column starting between logs
    assert summaries.picked_step([{"step_start": 31}], logged) == 30


def test_a_scale_of_zero_is_a_rule_and_a_missing_tracker_no_panel():
    """Issue 27: a log axis cannot draw 0 (the page went blank exactly when the scale collapsed): the zero steps
    are rules, the scale line holds only positive scales, and a run with no growth tracker has no empty panel."""
    from chart_check import chart_problems

    steps = pd.DataFrame({"step": [0, 1, 2], "loss": [1.0, np.nan, np.nan], "loss_scale": [2.0**-140, 0.0, 0.0],
                          "scale_after": [0.0, 0.0, 0.0], "skipped": [1.0, 1.0, 1.0],
                          "growth_tracker": [np.nan] * 3, "lr": [np.nan] * 3, "grad_norm": [np.nan] * 3})
    spec = charts.loss_scale_panel(steps).to_dict()
    assert len(spec["vconcat"]) == 2  # scale and loss; no growth-tracker, learning-rate or norm panel of nothing
    data = spec["datasets"]
    scale_layers = spec["vconcat"][0]["layer"]
    assert [r["loss_scale"] for r in data[scale_layers[0]["data"]["name"]]] == [2.0**-140]
    assert [r["step"] for r in data[scale_layers[-1]["data"]["name"]]] == [1, 2]
    notes = " ".join(summaries.loss_scale_notes(steps, "dynamic", "O1"))
    assert "fell to 0 at step 1" in notes and "No growth-tracker panel" in notes
    assert "O0 has no GradScaler" in " ".join(summaries.loss_scale_notes(steps.assign(loss_scale=1.0), "none", "O0"))

    class Proto:  # what AppTest hands the chart check: the spec with its datasets inline
        spec = json.dumps(charts.loss_scale_panel(steps).to_dict())
        datasets = []

    assert chart_problems(Proto) == []


def test_cast_shares_is_exact_at_two_to_the_zero_and_at_the_steps_own_scale():
    """The tiles and the what-if read one function: at 2^0 and at the step's own scale the exact counts,
    elsewhere the histogram's bounds."""
    hist = np.zeros(N_EXP_BINS, dtype=np.int64)
    hist[-30 - EXP_MIN] = 3  # 2^-30: underflows FP16 unscaled, subnormal at 2^8
    hist[-10 - EXP_MIN] = 1
    row = pd.Series({"numel": 5, "zeros": 1, "nan": 0, "posinf": 0, "neginf": 0,
                     "fp16_underflow": 3, "fp16_subnormal": 0, "fp16_overflow": 0,
                     "fp16_underflow_at_scale": 1, "fp16_subnormal_at_scale": 2, "fp16_overflow_at_scale": 0})
    assert summaries.cast_shares(row, hist, "fp16", 0, 256.0)["underflow"] == (0.75, 0.75, True)
    own = summaries.cast_shares(row, hist, "fp16", 8, 256.0)
    assert own["underflow"] == (0.25, 0.25, True) and own["subnormal"] == (0.5, 0.5, True)  # the record, not the histogram
    assert summaries.cast_shares(row, hist, "fp16", 9, 256.0)["underflow"][2] is False
    assert summaries.share_text((np.nan, np.nan, True)) == "n/a"


def test_the_heatmap_caption_names_the_default_thinning_only_once_a_run_is_past_its_dense_start():
    """A default-retention run (every None) kept whole (under 1,000 steps) needs no caption; past it, the
    caption says where the thinning starts and names the anomalies, not the start or the multiples."""
    start = pd.DataFrame({"step": range(1000), "reason": "start"})
    assert summaries.kept_steps_text(start.iloc[:600], None) is None
    later = pd.DataFrame({"step": [1000, 1026, 1027, 1028, 1050],
                          "reason": ["every", "before", "overflow", "after", "every"]})
    assert summaries.kept_steps_text(pd.concat([start, later]), None) == (
        "Statistics are stored at every step up to step 999, then every 50 steps; the columns between them are not "
        "stored, except where something happened: overflow at step 1,027, and 2 steps next to them.")
    # a run recorded before --every had a default of None (every NULL, every step 'every') has no gaps to explain
    assert summaries.kept_steps_text(pd.DataFrame({"step": range(1200), "reason": "every"}), None) is None


def test_signal_lines_thin_a_live_runs_steps_without_losing_a_one_step_spike():
    """12,000 steps read one by one (a live run): at most SIGNAL_POINTS points a line, the spike at its value, and
    only the lines with something to draw."""
    columns = list(summaries.SIGNAL_LINES.values())
    totals = pd.DataFrame(0, index=range(12_000), columns=["step", *columns, "steps"]).assign(
        step=range(12_000), steps=1)
    totals.loc[7_777, "fp16_overflow_at_scale"] = 42
    totals.loc[::3, "fp16_underflow_at_scale"] = 5
    lines = summaries.signal_lines(totals)
    assert set(lines["line"]) == {"FP16 overflow at the scale", "FP16 underflow at the scale"}
    overflow = lines[lines["line"] == "FP16 overflow at the scale"]
    assert len(overflow) <= summaries.SIGNAL_POINTS and overflow["values"].max() == 42
    assert (lines[lines["line"] == "FP16 underflow at the scale"]["values"] == 5).all()  # every range holds one
    assert summaries.signal_note(totals, 1_200, "O1").startswith("Values that overflow") and \
        "12,000 steps counted, 1,200" in summaries.signal_note(totals, 1_200, "O1")
    quiet = totals.assign(**{column: 0 for column in columns})
    said = summaries.signal_note(quiet, 1_200, "O1")  # nothing counted: it says so, and what it cannot count
    # an FP16 backward's flushed values are zeros these counts cannot see: never "no underflow" first (a watched
    # FP16 loop judged in FP16, custom-fp16, too)
    for level in ("O1", "custom-fp16"):
        said = summaries.signal_note(quiet, 1_200, level)
        assert said.startswith("No inf/NaN or overflow at any step, and no recorded value that would underflow FP16")
        assert "flushed to zero was recorded as a zero" in said
    # an FP32 or BF16 backward flushes nothing to zero that FP16 could have held: no such caveat there
    for level in ("O0", "bf16"):
        said = summaries.signal_note(quiet, 1_200, level)
        assert said.startswith("No inf/NaN and no FP16/BF16 overflow or underflow") and "flushed" not in said


def _one_step_charts(steps: list[int]) -> dict:
    """Every line chart, on frames holding ``steps``: (chart, its series)."""
    n = len(steps)
    frame = pd.DataFrame({"step": steps, "loss_scale": [65536.0] * n, "skipped": [0] * n, "scale_after": [65536.0] * n,
                          "growth_tracker": [1] * n, "loss": [2.5] * n, "lr": [1e-3] * n, "grad_norm": [0.7] * n,
                          "wall_time_s": [0.1] * n})
    runs = pd.DataFrame({"step": steps * 2, "loss": [2.5] * n + [2.4] * n, "rel_diff": [0.0] * n + [0.01] * n,
                         "run": ["a"] * n + ["b"] * n})
    lines = pd.DataFrame({"step": steps * 2, "line": ["overflow"] * n + ["underflow"] * n, "values": [0] * n + [3] * n})
    fp8 = pd.DataFrame({"step": steps, "amax": [3.0] * n, "limit": [448.0] * n, "overflows": [False] * n,
                        "overflow": [0] * n, "underflow low": [1] * n, "overflow low": [0] * n,
                        "underflow high": [2] * n, "overflow high": [0] * n, "scale": [1.0] * n})
    shares = pd.DataFrame({"step": steps, "below_resolution_share": [0.2] * n, "unchanged_share": [0.1] * n})
    return {"loss scale, growth tracker, loss, lr, grad norm": (charts.loss_scale_panel(frame), 5),
            "live loss": (charts.live_loss(frame), 1),
            "runs overlay": (charts.runs_overlay(runs, "loss", "loss", ["a", "b"]), 2),
            "runs overlay, log2, smoothed": (charts.runs_overlay(
                runs.assign(loss_smoothed=runs["loss"]), "loss", "loss", ["a", "b"], log=True, smooth=True), 4),
            "loss difference": (charts.loss_difference(runs, None, ["a", "b"], 0.1), 2),
            "signal lines": (charts.signal_lines(lines), 2),
            "update shares": (charts.update_share_lines(shares, "bf16"), 2),
            "FP8 amax": (charts.fp8_amax_panel(fp8), 2),
            "FP8 what-if": (charts.fp8_whatif_lines(fp8), 1)}


def test_a_run_of_one_step_draws_a_point_on_every_line_chart():
    """A line through one point draws nothing: a running run's first refresh (or a run of one step) showed empty
    panels. Rendered by Vega (vl-convert), each series of one step is a point; with two steps none is."""
    import vl_convert

    def points(chart) -> int:
        return vl_convert.vegalite_to_svg(chart.to_dict()).count('aria-roledescription="point"')

    for name, (chart, series) in _one_step_charts([7]).items():
        assert points(chart) == series, name
    for name, (chart, _) in _one_step_charts([7, 8]).items():
        assert points(chart) == 0, name


def test_signal_lines_of_a_format_the_run_does_not_compute_in_say_if_cast():
    """An FP32 twin's "FP16 underflow at the scale" line (what FP16 would have lost) read as if the twin had
    underflowed, worse than the failing FP16 run beside it, and a BF16 run's as FP16's: each such line says "if
    cast", and the note says what that means; a run of unknown format (a watched script) keeps the plain names."""
    totals = pd.DataFrame({"step": [0, 1], "nan": [0, 0], "posinf": [0, 0], "neginf": [0, 0],
                           "fp16_overflow_at_scale": [0, 0], "fp16_underflow_at_scale": [4000, 3],
                           "bf16_overflow_at_scale": [0, 0], "bf16_underflow_at_scale": [0, 2], "steps": [1, 1]})
    named = {level: summaries.signal_lines(totals, level)["line"].unique().tolist()
             for level in ("O0", "bf16", "O1", "custom")}
    assert named == {"O0": ["FP16 underflow at the scale, if cast", "BF16 underflow at the scale, if cast"],
                     "bf16": ["FP16 underflow at the scale, if cast", "BF16 underflow at the scale"],
                     "O1": ["FP16 underflow at the scale", "BF16 underflow at the scale, if cast"],
                     "custom": ["FP16 underflow at the scale", "BF16 underflow at the scale"]}
    assert "This run computes in FP32" in summaries.signal_note(totals, 2, "O0")
    assert "cast of its gradients to FP16 would" in summaries.signal_note(totals, 2, "bf16")
    assert "if cast" not in summaries.signal_note(totals, 2, "custom")
    fp16_only = totals.assign(bf16_underflow_at_scale=0)
    assert "if cast" not in summaries.signal_note(fp16_only, 2, "O1")  # no such line drawn: nothing to explain


def test_each_signal_line_keeps_its_colour_whichever_lines_a_run_has():
    """NaN was blue on a run with no inf (Vega colours by order of appearance) and red beside +inf on the next."""
    def colours(lines: list[str]) -> dict[str, str]:
        df = pd.DataFrame({"step": [0, 1] * len(lines), "line": [n for n in lines for _ in (0, 1)],
                           "values": [1, 2] * len(lines)})
        spec = charts.signal_lines(df).to_dict()
        scale = (spec["layer"][0] if "layer" in spec else spec)["encoding"]["color"]["scale"]
        return dict(zip(scale["domain"], scale["range"], strict=True))

    alone = colours(["NaN values"])
    beside = colours(["+inf values", "NaN values", "FP16 underflow at the scale, if cast"])
    assert alone["NaN values"] == beside["NaN values"] != beside["+inf values"]
    assert list(beside) == ["NaN values", "+inf values", "FP16 underflow at the scale, if cast"]  # drawing order
    assert beside["FP16 underflow at the scale, if cast"] == colours(["FP16 underflow at the scale"])[
        "FP16 underflow at the scale"]
