"""Every chart of the dashboard, downloadable as PNG and SVG: :func:`show_chart` (and :func:`show_chart_in` for a
column) draws an Altair chart as ``st.altair_chart`` draws it and adds two small download buttons under it.

Streamlit draws Altair with vega-embed's actions menu turned off, so the browser offers no way to save a chart.
The files are rendered here, in the server, by vl-convert (Vega-Lite to SVG and PNG without a browser), and only
when a button is clicked (the buttons are given a function, not bytes: rendering a chart costs tens to hundreds of
milliseconds, which no page load pays). A chart that fills its container (``width="container"``) is drawn
EXPORT_WIDTH pixels wide. A chart is converted for Streamlit once per chart object (:func:`streamlit_spec`, as
``st.altair_chart`` converts it) and drawn from that with ``st.vega_lite_chart``: a live page's refresh that finds no
new data draws the very charts it drew before (charts.py hands them back), without converting them again. Owns the
rendering (:func:`chart_svg`, :func:`chart_png`, :func:`streamlit_spec`) and the buttons. Must not build charts
(charts.py does) or read the store.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable

import streamlit as st
from streamlit.elements.vega_charts import _convert_altair_to_vega_lite_spec  # st.altair_chart's own conversion

#: the width, in pixels, of a chart drawn for a file when on the page it fills its container
EXPORT_WIDTH = 900
#: PNG pixels per chart pixel (2: sharp on high-density screens and in documents)
PNG_SCALE = 2


def _fixed_width(spec, top: bool = True):
    """The Vega-Lite ``spec`` with every ``width: "container"`` made EXPORT_WIDTH; a top-level single or layered
    chart that leaves its width to the container (no width, autosize fit) gets EXPORT_WIDTH too."""
    if isinstance(spec, dict):
        out = {k: (EXPORT_WIDTH if k == "width" and v == "container" else _fixed_width(v, top=False))
               for k, v in spec.items()}
        concat = any(k in out for k in ("vconcat", "hconcat", "concat", "facet", "repeat"))
        if top and not concat and "width" not in out:
            out["width"] = EXPORT_WIDTH
        return out
    if isinstance(spec, list):
        return [_fixed_width(v, top=False) for v in spec]
    return spec


def _vegalite(chart) -> tuple[dict, str]:
    """(spec with fixed widths, the Vega-Lite version vl-convert should compile it with)."""
    spec = _fixed_width(chart.to_dict())
    found = re.search(r"/v(\d+)\.(\d+)", spec.get("$schema", ""))
    return spec, (f"{found.group(1)}.{found.group(2)}" if found else "6.4")


def chart_svg(chart) -> str:
    """The chart as an SVG document (its title and text as SVG text)."""
    import vl_convert

    spec, version = _vegalite(chart)
    return vl_convert.vegalite_to_svg(spec, vl_version=version)


def chart_png(chart, scale: float = PNG_SCALE) -> bytes:
    """The chart as a PNG image, ``scale`` pixels per chart pixel."""
    import vl_convert

    spec, version = _vegalite(chart)
    return vl_convert.vegalite_to_png(spec, vl_version=version, scale=scale)


def file_stem(chart, fallback: str) -> str:
    """A file name (no extension) for the chart: its title's letters and digits, else ``fallback``."""
    title = getattr(chart, "title", None)
    text = title if isinstance(title, str) else getattr(title, "text", None)
    if isinstance(text, list):
        text = " ".join(str(t) for t in text)
    stem = re.sub(r"[^A-Za-z0-9]+", "_", str(text) if isinstance(text, str) else "").strip("_")[:60]
    return stem or fallback


def _call_site() -> str:
    """A key for a chart drawn without one: the page file and line that drew it (the same on every rerun)."""
    frame = sys._getframe(3)
    return f"{re.sub(r'[^A-Za-z0-9]+', '_', frame.f_code.co_filename.rsplit('/', 1)[-1])}_{frame.f_lineno}"


def _downloads(where, chart, key: str) -> None:
    stem = file_stem(chart, key)
    png: Callable[[], bytes] = lambda: chart_png(chart)  # noqa: E731 - rendered on click only
    svg: Callable[[], str] = lambda: chart_svg(chart)  # noqa: E731
    # a row sized to the buttons, not columns of fixed shares: in a half-width column a tenth of it cut the
    # labels to "P" and "S" (seen in a screenshot of the Plan page)
    row = where.container(horizontal=True, gap="small")
    row.download_button("PNG", png, file_name=f"{stem}.png", mime="image/png", key=f"chart_png_{key}",
                        on_click="ignore", type="tertiary", icon=":material/download:",
                        help="Download this chart as a PNG image")
    row.download_button("SVG", svg, file_name=f"{stem}.svg", mime="image/svg+xml", key=f"chart_svg_{key}",
                        on_click="ignore", type="tertiary", icon=":material/download:",
                        help="Download this chart as an SVG image")


#: how many charts' converted specs are held (a page draws a dozen at most; a live one the same ones again)
HELD_SPECS = 32
_held_specs: dict[int, tuple] = {}
_held_lock = threading.Lock()


def streamlit_spec(chart) -> dict:
    """The chart as ``st.altair_chart`` converts it (Vega-Lite, each dataset as Arrow bytes under its content's
    hash), once per chart object: converting validates every part of the chart (20-150 ms a chart). The chart is
    held with its spec, so its id is not reused while the spec is held; the spec is never changed (Streamlit
    copies it before moving the datasets out)."""
    with _held_lock:
        held = _held_specs.get(id(chart))
    if held is not None:
        return held[1]
    spec = _convert_altair_to_vega_lite_spec(chart)
    with _held_lock:
        while len(_held_specs) >= HELD_SPECS:
            del _held_specs[next(iter(_held_specs))]
        _held_specs[id(chart)] = (chart, spec)
    return spec


def _show(where, chart, key: str | None, kwargs: dict):
    key = key or kwargs.get("key") or _call_site()
    shown = where.vega_lite_chart(spec=dict(streamlit_spec(chart)), **kwargs)
    _downloads(where, chart, str(key))
    return shown


def show_chart(chart, key: str | None = None, **kwargs):
    """``st.altair_chart(chart, **kwargs)`` (its return value too) with PNG and SVG download buttons under it.
    ``key`` names the buttons (default: the chart's own ``key``, else the line that drew it)."""
    return _show(st, chart, key, kwargs)


def show_chart_in(where, chart, key: str | None = None, **kwargs):
    """:func:`show_chart` in a container or column ``where`` (``where.altair_chart``)."""
    return _show(where, chart, key, kwargs)
