"""The page tests' AppTest helpers: a page rendered on a store (with query parameters), what it says as it
reads on screen, the Runs page's table whole, a confirmed click, and waiting for the runs a click started."""

import re
import time

import pandas as pd
from conftest import ROOT
from streamlit.testing.v1 import AppTest

from mpdiag import Store

PAGES = ["app.py", "pages/1_Gradients.py", "pages/2_Loss_scale.py", "pages/3_Compare.py", "pages/4_Upload.py",
         "pages/5_Findings.py", "pages/6_FP8.py", "pages/7_Modules.py", "pages/8_Plan.py"]
TIMEOUT = 30


def app(page, store, monkeypatch, **query):
    monkeypatch.setenv("MPDIAG_STORE", str(store))
    at = AppTest.from_file(str(ROOT / page), default_timeout=TIMEOUT)
    for key, value in query.items():
        at.query_params[key] = value
    return at.run()


def runs_table(at) -> pd.DataFrame:
    """The Runs page's table whole: the columns on screen and the two tables folded beneath it (its settings; its
    timing, tags and notes), joined on the run, in the table's order."""
    parts = [d.value.set_index("run") for d in at.dataframe[:3]]
    assert [p.index.tolist() for p in parts[1:]] == [parts[0].index.tolist()] * 2
    return pd.concat(parts, axis=1).reset_index()


def shown(markdown: str) -> str:
    """Markdown as it reads on screen: backslash escapes (how user text is made inert) removed."""
    return re.sub(r"\\(.)", r"\1", markdown)


def texts(at):
    """Everything the page said in Markdown or code, as it reads on screen."""
    parts = [m.value for m in at.markdown] + [c.value for c in at.caption] + [i.value for i in at.info]
    said = "\n".join(parts + [w.value for w in at.warning] + [e.value for e in at.error] + [c.value for c in at.code])
    return shown(said)


def confirm(at, key):
    """Click the button ``key`` and then Confirm in the panel it opens (every action needs both)."""
    at.button(key=key).click().run()
    assert not at.exception, [e.value for e in at.exception]
    return at.button(key=f"{key}_confirm").click().run()


def wait_for_runs(store, n, timeout=120):
    """The store's runs once it holds ``n`` and none is queued or running (else fail after ``timeout`` s)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        runs = Store(store).runs()
        if len(runs) >= n and (~runs["status"].isin(["queued", "running"])).all():
            return runs
        time.sleep(0.5)
    raise AssertionError(f"runs did not finish: {Store(store).runs()[['run_id', 'status', 'error']]}")


def step_slider(at, key: str):
    """The step slider a page draws for the choice kept in session state ``key`` (frame.step_slider: its widget's
    own key changes with the steps and the choice)."""
    return next(s for s in at.select_slider if str(s.key).startswith(f"{key}_at_"))

