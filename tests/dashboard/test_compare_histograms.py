"""Compare's overlaid gradient histograms (issue 27): two tiny seeded loops recorded with the Recorder, FP32 and
FP16 autocast with a GradScaler, whose real ``.grad`` tensors are kept here; the shares drawn for a tensor at a step
(and summed over the logged steps) must be the exponent histogram of those tensors, computed here with
torch.frexp, count for count; under AppTest the chart's data must be the same numbers, the zero shares beside it the
zeros of those tensors, and a run without the tensor named."""

import json
import math

import pandas as pd
import pyarrow as pa
import pytest
import torch
from app_helpers import step_slider
from chart_check import page_chart_problems
from conftest import ROOT
from streamlit.testing.v1 import AppTest

from mpdiag import Recorder, Store
from mpdiag.analysis.compare import (
    NO_SCALE,
    NO_STEP,
    NO_TENSOR,
    histogram_steps,
    histogram_tensors,
    overlaid_histograms,
)

TIMEOUT = 60
STEPS = 6
SCALE_LOG2 = 4  # the FP16 run's constant loss scale, 2^4: the recorded unscaled g is .grad / 16
DOWN_WEIGHT = 2.0**-18  # small enough gradients that FP16's backward pass flushes some of them to zero


def _loop(path, name: str, fp16: bool, every: int, other_model: bool = False) -> tuple[int, dict]:
    """A seeded loop; returns (run id, {step: {tensor name: the unscaled gradient as the Recorder saw it}})."""
    torch.manual_seed(0)
    first = torch.nn.Tanh() if other_model else torch.nn.Linear(8, 8)  # other_model: no tensor "0.weight"
    model = torch.nn.Sequential(first, torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**SCALE_LOG2, growth_interval=10_000) if fp16 else None)
    recorder = Recorder(model, store=path, name=name, scaler=scaler, optimizer=optimizer, every=every)
    generator = torch.Generator().manual_seed(1)
    grads = {}
    for step in range(STEPS):
        x, y = torch.randn(64, 8, generator=generator), torch.randn(64, 4, generator=generator)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y) * DOWN_WEIGHT
        (scaler.scale(loss) if fp16 else loss).backward()
        if step % every == 0:
            scale = scaler.get_scale() if fp16 else 1.0
            assert scale == 2.0**SCALE_LOG2 or not fp16
            grads[step] = {n: p.grad.detach().double() / scale for n, p in model.named_parameters()}
        recorder.record(loss)
        if fp16:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    recorder.close()
    return recorder.run_id, grads


def exponent_counts(tensors) -> dict[int, int]:
    """{e: how many finite non-zero values have 2^e <= |g| < 2^(e+1)} over ``tensors``, by torch.frexp
    (|g| = m 2^k with 0.5 <= m < 1, so e = k - 1)."""
    counts: dict[int, int] = {}
    for g in tensors:
        g = g.flatten()
        g = g[torch.isfinite(g) & (g != 0)]
        exponents, n = torch.unique(torch.frexp(g).exponent - 1, return_counts=True)
        for e, c in zip(exponents.tolist(), n.tolist(), strict=True):
            counts[e] = counts.get(e, 0) + c
    return counts


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Run 1: FP16 autocast at scale 2^4, logged every 2nd step; run 2: FP32, the same model and batches, every
    step; run 3: FP32 of a model without the tensor "0.weight"."""
    path = tmp_path_factory.mktemp("hists") / "runs.db"
    fp16_id, fp16 = _loop(path, "fp16 *loop*", fp16=True, every=2)
    fp32_id, fp32 = _loop(path, "fp32 loop", fp16=False, every=1)
    other_id, _ = _loop(path, "other model", fp16=False, every=1, other_model=True)
    assert (fp16_id, fp32_id, other_id) == (1, 2, 3)
    assert Store(path).logged_steps(1) == [0, 2, 4] and Store(path).logged_steps(2) == list(range(STEPS))
    # the FP16 run lost values to zero that the FP32 run kept: its histogram alone would read as healthy
    assert (fp16[4]["1.weight"] == 0).sum() > (fp32[4]["1.weight"] == 0).sum()
    return path, {1: fp16, 2: fp32}


def records(path, runs: dict[str, int], tensor: str, step: int | None):
    store = Store(path)
    return {label: (store.tensor_totals(run_id), None if step is None else store.tensor_stats(run_id, step=step),
                    *store.histogram_matrix(run_id, tensor)) for label, run_id in runs.items()}


def expected_bins(grads: list[torch.Tensor]) -> pd.DataFrame:
    counts = exponent_counts(grads)
    total = sum(counts.values())
    return pd.DataFrame({"log2": list(counts), "count": list(counts.values()),
                         "share": [c / total for c in counts.values()]}).sort_values("log2").reset_index(drop=True)


def drawn_bins(bins: pd.DataFrame, run: str) -> pd.DataFrame:
    mine = bins[bins["run"].str.startswith(run)]
    return mine[mine["count"] > 0][["log2", "count", "share"]].astype({"log2": int, "count": int}).reset_index(drop=True)


@pytest.mark.parametrize("tensor", ["1.weight", "3.weight", "3.bias"])
def test_the_shares_are_the_real_gradients_exponent_histogram_at_a_step_and_summed(recorded, tensor):
    path, grads = recorded
    bins, per_run = overlaid_histograms(records(path, {"a": 1, "b": 2}, tensor, 4), tensor, 4)
    for run, run_id in (("a", 1), ("b", 2)):
        pd.testing.assert_frame_equal(drawn_bins(bins, run), expected_bins([grads[run_id][4][tensor]]))
        row = per_run.set_index("run").loc[run]
        g = grads[run_id][4][tensor]
        assert row["zeros"] == int((g == 0).sum()) and row["numel"] == g.numel()
        assert row["zero_share"] == int((g == 0).sum()) / g.numel() and row["missing"] is None
    # every run spans the same bins, with an empty bin at each end: each step-line starts and ends at 0
    spans = bins.groupby("run")["log2"].agg(list)
    assert spans["a"] == spans["b"] == list(range(min(spans["a"]), max(spans["a"]) + 1))
    assert (bins.groupby("run")["count"].first() == 0).all() and (bins.groupby("run")["count"].last() == 0).all()

    bins, _ = overlaid_histograms(records(path, {"a": 1, "b": 2}, tensor, None), tensor, None)
    for run, run_id in (("a", 1), ("b", 2)):  # summed over each run's own logged steps: 3 against 6
        pd.testing.assert_frame_equal(drawn_bins(bins, run), expected_bins([g[tensor] for g in grads[run_id].values()]))


def test_a_run_without_the_tensor_or_the_step_has_no_line_and_says_why(recorded):
    path, grads = recorded
    bins, per_run = overlaid_histograms(records(path, {"fp16": 1, "fp32": 2, "other": 3}, "0.weight", 5),
                                        "0.weight", 5)
    assert per_run.set_index("run")["missing"].to_dict() == {"fp16": NO_STEP, "fp32": None, "other": NO_TENSOR}
    assert set(bins["run"]) == {"fp32"}
    pd.testing.assert_frame_equal(drawn_bins(bins, "fp32"), expected_bins([grads[2][5]["0.weight"]]))


def test_the_tensor_offered_first_is_the_first_runs_worst_fp16_underflow_and_the_step_the_last_common(recorded):
    path, grads = recorded
    store = Store(path)
    names = histogram_tensors([store.tensor_totals(1), store.tensor_totals(3)])
    # worst by FP16 underflow of the unscaled g, counted here: |g| below half of 2^-24 rounds to zero in FP16
    def underflow(tensor):
        g = torch.cat([s[tensor].flatten() for s in grads[1].values()])
        nonzero = g[torch.isfinite(g) & (g != 0)]
        return float((nonzero.abs() <= 2.0**-25).sum()) / nonzero.numel()
    own = list(grads[1][0])
    assert names[0] == max(own, key=underflow) and set(names) == set(own)
    assert histogram_steps([store.logged_steps(1), store.logged_steps(2)]) == ([0, 1, 2, 3, 4, 5], 4)
    assert histogram_steps([[], []]) == ([], None)


def page(path, monkeypatch, runs):
    monkeypatch.setenv("MPDIAG_STORE", str(path))
    at = AppTest.from_file(str(ROOT / "pages" / "3_Compare.py"), default_timeout=TIMEOUT)
    at.query_params["runs"] = [str(r) for r in runs]
    return at.run()


def histogram_chart(at):
    charts = [c for c in at.get("vega_lite_chart") if any(
        what in json.dumps(json.loads(c.proto.spec).get("title"), ensure_ascii=False)
        for what in ("unscaled gradient g", "S·g at each run's loss scale"))]
    assert len(charts) == 1
    return charts[0]


def chart_bins(chart) -> pd.DataFrame:
    frames = [pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in chart.proto.datasets]
    return next(f for f in frames if "share" in f and "run" in f)


def said(at) -> str:
    return "\n".join(c.value for c in at.caption).replace("\\", "")  # plain()'s escapes


def test_the_page_draws_the_stored_histograms_and_the_zero_shares(recorded, monkeypatch):
    path, grads = recorded
    at = page(path, monkeypatch, [1, 2])
    assert not at.exception, [e.value for e in at.exception]
    assert not page_chart_problems(at)
    tensor = at.selectbox(key="hist_tensor").value
    assert tensor == histogram_tensors([Store(path).tensor_totals(1)])[0]
    assert step_slider(at, "hist_step").value == 4  # the last step both logged
    # run 1 ran at 2^4: the page opens on S·g, what its FP16 backward held (its .grad), the FP32 run's g beside it
    assert at.radio(key="hist_view").value == "at the loss scale (S·g)"
    bins = chart_bins(histogram_chart(at))
    pd.testing.assert_frame_equal(drawn_bins(bins, "#1 "), expected_bins([grads[1][4][tensor] * 2.0**SCALE_LOG2]))
    pd.testing.assert_frame_equal(drawn_bins(bins, "#2 "), expected_bins([grads[2][4][tensor]]))
    assert "S·g: each run's recorded g at step 4 multiplied by the loss scale it ran at there" in said(at)
    at.toggle(key="hist_summed").set_value(True).run()  # each logged step at its own scale (2^4 at every one)
    bins = chart_bins(histogram_chart(at))
    pd.testing.assert_frame_equal(drawn_bins(bins, "#1 "), expected_bins([g[tensor] * 2.0**SCALE_LOG2
                                                                         for g in grads[1].values()]))
    pd.testing.assert_frame_equal(drawn_bins(bins, "#2 "), expected_bins([g[tensor] for g in grads[2].values()]))
    at.toggle(key="hist_summed").set_value(False).run()
    at.radio(key="hist_view").set_value("unscaled g").run()
    spec = json.loads(histogram_chart(at).proto.spec)
    rules = [layer for layer in spec["layer"] if layer.get("mark", {}).get("type") == "rule"]
    assert len(rules) == 1 and rules[0]["encoding"]["x"]["field"] == "log2"  # vertical: log2 |g| is on x
    frames = [pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in histogram_chart(at).proto.datasets]
    limits = next(f for f in frames if "limit" in f)  # FP16's 2^-24, 2^-14 and 65504, named
    assert sorted(limits["log2"]) == [-24, -14, math.log2(65504)]
    assert all(name.startswith("fp16 ") for name in limits["limit"])
    bins = chart_bins(histogram_chart(at))
    for run_id in (1, 2):
        pd.testing.assert_frame_equal(drawn_bins(bins, f"#{run_id} "), expected_bins([grads[run_id][4][tensor]]))
    table = next(d.value for d in at.dataframe if "zeros" in d.value and "NaN / inf" in d.value)
    for run_id, row in zip((1, 2), table.itertuples(index=False), strict=True):
        g = grads[run_id][4][tensor]
        assert row[0].startswith(f"#{run_id} ") and row[1] == g.numel()
        assert row[3] == int((g == 0).sum()) / g.numel()
    assert table["zeros"].iloc[0] > table["zeros"].iloc[1]  # the FP16 run's flushed values, in sight
    element = next(d for d in at.dataframe if "zeros" in d.value and "NaN / inf" in d.value)
    # five columns leave the run column room for a rerun's label, whose end tells it from its parent (it was cut)
    assert json.loads(element.proto.columns)["run"]["width"] == "large"

    at.toggle(key="hist_summed").set_value(True).run()
    assert not at.exception and not page_chart_problems(at)
    bins = chart_bins(histogram_chart(at))
    for run_id in (1, 2):
        pd.testing.assert_frame_equal(drawn_bins(bins, f"#{run_id} "),
                                      expected_bins([g[tensor] for g in grads[run_id].values()]))


def test_the_page_names_the_run_without_the_tensor_and_the_one_without_the_step(recorded, monkeypatch):
    path, _ = recorded
    at = page(path, monkeypatch, [1, 2, 3])
    assert not at.exception, [e.value for e in at.exception]
    at.selectbox(key="hist_tensor").set_value("0.weight").run()
    step_slider(at, "hist_step").set_value(5).run()
    assert not at.exception and not page_chart_problems(at)
    text = said(at)
    assert "No line: these runs did not record the tensor 0.weight: #3 · other model · custom." in text
    assert "No line: these runs did not log step 5: #1 · fp16 *loop* · custom." in text
    assert set(chart_bins(histogram_chart(at))["run"]) == {"#2 · fp32 loop · custom"}


def test_s_g_of_a_step_whose_scale_was_never_written_has_no_line_and_says_why(recorded):
    """A run killed before its last step's row was written keeps that step's gradient rows but no loss scale for
    it: its S·g there has no line (it was drawn as g, at scale 1), said so, while its values are still counted; summed
    over steps, the step of unknown scale is left out and the others are each at their own."""
    path, grads = recorded
    at_step = records(path, {"fp16": 1}, "1.weight", 4)
    bins, per_run = overlaid_histograms(at_step, "1.weight", 4, {"fp16": [2.0**SCALE_LOG2] * 2 + [math.nan]})
    assert bins.empty and per_run["missing"].tolist() == [NO_SCALE]
    assert per_run["numel"].iloc[0] == grads[1][4]["1.weight"].numel()
    summed = records(path, {"fp16": 1}, "1.weight", None)
    bins, per_run = overlaid_histograms(summed, "1.weight", None, {"fp16": [2.0**SCALE_LOG2] * 2 + [math.nan]})
    pd.testing.assert_frame_equal(drawn_bins(bins, "fp16"), expected_bins([grads[1][s]["1.weight"] * 2.0**SCALE_LOG2
                                                                           for s in (0, 2)]))


def test_s_g_at_a_scale_not_a_power_of_two_has_its_bins_edges_at_s_times_2_to_the_e(recorded):
    """S·g's histogram from the stored rows of g: at 2^4 every value moves exactly 4 bins; at 3 the bins' edges are
    3·2^e (the line at e + log2 3), each bin holding exactly the values of 3·g between its edges; a step at scale 0
    holds no finite non-zero S·g; steps at scales not a power of two apart are summed on the nearest powers, said."""
    path, grads = recorded
    store = Store(path)
    index, counts = store.histogram_matrix(1, "1.weight")
    steps = index["step"].tolist()  # 0, 2, 4
    assert steps == [0, 2, 4]
    records = {"fp16": (store.tensor_totals(1), None, index, counts)}
    bins, per_run = overlaid_histograms(records, "1.weight", None, {"fp16": [2.0**SCALE_LOG2] * 3})
    pd.testing.assert_frame_equal(drawn_bins(bins, "fp16"), expected_bins([grads[1][s]["1.weight"] * 2.0**SCALE_LOG2
                                                                           for s in steps]))
    assert not bins["rounded"].any()

    bins, per_run = overlaid_histograms(records, "1.weight", None, {"fp16": [3.0, 3.0, 0.0]})
    g = torch.cat([grads[1][s]["1.weight"].flatten() for s in (0, 2)]) * 3.0  # step 4, at scale 0, left out
    g = g[g != 0].abs()
    drawn = bins[bins["count"] > 0]
    assert not drawn["rounded"].any() and int(drawn["count"].sum()) == g.numel() == per_run["finite_nonzero"].iloc[0]
    for log2, count in zip(drawn["log2"], drawn["count"], strict=True):
        assert log2 % 1 == pytest.approx(math.log2(3) - 1)
        assert count == int(((g >= 2.0**log2) & (g < 2.0 ** (log2 + 1))).sum())

    bins, _ = overlaid_histograms(records, "1.weight", None, {"fp16": [3.0, 4.0, 4.0]})
    assert bins["rounded"].all()  # 3 and 4: no shared bins; step 0 moved by 2^2, the power of two nearest 3
    pd.testing.assert_frame_equal(drawn_bins(bins, "fp16"), expected_bins([grads[1][s]["1.weight"] * 4.0
                                                                           for s in steps]))


def test_an_fp16_run_whose_backward_overflowed_has_overflow_bars_its_inf_values(tmp_path):
    """At 2^40 an FP16 backward overflows: the values are inf when recorded, and no finite one is above 65,504, so
    a count of finite values that would overflow read 0 for the run that overflowed. The overflow bars hold its
    inf/NaN share (what the .grad held, counted here with torch) and the counted part apart."""
    from mpdiag.analysis.compare import NONFINITE_PART, OVERFLOW_PART
    from mpdiag.dashboard import compare_model

    path = tmp_path / "runs.db"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    recorder = Recorder(model, store=path, name="overflows", scaler=scaler, optimizer=optimizer)
    nonfinite, numel = {}, {}
    for _ in range(3):
        x, y = torch.randn(64, 8), torch.randn(64, 4)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        for name, p in model.named_parameters():
            nonfinite[name] = nonfinite.get(name, 0) + int((~torch.isfinite(p.grad)).sum())
            numel[name] = numel.get(name, 0) + p.grad.numel()
        recorder.record(loss)
        scaler.step(optimizer)
        scaler.update()
    recorder.close()
    assert sum(nonfinite.values()) > 0
    store = Store(path)
    runs = store.runs()
    over = compare_model.compare(store, runs, runs, weight=0.0).fp16_shares().over
    counted = over[over["part"] == NONFINITE_PART].set_index("tensor")["share"]
    assert {t: counted.get(t, 0.0) for t in nonfinite} == pytest.approx({t: nonfinite[t] / numel[t] for t in nonfinite})
    assert (over.loc[over["part"] == OVERFLOW_PART, "share"] == 0).all()  # inf already: nothing finite above 65,504
