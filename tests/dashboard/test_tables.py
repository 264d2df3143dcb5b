"""The dashboard's tables at 1,280 px (mpdiag.dashboard.tables and the view models' column specs), without Streamlit:
each table's columns fit the width a table has there, every column a page's table holds is shown somewhere, the
reruns table says which findings are still there, and a final loss reads the same on every page."""

import math

import pandas as pd
import pytest

from mpdiag.analysis.findings import Finding
from mpdiag.analysis.summaries import runs_table
from mpdiag.dashboard import compare_model, findings_model, gradients_model, plan_model, runs_model
from mpdiag.dashboard.tables import TABLE_PX, Column, loss_digits, loss_texts, width_px

#: a table folded in an expander has a little less room than one on the page
EXPANDER_PX = 780


@pytest.mark.parametrize("columns, room", [
    (runs_model.TABLE_COLUMNS, TABLE_PX),
    *((columns, EXPANDER_PX) for columns in runs_model.MORE_TABLES.values()),
    (findings_model.RERUN_COLUMNS, TABLE_PX),
    (compare_model.COST_COLUMNS, TABLE_PX),
    (plan_model.LINEAR_COLUMNS, TABLE_PX),
    (plan_model.ROUND_COLUMNS, TABLE_PX),
    ({c: Column(width=w) for c, (_, w) in gradients_model.TABLE_HEADERS.items()}, TABLE_PX),
])
def test_every_table_fits_at_1280_px(columns, room):
    assert all(isinstance(c.width, int) for c in columns.values())
    assert width_px(columns) <= room, width_px(columns)


def test_the_runs_table_shows_each_of_its_columns_once_on_screen_or_folded_beneath_it():
    runs = pd.DataFrame({"run_id": [1], "name": ["a"], "status": ["finished"], "opt_level": ["O1"],
                         "final_loss": [1.0], "steps_done": [3], "steps": [3], "skipped_steps": [0],
                         "script_path": ["a.py"], "scaling": ["dynamic"], "init_scale": [65536.0],
                         "loss_scale": [None], "median_step_time_s": [0.01], "device": ["cpu"], "world_size": [1],
                         "pair_run_id": [None], "parent_run_id": [None], "config": [{}],
                         "started_at": [pd.Timestamp("2026-01-01", tz="UTC")]})
    table = runs_table(pd.concat([runs, runs.assign(run_id=2, init_scale=2.0**35, loss_scale=1000.0)]), [[], []])
    shown = [*runs_model.TABLE_COLUMNS, *(c for cols in runs_model.MORE_TABLES.values() for c in cols if c != "run")]
    assert sorted(shown) == sorted([*table.columns, "tags", "note"])
    # one way in one column (65,536 beside 2^35 read as two kinds of number); 2^35 was cut to "3.435973837e+1"
    assert table["init scale"].tolist() == ["2^16", "2^35"]
    assert table["static scale"].tolist() == ["", "1,000"]


def test_a_final_loss_gets_the_digits_that_tell_the_stores_runs_apart():
    runs = pd.DataFrame({"final_loss": [1.48223e-05, 1.48231e-05, 6.43171e-05, math.nan, 1.48223e-05]})
    digits = loss_digits(runs)
    assert digits == 5  # 4 digits wrote the first two 1.482e-05
    assert loss_texts(runs["final_loss"], digits) == ["1.4822e-05", "1.4823e-05", "6.4317e-05", "NaN", "1.4822e-05"]
    assert loss_digits(pd.DataFrame({"final_loss": [1.5, 2.25]})) == 4 and loss_digits(pd.DataFrame()) == 4


def _finding(rule: str) -> Finding:
    return Finding(rule=rule, severity="warning", title=rule, evidence="", recommendation="", page="Findings")


def test_the_reruns_table_names_the_findings_still_there_and_counts_those_gone():
    outcomes = pd.DataFrame([
        {"run": 1, "name": "x.py", "opt level": "O1", "status": "finished", "final loss": 1.5e-05, "this run": True},
        {"run": 3, "name": "fix", "opt level": "O1", "status": "finished", "final loss": 1.48223e-05,
         "a-rule": "gone", "b-rule": "still there", "FP32 final loss": 1.48231e-05, "vs FP32": -0.005},
        {"run": 4, "name": "x.py ↻ bf16", "opt level": "bf16", "status": "finished", "final loss": 2.0,
         "a-rule": "gone", "b-rule": "gone"},
        {"run": 5, "name": "going", "opt level": "O1", "status": "running", "final loss": math.nan},
    ])
    runs = pd.DataFrame({"final_loss": [1.48223e-05, 1.48231e-05, 2.0]})
    table, columns = findings_model.reruns_table(outcomes, [_finding("a-rule"), _finding("b-rule")], runs)
    assert table.columns.tolist() == list(findings_model.RERUN_COLUMNS) == list(columns)
    # the run itself first, whose loss the reruns' are read against: no findings of its own to judge
    # a rerun named by mpdiag by what it changed (its 150 px showed "x.py ↻" for every rerun); a typed name as typed
    assert table["name"].tolist() == ["this run: x.py", "fix", "↻ bf16", "going"]
    assert table["still there"].tolist() == ["", "b-rule", "none", ""]  # blank until the rerun has finished
    assert table["gone"].tolist() == ["", "1 of 2", "2 of 2", ""]
    assert table["final loss"].tolist() == ["1.5e-05", "1.4822e-05", "2", "NaN"]  # as the Runs page writes them
    assert table["FP32 final loss"].tolist() == ["", "1.4823e-05", "", ""]
    assert table["vs FP32"].iloc[1] == -0.005 and table["vs FP32"].drop(index=1).isna().all()
    # a run without findings: its reruns have no findings to count
    table, columns = findings_model.reruns_table(outcomes[["run", "name", "opt level", "status", "final loss"]], [],
                                                 runs)
    assert "still there" not in columns and "gone" not in columns


def test_the_gradients_table_heads_its_columns_short_with_the_long_name_on_hover():
    column = gradients_model.table_column("underflow_share", "fp16 underflow (%)", "Share of ...", 0)
    assert column.label == "underflow" and column.help.startswith("fp16 underflow (%): ")
    whatif = gradients_model.table_column("whatif", "fp16 underflow at 2^-3, step 19", "Of its ...", -3)
    assert whatif.label == "underflow at 2^-3" and "step 19" in whatif.help
    count = gradients_model.table_column("numel", "values per step", "Number of elements", 0)
    assert count.kind == "number" and count.format == "%,d"
    assert gradients_model.table_column("tensor", "tensor", "The parameter", 0).pinned is True


def test_column_specs_become_streamlits_column_config():
    from mpdiag.dashboard.frame import column_config

    config = column_config({"a": Column("A", help="long", width=80, kind="number", format="%,d"),
                            "b": Column(kind="link", display_text="Open", width=70)})
    assert config["a"]["label"] == "A" and config["a"]["help"] == "long" and config["a"]["width"] == 80
    assert config["a"]["type_config"]["format"] == "%,d"
    assert config["b"]["type_config"]["display_text"] == "Open"


def test_reruns_without_an_fp32_reference_say_how_to_get_one():
    """A watched run's bf16 fix, rerun: the table's "vs FP32" read None and nothing said why (a user's trial); the page
    now says an O0 rerun of the same command gives the reference. With a reference in any row it says nothing."""
    run = pd.Series({"run_id": 1, "config": {"watch": {"argv": ["train.py"], "cwd": "/tmp"}}})
    table = pd.DataFrame({"run": [1, 2], "vs FP32": [math.nan, math.nan]})
    view = findings_model.FindingsRun(run, [], pd.DataFrame(), None, None, table)
    assert view.no_reference == ("No FP32 reference for these runs yet, so no loss against FP32: an O0 rerun of the "
                                 "same command gives one: python -m mpdiag rerun 1 --opt-level O0 (mpdiag watch "
                                 "records no FP32 twin).")
    assert findings_model.FindingsRun(run, [], pd.DataFrame(), None, None, table.assign(**{"vs FP32": [1.0, 0.2]})
                                      ).no_reference is None
