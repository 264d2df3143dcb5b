"""The Gradients page (issue 27): its ranking of an FP16 run whose gradients FP16 already flushed, the table's
names and units, the heatmap's blank columns explained, and every tensor's histogram as small multiples; each
checked against the store's own rows (or against values cast with torch), never against the page's functions."""

import json
import math
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from app_helpers import step_slider
from chart_check import chart_problems, datasets
from conftest import EXAMPLES, ROOT
from streamlit.testing.v1 import AppTest

from mpdiag.analysis import summaries
from mpdiag.dashboard import charts
from mpdiag.numerics.formats import EXP_MIN, FP16, N_EXP_BINS

TIMEOUT = 60
RAW_NAMES = {"underflow_share", "subnormal_share", "overflow_share", "zero_share", "flushed_share", "numel",
             "nonfinite"}


def record(store, *options):
    subprocess.run([sys.executable, "-m", "mpdiag", "run", str(EXAMPLES / "gallery_underflow.py"), "--device", "cpu",
                    "--store", str(store), "--opt-level", "O1", "--loss-scale", "1", *options],
                   check=True, cwd=ROOT, capture_output=True)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    """Run 1: the README's failing example (gallery_underflow at O1, static scale 1: FP16 flushes most of its
    gradients to zero), with its FP32 twin, run 2 (--pair); run 3: the same without a twin, 3 steps."""
    path = tmp_path_factory.mktemp("gradients") / "runs.db"
    record(path, "--steps", "8", "--pair")
    record(path, "--steps", "3")
    return path


def page(store, monkeypatch, **query):
    monkeypatch.setenv("MPDIAG_STORE", str(store))
    at = AppTest.from_file(str(ROOT / "pages" / "1_Gradients.py"), default_timeout=TIMEOUT)
    for key, value in query.items():
        at.query_params[key] = value
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def ranking_table(at) -> pd.DataFrame:
    return next(d.value for d in at.dataframe if "tensor" in d.value.columns)


def captions(at) -> str:
    return "\n".join(c.value.replace("\\", "") for c in at.caption)


def test_an_fp16_run_with_a_twin_ranks_by_what_fp16_flushed(store_path, monkeypatch):
    from mpdiag import Store

    store = Store(store_path, create=False)
    totals, twin = store.tensor_totals(1).set_index("tensor"), store.tensor_totals(2).set_index("tensor")
    assert (totals["fp16_underflow"] == 0).all()  # the recorded underflow cannot rank: FP16 flushed those values
    flushed = (totals["zeros"] / totals["numel"] - twin.loc[totals.index, "zeros"] / twin.loc[totals.index, "numel"]
               ).clip(lower=0)
    assert flushed.max() > 0.05 and flushed.nunique() > 1
    at = page(store_path, monkeypatch, run="1")
    table = ranking_table(at)
    assert table["tensor"].tolist() == flushed.sort_values(ascending=False, kind="stable").index.tolist()
    column = "flushed vs FP32 twin (%)"
    assert table[column].tolist() == [f"{flushed[t]:.2%}" for t in table["tensor"]]
    assert at.selectbox(key="tensor").value == table["tensor"].iloc[0]  # the worst tensor is shown first
    assert "Ranked by the share of all values flushed to zero before recording, estimated against the FP32 twin" \
        in captions(at)


def test_without_a_twin_an_fp16_run_ranks_by_its_zeros_and_low_values_and_says_so(store_path, monkeypatch):
    """Without a twin an FP16 run's flushed values are among its zeros: it is ranked by its zeros and its values
    kept only as subnormals or underflowing, of all its values, at the view shown (S·g at its loss scale). By zeros
    alone, a tensor with 0.04 % zeros opened the page, one with 9.6 % subnormal values far below it."""
    from mpdiag import Store

    totals = Store(store_path, create=False).tensor_totals(3).set_index("tensor")
    zeros = totals["zeros"] / totals["numel"]
    at = page(store_path, monkeypatch, run="3")
    view = "_at_scale" if at.radio(key="view").value == "at the loss scale (S·g)" else ""
    low = (totals["zeros"] + totals[f"fp16_underflow{view}"] + totals[f"fp16_subnormal{view}"]) / totals["numel"]
    table = ranking_table(at)
    assert low[table["tensor"]].is_monotonic_decreasing and sorted(table["tensor"]) == sorted(low.index)
    assert table["zeros (%)"].tolist() == [f"{zeros[t]:.2%}" for t in table["tensor"]]
    assert at.selectbox(key="tensor").value == table["tensor"].iloc[0]
    assert "flushed vs FP32 twin (%)" not in table.columns  # not known without a twin
    said = captions(at)
    assert "Ranked by the share of values recorded as exact zeros or as fp16 subnormals or underflow" in said
    assert "without an FP32 twin" in said


def test_the_table_names_its_columns_with_units_and_separates_thousands(store_path, monkeypatch):
    from mpdiag import Store

    at = page(store_path, monkeypatch, run="2")  # the FP32 twin: ranked by the recorded underflow
    element = next(d for d in at.dataframe if "tensor" in d.value.columns)
    table = element.value
    assert not RAW_NAMES & set(table.columns), table.columns
    totals = Store(store_path, create=False).tensor_totals(2).set_index("tensor")
    assert table.set_index("tensor")["values per step"].to_dict() == totals["numel_per_step"].to_dict()
    assert 8192 in table["values per step"].tolist()
    config = json.loads(element.proto.columns)
    assert config["values per step"]["type_config"]["format"] == "%,d"  # 8192 reads 8,192
    # headed "size" (it read "values", beside a NaN / inf count over all steps that was larger than it)
    assert config["values per step"]["label"] == "size" and "one step" in config["values per step"]["help"]
    assert all(config[c].get("help") for c in table.columns)
    for c in ("fp16 underflow (%)", "fp16 subnormal (%)", "zeros (%)"):
        assert all(re.fullmatch(r"\d+\.\d\d%|n/a", v) for v in table[c]), table[c]
    share = totals["fp16_underflow"] / (totals["numel"] - totals["zeros"] - totals["nan"] - totals["posinf"]
                                        - totals["neginf"])
    assert table.set_index("tensor")["fp16 underflow (%)"].to_dict() == {t: f"{v:.2%}" for t, v in share.items()}
    assert "Ranked by fp16 underflow, then overflow" in captions(at)
    # at 1,280 px the last columns are scrolled off: the what-if's underflow at the slider's power sits beside the
    # underflow over all steps, and the tensor column stays in view when the table scrolls sideways
    columns = table.columns.tolist()
    assert columns[:3] == ["tensor", "fp16 underflow (%)", "fp16 underflow at 2^0, step 7"], columns
    assert config["tensor"].get("pinned") is True


def expand(steps_text: str) -> set[int]:
    out = set()
    for part in re.split(r", | and ", steps_text):
        a, _, b = part.partition("–")
        out |= set(range(int(a.replace(",", "")), int((b or a).replace(",", "")) + 1))
    return out


def test_the_heatmap_names_its_blank_columns_from_the_data(store_path, monkeypatch):
    from mpdiag import Store

    stats = Store(store_path, create=False).tensor_stats(1)
    per = {t: set(one.loc[one["zeros"] == one["numel"], "step"]) for t, one in stats.groupby("tensor")}
    # a tensor whose gradient FP16 flushed entirely at some steps, but not at every one (a heatmap is drawn)
    tensor = next(t for t, s in per.items() if s and len(s) < stats["step"].nunique())
    at = page(store_path, monkeypatch, run="1", tensor=tensor)
    line = next(c for c in captions(at).splitlines() if c.startswith("Blank columns"))
    assert f"({len(per[tensor])} of {stats['step'].nunique()} logged steps)" in line
    named = re.search(r"the gradient was all zero at steps? ([0-9,–and ]+)[.;(]", line).group(1).strip()
    assert expand(named) == per[tensor]
    clean = next(t for t, s in per.items() if not s)
    assert not any(c.startswith("Blank columns") for c in captions(page(store_path, monkeypatch, run="1",
                                                                        tensor=clean)).splitlines())


def grid_chart(at):
    return next(c for c in at.get("vega_lite_chart") if "facet" in json.loads(c.proto.spec))


def grid_panels(spec: dict, named: dict) -> tuple[list[str], pd.DataFrame, pd.DataFrame]:
    """The small multiples' spec read as panels: the tensors in panel order (the facet's sort, by tensor), every
    panel's bars (one dataset, the facet splits it) and the rules drawn in each panel (their own dataset)."""
    assert spec["facet"]["field"] == "tensor" and spec["spec"]["layer"][0]["mark"]["type"] == "rect"
    assert spec["spec"]["width"] >= 150 and spec["spec"]["height"] >= 150  # each panel's plot
    return (spec["facet"]["sort"], named[spec["data"]["name"]],
            named[spec["spec"]["layer"][1]["data"]["name"]])


def test_every_tensors_histogram_as_small_multiples_matches_the_store(store_path, monkeypatch):
    from mpdiag import Store

    store = Store(store_path, create=False)
    at = page(store_path, monkeypatch, run="1")
    step = store.logged_steps(1)[-1]  # the default: the latest logged step
    assert step_slider(at, "step").value == step
    element = grid_chart(at)
    assert chart_problems(element.proto) == []  # non-empty, finite, at least 150 px each way
    spec = json.loads(element.proto.spec)
    named = {**{k: pd.DataFrame(v) for k, v in spec.get("datasets", {}).items()}, **datasets(element.proto)}
    titles, every_bar, rules = grid_panels(spec, named)
    order = ranking_table(at)["tensor"].tolist()
    stats = store.tensor_stats(1, step=step).set_index("tensor")
    finite = stats["numel"] - stats["zeros"] - stats["nan"] - stats["posinf"] - stats["neginf"]
    assert titles == [t for t in order if finite[t] > 0]  # worst first; a tensor with nothing to draw is named
    assert set(every_bar["tensor"]) == set(titles)  # no panel beyond those
    index, counts = store.histogram_matrix(1, step=step)
    for name in titles:
        bars = every_bar[every_bar["tensor"] == name]
        assert bars["count"].sum() == finite[name]
        truth = counts[index["tensor"].tolist().index(name)]
        assert dict(zip(bars["log2_lo"].astype(int), bars["count"], strict=True)) == {
            int(b) + EXP_MIN: int(truth[b]) for b in np.flatnonzero(truth)}
    # FP16's limits near the data are rules in every panel (max 65,504 is 30 binades away: named in the caption)
    assert sorted(rules["log2"]) == [-24, -14]
    assert "Dotted rule: fp16 min subnormal 2^-24" in captions(at)
    # each chart says which values its distance is from (the heatmap's tensor over its steps, the grid's tensors
    # at this step): two different numbers for one limit read as a contradiction otherwise
    largest = every_bar["log2_lo"].max() + 1  # bin e holds 2^e to 2^(e+1)
    assert (f"fp16 max 65,504 is {math.log2(65504) - largest:,.0f} binades above the largest value of these tensors "
            f"at step {step:,}") in captions(at)
    assert f"binades above the largest value of {order[0]} at any logged step" in captions(at)
    empty = [t for t in order if finite[t] == 0]
    if empty:
        assert "Nothing to draw for" in captions(at)


def test_the_small_multiples_say_so_when_no_tensor_has_a_value(monkeypatch, tmp_path):
    path = tmp_path / "runs.db"
    subprocess.run([sys.executable, "-m", "mpdiag", "run", str(EXAMPLES / "gallery_underflow.py"), "--device", "cpu",
                    "--store", str(path), "--opt-level", "O1", "--loss-scale", repr(2.0**-83), "--steps", "2"],
                   check=True, cwd=ROOT, capture_output=True)
    at = page(path, monkeypatch, run="1")
    assert not any("facet" in json.loads(c.proto.spec) for c in at.get("vega_lite_chart"))
    assert "Nothing to draw for 4" in captions(at)  # every recorded gradient was zero: a sentence, no chart


def cast_histogram(values: torch.Tensor) -> np.ndarray:
    """Exponent histogram of the finite non-zero values (bin e: 2^e <= |x| < 2^(e+1)), from torch's frexp."""
    nonzero = values[(values != 0) & values.isfinite()].double().abs()
    exponent = torch.frexp(nonzero).exponent - 1
    return np.bincount((exponent - EXP_MIN).numpy(), minlength=N_EXP_BINS).astype(np.int64)


def test_the_histogram_grid_chart_draws_every_tensor_worst_first():
    g = torch.Generator().manual_seed(0)
    values = {f"layer{i}.weight": (torch.exp2(torch.randn(4000, generator=g) * 4 - 6 - 2 * i)).float()
              for i in range(15)}
    values["dead.bias"] = torch.zeros(10)
    index = pd.DataFrame({"step": 0, "tensor": list(values)})
    counts = np.stack([cast_histogram(v) for v in values.values()])
    order = list(reversed(values))  # the page's ranking, worst first
    bars, drawn, empty = summaries.histogram_grid(index, counts, order, "fp16", 0.0, limit=12)
    assert drawn == [t for t in order[:12] if t != "dead.bias"] and empty == ["dead.bias"]
    every, all_drawn, _ = summaries.histogram_grid(index, counts, order, "fp16", 0.0)
    assert len(all_drawn) == 15
    # the FP16 regions the bars are coloured by, against casting each bin's lower edge to FP16
    for row in every.itertuples():
        edge = torch.tensor(2.0**row.log2_lo, dtype=torch.float64)
        top = torch.tensor(2.0**row.log2_hi * (1 - 2**-20), dtype=torch.float64)
        low, high = edge.half().double(), top.half().double()
        if high == 0:
            assert row.region == "underflow"
        elif torch.isinf(low):
            assert row.region == "overflow"
        elif high < 2.0**FP16.min_normal_exponent and low > 0:
            assert row.region == "subnormal"
    per = every.groupby("tensor")["count"].sum()
    assert all(per[t] == int((values[t] != 0).sum()) for t in all_drawn)
    assert every.groupby("tensor")["share"].sum().to_numpy() == pytest.approx(1.0)
    lines = summaries.format_lines(("fp16",))
    chart = charts.histogram_grid(bars, drawn, lines, (-40.0, 17.0), "t")
    spec = chart.to_dict()
    titles, every_bar, rules = grid_panels(spec, {k: pd.DataFrame(v) for k, v in spec["datasets"].items()})
    assert titles == drawn
    assert spec["columns"] == charts.GRID_COLUMNS
    assert sorted(rules["log2"]) == pytest.approx([-24, -14, np.log2(65504)])  # FP16's range marked
    for name in drawn:
        data = every_bar[every_bar["tensor"] == name]
        assert len(data) and np.isfinite(data[["log2_lo", "log2_hi", "share", "count"]].to_numpy(float)).all()

    class Proto:  # what AppTest hands the chart check: the spec with its datasets inline
        spec = json.dumps(chart.to_dict())
        datasets = []

    assert chart_problems(Proto) == []


def test_blank_steps_name_skipped_steps_and_a_zero_loss_scale():
    counts = np.zeros((4, N_EXP_BINS), dtype=np.int64)
    counts[0, 100] = counts[3, 100] = 5
    index = pd.DataFrame({"step": [0, 1, 2, 3], "tensor": "w"})
    steps = pd.DataFrame({"step": [0, 1, 2, 3], "loss_scale": [1.0, 1.0, 1.0, 0.0], "skipped": [0, 1, 1, 0]})
    stats = pd.DataFrame({"step": [0, 1, 2, 3], "numel": 5, "zeros": [0, 5, 0, 0], "nan": [0, 0, 5, 0],
                          "posinf": 0, "neginf": 0})
    blank = summaries.blank_steps(index, counts, steps, stats)
    assert blank["step"].tolist() == [1, 2] and blank["reason"].tolist() == ["all zero", "all NaN or inf"]
    text = summaries.blank_steps_text(blank, 4)
    assert "the gradient was all zero at step 1 (all skipped steps" in text and "NaN or inf at step 2" in text
    scaled = summaries.blank_steps(index, counts, steps, stats, at_scale=True)
    assert scaled["step"].tolist() == [1, 2, 3] and scaled["reason"].iloc[-1] == "loss scale 0"
    assert summaries.blank_steps_text(blank.iloc[0:0], 4) == ""


def test_the_view_model_holds_the_twins_totals_and_what_the_page_shows_of_them(store_path):
    """gradients_model without Streamlit's script runner: run 1's twin (run 2) is found in the runs table read once,
    its totals are the store's, and the ranking, the flushed share at a step and the table say what they imply."""
    from mpdiag import Store
    from mpdiag.dashboard import gradients_model

    store = Store(store_path, create=False)
    runs = store.runs()
    run = runs[runs["run_id"] == 1].iloc[0]
    model = gradients_model.gradients(store, run, True, runs)
    assert int(model.twin["run_id"]) == 2
    pd.testing.assert_frame_equal(model.twin_totals, store.tensor_totals(2))
    totals, twin = store.tensor_totals(1).set_index("tensor"), store.tensor_totals(2).set_index("tensor")
    flushed = (totals["zeros"] / totals["numel"] - twin.loc[totals.index, "zeros"] / twin.loc[totals.index, "numel"]
               ).clip(lower=0)
    ranking = model.ranking("fp16", at_scale=False)
    assert ranking.states_flushed and ranking.tensors == flushed.sort_values(ascending=False, kind="stable").index.tolist()
    tensor, step = ranking.tensors[0], model.logged[-1]
    shown = model.tensor(ranking, tensor, show_bf16=False)
    assert f"{flushed[tensor]:.2%} of all values flushed to zero before recording" in shown.summary
    at = model.at_step(ranking, shown, step)
    mine = store.tensor_stats(1, tensor, step=step).iloc[0]
    theirs = store.tensor_stats(2, tensor, step=step).iloc[0]
    assert at.flushed == pytest.approx(max(0.0, (mine["zeros"] - theirs["zeros"]) / mine["numel"]))
    assert at.flushed_said.startswith(f"At step {step}: {at.flushed:.2%} of all values")
    table, columns = model.table(ranking, at, k=0)
    assert table.columns.tolist() == list(columns)
    assert table["flushed vs FP32 twin (%)"].tolist() == [f"{flushed[t]:.2%}" for t in table["tensor"]]
    assert table.columns[2:4].tolist() == ["fp16 underflow (%)", f"fp16 underflow at 2^0, step {step:,}"]


def test_without_a_twin_the_view_model_states_none_and_the_table_has_no_flushed_column(store_path):
    from mpdiag import Store
    from mpdiag.dashboard import gradients_model

    store = Store(store_path, create=False)
    runs = store.runs()
    model = gradients_model.gradients(store, runs[runs["run_id"] == 3].iloc[0], True, runs)
    assert model.twin is None and model.twin_totals is None
    ranking = model.ranking("fp16", at_scale=False)
    at = model.at_step(ranking, model.tensor(ranking, ranking.tensors[0], show_bf16=False), model.logged[-1])
    assert at.flushed is None and "cannot be known from this run" in at.flushed_said
    table, _ = model.table(ranking, at, k=0)
    assert "flushed vs FP32 twin (%)" not in table.columns


@pytest.mark.parametrize("script", ["1_Gradients.py", "2_Loss_scale.py", "5_Findings.py", "6_FP8.py", "7_Modules.py"])
@pytest.mark.parametrize("run_id", ["1", "3"])
def test_one_render_reads_the_runs_table_once(store_path, monkeypatch, run_id, script):
    """A single-run page's run picker reads the runs table; the FP32 twin's row (run 1's twin, run 2), the
    findings, the reruns and a fix's FP32 reference are found in it, not read again (Store.run reads the whole
    table too, so it is counted through Store.runs)."""
    from mpdiag import Store

    reads = []
    whole_table = Store.runs
    monkeypatch.setattr(Store, "runs", lambda self: reads.append(1) or whole_table(self))
    monkeypatch.setenv("MPDIAG_STORE", str(store_path))
    at = AppTest.from_file(str(ROOT / "pages" / script), default_timeout=TIMEOUT)
    at.query_params["run"] = run_id
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(reads) == 1


def test_the_findings_view_model_offers_the_fix_judged_against_the_twin(store_path):
    """findings_model without Streamlit: run 1 (O1, static scale 1) has a finding whose fix reruns it; its FP32
    twin already exists, so the rerun asks for no second twin, and its evidence link names the run."""
    from mpdiag import Store
    from mpdiag.analysis.findings import diagnose
    from mpdiag.dashboard import findings_model

    store = Store(store_path, create=False)
    runs = store.runs()
    model = findings_model.findings(store, runs[runs["run_id"] == 1].iloc[0], True, runs)
    assert [f.rule for f in model.findings] == [f.rule for f in diagnose(store, 1)]
    fixes = [card for card in model.cards if card.options is not None]
    assert fixes and all(card.options["pair"] is False and card.described for card in fixes)
    assert all("run=1" in card.link or card.link.startswith("#") for card in model.cards)
    assert model.outcomes.empty  # never rerun


def test_compare_finds_the_twin_in_the_runs_table_for_the_flushed_share(store_path):
    """compare_model's FP16 shares of run 1 (paired) and run 3 (no twin): run 1's flushed part is estimated
    against the twin found in the runs table; run 3 is named as having none."""
    from mpdiag import Store
    from mpdiag.analysis.compare import FLUSHED_PART
    from mpdiag.dashboard import compare_model

    store = Store(store_path, create=False)
    runs = store.runs()
    model = compare_model.compare(store, runs.set_index("run_id").loc[[1, 3]].reset_index(), runs, weight=0.0)
    shares = model.fp16_shares()
    assert [lab for lab, _ in shares.no_twin] == [model.labels[1]] and not shares.no_stats
    assert "record it with --pair" in shares.no_twin[0][1]
    flushed = shares.under[shares.under["part"] == FLUSHED_PART]
    assert set(flushed["run"]) == {model.labels[0]} and flushed["share"].max() > 0.05


def test_compare_says_which_runs_are_drawn_at_zero(store_path, monkeypatch):
    """Compare's FP16 underflow bars of run 1 (paired: values flushed) and run 3 (no twin; at scale 1 its recorded
    values are FP16 subnormals, none would underflow): run 3's bars are all at 0, which read as a run left out of the
    chart (a helper's gallery review); the page says so, in the run's words, from the counts the chart drew."""
    from mpdiag import Store
    from mpdiag.dashboard import compare_model

    store = Store(store_path, create=False)
    runs = store.runs()
    shares = compare_model.compare(store, runs.set_index("run_id").loc[[1, 3]].reset_index(), runs,
                                   weight=0.0).fp16_shares()
    at_zero = [lab for lab, parts in shares.under.groupby("run") if (parts["share"] == 0).all()]
    assert len(at_zero) == 1 and at_zero[0].startswith("#3")
    monkeypatch.setenv("MPDIAG_STORE", str(store_path))
    at = AppTest.from_file(str(ROOT / "pages" / "3_Compare.py"), default_timeout=TIMEOUT)
    at.query_params["runs"] = ["1", "3"]
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    said = captions(at)
    assert f"{at_zero[0]}: no value of any tensor would underflow FP16 (its bars are at 0)." in said, said
    assert "#1" not in [line.split(":")[0][:2] for line in said.splitlines() if "(its bars are at 0)" in line]


def _long_run(path) -> tuple[int, dict]:
    """A 6,000-step run of one tensor written through the writer: every step kept, a blank step (no finite
    non-zero value: all zero) at 2,500, the loss scale 2^16 halved to 2^15 at step 3,000; returns its id and the
    exact histograms by step (the ground truth here: what was written)."""
    from mpdiag.numerics.formats import LOW_PRECISION
    from mpdiag.store import StepRow, StoreWriter, TensorBatch

    rng, steps, exact = np.random.default_rng(0), 6_000, {}
    with StoreWriter(path, finish_runs=True) as writer:
        run_id = writer.create_run(name="long", opt_level="O1", scaling="dynamic", steps=steps, every=1)
        writer.add_tensors(run_id, [(0, "w", [64], 64, "float32", "float32")])
        for start in range(0, steps, 500):
            block = np.arange(start, start + 500)
            hist = np.zeros((500, N_EXP_BINS), dtype=np.int64)
            hist[:, 100:180] = rng.integers(0, 8, (500, 80))  # 80 bins: the heatmap draws 250 columns
            hist[block == 2_500] = 0
            specials = np.zeros((500, 4), dtype=np.int64)
            specials[block == 2_500, 0] = 64
            exact.update(zip(block.tolist(), hist, strict=True))
            formats = len(LOW_PRECISION)
            batch = TensorBatch(block, np.zeros(500, dtype=np.int64), hist, specials, np.ones(500), np.ones(500),
                                np.ones(500), np.zeros((500, formats, 6), dtype=np.int64), np.ones((500, formats), bool))
            writer.write_batch(run_id, [StepRow(int(s), 1.0, 2.0**16 if s < 3_000 else 2.0**15, 0, 0, 1.0, 0.1, 10, 1)
                                        for s in block], batch, kept=[(int(s), "every") for s in block])
    return run_id, exact


def test_a_long_runs_heatmap_reads_bucket_sums_that_are_exact_and_says_what_each_column_sums(tmp_path):
    """6,000 kept steps, more than the heatmap's width: its columns are the writer's bucket sums, each an exact sum
    of whole kept steps (every count there), in the S·g view each of one loss scale (moved by its own log2), the
    blank step its own column and named; the tooltip's words say the steps a column spans and how many it kept."""
    from mpdiag import Store
    from mpdiag.dashboard import gradients_model

    path = tmp_path / "long.db"
    run_id, exact = _long_run(path)
    store = Store(path)
    runs = store.runs()
    model = gradients_model.gradients(store, runs.iloc[0], True, runs)
    for at_scale in (False, True):
        shown = model.tensor(model.ranking("fp16", at_scale), "w", show_bf16=False)
        cells = shown.cells
        assert len(shown.index) < 4_000 and cells["count"].sum() == sum(h.sum() for h in exact.values())
        for (start, end, kept, said), group in cells.groupby(["step_start", "step_end", "steps_kept", "steps"]):
            covered = [s for s in range(start, end) if s in exact]
            assert kept == len(covered)
            assert said == (f"step {start:,}" if kept == 1 else
                            f"steps {start:,}–{end - 1:,}, {kept:,} steps kept (counts summed)")
            shift = (16 if start < 3_000 else 15) if at_scale else 0
            assert not (start < 3_000 < end) if at_scale else True  # one loss scale per column
            summed = sum(exact[s] for s in covered)
            assert dict(zip(group["log2_lo"] - shift - EXP_MIN, group["count"], strict=True)) == {
                b: summed[b] for b in np.flatnonzero(summed)}
        assert "the gradient was all zero at step 2,500" in shown.blank
    spec = charts.exponent_heatmap(cells.head(50), summaries.format_lines(), (0, 6_000)).to_dict()
    tooltips = [t.get("title") for t in spec["layer"][0]["encoding"]["tooltip"]]
    assert tooltips[0] == "column" and spec["layer"][0]["encoding"]["tooltip"][0]["field"] == "steps"


def test_the_format_opens_on_the_one_the_run_computes_in(store_path, monkeypatch):
    """A BF16 run's page opened on FP16's limits and shares (the first format): it opens on the run's own; an FP16
    run's and an FP32 run's on FP16, and the radio shows it."""
    from mpdiag import Store
    from mpdiag.dashboard import gradients_model

    store = Store(store_path, create=False)
    runs = store.runs()
    run = runs[runs["run_id"] == 1].iloc[0]

    def at_level(level: str) -> pd.Series:
        relabelled = run.copy()
        relabelled["opt_level"] = level
        return relabelled

    by_level = {level: gradients_model.gradients(store, at_level(level), True, runs).default_format
                for level in ("O1", "O0", "bf16", "bf16-pure", "fp8-sim", "custom")}
    assert by_level == {"O1": "fp16", "O0": "fp16", "bf16": "bf16", "bf16-pure": "bf16", "fp8-sim": "bf16",
                        "custom": "fp16"}
    assert page(store_path, monkeypatch, run="1").radio(key="fmt").value == "fp16"


def test_the_step_tiles_show_the_view_the_histogram_shows(tmp_path, monkeypatch):
    """A dynamic-scale FP16 run (S = 2^16): under the default view the histogram showed g coloured by FP16 region
    (most of it underflow) above tiles of S·g saying 0% underflow. The tiles now count the view shown, each equal
    to the stored torch-cast count of that view (g's, or S·g's) over the finite non-zero values, and the other
    view's shares are said beneath; the histogram's title names its view."""
    from mpdiag import Store

    store_path = tmp_path / "runs.db"
    subprocess.run([sys.executable, "-m", "mpdiag", "run", str(EXAMPLES / "gallery_underflow.py"), "--device", "cpu",
                    "--store", str(store_path), "--opt-level", "O1", "--steps", "2"], check=True, cwd=ROOT,
                   capture_output=True)
    for view, suffix, named in (("unscaled g", "", "g, unscaled"),
                                ("at the loss scale (S·g)", "_at_scale", "S·g at this step's loss scale")):
        at = page(store_path, monkeypatch, run="1", view=view)
        tensor, step = at.selectbox(key="tensor").value, at.session_state["step"]
        row = Store(store_path, create=False).tensor_stats(1, tensor=tensor, step=step).iloc[0]
        finite_nonzero = row["numel"] - row["zeros"] - row["nan"] - row["posinf"] - row["neginf"]
        tiles = {m.label: m.value for m in at.metric}
        for kind in ("underflow", "subnormal", "overflow"):
            share = row[f"fp16_{kind}{suffix}"] / finite_nonzero
            assert tiles[f"fp16 {kind}"] == summaries.share_text((share, share, True)), view
        assert f"At step {step}: {named}" in "\n".join(m.value for m in at.markdown), view
        histogram = next(c for c in at.get("vega_lite_chart") if "coloured by fp16 region" in c.proto.spec)
        assert named in json.loads(histogram.proto.spec)["title"], view


def test_the_zeros_and_low_values_ranking_puts_a_subnormal_tensor_before_one_with_a_few_zeros():
    """The first user's run, in numbers: body.4.weight had 0.04 % zeros and no low value, body.2.weight 9.63 %
    subnormal and no zero. Ranked by zeros alone the page opened on body.4.weight."""
    from mpdiag.analysis.summaries import gradient_ranking

    n = 10_000
    totals = pd.DataFrame({"tensor": ["body.4.weight", "body.2.weight"], "numel": [n, n], "numel_per_step": [64, 64],
                           "zeros": [4, 0], "nan": [0, 0], "posinf": [0, 0], "neginf": [0, 0],
                           "fp16_underflow_at_scale": [0, 0], "fp16_subnormal_at_scale": [0, 963],
                           "fp16_overflow_at_scale": [0, 0]})
    ranking, _ = gradient_ranking(totals, "fp16", True, True, None)
    assert ranking["tensor"].tolist() == ["body.2.weight", "body.4.weight"]



def test_a_twin_whose_loss_parted_gives_no_flushed_share_past_the_parting(tmp_path, monkeypatch):
    """The flushed share is the run's zeros beyond its FP32 twin's; once their losses part (by more than 5 %), their
    weights differ and so do their zeros for reasons FP16 has nothing to do with (a user's watched run read 3 %
    "flushed" against an O0 run it had parted from at step 3, where FP32 gradients at its own weights lost 0.001 %).
    The README's example at static scale 1 parts from its twin at step 22: the page, the Compare bars and the
    finding say so and estimate nothing for the run; a step before the parting keeps its estimate from the twin's
    row there."""
    from mpdiag.analysis.compare import first_divergence, loss_comparison
    from mpdiag.analysis.findings import diagnose
    from mpdiag.dashboard import compare_model, gradients_model
    from mpdiag.store import Store

    store_path = tmp_path / "runs.db"
    record(store_path, "--steps", "30", "--pair")
    store = Store(store_path)
    runs = store.runs()
    mixed = runs[runs["opt_level"] == "O1"].iloc[0]
    twin = runs[runs["opt_level"] == "O0"].iloc[0]
    # where they part, read from the two runs' stored losses (the losses themselves: tests of the loss rows)
    losses = loss_comparison(store.steps(int(twin["run_id"])), store.steps(int(mixed["run_id"])))
    rel = (losses["loss"] - losses["loss_ref"]).abs() / losses["loss_ref"].abs()
    parted = int(losses.loc[rel > 0.05, "step"].iloc[0])
    assert parted == first_divergence(losses) and 0 < parted < 29
    model = gradients_model.gradients(store, mixed, True, runs)
    assert model.twin_parted_at == parted and model.twin_totals is None
    ranking = model.ranking("fp16", True)
    tensor = ranking.rows["tensor"].iloc[0]
    assert ranking.rows["flushed_share"].isna().all()
    shown = model.tensor(ranking, tensor, False)
    assert f"not estimated: the FP32 twin's loss parts from this run's at step {parted}" in shown.summary
    before, after = model.at_step(ranking, shown, parted - 1), model.at_step(ranking, shown, parted)
    assert before.flushed is not None and after.flushed is None and "parts from this run's" in after.flushed_said
    underflow = next(f for f in diagnose(store, int(mixed["run_id"])) if f.rule == "gradient-underflow")
    assert f"parts from this run's at step {parted}" in underflow.evidence and "estimated against" not in underflow.evidence
    label_runs = runs.set_index("run_id").loc[[int(mixed["run_id"])]].reset_index()
    shares = compare_model.compare(store, label_runs, runs, weight=0.0).fp16_shares()
    assert len(shares.no_twin) == 1 and f"at step {parted}" in shares.no_twin[0][1]
    page(store_path, monkeypatch, run=str(int(mixed["run_id"])))  # the page itself renders it
