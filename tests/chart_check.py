"""The chart check (issue 27): what every Altair chart a page draws must be, read from the Vega-Lite spec and the
data Streamlit ships with it (an AppTest ``vega_lite_chart`` element's proto).

Every drawn view (a mark, alone or in a layer, a concatenation or a facet, whose panels split its data):
- has rows to draw, with a finite value in each quantitative position field it encodes (x, y, and their
  second ends): a panel of nothing, or of nothing but NaN, must be a sentence on the page instead;
- is at least MIN_PX tall, and, where its width is a number, that wide (``"container"`` and an unset width
  take the element's width: the pages draw every chart ``width="stretch"``); the chart's autosize fits the
  width only, so a height is the plot's own (Streamlit's default fits title, axes and legends into it);
- puts no log scale over a value that is zero, negative or infinite (Vega draws nothing, or warns of an
  infinite extent, and the axis ends at 0 or inf).

Filters in a view's transforms are applied (the simple ``datum.field`` comparisons the chart layer writes)
before its data is judged; selection filters are ignored.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pyarrow as pa

MIN_PX = 150
POSITIONS = ("x", "y", "x2", "y2")


def datasets(proto) -> dict[str, pd.DataFrame]:
    """The named datasets Streamlit moved out of the spec, as frames."""
    return {d.name: pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in proto.datasets}


def _frame(data, named: dict[str, pd.DataFrame]) -> pd.DataFrame | None:
    if not isinstance(data, dict):
        return None
    if "name" in data:
        return named.get(data["name"])
    if "values" in data:
        return pd.DataFrame(data["values"])
    return None


def _filtered(df: pd.DataFrame, transforms: list) -> pd.DataFrame:
    """``df`` after the view's simple filters (``datum.a``, ``!datum.a``, ``datum.a == 'x'``, ``!=``)."""
    for t in transforms:
        expr = t.get("filter") if isinstance(t, dict) else None
        if not isinstance(expr, str):
            continue
        if m := re.fullmatch(r"(!?)datum\.(\w+)", expr.strip()):
            keep = df[m.group(2)].astype(bool)
            df = df[~keep if m.group(1) else keep]
        elif m := re.fullmatch(r"datum\.(\w+)\s*(==|!=)\s*'([^']*)'", expr.strip()):
            equal = df[m.group(1)].astype(str) == m.group(3)
            df = df[equal if m.group(2) == "==" else ~equal]
    return df


def _field(channel) -> str | None:
    if isinstance(channel, dict) and isinstance(channel.get("field"), str):
        return channel["field"].replace("\\", "")
    if isinstance(channel, str):
        return channel.split(":")[0]
    return None


def _height(height, df: pd.DataFrame, encoding: dict) -> float | None:
    if isinstance(height, (int, float)):
        return float(height)
    if isinstance(height, dict) and "step" in height:  # one step per category of the y field
        field = _field(encoding.get("y"))
        n = df[field].nunique() if field is not None and field in df else 0
        return float(height["step"]) * n
    return None


def _views(spec: dict, inherited: dict):
    """(view spec, its data, its height, its width, its transforms, where) for every leaf view."""
    here = {
        "data": spec.get("data", inherited.get("data")),
        "height": spec.get("height", inherited.get("height")),
        "width": spec.get("width", inherited.get("width")),
        "transform": [*inherited.get("transform", []), *spec.get("transform", [])],
        "title": spec.get("title") or inherited.get("title"),
    }
    children = [*spec.get("layer", []), *spec.get("vconcat", []), *spec.get("hconcat", []), *spec.get("concat", []),
                *([spec["spec"]] if "facet" in spec else [])]  # a faceted chart's panels, its data split among them
    if "mark" in spec:
        yield spec, here
    for child in children:
        yield from _views(child, here)


def _title(title) -> str:
    if isinstance(title, dict):
        title = title.get("text")
    return str(title)[:60] if title else "untitled"


def chart_problems(proto) -> list[str]:
    """What is wrong with one chart element (empty list: nothing)."""
    spec = json.loads(proto.spec)
    named = {**{k: pd.DataFrame(v) for k, v in spec.get("datasets", {}).items()}, **datasets(proto)}
    problems = []
    autosize = spec.get("autosize")
    fitted = autosize.get("type") if isinstance(autosize, dict) else autosize
    if fitted not in ("fit-x", "pad", "none"):  # Streamlit's default "fit" squeezes title, axes and legends in
        problems.append(f"{_title(spec.get('title'))}: autosize {fitted}: the heights are not the plots' own")
    for view, where in _views(spec, {}):
        name = _title(where["title"])
        mark = view["mark"]["type"] if isinstance(view["mark"], dict) else view["mark"]
        encoding = view.get("encoding", {})
        df = _frame(where["data"], named)
        if df is None:
            problems.append(f"{name} ({mark}): no data")
            continue
        df = _filtered(df, where["transform"])
        if df.empty:
            problems.append(f"{name} ({mark}): no rows to draw")
            continue
        rows = np.ones(len(df), dtype=bool)
        for channel in POSITIONS:
            enc = encoding.get(channel)
            field = _field(enc)
            if field is None or field not in df:
                continue
            if isinstance(enc, dict) and enc.get("type") == "quantitative" or channel in ("x2", "y2"):
                values = pd.to_numeric(df[field], errors="coerce").to_numpy(dtype=float)
                rows &= np.isfinite(values)
            else:
                rows &= df[field].notna().to_numpy()
        if not rows.any():
            problems.append(f"{name} ({mark}): no row with finite positions")
        for channel, enc in encoding.items():
            if not (isinstance(enc, dict) and isinstance(enc.get("scale"), dict) and enc["scale"].get("type") == "log"):
                continue
            field = _field(enc)
            if field is None or field not in df:
                continue
            values = pd.to_numeric(df[field], errors="coerce").dropna().to_numpy(dtype=float)
            if (values <= 0).any() or np.isinf(values).any():
                problems.append(f"{name} ({mark}): log scale on {channel} over {field} values <= 0 or infinite")
        height = _height(where["height"], df, encoding)
        if height is None:
            problems.append(f"{name} ({mark}): no explicit height")
        elif height < MIN_PX:
            problems.append(f"{name} ({mark}): {height:.0f} px tall")
        width = where["width"]
        if isinstance(width, (int, float)) and width < MIN_PX:
            problems.append(f"{name} ({mark}): {width} px wide")
        elif isinstance(width, dict) and "step" in width:
            field = _field(encoding.get("x"))
            n = df[field].nunique() if field is not None and field in df else 0
            if width["step"] * n < MIN_PX:
                problems.append(f"{name} ({mark}): {width['step'] * n} px wide")
    return problems


def page_chart_problems(at) -> list[str]:
    """Every chart of a rendered AppTest page, checked."""
    return [p for element in at.get("vega_lite_chart") for p in chart_problems(element.proto)]
