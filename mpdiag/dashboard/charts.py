"""Pure chart functions: DataFrame in, Altair chart out. No Streamlit, no store access.

Data is expected already aggregated (:mod:`mpdiag.analysis.summaries`), so no chart ships more than about 20k marks.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import warnings

import altair as alt
import numpy as np
import pandas as pd

from mpdiag.analysis.summaries import IF_CAST, SIGNAL_LINES
from mpdiag.numerics.formats import FP16

#: Fixed colours for runs on the Compare page, by position of the run in the selection.
RUN_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
#: and dashes: two runs whose curves coincide (a fix that brings the loss back to its FP32 twin's) both stay visible
RUN_DASHES = [[1, 0], [7, 4], [2, 3], [10, 3, 2, 3]]
REGION_COLOURS = {
    "underflow": "#d62728",
    "subnormal": "#ff7f0e",
    "normal": "#2ca02c",
    "overflow": "#9467bd",
    "zero / non-finite": "#7f7f7f",
}
LIMIT_COLOURS = {"fp16": "#d62728", "bf16": "#1f77b4", "fp8_e4m3": "#ff7f0e", "fp8_e5m2": "#8c564b"}


#: how many charts each reused chart function holds (a live page draws one or a few of each)
REUSED_CHARTS = 16


def _same_value(value):
    """A key for one argument of a chart function: plain values and lists of strings by value, anything else
    (frames, other lists) by identity."""
    if value is None or isinstance(value, (str, int, float, bool, np.integer, np.floating)):
        return type(value).__name__, value
    if isinstance(value, tuple):
        return ("tuple", *map(_same_value, value))
    if isinstance(value, list) and all(isinstance(v, str) for v in value):  # labels, tensor names: by value
        return ("list", *value)
    return "id", id(value)


def _reused(build):
    """``build`` handing back the chart it built before when called again with the very same frames and equal
    plain values: a live page's view-model hands back the frames it held while the run's data stayed the same, so
    a refresh with nothing new builds no chart (building validates every encoding: tens of milliseconds each).
    The frames a chart was built from are held with it, so their identities are not reused while it is held;
    nothing changes a frame in place once a chart is built from it (the view-models build new ones)."""
    built, lock = {}, threading.Lock()

    @functools.wraps(build)
    def reuse(*args, **kwargs):
        key = (tuple(map(_same_value, args)), tuple((k, _same_value(v)) for k, v in sorted(kwargs.items())))
        with lock:
            if key in built:
                return built[key][1]
        chart = build(*args, **kwargs)
        with lock:
            while len(built) >= REUSED_CHARTS:
                del built[next(iter(built))]
            built[key] = ((args, kwargs), chart)
        return chart
    return reuse


#: stacked charts (vconcat) whose parts are "container" wide: without fit-x on the whole, each part takes the
#: container's width and the axes and padding push the whole past it (seen in Chromium)
_FIT_WIDTH = alt.AutoSizeParams(type="fit-x", contains="padding")


def _fit(chart):
    """``chart`` sized as its heights say: the width fits the element (the pages draw every chart
    ``width="stretch"``), each height is the plot's own. Without it Streamlit fits the whole chart, title, axes
    and legends included, into the height, and a 240 px chart with a legend above has a plot of 130 px."""
    return chart.properties(autosize=_FIT_WIDTH)


def _unfit(chart):
    """A copy of ``chart`` without an autosize (a part of a concatenation may not have one)."""
    part = chart.copy()
    part.autosize = alt.Undefined
    return part


#: the x axis of every chart over steps: whole steps only (a 3-step run would otherwise be ticked 0.1, 0.2, ...);
#: from the first step to the last, not rounded out (a 20-step run's axis ran to 20, past its last step 19), with
#: a few pixels' room each side: the panels bound to the zoom clip their marks, and a marker on the first step
#: (a skipped step 0) was cut in half
_STEP_SCALE = alt.Scale(padding=6, nice=False, zero=False)
STEP_X = alt.X("step:Q", title="step", scale=_STEP_SCALE, axis=alt.Axis(format="d", tickMinStep=1))
#: Compare's other x axis: seconds from each run's start (Store.steps' wall_time_s), relative
WALL_X = alt.X("wall_time_s:Q", title="wall time since the run started (s)", axis=alt.Axis(format=",.12~g"))


def x_axis(x: str) -> alt.X:
    """The x encoding of a chart over ``x``: "step" or "wall_time_s"."""
    return {"step": STEP_X, "wall_time_s": WALL_X}[x]


def _log2_bounds(values) -> tuple[int, int] | None:
    """(lowest, highest) whole k of a log2 axis over ``values`` (finite, above 0): one binade beyond the data each
    side, so the largest and smallest values (a line, a marker on it) lie inside the plot, not on its border."""
    v = np.asarray([] if values is None else values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    if not v.size:
        return None
    return math.floor(math.log2(v.min())) - 1, math.ceil(math.log2(v.max())) + 1


def log2_scale(values) -> alt.Scale:
    """A log2 scale over ``values`` whose domain is padded by one binade each side (:func:`_log2_bounds`)."""
    bounds = _log2_bounds(values)
    if bounds is None:
        return alt.Scale(type="log", base=2)
    return alt.Scale(type="log", base=2, domain=[2.0**bounds[0], 2.0**bounds[1]], nice=False)


def _power_of_two_axis(title: str, values=None) -> alt.Axis:
    """A log2 axis labelled 2^k, ticked only at whole powers of two inside :func:`log2_scale`'s domain over
    ``values`` (the data it shows, with any rule drawn on it), at most about eight of them: Vega's own log ticks
    fall between powers of two, and rounded to 2^k they read 2^16, 2^16, 2^15."""
    axis = dict(title=title, labelExpr="'2^' + round(log(datum.value) / log(2))")
    bounds = _log2_bounds(values)
    if bounds is not None:
        lo, hi = bounds
        stride = max(1, math.ceil((hi - lo) / 8))
        start = lo + (-lo) % stride  # a multiple of the stride, so 2^0 is a tick whenever it is inside
        axis["values"] = [2.0**k for k in range(start, hi + 1, stride)]
    return alt.Axis(**axis)


#: how a linear axis writes its numbers: plain, with thousands separators, no SI prefix and no exponent for a
#: value like 400 or 6,553.6 (Vega rounds "~g" to the tick step's precision, so 6,000 read "6e+3")
PLAIN_FORMAT = ",.12~g"
#: ... except on an axis whose values are all tiny (a loss of 8e-5, a learning rate of 3e-4): there every tick
#: reads as a short exponent, 8e-5, 6e-5 ... 0, not 0.00008 beside 0.00000
_SMALL_TICKS = "datum.value == 0 ? '0' : format(datum.value, '.2~e')"
SMALL_BELOW = 1e-3


def linear_axis(title: str, values) -> alt.Axis:
    """A linear axis in :data:`PLAIN_FORMAT`, or in short exponents when every finite value is below
    :data:`SMALL_BELOW` in magnitude (and one is not zero)."""
    v = np.asarray(values, dtype=float)
    v = np.abs(v[np.isfinite(v)])
    if v.size and 0 < v.max() < SMALL_BELOW:
        return alt.Axis(title=title, labelExpr=_SMALL_TICKS)
    return alt.Axis(title=title, format=PLAIN_FORMAT)
#: how many times apart the smallest and largest drawn (positive) losses may lie before a loss axis is a log one:
#: a loss that fell three decades (1.7e-4 to 1.6e-7) sat on "0" of a linear axis after its first 30 steps
LOG_LOSS_SPAN = 100


def losses_far_apart(losses) -> bool:
    """Whether the finite positive ``losses`` (every one a chart draws, all runs and steps) span more than
    :data:`LOG_LOSS_SPAN`: then a log axis shows them, a linear one puts most of them on 0."""
    v = np.asarray(losses, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    return v.size > 1 and float(v.max() / v.min()) > LOG_LOSS_SPAN


#: a log10 axis's labels: plain (0.01 ... 1,000) when every tick is, else all as 1e-5, 1e0, 1e3 (d3's ".0e")
_PLAIN_POWERS = "format(datum.value, ',~g')"
_EXPONENT_POWERS = "replace(format(datum.value, '.0e'), 'e+', 'e')"


#: how close (in decades) the data may come to a log10 axis's end before the axis takes one more decade: a
#: marker's radius on a chart of a few decades in ~250 px
LOG10_MARGIN = 0.05


def _log10_bounds(values) -> tuple[int, int] | None:
    """(lowest, highest) whole k of a log10 axis over ``values`` (finite, above 0): the decades around the data,
    one further where the smallest or largest value lies within LOG10_MARGIN of a decade of a power of ten, so no
    value (a spike, the last point of a falling loss) lies on the plot's border (a point at 0.1003 on an axis
    from 0.1 was drawn half cut)."""
    v = np.asarray([] if values is None else values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    if not v.size:
        return None
    low, high = math.log10(v.min()), math.log10(v.max())
    lo, hi = math.floor(low), math.ceil(high)
    return lo - (low - lo < LOG10_MARGIN), hi + (hi - high < LOG10_MARGIN)


def log10_scale(values) -> alt.Scale:
    """A log10 scale over ``values`` whose domain is the decades around them (:func:`_log10_bounds`), not
    Vega's default, which ends exactly at the extreme values."""
    bounds = _log10_bounds(values)
    if bounds is None:
        return alt.Scale(type="log")
    return alt.Scale(type="log", domain=[10.0**bounds[0], 10.0**bounds[1]], nice=False)


def _power_of_ten_axis(title: str, values=None) -> alt.Axis:
    """A log10 axis ticked only at whole powers of ten inside :func:`log10_scale`'s domain over ``values`` (at
    most about eight, every second or third decade beyond), labelled 0.01 ... 1,000 when all ticks lie there,
    else 1e-5 ... 1e3 alike: Vega's own log ticks crowd in 0.0004, 0.0002, 0.00005 between them."""
    axis = dict(title=title, labelExpr=_EXPONENT_POWERS)
    bounds = _log10_bounds(values)
    if bounds is not None:
        lo, hi = bounds
        stride = max(1, math.ceil((hi - lo) / 8))
        axis["values"] = [10.0**k for k in range(lo - lo % stride, hi + stride, stride) if k <= hi]
        if -2 <= lo and hi <= 3:
            axis["labelExpr"] = _PLAIN_POWERS
    return alt.Axis(**axis)


#: the dash of each kind of format limit (``summaries.format_lines``' "kind")
LIMIT_DASHES = {"min subnormal": [2, 2], "min normal": [6, 3], "max": [12, 3]}


def _limit_rules(lines: pd.DataFrame, along: str = "y") -> alt.Chart:
    """Rules at each format limit (``summaries.format_lines``), coloured by format and dashed by kind, named in
    a legend beside the plot ("fp16 min normal 2^-14"), not on it, where the data would cover the name.
    ``along``: the channel whose axis is log2 |value| ("y": horizontal rules; "x": vertical ones)."""
    names = list(lines["limit"])
    colours = [LIMIT_COLOURS[f] for f in lines["format"]]
    dashes = [LIMIT_DASHES.get(k, [6, 3]) for k in lines["kind"]]
    legend = alt.Legend(title="format limits", labelLimit=260, symbolType="stroke", symbolStrokeWidth=2,
                        symbolSize=300)
    return alt.Chart(lines).mark_rule(strokeWidth=1.5).encode(
        **{along: "log2:Q"}, tooltip=["limit:N"],
        color=alt.Color("limit:N", scale=alt.Scale(domain=names, range=colours), legend=None),
        strokeDash=alt.StrokeDash("limit:N", scale=alt.Scale(domain=names, range=dashes), legend=legend))


#: the heatmap's click selection: the page reads it (st.altair_chart on_select) to show the clicked step
PICKED_STEP = "picked_step"


@_reused
def exponent_heatmap(cells: pd.DataFrame, lines: pd.DataFrame, steps: tuple[int, int],
                     title: str = "", log2_range: tuple[float, float] | None = None) -> alt.LayerChart:
    """Heatmap of gradient magnitude over steps: x step, y log2|g| (one row per exponent bin), colour =
    count on a log scale (of a column summing several kept steps, their sum: its tooltip names the steps and how
    many were kept); dashed lines at the formats' min subnormal, min normal and max. The step axis spans
    ``steps`` (first logged step, last logged step + 1) whatever the cells hold, so steps with no finite
    non-zero value (every value zero) stay on it as empty columns rather than vanishing. Clicking a cell
    selects its column (the selection ``PICKED_STEP``, its ``step_start``): the page shows that step below.
    ``log2_range``: the y axis's extent (``summaries.heatmap_view``: the data and the limits near it), by
    default the cells' and the lines'."""
    if log2_range is None:
        log2_range = (min([*cells["log2_lo"], *lines["log2"]]) - 1, max([*cells["log2_hi"], *lines["log2"]]) + 1)
    heat = (
        alt.Chart(cells)
        .mark_rect()
        .add_params(pick := alt.selection_point(name=PICKED_STEP, fields=["step_start"], on="click"))
        .encode(
            x=alt.X("step_start:Q", title="step (a column sums the kept steps it spans; hover for which)", scale=alt.Scale(domain=list(steps), nice=False),
                    axis=alt.Axis(format="d", tickMinStep=1)),
            x2="step_end:Q",
            y=alt.Y("log2_lo:Q", title="log2 |gradient|", scale=alt.Scale(domain=list(log2_range), nice=False)),
            y2="log2_hi:Q",
            color=alt.Color("count:Q", scale=alt.Scale(type="log", scheme="viridis"), title="values"),
            opacity=alt.condition(pick, alt.value(1.0), alt.value(0.45)),  # the clicked column stands out
            # a column may sum several kept steps (summaries.heatmap_cells): the tooltip says which and how many
            tooltip=[alt.Tooltip("steps:N", title="column"), alt.Tooltip("log2_lo:Q", title="log2 lower edge"),
                     alt.Tooltip("count:Q", format=",d", title="values (exact)")],
        )
    )
    return alt.layer(heat, *([_limit_rules(lines)] if len(lines) else [])).resolve_scale(color="independent").properties(title=title, height=360).properties(autosize=_FIT_WIDTH)


@_reused
def step_histogram(bars: pd.DataFrame, title: str = "") -> alt.Chart:
    """Bars of one step's exponent histogram, coloured by the region the values fall in for the format;
    zero / NaN / inf as separate bars on the right."""
    order = list(bars["label"])
    return (
        alt.Chart(bars)
        .mark_bar()
        .encode(
            x=alt.X("label:N", sort=order, title="exponent bin (|g| from 2^e to 2^(e+1)) and special values"),
            y=alt.Y("count:Q", title="values"),
            color=alt.Color("region:N", scale=alt.Scale(
                domain=list(REGION_COLOURS) + [f"{r} (edge bin)" for r in ("subnormal", "normal")],
                range=list(REGION_COLOURS.values()) + ["#ffbb78", "#98df8a"])),
            tooltip=["label:N", alt.Tooltip("count:Q", format=",d", title="values (exact)"), "region:N"],
        )
        .properties(title=title, height=260, autosize=_FIT_WIDTH)
    )


#: the small multiples of every tensor's exponent histogram: columns per row and each panel's plot size (px), so
#: that a row fits the page's main column at 1,280 px
GRID_COLUMNS = 3
GRID_WIDTH = 170
GRID_HEIGHT = 150


@_reused
def histogram_grid(bars: pd.DataFrame, drawn: list[str], lines: pd.DataFrame, log2_range: tuple[float, float],
                   title: str = "") -> alt.FacetChart:
    """Small multiples: one exponent histogram per tensor (``summaries.histogram_grid``'s bars), in the order of
    ``drawn`` (worst first), GRID_COLUMNS per row, each GRID_WIDTH x GRID_HEIGHT px. x: log2 |value| (bin e holds
    2^e to 2^(e+1)) over ``log2_range``, the same for every panel (``summaries.heatmap_view``: the data and the
    format limits near it); y: the share of the tensor's finite non-zero values (each panel its own scale, so a
    small tensor stays readable). Bars are coloured by the region of the format they fall in, as the single-step
    histogram colours them; the format's limits ``lines`` (``summaries.format_lines``, those near the data) are
    rules in the format's colour, dotted at the min subnormal, dashed at the min normal, long-dashed at the max
    (the page names them), drawn in every panel. Tensor names are the panels' headers (Vega draws them as text).
    One chart faceted by tensor, its bars one dataset: twelve charts, each with its slice of the bars, took ten
    times as long to build and convert (1.5 + 1.1 s against 0.13 + 0.17 s), and every tensor of a 100-tensor run
    22 s against 0.2 s."""
    regions = {**{r: c for r, c in REGION_COLOURS.items() if r != "zero / non-finite"},
               "subnormal (edge bin)": "#ffbb78", "normal (edge bin)": "#98df8a"}
    colour = alt.Color("region:N", title=None, scale=alt.Scale(domain=list(regions), range=list(regions.values())),
                       legend=alt.Legend(orient="top", labelLimit=200, columns=3))
    x = alt.X("log2_lo:Q", title="log2 |value|", scale=alt.Scale(domain=list(log2_range), nice=False, zero=False),
              axis=alt.Axis(format="d", tickMinStep=1))
    bar = alt.Chart().mark_rect().encode(
        x=x, x2="log2_hi:Q",
        y=alt.Y("share:Q", title="share of values", axis=alt.Axis(format="%", tickCount=4)), y2=alt.datum(0),
        color=colour,
        tooltip=[alt.Tooltip("tensor:N"), alt.Tooltip("log2_lo:Q", title="bin 2^e, e"),
                 alt.Tooltip("count:Q", format=",d", title="values (exact)"),
                 alt.Tooltip("share:Q", format=".3%", title="share of finite non-zero"), "region:N"])
    layers = [bar]
    if len(lines):  # their own data: not faceted, so every panel draws them
        names = list(lines["limit"])
        layers.append(alt.Chart(lines).mark_rule(strokeWidth=1.5, color=LIMIT_COLOURS.get(lines["format"].iloc[0], "#000"))
                      .encode(x="log2:Q", tooltip=["limit:N"], strokeDash=alt.StrokeDash("limit:N", legend=None, scale=alt.Scale(
                          domain=names, range=[LIMIT_DASHES.get(k, [6, 3]) for k in lines["kind"]]))))
    header = alt.Header(labelFontSize=12, labelFontWeight="bold", labelLimit=GRID_WIDTH + 40)
    return (alt.layer(*layers, data=bars).properties(width=GRID_WIDTH, height=GRID_HEIGHT)
            .facet(facet=alt.Facet("tensor:N", sort=list(drawn), title=None, header=header), columns=GRID_COLUMNS)
            # each panel its own share axis, and its own log2 axis as the separate charts had (same scale)
            .resolve_scale(y="independent").resolve_axis(x="independent")
            .properties(title=title, autosize=alt.AutoSizeParams(type="pad")))


@_reused
def runs_histograms(bins: pd.DataFrame, lines: pd.DataFrame, domain: list[str], title: str = "",
                    what: str = "g") -> alt.LayerChart:
    """Exponent histograms of several runs overlaid (``compare.overlaid_histograms``' bins): x log2 |``what``|
    (g, unscaled, or S·g at the run's loss scale; bin e holds 2^e to 2^(e+1)), y the share of the run's finite non-zero values, one step-line per run in its fixed
    colour over a faint area; the format limits (``summaries.format_lines``) as dashed rules named in a legend.
    The x axis spans the bins and the limits, a binade of room each side."""
    lo = min([*bins["log2"], *lines["log2"]]) - 1
    hi = max([*(bins["log2"] + 1), *lines["log2"]]) + 1
    x = alt.X("log2:Q", title=f"log2 |{what}|{', unscaled' if what == 'g' else ''} (bin e: 2^e <= |{what}| < "
                              "2^(e+1))",
              scale=alt.Scale(domain=[math.floor(lo), math.ceil(hi)], nice=False, zero=False),
              axis=alt.Axis(format="d", tickMinStep=1))
    colour = _run_colour(domain, orient="top")
    tooltip = ["run:N", alt.Tooltip("log2:Q", title="bin 2^e, e"), alt.Tooltip("count:Q", format=",d", title="values (exact)"),
               alt.Tooltip("share:Q", format=".3%", title="share of finite non-zero")]
    base = alt.Chart(bins).encode(x=x, y=alt.Y("share:Q", title="share of finite non-zero values", stack=None,
                                               axis=alt.Axis(format="%")), color=colour, tooltip=tooltip)
    runs = alt.layer(base.mark_area(interpolate="step-after", opacity=0.12),  # overlaid, not stacked
                     base.mark_line(interpolate="step-after", strokeWidth=2))
    layers = [runs, *([_limit_rules(lines, along="x")] if len(lines) else [])]
    return _fit(alt.layer(*layers).resolve_scale(color="independent")
                .properties(height=280, width="container", title=title))


@_reused
def stacked_over_steps(*panels) -> alt.VConcatChart:
    """Charts over steps stacked, container wide, on one shared step axis: dragging or scrolling any panel pans
    or zooms the steps of all (one zoom parameter bound to the shared x scale)."""
    zoom = alt.selection_interval(bind="scales", encodings=["x"], name="steps_zoom")
    parts = [_unfit(panel) for panel in panels]
    for part in parts:
        part.width = "container"
    with warnings.catch_warnings():  # one parameter in every panel is the point: Altair's notice says it merged them
        warnings.filterwarnings("ignore", message="Automatically deduplicated selection parameter")
        stacked = alt.vconcat(*parts).add_params(zoom)
    # set on the chart made here, not through resolve_scale(), properties() and configure_legend(): each of those
    # copies the whole chart again (a third of building it); the spec is the same
    stacked.resolve = alt.Resolve(scale=alt.ScaleResolveMap(x="shared"))
    stacked.autosize = _FIT_WIDTH
    stacked.config = alt.Config(legend=alt.LegendConfig(orient="top"))  # a legend at the side would narrow every panel
    return stacked


def drawable_on_log(values: pd.Series) -> pd.Series:
    """Which values a log axis can draw: finite and above zero (a zero or negative one has no place on it; one
    in the data gives Vega an infinite extent and a blank chart)."""
    v = values.astype(float)
    return np.isfinite(v) & (v > 0)


@_reused
def loss_scale_panel(steps: pd.DataFrame, marked: int | None = None) -> alt.VConcatChart:
    """Loss scale per step on a log2 axis with skipped steps marked, the growth tracker, and the loss curve
    beneath (on a log10 axis where its losses span more than LOG_LOSS_SPAN: :func:`losses_far_apart`), sharing the
    step axis. Only what has something to draw is a panel: steps whose scale is 0 (a
    collapsed dynamic scale) are red rules on the scale panel (a log axis has no 0), the scale panel is left out
    when no step had a scale above 0, the growth tracker when none was recorded (no dynamic GradScaler): the
    page says why (:func:`mpdiag.analysis.summaries.loss_scale_notes`). ``marked``: a step (an event's link
    names one) drawn as a dashed rule across every panel."""
    panels = []
    positive = drawable_on_log(steps["loss_scale"])
    if positive.any():
        on_log = steps[positive]
        line = alt.Chart(on_log).mark_line(interpolate="step-after").encode(
            x=STEP_X,
            y=alt.Y("loss_scale:Q", scale=log2_scale(on_log["loss_scale"]),
                    axis=_power_of_two_axis("loss scale", on_log["loss_scale"])),
            tooltip=["step:Q", alt.Tooltip("loss_scale:Q", format=".10g", title="loss scale"),
                     alt.Tooltip("scale_after:Q", format=".10g", title="scale after update()"), "skipped:Q"],
        )
        layers = [line, *_lone_points(line, "loss_scale")]
        said = ["▼ skipped step"] if (on_log["skipped"] == 1).any() else []
        if said:  # an empty layer would give Vega an infinite extent (a console warning)
            layers.append(alt.Chart(on_log[on_log["skipped"] == 1])
                          .mark_point(shape="triangle-down", color="#d62728", size=60, filled=True)
                          .encode(x=STEP_X, y="loss_scale:Q", tooltip=["step:Q", alt.Tooltip("loss_scale:Q", format=".10g")]))
        if not positive.all():
            zero = steps[~positive].assign(value=lambda d: d["loss_scale"].astype(str))
            layers.append(alt.Chart(zero).mark_rule(color="#d62728", opacity=0.5, strokeWidth=2).encode(
                x=STEP_X, tooltip=["step:Q", alt.Tooltip("value:N", title="loss scale")]))
            said.append("red rules: scale 0, below any log axis")
        panels.append(alt.layer(*layers).properties(
            height=220, title="loss scale" + (f" ({'; '.join(said)})" if said else "")))
    if steps["growth_tracker"].notna().any():
        panels.append(_with_lone_points(alt.Chart(steps).mark_line(color="#7f7f7f").encode(
            x=STEP_X, y=alt.Y("growth_tracker:Q", title="growth tracker", axis=alt.Axis(format="d", tickMinStep=1)),
            tooltip=["step:Q", alt.Tooltip("growth_tracker:Q", format="d", title="good steps since a change")],
        ), "growth_tracker").properties(height=150, title="growth tracker (good steps since the scale last changed)"))
    # a log axis where the losses span decades (Vega's linear one read 0.00000, 0.00005 and put 120 of 150 steps on
    # 0), else a linear one whose ticks never write a small loss as 0.00000 (linear_axis)
    log = losses_far_apart(steps["loss"])
    on_axis = steps["loss"].astype(float)[drawable_on_log(steps["loss"])] if log else steps["loss"]
    y = (alt.Y("loss:Q", title="loss", scale=log10_scale(on_axis), axis=_power_of_ten_axis("loss", on_axis)) if log
         else alt.Y("loss:Q", title="loss", axis=linear_axis("loss", steps["loss"])))
    loss = alt.Chart(_blanked(steps, "loss", log)).mark_line(color="#1f77b4").encode(
        x=STEP_X, y=y, tooltip=["step:Q", alt.Tooltip("loss:Q", format=".6g")])
    loss = _with_nonfinite_rules([loss, *_lone_points(loss, "loss")], steps, "loss", alt.value("#d62728"), log)
    bad = _undrawable(steps["loss"], log).any()
    panels.append(loss.properties(height=200, title="loss" + (" (log axis)" if log else "") + (
        f" (red rules: NaN/inf{' or 0' if log else ''} loss)" if bad else "")))
    panels += [p for p in (learning_rate_panel(steps), grad_norm_panel(steps)) if p is not None]
    if marked is not None:
        rule = alt.Chart(pd.DataFrame({"step": [marked]})).mark_rule(color="black", strokeDash=[4, 4]).encode(
            x=STEP_X, tooltip=[alt.Tooltip("step:Q", title="the linked step")])
        panels = [alt.layer(panel, rule) for panel in panels]
    return stacked_over_steps(*panels)


#: each per-step signal line's colour (summaries.SIGNAL_LINES; a format's line "if cast" in its format's colour)
SIGNAL_COLOURS = {"NaN values": "#d62728", "+inf values": "#ff7f0e", "-inf values": "#8c564b",
                  "FP16 overflow at the scale": "#9467bd", "FP16 underflow at the scale": "#1f77b4",
                  "BF16 overflow at the scale": "#e377c2", "BF16 underflow at the scale": "#17becf"}


@_reused
def signal_lines(lines: pd.DataFrame) -> alt.Chart:
    """The per-step signals (summaries.signal_lines): one line per kind, values summed over the tensors on a
    symmetric-log axis (0 stays drawable), every counted step whether its full statistics were kept or not."""
    top = float(pd.to_numeric(lines["values"], errors="coerce").max()) if len(lines) else 0.0
    # a labelled tick at 0 and each power of ten up to the one above the highest line (the axis's top): Vega's own
    # symlog ticks were 0 and the top alone, so a flat line (an all-NaN run's ~18k a step) could not be read off
    ticks = [0] + [10**k for k in range(1, max(1, math.ceil(math.log10(top)) if top > 0 else 1) + 1)]  # 1 would sit on 0
    order = [*SIGNAL_LINES]
    names = sorted(set(lines["line"]), key=lambda name: (order.index(name.removesuffix(IF_CAST))
                                                         if name.removesuffix(IF_CAST) in order else len(order), name))
    spare = iter(["#7f7f7f", "#bcbd22", "#2ca02c", "#aec7e8"])  # a line outside SIGNAL_LINES (none today)
    colours = [SIGNAL_COLOURS.get(name.removesuffix(IF_CAST)) or next(spare, "#7f7f7f") for name in names]
    return _fit(_with_lone_points(alt.Chart(lines).mark_line(interpolate="step-after").encode(
        x=STEP_X, y=alt.Y("values:Q", title="values (all tensors)",
                          scale=alt.Scale(type="symlog", domain=[0, ticks[-1]]),
                          axis=alt.Axis(values=ticks, format=",d", labelOverlap=False)),
        # the names ("FP16 underflow at the scale", 27 characters) were cut at Vega's default 160 px; each line its
        # own colour in every run (by order of appearance, NaN was blue in one run and red in the next)
        color=alt.Color("line:N", title=None, legend=alt.Legend(orient="top", labelLimit=280),
                        scale=alt.Scale(domain=names, range=colours)),
        tooltip=["step:Q", "line:N", alt.Tooltip("values:Q", format=",d")],
    ), "values", by="line").properties(height=180, title="over/underflow per step, kept or not"))


def learning_rate_panel(steps: pd.DataFrame) -> alt.Chart | None:
    """The learning rate of every step (Store.steps' ``lr``), or None when no step has one (a run recorded before
    schema 9, or without a known optimizer: the page says so, :func:`mpdiag.analysis.summaries.lr_norm_notes`)."""
    if not np.isfinite(steps["lr"].astype(float)).any():
        return None
    lr = steps["lr"].astype(float)
    top = float(lr[np.isfinite(lr)].max())
    # from 0 to a tenth above the highest rate, rounded up to a tick: a constant rate is not drawn on the border
    scale = alt.Scale(domainMin=min(0.0, float(lr[np.isfinite(lr)].min())), domainMax=top * 1.1 if top > 0 else 1.0,
                      nice=True)
    return _with_lone_points(alt.Chart(_blanked(steps, "lr")).mark_line(color="#2ca02c", interpolate="step-after").encode(
        x=STEP_X, y=alt.Y("lr:Q", scale=scale, axis=linear_axis("learning rate", lr)),
        tooltip=["step:Q", alt.Tooltip("lr:Q", format=".6g", title="learning rate")],
    ), "lr").properties(height=160, title="learning rate (param_groups[0] of the first optimizer, at the step)")


def grad_norm_panel(steps: pd.DataFrame) -> alt.LayerChart | None:
    """The global gradient norm of every step (unscaled, before clipping) on a log axis; steps where it was inf
    or NaN are red rules, where it was 0 grey ones (a log axis has no 0); None when it was not recorded (a run
    recorded before schema 9) or was 0 at every step (the page says so)."""
    recorded = steps[steps["wall_time_s"].notna()] if "wall_time_s" in steps else steps.iloc[:0]
    norm = recorded["grad_norm"].astype(float)
    if recorded.empty or (norm == 0).all():
        return None
    layers = []
    if drawable_on_log(norm).any():
        on_log = _blanked(recorded, "grad_norm", log=True)
        line = alt.Chart(on_log).mark_line(color="#9467bd").encode(
            x=STEP_X, y=alt.Y("grad_norm:Q", scale=log10_scale(norm),
                              axis=_power_of_ten_axis("gradient norm", norm)),
            tooltip=["step:Q", alt.Tooltip("grad_norm:Q", format=".6g", title="gradient norm")])
        layers += [line, *_lone_points(line, "grad_norm")]
    said = []
    for label, rows, colour in (("red rules: inf/NaN", ~np.isfinite(norm), "#d62728"),
                                ("grey rules: 0", norm == 0, "#7f7f7f")):
        if rows.any():  # an empty layer would give Vega an infinite extent
            bad = recorded[rows].assign(value=lambda d: d["grad_norm"].astype(str))
            layers.append(alt.Chart(bad).mark_rule(color=colour, opacity=0.5, strokeWidth=2).encode(
                x=STEP_X, tooltip=["step:Q", alt.Tooltip("value:N", title="gradient norm")]))
            said.append(label)
    title = "global gradient norm (unscaled, before clipping" + (f"; {'; '.join(said)}" if said else "") + ")"
    return alt.layer(*layers).properties(height=180, title=title)


def rank_panel(rank_steps: pd.DataFrame, marked_step: int | None) -> alt.VConcatChart:
    """A distributed run's per-rank view (Store.rank_steps): each rank's local loss, and each rank's count of
    inf/NaN values in its local gradients before the all-reduce, sharing the step axis; ``marked_step`` (the
    first step where a rank held such values, as the rank-nonfinite finding names it) is drawn as a rule on both.
    Ranks whose counts were not recorded (FSDP2) have no points in the lower chart."""
    df = rank_steps.assign(rank=rank_steps["rank"].astype(int).map(lambda r: f"rank {r}"))
    colour = alt.Color("rank:N", legend=alt.Legend(title=None, orient="top"))
    loss = alt.Chart(df).mark_line(point=True).encode(
        x=STEP_X, y=alt.Y("loss:Q", title="local loss"), color=colour,
        tooltip=["step:Q", "rank:N", alt.Tooltip("loss:Q", format=".6g")])
    counted = df[df["nonfinite"].notna()]
    # a symmetric-log axis with a labelled tick at 0 and each power of ten (as the over/underflow panel's): on a
    # linear one to 5,000 counts of 1 and 4 sat on 0 (a constant under 1 keeps 1 clear of 0's label)
    most = float(counted["nonfinite"].max()) if len(counted) else 0.0
    ticks = [0] + [10**k for k in range(0, max(1, math.ceil(math.log10(most)) if most > 1 else 1) + 1)]
    # each rank drawn a few pixels either side of its step (at a 1,280 px window), so two ranks with the same count
    # at a step are both seen (Vega-Lite's xOffset does nothing on a quantitative x); the tooltip gives the step
    ranks = sorted(df["rank"].unique(), key=lambda r: int(r.split()[-1]))
    px = min(5.0, 16.0 / max(len(ranks) - 1, 1))
    per_px = max(float(df["step"].max() - df["step"].min()), 1.0) / _PLOT_PX
    # as float: no count recorded (FSDP2) leaves the offsets an empty column of strings
    side = counted["rank"].map({r: (i - (len(ranks) - 1) / 2) * px * per_px for i, r in enumerate(ranks)}).astype(float)
    nonfinite = alt.Chart(counted.assign(drawn_at=counted["step"].astype(float) + side)).mark_circle(size=50, opacity=0.9).encode(
        x=alt.X("drawn_at:Q", title="step", scale=_STEP_SCALE, axis=alt.Axis(format="d", tickMinStep=1)),
        y=alt.Y("nonfinite:Q", title="local inf/NaN before all-reduce",
                scale=alt.Scale(type="symlog", constant=0.2, domain=[0, ticks[-1]]),
                axis=alt.Axis(values=ticks, format=",d", labelOverlap=False)),
        color=colour, tooltip=["step:Q", "rank:N", alt.Tooltip("nonfinite:Q", format="d", title="inf/NaN values")])
    top, bottom = loss, nonfinite
    if marked_step is not None:
        rule = alt.Chart(pd.DataFrame({"step": [marked_step]})).mark_rule(color="#d62728", strokeDash=[4, 3]).encode(
            x=STEP_X, tooltip=[alt.Tooltip("step:Q", title="first step with a rank's inf/NaN")])
        top, bottom = alt.layer(loss, rule), alt.layer(nonfinite, rule)
    return alt.vconcat(top.properties(height=180, width="container", title="loss per rank"),
                       bottom.properties(height=140, width="container", title="inf/NaN per rank (before the all-reduce)")
                       ).resolve_scale(x="shared").properties(autosize=_FIT_WIDTH)


def _run_colour(domain: list[str], orient: str = "right") -> alt.Color:
    return alt.Color("run:N", scale=alt.Scale(domain=domain, range=RUN_COLOURS[: len(domain)]),
                     legend=alt.Legend(title="run", symbolOpacity=1, labelLimit=1200, orient=orient,
                                       direction="vertical"))


def _run_dash(domain: list[str]) -> alt.StrokeDash:
    """Each run's dash (the legend is the colour's: same field, same title, merged into one)."""
    return alt.StrokeDash("run:N", scale=alt.Scale(domain=domain, range=RUN_DASHES[: len(domain)]),
                          legend=alt.Legend(title="run", symbolOpacity=1, labelLimit=1200, orient="top",
                                            direction="vertical"))


def _undrawable(values: pd.Series, log: bool = False) -> np.ndarray:
    """Which values a line cannot draw: NaN and inf, and on a log axis zero and negative ones too."""
    v = values.astype(float).to_numpy()
    return ~np.isfinite(v) | (v <= 0) if log else ~np.isfinite(v)


def _lone_rows(data: pd.DataFrame, y: str, by: str | None = None, x: str = "step") -> pd.DataFrame:
    """The rows of ``data`` whose ``y`` a line through ``data`` draws nothing at: a finite value whose neighbours
    in its series (``by``'s values; the whole frame without it), in order of ``x`` as Vega draws a line, are NaN,
    inf or absent. A line needs two consecutive drawable values for a segment: a run's one step, the first or last
    finite value beside a gap, and every finite value of steps alternating skipped (NaN) and applied were not drawn."""
    if data.empty or y not in data or x not in data:
        return data.iloc[:0]
    xs = pd.to_numeric(data[x], errors="coerce").to_numpy(dtype=float)
    ys = pd.to_numeric(data[y], errors="coerce").to_numpy(dtype=float)
    placed = np.flatnonzero(np.isfinite(xs))  # a row without an x has no place on the line
    if by is not None and by in data:
        keys = data[by].to_numpy()[placed]
        order = placed[np.lexsort((xs[placed], pd.factorize(keys, use_na_sentinel=False)[0]))]
        series = pd.factorize(data[by].to_numpy()[order], use_na_sentinel=False)[0]
    else:
        order = placed[np.argsort(xs[placed], kind="stable")]
        series = np.zeros(len(order), dtype=int)
    drawable = np.isfinite(ys[order])
    same_before = np.r_[False, series[1:] == series[:-1]]
    same_after = np.r_[series[:-1] == series[1:], False]
    before = np.r_[False, drawable[:-1]] & same_before
    after = np.r_[drawable[1:], False] & same_after
    lone = order[drawable & ~before & ~after]
    return data.iloc[np.sort(lone)]


def _lone_points(line: alt.Chart, y: str, by: str | None = None, x: str = "step") -> list[alt.Chart]:
    """The layer to draw just after ``line`` (a line of ``y`` over a frame, encoded): a small filled point, in the
    line's colour and with its tooltip, at each value the line draws nothing at (:func:`_lone_rows`); no layer when
    there is none (an empty layer would give Vega an infinite extent). Only the lone values: a point at every step
    of a long run would bury the line."""
    lone = _lone_rows(line.data, y, by, x)
    if lone.empty:
        return []
    mark = line.mark.to_dict() if isinstance(line.mark, alt.MarkDef) else {}  # mark_line() alone: "line"
    style = {k: v for k, v in mark.items() if k in ("color", "opacity")}
    # the line's channels but its dash (a point has none), and no legend of their own: merged with the line's, the
    # legend's symbols became dots, and the runs' dashes were no longer shown in it
    channels = {k: v for k, v in line.encoding._kwds.items() if v is not alt.Undefined and k != "strokeDash"}
    for name, channel in channels.items():
        if isinstance(channel, alt.SchemaBase) and "legend" in channel._kwds:
            channels[name] = channel.copy(deep=False)
            channels[name].legend = None
    return [alt.Chart(lone).mark_point(filled=True, size=40, **style).encode(**channels)]


def _with_lone_points(line: alt.Chart, y: str, by: str | None = None, x: str = "step") -> alt.Chart | alt.LayerChart:
    """``line`` layered with its :func:`_lone_points`; ``line`` itself when it has none."""
    points = _lone_points(line, y, by, x)
    return alt.layer(line, *points) if points else line


def _blanked(df: pd.DataFrame, y: str, log: bool = False) -> pd.DataFrame:
    """``df`` with the values of ``y`` a line cannot draw made NaN (a gap): an inf, or a 0 on a log axis, in a
    chart's data gives Vega an infinite extent and a blank chart."""
    return df.assign(**{y: df[y].astype(float).where(~_undrawable(df[y], log))})


def _with_nonfinite_rules(chart, df: pd.DataFrame, y: str, colour, log: bool = False, x: str = "step") -> alt.LayerChart:
    """``chart`` (drawn from :func:`_blanked` data; or a list of layers: a line and its :func:`_lone_points`) with
    faint vertical rules at steps where ``y`` is NaN or inf (or, with ``log``, zero or negative), which a line
    chart would silently drop; without the layer when there are none (an empty layer makes Vega warn of an
    infinite extent in the browser console), and the rules alone when no value is drawable. ``x``: the x field
    ("step", or "wall_time_s")."""
    layers = chart if isinstance(chart, list) else [chart]
    bad_rows = _undrawable(df[y], log)
    bad = df[bad_rows].assign(value=lambda d: d[y].astype(str))
    if bad.empty:
        return alt.layer(*layers)
    rules = (
        alt.Chart(bad)
        .mark_rule(opacity=0.35, strokeWidth=2)
        .encode(x=x_axis(x), color=colour, tooltip=[*(["run:N"] if "run" in bad else []), "step:Q", alt.Tooltip("value:N", title=y)])
    )
    return alt.layer(*layers, rules) if not bad_rows.all() else alt.layer(rules)


@_reused
def runs_overlay(df: pd.DataFrame, y: str, title: str, domain: list[str], log: bool = False,
                 height: int = 240, x: str = "step", smooth: bool = False, log_base: int = 2,
                 zero: bool = False, axis_title: str | None = None) -> alt.LayerChart:
    """One line per run (column ``run``) of ``y`` over ``x`` ("step", or "wall_time_s": seconds since the run
    started), in the runs' fixed colours; NaN/inf values (and on a ``log`` axis zero ones: a collapsed loss
    scale) appear as faint vertical rules in the run's colour. The legend is above the plot, so a chart in a
    narrow column keeps its width for the data.

    ``log``: a log axis, base ``log_base`` (2: the loss scale, labelled 2^k and drawn as steps; 10: a loss or a
    gradient norm). ``smooth``: ``df`` also holds ``{y}_smoothed`` (compare.smoothed): the smoothed line is drawn
    over the raw one, which is drawn faint behind it, as TensorBoard does. Axes: a log2 one padded by a binade
    each side and ticked 2^k, a log10 one ticked at powers of ten, a linear one in plain numbers (from 0 with
    ``zero``: a peak memory, whose differences would otherwise look large). ``axis_title``: the y axis's, where the
    chart's ``title`` is longer than the plot is tall (else the title is both)."""
    # only the columns drawn travel to the browser (a chart ships its data; a steps frame has a dozen columns)
    df = df[[c for c in dict.fromkeys(["run", "step", x, y, *([f"{y}_smoothed"] if smooth else [])]) if c in df]]
    drawn = df[y] if not smooth else pd.concat([df[y], df[f"{y}_smoothed"]])
    named = axis_title or title
    if log and log_base == 2:
        scale, axis = log2_scale(drawn), _power_of_two_axis(named, drawn)
    elif log:
        scale, axis = log10_scale(drawn), _power_of_ten_axis(named, drawn)
    else:
        scale, axis = alt.Scale(zero=zero), linear_axis(named, drawn)
    colour = _run_colour(domain, orient="top")
    x_enc = x_axis(x)
    tooltip = ["run:N", "step:Q", *(["wall_time_s:Q"] if x == "wall_time_s" else []), alt.Tooltip(f"{y}:Q", format=".6g")]
    data = _blanked(df, y, log)
    if smooth:
        data = data.assign(**{f"{y}_smoothed": data[f"{y}_smoothed"].astype(float).where(
            ~_undrawable(df[f"{y}_smoothed"], log))})
    dash = _run_dash(domain)
    line = alt.Chart(data).mark_line(interpolate="step-after" if log and log_base == 2 else "linear",
                                     opacity=0.25 if smooth else 1.0).encode(
        x=x_enc, y=alt.Y(f"{y}:Q", scale=scale, axis=axis), color=colour, strokeDash=dash, tooltip=tooltip)
    # each line's lone values (between NaN/inf ones: steps alternating skipped and applied) as points after it
    line = [line, *_lone_points(line, y, by="run", x=x)]
    if smooth:
        smoothed = alt.Chart(data).mark_line().encode(
            x=x_enc, y=alt.Y(f"{y}_smoothed:Q", scale=scale, axis=axis), color=colour, strokeDash=dash,
            tooltip=[*tooltip, alt.Tooltip(f"{y}_smoothed:Q", format=".6g", title=f"{y} smoothed")])
        line = [alt.layer(*line, smoothed, *_lone_points(smoothed, f"{y}_smoothed", by="run", x=x))]
    if _undrawable(df[y], log).any():
        title = f"{title} (faint rules: NaN/inf{' or 0, below any log axis' if log else ''})"
    return _fit(_with_nonfinite_rules(line, df, y, colour, log, x=x).properties(height=height, title=title))


@_reused
def loss_difference(df: pd.DataFrame, divergence_step: int | None, domain: list[str],
                    threshold: float) -> alt.LayerChart:
    """Relative loss difference to the FP32 reference per run, in percent (ticks like 0.0005, not 5e-6 in
    fixed notation), with the first step beyond ``threshold`` (a fraction) marked when there is one."""
    data = _blanked(df.assign(rel_pct=df["rel_diff"] * 100), "rel_pct")
    line = (
        alt.Chart(data)
        .mark_line()
        .encode(x=STEP_X, y=alt.Y("rel_pct:Q", title="(loss - FP32 loss) / |FP32 loss|, %", axis=alt.Axis(format=PLAIN_FORMAT)),
                color=_run_colour(domain, orient="top"),
                tooltip=["run:N", "step:Q", alt.Tooltip("rel_diff:Q", format=".4~%", title="difference")])
    )
    points = _lone_points(line, "rel_pct", by="run")
    if divergence_step is None:  # no empty rule layer: Vega warns of an infinite extent in the browser console
        return _fit(alt.layer(line, *points).properties(height=200, title="difference to the FP32 reference"))
    rule = alt.Chart(pd.DataFrame({"step": [divergence_step]})).mark_rule(color="black", strokeDash=[4, 4]).encode(
        x=STEP_X, tooltip=[alt.Tooltip("step:Q", title=f"first step beyond {threshold:.0%}")])
    return _fit(alt.layer(line, *points, rule).properties(height=200, title="difference to the FP32 reference (dashed: "
                                                                    f"first step beyond {threshold:.0%})"))


@_reused
def runs_bars(df: pd.DataFrame, x: str, y: str, title: str, domain: list[str],
              parts: list[str] | None = None) -> alt.Chart:
    """Grouped bars: ``x`` categories (tensor names, labels slanted and kept whole up to 220 px), one bar per
    run in its colour, ``y`` a share (percent axis); with ``parts`` (the values of a ``part`` column) each run's
    bar is stacked from its parts, the first solid, the next lighter, with a legend beneath the plot saying which
    is which (above it, beside the runs' legend, its long labels ran past the chart's right edge). Legends are
    above or below the plot, so it keeps the element's width."""
    encoding = dict(
        x=alt.X(f"{x}:N", title=None, axis=alt.Axis(labelAngle=-30, labelLimit=220, labelOverlap=False)),
        xOffset="run:N", y=alt.Y(f"{y}:Q", title=None, axis=alt.Axis(format="%")),
        color=_run_colour(domain, orient="top"),
        tooltip=["run:N", f"{x}:N", *(["part:N"] if parts else []), alt.Tooltip(f"{y}:Q", format=".3%")])
    if parts:
        encoding["opacity"] = alt.Opacity("part:O", sort=parts, scale=alt.Scale(domain=parts, range=[1.0, 0.4][: len(parts)]),
                                          legend=alt.Legend(title=None, orient="bottom", direction="vertical",
                                                            labelLimit=480))
        encoding["order"] = alt.Order("part_order:Q")
        df = df.assign(part_order=df["part"].map({p: i for i, p in enumerate(parts)}))
    return _fit(alt.Chart(df).mark_bar().encode(**encoding).properties(height=260, width="container", title=title))


@_reused
def live_loss(steps: pd.DataFrame) -> alt.Chart | alt.LayerChart:
    """Small loss curve for a running run."""
    return _with_lone_points(alt.Chart(steps).mark_line().encode(
        x=STEP_X, y=alt.Y("loss:Q", scale=alt.Scale(zero=False))), "loss").properties(height=160, autosize=_FIT_WIDTH)


@_reused
def shadow_error_lines(shadow: pd.DataFrame, tensors: list[str], threshold: float) -> alt.LayerChart:
    """Relative gradient error against the FP32 shadow over steps (log axis) for ``tensors``, with the
    finding's threshold as a dashed rule. ``shadow``: Store.shadow_stats; non-finite errors are left out."""
    df = shadow[shadow["tensor"].isin(tensors) & np.isfinite(shadow["rel_error"]) & (shadow["rel_error"] > 0)]
    drawn = pd.concat([df["rel_error"], pd.Series([threshold])])  # the axis spans the threshold's rule too
    y = dict(scale=log10_scale(drawn), axis=_power_of_ten_axis("||g - g_fp32|| / ||g_fp32||", drawn))
    line = (
        alt.Chart(df)
        .mark_line(point=True)
        .encode(x=STEP_X, y=alt.Y("rel_error:Q", **y),
                color=alt.Color("tensor:N", sort=tensors, legend=alt.Legend(orient="top", labelLimit=280)),
                tooltip=["tensor:N", "step:Q", alt.Tooltip("rel_error:Q", format=".4g", title="relative error"),
                         alt.Tooltip("cosine:Q", format=".6f")])
    )
    said = pd.DataFrame({"threshold": [threshold], "label": [f"finding's threshold: {threshold:g}"]})
    rule = alt.Chart(said).mark_rule(color="black", strokeDash=[4, 4]).encode(
        y=alt.Y("threshold:Q", **y), tooltip=["label:N"])
    label = alt.Chart(said).mark_text(align="left", baseline="bottom", dx=4, dy=-3, fontSize=11).encode(
        x=alt.value(0), y=alt.Y("threshold:Q", **y), text="label:N")
    return _fit(alt.layer(line, rule, label).properties(height=240, title="gradient error against the FP32 shadow"))


@_reused
def update_share_lines(per_step: pd.DataFrame, fmt: str) -> alt.Chart:
    """Per tracked step, the share of updates below ``fmt``'s resolution and the share that left the weight
    unchanged (``summaries.update_shares``' per-step frame)."""
    long = per_step.melt(id_vars="step", value_vars=["below_resolution_share", "unchanged_share"],
                         var_name="what", value_name="share")
    long["what"] = long["what"].map({"below_resolution_share": f"below {fmt.upper()} resolution",
                                     "unchanged_share": "weight unchanged (lost)"})
    return _with_lone_points(
        alt.Chart(long)
        .mark_line()
        .encode(x=STEP_X, y=alt.Y("share:Q", title="share of updated values", axis=alt.Axis(format="%"),
                                    scale=alt.Scale(domain=[0, 1])),
                color=alt.Color("what:N", title=None), strokeDash=alt.StrokeDash("what:N", title=None),
                tooltip=["step:Q", "what:N", alt.Tooltip("share:Q", format=".2%")]),
        "share", by="what",
    ).properties(height=220, autosize=_FIT_WIDTH)


#: the FP8 charts' step axis: STEP_X with thousands separators (step 1,000)
#: STEP_X with thousands separators (the FP8 page's step counts are written so)
_FP8_STEP_X = alt.X("step:Q", title="step", scale=_STEP_SCALE, axis=alt.Axis(format=",d", tickMinStep=1))


def fp8_lost_heatmap(cells: pd.DataFrame, title: str = "") -> alt.Chart:
    """FP8 page: layers (rows) by recorded steps (columns), coloured by the share of the tensor's values the
    cast loses (underflow + overflow); cells losing nothing (``losing`` false: fp8_summaries.loses_any) are grey,
    so a lost value is never hidden by a colour scale's low end."""
    data = cells.assign(lost_pct=cells["lost_share"] * 100, lossless=~cells["losing"].astype(bool))
    base = alt.Chart(data).encode(
        x=alt.X("step:O", title="step", axis=alt.Axis(labelOverlap=True, format=",d", formatType="number")),
        y=alt.Y("module:N", title="Linear module", sort=None),
        tooltip=["module:N", alt.Tooltip("step:Q", format=",d"), alt.Tooltip("lost_pct:Q", title="lost %", format=".3g"),
                 alt.Tooltip("underflow:Q", format=",d"), alt.Tooltip("overflow:Q", format=",d"),
                 alt.Tooltip("amax:Q", format=",.6~g")])
    lossless = base.transform_filter("datum.lossless").mark_rect(color="#e0e0e0")
    lost = base.transform_filter("!datum.lossless").mark_rect().encode(
        color=alt.Color("lost_pct:Q", title="lost %", scale=alt.Scale(type="log", scheme="orangered"),
                        legend=alt.Legend(format=".3g", orient="bottom")))
    rows = max(1, cells["module"].nunique())  # 24 px a layer, never under 160 px: one layer is still readable
    drawn = [part for part, cells_in in ((lossless, data["lossless"]), (lost, ~data["lossless"])) if cells_in.any()]
    return _fit(alt.layer(*drawn).properties(title=title, width="container", height=max(160, 24 * rows)))


def fp8_amax_panel(series: pd.DataFrame, title: str = "") -> alt.LayerChart:
    """One tensor's amax per recorded step against the largest |x| its recipe's scale lets through (the
    format's overflow threshold / scale), log2 axis; steps where values overflow (``overflows``:
    fp8_summaries.overflows) are red points on the amax."""
    long = pd.concat([series.assign(line="amax", value=series["amax"]),
                      series.assign(line="limit of the scale", value=series["limit"])])
    colour = alt.Color("line:N", scale=alt.Scale(domain=["amax", "limit of the scale"], range=["#1f77b4", "#7f7f7f"]),
                       legend=alt.Legend(title=None, orient="top"))
    lines = alt.Chart(long).mark_line(interpolate="step-after").encode(
        x=_FP8_STEP_X,
        y=alt.Y("value:Q", scale=log2_scale(long["value"]), axis=_power_of_two_axis("largest |value|", long["value"])),
        color=colour,
        tooltip=[alt.Tooltip("step:Q", format=",d"), "line:N", alt.Tooltip("value:Q", format=",.6~g")])
    over = alt.Chart(series[series["overflows"].astype(bool)]).mark_point(
        shape="triangle-up", color="#d62728", size=80, filled=True).encode(
        x=_FP8_STEP_X, y="amax:Q", tooltip=[alt.Tooltip("step:Q", format=",d"), alt.Tooltip("amax:Q", format=",.6~g"),
                                         alt.Tooltip("limit:Q", format=",.6~g"), alt.Tooltip("overflow:Q", format=",d")])
    drawn = [lines, *_lone_points(lines, "value", by="line")]
    if series["overflows"].any():  # no empty marker layer
        drawn.append(over)
    return _fit(alt.layer(*drawn).properties(title=title, width="container", height=260))


def fp8_whatif_lines(df: pd.DataFrame, title: str = "") -> alt.LayerChart:
    """The what-if's lost values per recorded step: a band between the lower and upper bound of underflow +
    overflow (a line where they agree). The y axis starts at 0 and reaches at least 1, so a run losing nothing
    draws a visible line on 0 rather than a collapsed axis."""
    data = df.assign(low=df["underflow low"] + df["overflow low"], high=df["underflow high"] + df["overflow high"])
    x = _FP8_STEP_X
    top = max(1, int(data["high"].max())) if len(data) else 1
    band = alt.Chart(data).mark_area(opacity=0.3, color="#d62728").encode(
        x=x, y=alt.Y("low:Q", title="values lost (underflow + overflow)", scale=alt.Scale(domain=[0, top], nice=True),
                     axis=alt.Axis(format=",d", tickMinStep=1)), y2="high:Q")
    high = alt.Chart(data).mark_line(color="#d62728").encode(
        x=x, y="high:Q", tooltip=[alt.Tooltip("step:Q", format=",d"), alt.Tooltip("low:Q", format=",d", title="at least"),
                                  alt.Tooltip("high:Q", format=",d", title="at most"),
                                  alt.Tooltip("scale:Q", format=",.6~g")])
    return _fit(alt.layer(band, high, *_lone_points(high, "high")).properties(title=title, width="container", height=200))


#: flagged cells of the Modules heatmap: inf/NaN pale, since after the first one every later module and step
#: inherits it (a solid red block would hide which was first); the first one is strong red and circled
MODULE_STATES = {"above FP16's max": "#ff7f0e", "inf/NaN": "#f4c2c2", "first inf/NaN": "#d62728"}


def module_heatmap(cells: pd.DataFrame, order: list[str], width: int = 1) -> alt.VConcatChart:
    """Modules (forward order, top to bottom) × traced steps, one panel per pass (``module_trace.magnitude_cells``
    or its ``merge_steps`` with ``width`` steps a column): colour log2 of the largest |value|, orange where a
    finite value passed FP16's max, red where it was inf/NaN; the pass's first non-finite module circled."""
    tooltip = ["module:N", "type:N", alt.Tooltip("step:Q", title="step" if width == 1 else f"first of {width} steps"),
               alt.Tooltip("absmax:Q", format=".6g", title="largest |value|"), "state:N"]
    # rows read "name (Type)": a Sequential's children are named 0, 1, 2, which say nothing alone
    cells = cells.assign(row=cells["module"] + " (" + cells["type"] + ")")
    rows = dict(zip(cells["module"], cells["row"], strict=True))
    panels = []
    for label in dict.fromkeys(cells["pass"]):
        one = cells[cells["pass"] == label]
        base = alt.Chart(one).encode(
            x=alt.X("step:O", title="step" if width == 1 else f"step (columns of {width}, the worst of each)",
                    axis=alt.Axis(labelOverlap=True)),
            y=alt.Y("row:N", sort=[rows[m] for m in order if m in rows], title=None,
                    axis=alt.Axis(labelOverlap=False, labelLimit=240)),
            tooltip=tooltip)
        # no finite cell (every value inf/NaN): no colour scale of log2 |value|, whose empty layer would give
        # Vega an infinite extent
        layers = [base.transform_filter("datum.state == 'finite'").mark_rect().encode(
            color=alt.Color("log2_absmax:Q", title="log2 |value|", scale=alt.Scale(scheme="viridis")))
            for _ in range(int((one["state"] == "finite").any()))]
        flagged = one[one["state"] != "finite"]
        if len(flagged):  # an empty layer makes Vega warn of an infinite extent in the browser console
            drawn = [s for s in MODULE_STATES if s in set(flagged["state"])]
            layers.append(base.transform_filter("datum.state != 'finite'").mark_rect().encode(
                color=alt.Color("state:N", title="flagged",
                                scale=alt.Scale(domain=drawn, range=[MODULE_STATES[s] for s in drawn]))))
        if one["first"].any():
            layers.append(base.transform_filter("datum.first").mark_rect(color=MODULE_STATES["first inf/NaN"]))
            layers.append(base.transform_filter("datum.first").mark_point(
                shape="circle", size=220, filled=False, color="black", strokeWidth=2.5))
        panels.append(alt.layer(*layers).resolve_scale(color="independent").properties(
            title=f"{label}: largest |value| per step (red ○: the first inf/NaN; pale red: inf/NaN after it)",
            width="container", height=max(160, 24 * len(order))))
    return alt.vconcat(*panels).resolve_scale(color="independent").properties(autosize=_FIT_WIDTH)


REPLAY_COLOURS = {"finite": "#9ecae1", "above FP16's max": "#ff7f0e", "inf/NaN": "#f4c2c2",
                  "first offender": "#d62728"}


#: the replay strip names its cells up to this many module calls
REPLAY_NAMED_CALLS = 40


def replay_strip(rows: pd.DataFrame, step: int) -> alt.LayerChart:
    """The replayed step (``modules_model.ReplayStrip.rows``) as one strip of module calls, the forward then the
    backward, each in execution order left to right: coloured by state, the first offender outlined, each call
    named in its cell (up to REPLAY_NAMED_CALLS)."""
    drawn = [s for s in REPLAY_COLOURS if s in set(rows["state"])]
    both = (rows["phase"] == "backward").any()  # the backward is not replayed once the forward went bad
    base = alt.Chart(rows).encode(
        x=alt.X("pos:O", title="execution order: the forward, then the backward" if both else
                "execution order of the forward (the backward was not replayed)",
                axis=alt.Axis(labels=False, ticks=False)),
        y=alt.Y("phase:N", sort=["forward", "backward"], title=None),
        tooltip=["call:N", "phase:N", alt.Tooltip("ord:Q", title="order in its phase"),
                 alt.Tooltip("absmax:Q", format=".6g", title="largest finite |value|"),
                 alt.Tooltip("nonfinite:Q", title="inf/NaN values"), "state:N"])
    layers = [base.mark_rect(stroke="white").encode(
        color=alt.Color("state:N", title=None, scale=alt.Scale(domain=drawn, range=[REPLAY_COLOURS[s] for s in drawn]),
                        legend=alt.Legend(orient="top")))]
    if (rows["state"] == "first offender").any():
        layers.append(base.transform_filter("datum.state == 'first offender'").mark_rect(
            filled=False, stroke="black", strokeWidth=3))  # outlined, so the name inside stays readable
    if len(rows) <= REPLAY_NAMED_CALLS:  # each cell named; past that the names would overlap (tooltips name them)
        layers.append(base.mark_text(angle=270, fontSize=10).encode(
            text="call:N", color=alt.condition("datum.state == 'first offender'", alt.value("white"),
                                               alt.value("#222"))))
    return alt.layer(*layers).properties(
        title=f"step {step} replayed: each module call's output (forward)"
              + (" and produced gradient (backward)" if both else ""),
        width="container", height=160).properties(autosize=_FIT_WIDTH)


def spike_rises(rises: pd.DataFrame, step: int, threshold: float) -> alt.LayerChart:
    """A loss spike's replay (``modules_model.ReplayStrip.rises``): per forward call in execution order (one x
    position per call: a shared module's calls each have their own), how many times its output's absmax (dot) and
    its inputs' (grey tick) were the same call's on step ``step`` - 1's batch, on a log axis with 1x (no change) and
    the spike rule's ``threshold`` as rules labelled at the right; a call meeting the rule (its output rose that
    much, its inputs less) in red: the first offender the replay names a large outlined diamond, the calls that
    meet it after it (the modules holding it) pale red. Each call is named on the x axis up to REPLAY_NAMED_CALLS
    calls; past that the red ones are named beside their points. Calls not comparable (no previous call, no float
    tensor) are left out of the drawing (the page names them: ``ReplayStrip.undrawn_said``)."""
    drawn = rises[np.isfinite(rises["out_rise"]) & (rises["out_rise"] > 0)]
    finite = [*drawn["out_rise"], *rises["in_rise"][np.isfinite(rises["in_rise"]) & (rises["in_rise"] > 0)]]
    low, high = min([1.0, *finite]) / 2, max([threshold, *finite]) * 2
    y_scale = alt.Scale(type="log", domain=[low, high], nice=False)
    named = len(drawn) <= REPLAY_NAMED_CALLS
    names = [""] * (int(rises["pos"].max()) + 1 if len(rises) else 0)
    for pos, call in zip(rises["pos"], rises["call"], strict=True):
        names[int(pos)] = str(call)
    # the names as a JSON array the label looks its position up in (escaped: a name is the user's text)
    x = alt.X("pos:O", title="forward calls in execution order",
              axis=alt.Axis(labels=named, labelAngle=-40, labelLimit=160, ticks=False,
                            **({"labelExpr": f"{json.dumps(names)}[datum.value]"} if named else {})))
    rule_met = f"output rose {threshold:g}x or more, inputs less"
    first_said = f"the first offender: {rule_met}"
    also_said = "met the rule too, after it" if drawn["first"].any() else rule_met
    kinds = [first_said, also_said, "below the rule"]
    meets = np.where(drawn["first"], first_said, np.where(drawn["offender"], also_said, "below the rule"))
    legend = alt.Legend(orient="top", labelLimit=400)
    colour = alt.Color("meets:N", title=None, legend=legend, scale=alt.Scale(
        domain=kinds, range=[REPLAY_COLOURS["first offender"], "#f19c9c", RUN_COLOURS[0]]))
    shape = alt.Shape("meets:N", title=None, legend=legend,
                      scale=alt.Scale(domain=kinds, range=["diamond", "circle", "circle"]))
    size = alt.Size("meets:N", legend=None, scale=alt.Scale(domain=kinds, range=[220, 90, 80]))
    base = alt.Chart(drawn.assign(meets=meets)).encode(x=x, tooltip=[
        "call:N", alt.Tooltip("out_rise:Q", format=".4g", title="output rise (x)"),
        alt.Tooltip("in_rise:Q", format=".4g", title="inputs' rise (x)"),
        alt.Tooltip("absmax:Q", format=".6g", title=f"output absmax, step {step}"),
        alt.Tooltip("absmax_before:Q", format=".6g", title=f"output absmax, step {step - 1}'s batch"), "meets:N"])
    axis = alt.Axis(title=f"absmax on step {step}'s batch ÷ on step {step - 1}'s",
                    labelExpr="format(datum.value, '~g') + 'x'", values=_decades(low, high))
    y = alt.Y("out_rise:Q", scale=y_scale, axis=axis)
    dots = base.mark_point(filled=True, opacity=1).encode(y=y, color=colour, shape=shape, size=size)
    ticks = base.transform_filter("isFinite(datum.in_rise) && datum.in_rise > 0").mark_tick(
        color="#7f7f7f", thickness=2, size=18).encode(y=alt.Y("in_rise:Q", scale=y_scale))
    rules = pd.DataFrame({"y": [1.0, threshold], "label": ["1x: no change", f"{threshold:g}x: the spike rule"]})
    rule = alt.Chart(rules).mark_rule(strokeDash=[6, 3]).encode(
        y=alt.Y("y:Q", scale=y_scale), color=alt.value("#555"))
    # right of the plot's end: inside it they sat over the dots (most calls are at 1x, on the left and the right)
    text = alt.Chart(rules).mark_text(align="left", baseline="middle", dx=6, color="#555").encode(
        y=alt.Y("y:Q", scale=y_scale), x=alt.value("width"), text="label:N")
    layers = [rule, text, ticks, dots]
    if drawn["first"].any():  # outlined, apart from the calls that merely meet the rule after it
        layers.append(base.transform_filter("datum.first").mark_point(
            shape="diamond", size=300, filled=False, color="black", strokeWidth=1.5).encode(y=y))
    if not named:  # no names on the axis: the red points named beside them, where no other point is
        sides = _label_sides(drawn, low, high, 260)
        for side, (align, dx, dy) in _LABEL_PLACES.items():
            for first in (True, False):  # the first offender's name in bold
                if not ((sides == side) & (drawn["first"] == first)).any():
                    continue
                layers.append(alt.Chart(drawn[(sides == side) & (drawn["first"] == first)]).mark_text(
                    align=align, dx=dx, dy=dy, baseline="middle", fontSize=11,
                    fontWeight="bold" if first else "normal").encode(x=x, y=y, text="call:N"))
    return alt.layer(*layers).properties(
        title=f"step {step}'s loss spike replayed: each forward call's output (dot) and inputs (grey tick) against "
              f"step {step - 1}'s batch", width="container", height=260).properties(autosize=_FIT_WIDTH)


#: where a red point's name goes on the spike replay (text align, dx, dy): right of it, left of it, or above it
#: ending at it
_LABEL_PLACES = {"right": ("left", 11, 0), "left": ("right", -11, 0), "above": ("right", 6, -13)}
#: the spike replay's plot width at a 1,280 px window (its labels are placed for it), and a name's pixels a character
_PLOT_PX, _CHAR_PX = 740, 6.2


def _label_sides(drawn: pd.DataFrame, low: float, high: float, height: int) -> pd.Series:
    """For each red (rule-meeting) point of the spike replay, the side of :data:`_LABEL_PLACES` whose text box
    covers no other point or tick at a 1,280 px window: right, else left, else above (a red point's neighbours
    are often at its height: the module holding it, the next block); "" for the other points."""
    order = {p: i for i, p in enumerate(sorted(drawn["pos"]))}
    step_px = _PLOT_PX / max(len(order), 1)
    px_decade = height / (math.log10(high) - math.log10(low))
    marks = [(order[p], math.log10(v) * px_decade) for p, out, inp in drawn[["pos", "out_rise", "in_rise"]].itertuples(
        index=False) for v in (out, inp) if np.isfinite(v) and v > 0]
    sides = pd.Series("", index=drawn.index)
    for i, row in drawn[drawn["offender"]].iterrows():
        at, y = order[row["pos"]], math.log10(row["out_rise"]) * px_decade
        width = (len(str(row["call"])) * _CHAR_PX + 12) / step_px  # in positions
        boxes = {"right": (at + 0.4, at + width, y - 7, y + 7), "left": (at - width, at - 0.4, y - 7, y + 7),
                 "above": (at - width, at + 0.4, y + 6, y + 20)}
        free = [side for side, (x0, x1, y0, y1) in boxes.items()
                if x0 >= -0.5 and x1 <= len(order) - 0.5
                and not any(x0 <= mx <= x1 and y0 - 5 <= my <= y1 + 5 for mx, my in marks if (mx, my) != (at, y))]
        sides[i] = free[0] if free else "above"
    return sides


def _decades(low: float, high: float) -> list[float]:
    """Axis values for a log axis from ``low`` to ``high``: 1, 2, 5 per decade when it spans two decades or
    less, else the powers of ten."""
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    steps = (1, 2, 5) if last - first <= 2 else (1,)
    return [m * 10.0**k for k in range(first, last + 1) for m in steps if low <= m * 10.0**k <= high]


def module_lines(cells: pd.DataFrame, module: str) -> alt.LayerChart:
    """One module's largest |forward output| and |gradient into its output| per traced step on a log2 axis,
    FP16's max as a labelled rule, faint vertical rules where a value was inf/NaN."""
    one = cells[cells["module"] == module]
    colour = alt.Color("pass:N", legend=alt.Legend(title=None, orient="top", labelLimit=400))
    drawn = one[np.isfinite(one["absmax"]) & (one["absmax"] > 0)]  # the page says so where none is
    lines = alt.Chart(drawn).mark_line(point=True).encode(
        x=STEP_X, y=alt.Y("absmax:Q", scale=log2_scale([*drawn["absmax"], FP16.max_finite]),
                          axis=_power_of_two_axis("largest |value|", [*drawn["absmax"], FP16.max_finite])),
        color=colour, tooltip=["step:Q", "pass:N", alt.Tooltip("absmax:Q", format=".6g")])
    limit = alt.Chart(pd.DataFrame({"absmax": [FP16.max_finite], "label": [f"fp16 max {FP16.max_finite:g}"]}))
    rule = limit.mark_rule(strokeDash=[6, 3], color=LIMIT_COLOURS["fp16"]).encode(y="absmax:Q")
    text = limit.mark_text(align="left", baseline="bottom", dx=4, dy=-2, fontWeight="bold",
                           color=LIMIT_COLOURS["fp16"]).encode(y="absmax:Q", x=alt.value(0), text="label:N")
    chart = alt.layer(lines, rule, text)
    return _with_nonfinite_rules(chart, one.assign(value=one["absmax"].where(one["state"] != "inf/NaN", np.nan)),
                                 "value", colour).properties(height=260, autosize=_FIT_WIDTH)


#: the Plan page's bars: the reference configurations grey, the plan in the first run colour
PLAN_BAR_COLOURS = {"FP32": "#9e9e9e", "mixed precision (16Ψ)": "#c7c7c7", "BF16": "#c7c7c7", "plan": RUN_COLOURS[0]}


def plan_bytes(df: pd.DataFrame, title: str) -> alt.LayerChart:
    """Predicted megabytes under each configuration (``df``: configuration, MB; the plan last), one horizontal bar
    each, labelled with its value at its end (the axis runs 30 % past the longest bar, so the label fits)."""
    colour = alt.Color("configuration:N", legend=None, scale=alt.Scale(
        domain=df["configuration"].tolist(), range=[PLAN_BAR_COLOURS.get(c, "#c7c7c7") for c in df["configuration"]]))
    y = alt.Y("configuration:N", sort=None, title=None, axis=alt.Axis(labelLimit=220))
    bars = alt.Chart(df).mark_bar().encode(
        y=y, x=alt.X("MB:Q", title="MB", axis=alt.Axis(format=PLAIN_FORMAT),
                     scale=alt.Scale(domain=[0, 1.3 * float(df["MB"].max() or 1)])),
        color=colour, tooltip=["configuration:N", alt.Tooltip("MB:Q", format=",.6~g")])
    labels = alt.Chart(df).mark_text(align="left", dx=4).encode(y=y, x="MB:Q", text=alt.Text("MB:Q", format=",.4~g"))
    return _fit(alt.layer(bars, labels).properties(height=150, title=title))
