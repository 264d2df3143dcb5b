"""The module view of a --trace-modules run: the first inf/NaN per pass, the magnitude cells and their merged
columns on a planted trace; on a recorded overflow, the finding links to the Modules page on the module it
names, and that page says the same and charts it with the modules' names in the chart's data."""

import json
import math

import numpy as np
import pandas as pd
import pyarrow as pa
from app_helpers import app, texts
from conftest import EXAMPLES

from mpdiag import Store
from mpdiag.analysis import module_trace
from mpdiag.analysis.findings import diagnose, evidence_link
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript

INF, NAN = math.inf, math.nan


def planted_trace() -> pd.DataFrame:
    """Modules a -> b -> c over steps 0..3: b's output passes FP16's max at step 1 (finite: an FP32 module) and
    is inf at step 2, where c inherits a NaN; in the backward pass (order c, b, a) c's gradient is inf at step
    3 and b's at steps 2 and 3 — at step 2 b is the first, being the only one."""
    rows = []
    fwd = {"a": [1.0, 2.0, 4.0, 8.0], "b": [3.0, 7e4, INF, 5.0], "c": [0.5, 0.5, NAN, 0.25]}
    bwd = {"a": [1e-3] * 4, "b": [2e-3, 2e-3, INF, INF], "c": [1e-2, 1e-2, 1e-2, INF]}
    for step in range(4):
        for order, name in enumerate("abc"):
            f, b = fwd[name][step], bwd[name][step]
            rows.append({"step": step, "module": name, "type": "Linear", "fwd_order": order, "fwd_absmax": f,
                         "fwd_finite": int(math.isfinite(f)), "bwd_order": 2 - order, "bwd_absmax": b,
                         "bwd_finite": int(math.isfinite(b))})
    return pd.DataFrame(rows)


def test_first_nonfinite_per_pass_is_the_earliest_step_then_the_pass_order():
    first = module_trace.first_nonfinite_modules(planted_trace())
    assert (first["fwd"]["module"], first["fwd"]["step"]) == ("b", 2)  # c's NaN at step 2 comes after b
    assert (first["bwd"]["module"], first["bwd"]["step"]) == ("b", 2)
    said = module_trace.first_nonfinite(planted_trace())
    assert "output of module 'b' (Linear) at step 2 in the forward pass" in said
    assert module_trace.first_nonfinite(planted_trace().assign(fwd_finite=1, bwd_finite=1)) == ""


def test_magnitude_cells_flag_what_fp16_cannot_hold_and_mark_the_first():
    cells = module_trace.magnitude_cells(planted_trace()).set_index(["pass", "module", "step"])
    fwd = module_trace.PASSES["fwd"]
    assert cells.loc[(fwd, "b", 1), "state"] == "above FP16's max"  # 70000 > 65504, still finite
    assert cells.loc[(fwd, "b", 2), "state"] == "inf/NaN" and cells.loc[(fwd, "c", 2), "state"] == "inf/NaN"
    assert cells.loc[(fwd, "a", 3), "log2_absmax"] == 3.0 and np.isnan(cells.loc[(fwd, "b", 2), "log2_absmax"])
    assert cells["first"].sum() == 2 and cells.loc[(fwd, "b", 2), "first"]
    assert module_trace.module_order(planted_trace()) == ["a", "b", "c"]
    table = module_trace.module_table(planted_trace()).set_index("module")
    assert table.loc["b", "largest |output|"] == "70,000" and table.loc["b", "output first inf/NaN at step"] == "2"
    assert table.loc["a", "gradient first inf/NaN at step"] == "never"


def test_merged_columns_keep_the_worst_of_their_steps():
    cells = module_trace.magnitude_cells(planted_trace())
    merged, width = module_trace.merge_steps(cells, max_columns=2)
    assert width == 2 and sorted(merged["step"].unique()) == [0, 2]
    b = merged[(merged["module"] == "b") & (merged["pass"] == module_trace.PASSES["fwd"])].set_index("step")
    assert b.loc[0, "absmax"] == 7e4 and b.loc[0, "state"] == "above FP16's max"
    assert b.loc[2, "state"] == "inf/NaN" and b.loc[2, "absmax"] == 5.0 and b.loc[2, "first"]
    assert module_trace.merge_steps(cells, max_columns=200) == (cells, 1)


def chart_frames(at) -> list[pd.DataFrame]:
    return [pa.ipc.open_stream(d.data.data).read_all().to_pandas() for c in at.get("vega_lite_chart")
            for d in c.proto.datasets]


def test_the_overflow_finding_opens_the_modules_page_on_the_module_it_names(store_path, monkeypatch):
    script = ModelScript.from_path(EXAMPLES / "gallery_activation_overflow.py")
    run_id = train(script, RunConfig(opt_level="O1", steps=3, device="cpu", trace_modules=True), store_path)
    plain_run = train(script, RunConfig(opt_level="O1", steps=2, device="cpu"), store_path)
    finding = next(f for f in diagnose(Store(store_path), run_id) if f.rule == "scale-collapse")
    assert evidence_link(finding, run_id) == f"/Modules?run={run_id}&module=0"
    at = app("pages/7_Modules.py", store_path, monkeypatch, run=str(run_id), module="0")
    assert not at.exception, [e.value for e in at.exception]
    said = texts(at)
    assert finding.evidence in said  # what Findings says is said where it links
    located = module_trace.first_nonfinite(Store(store_path).module_stats(run_id)).strip()
    assert located and said.count(located) == 1  # said by the finding, not again in the caption
    stats = Store(store_path).module_stats(run_id)
    assert at.selectbox(key="module").value == "0"
    frames = chart_frames(at)
    heat = next(f for f in frames if "pass" in f and "first" in f and f["module"].nunique() == 3)
    first = heat[heat["first"]]
    assert set(first["module"]) == {"0"} and set(first["step"]) == {0}
    assert set(heat["module"]) == set(stats["module"])
    # a Sequential's children are named 0, 1, 2: each row says its type too
    assert set(heat["row"]) == {f"{m} ({t})" for m, t in zip(stats["module"], stats["type"], strict=True)}
    spec = json.loads(at.get("vega_lite_chart")[0].proto.spec)
    assert "first inf/NaN" in json.dumps(spec)
    untraced = app("pages/7_Modules.py", store_path, monkeypatch, run=str(plain_run))
    assert not untraced.exception and f"python -m mpdiag rerun {plain_run} --trace-modules" in texts(untraced)
    # with no run named, the page opens on the traced run, not the newer untraced one
    assert Store(store_path).runs_with("modules") == {run_id}
    unnamed = app("pages/7_Modules.py", store_path, monkeypatch)
    assert not unnamed.exception and unnamed.query_params["run"] == str(run_id)


def test_the_loss_scale_page_says_what_the_findings_linking_to_it_say(store_path, monkeypatch):
    """O3 with Adam: the optimizer-step finding links to Loss scale; that page states its evidence."""
    script = ModelScript.from_path(EXAMPLES / "mlp_digits.py")
    run_id = train(script, RunConfig(opt_level="O3", steps=4, device="cpu"), store_path)
    linked = [f for f in diagnose(Store(store_path), run_id) if f.page == "Loss_scale"]
    assert "optimizer-step-nonfinite" in {f.rule for f in linked}
    at = app("pages/2_Loss_scale.py", store_path, monkeypatch, run=str(run_id))
    assert not at.exception
    for finding in linked:
        assert finding.evidence in texts(at)


def test_the_modules_view_model_offers_the_first_nonfinite_module_and_leaves_said_findings_out(store_path):
    """modules_model without Streamlit: the module offered first is the first to go inf/NaN; the caption names
    where unless the findings at the page's top already said it; an untraced run has an empty trace."""
    from mpdiag.dashboard import modules_model

    script = ModelScript.from_path(EXAMPLES / "gallery_activation_overflow.py")
    run_id = train(script, RunConfig(opt_level="O1", steps=3, device="cpu", trace_modules=True), store_path)
    plain_run = train(script, RunConfig(opt_level="O1", steps=2, device="cpu"), store_path)
    runs = Store(store_path).runs().set_index("run_id", drop=False)
    model = modules_model.modules(Store(store_path), runs.loc[run_id], True)
    stats = Store(store_path).module_stats(run_id)
    assert model.default == "0" and model.order == module_trace.module_order(stats)
    located = module_trace.first_nonfinite(stats).strip()
    assert located in model.said("") and located not in model.said(located)
    assert modules_model.modules(Store(store_path), runs.loc[plain_run], True).modules.empty


def test_a_trace_that_began_after_step_0_says_so():
    """Under watch the Recorder starts at the first optimizer step, so step 0's forward is never traced: the caption
    said "traced over 59 steps" of a 60-step run without saying which; it names the step the trace began at."""
    from mpdiag.dashboard import modules_model

    trace = planted_trace()
    model = modules_model.ModulesRun(trace, ["a", "b", "c"], None, None, "a", {}, None)
    assert "traced over 4 steps. " in model.said("")
    later = modules_model.ModulesRun(trace[trace["step"] > 0], ["a", "b", "c"], None, None, "a", {}, None)
    assert "traced over 3 steps from step 1 (the steps before it ran before the trace began)" in later.said("")
