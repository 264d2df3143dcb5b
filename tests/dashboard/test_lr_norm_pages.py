"""The learning rate and gradient norm on the Loss scale and Compare pages, and Compare's TensorBoard-like controls
(smoothing, log loss axis, step or wall-time x axis), under AppTest: every number drawn is checked against
Store.steps, and the smoothing against a debiased EMA computed here, as TensorBoard computes it."""

import json
import math
import warnings

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from chart_check import page_chart_problems
from conftest import ROOT
from streamlit.testing.v1 import AppTest

from mpdiag import Recorder, Store
from mpdiag.store import StepRow, StoreWriter

TIMEOUT = 60
STEPS = 16


def _loop(path, name, fp16: bool, optimizer_kind: str = "sgd", seed: int = 0) -> int:
    """A seeded loop recorded with --every 2; FP16 autocast + GradScaler from 2**24 (its first steps overflow)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05) if optimizer_kind == "sgd" else None
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=STEPS) if optimizer else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24) if fp16 else None
    recorder = Recorder(model, store=path, name=name, scaler=scaler, optimizer=optimizer, every=2)
    generator = torch.Generator().manual_seed(seed + 1)
    for _ in range(STEPS):
        x, y = torch.randn(32, 6, generator=generator), torch.randn(32, 3, generator=generator)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        (scaler.scale(loss) if fp16 else loss).backward()
        recorder.record(loss)
        if optimizer is None:
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
            continue
        if fp16:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        with warnings.catch_warnings():  # GradScaler skipped step 0
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            scheduler.step()
    recorder.close()
    return recorder.run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Run 1: FP16 with skipped (non-finite norm) steps; 2: FP32, same model and batches; 3: weights updated by
    hand (no optimizer); 4: a run as an older mpdiag wrote it (no lr, norm or wall time)."""
    path = tmp_path_factory.mktemp("lr_norm") / "runs.db"
    ids = [_loop(path, "fp16 <b>loop</b>", fp16=True), _loop(path, "fp32 loop", fp16=False),
           _loop(path, "by hand", fp16=False, optimizer_kind="none")]
    with StoreWriter(path, finish_runs=True) as writer:
        old = writer.create_run(name="older run", opt_level="O0")
        writer.write_batch(old, [StepRow(s, 2.0 - 0.1 * s, 1.0, 0, None, 1.0, 0.01, 100, 0) for s in range(5)], [])
    assert ids == [1, 2, 3] and old == 4
    return path


def page(name, path, monkeypatch, **query):
    monkeypatch.setenv("MPDIAG_STORE", str(path))
    at = AppTest.from_file(str(ROOT / "pages" / name), default_timeout=TIMEOUT)
    for key, value in query.items():
        at.query_params[key] = value
    return at.run()


def frames(chart) -> list[pd.DataFrame]:
    return [pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in chart.proto.datasets]


def views(spec: dict):
    """Every leaf view of a Vega-Lite spec with its title (inherited from the panel)."""
    def walk(node, title):
        title = node.get("title", title)
        if "mark" in node:
            yield node, title if isinstance(title, str) else (title or {}).get("text", "")
        for key in ("layer", "vconcat", "hconcat"):
            for child in node.get(key, []):
                yield from walk(child, title)
    yield from walk(spec, "")


def said(at) -> str:
    return "\n".join([c.value for c in at.caption] + [i.value for i in at.info]).replace("\\", "")  # plain()'s escapes


def stacked(at):
    """The page's chart of stacked panels over one x axis."""
    return next(c for c in at.get("vega_lite_chart") if "vconcat" in json.loads(c.proto.spec))


def tensorboard_ema(values, weight):
    """TensorBoard's resmoothDataset: last = last*w + (1-w)*v over the finite values, divided by 1 - w**n;
    non-finite values pass through."""
    out, last, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last = last * weight + (1 - weight) * v
        n += 1
        out.append(last / (1 - weight**n))
    return out


def test_loss_scale_page_draws_the_stored_lr_and_norm_with_rules_at_non_finite_norms(store, monkeypatch):
    at = page("2_Loss_scale.py", store, monkeypatch, run="1")
    assert not at.exception, [e.value for e in at.exception]
    assert not page_chart_problems(at)
    steps = Store(store).steps(1)
    bad = steps.loc[~np.isfinite(steps["grad_norm"]), "step"].tolist()
    assert bad and len(bad) < STEPS and steps["lr"].notna().all()
    spec = json.loads(stacked(at).proto.spec)
    titles = [t for _, t in views(spec)]
    assert any(t.startswith("learning rate") for t in titles)
    assert any(t.startswith("global gradient norm") and "red rules: inf/NaN" in t for t in titles)
    data = frames(stacked(at))
    lr = next(d for d in data if "lr" in d and d["lr"].notna().all())
    assert dict(zip(lr["step"], lr["lr"], strict=True)) == dict(zip(steps["step"], steps["lr"], strict=True))
    # the norm's line: the finite norms, as stored; its red rules: exactly the steps whose norm was inf/NaN
    norm_view = next(v for v, t in views(spec) if t.startswith("global gradient norm") and v["mark"]["type"] == "line")
    assert norm_view["encoding"]["y"]["scale"]["type"] == "log"
    drawn = pd.concat([d for d in data if "grad_norm" in d])
    finite = drawn[np.isfinite(drawn["grad_norm"])].drop_duplicates("step").set_index("step")["grad_norm"]
    stored = steps.set_index("step")["grad_norm"]
    assert finite.to_dict() == stored[np.isfinite(stored)].to_dict()
    rules = [d for d in data if "value" in d and "grad_norm" in d]
    assert sorted(rules[0]["step"]) == bad
    assert f"inf or NaN at {len(bad):,} of {STEPS:,} steps (first at step {bad[0]:,})" in said(at)


@pytest.mark.parametrize(("run", "sentence"), [
    ("3", "No learning-rate panel: the recording knew no optimizer"),
    ("4", "No learning-rate or gradient-norm panel: this run was recorded before mpdiag kept them"),
])
def test_loss_scale_page_says_why_a_panel_is_missing(store, monkeypatch, run, sentence):
    at = page("2_Loss_scale.py", store, monkeypatch, run=run)
    assert not at.exception, [e.value for e in at.exception]
    assert not page_chart_problems(at)
    assert sentence in said(at)
    titles = [t for _, t in views(json.loads(stacked(at).proto.spec))]
    assert not any(t.startswith("learning rate") for t in titles)
    assert any(t.startswith("global gradient norm") for t in titles) == (run == "3")


def test_a_step_in_the_link_is_marked_on_every_loss_scale_panel(store, monkeypatch):
    """An event's link (/Loss_scale?run=1&step=N) opened the page with nothing at step N: a dashed rule at N in
    every panel, said in a caption; a step the run does not have (or not a number) marks nothing."""
    at = page("2_Loss_scale.py", store, monkeypatch, run="1", step="5")
    assert not at.exception and not page_chart_problems(at)
    assert "The dashed line marks step 5" in said(at)
    spec = json.loads(stacked(at).proto.spec)
    panels = spec["vconcat"]
    rules = [[v for v, _ in views(panel) if v["mark"] == {"type": "rule", "color": "black", "strokeDash": [4, 4]}]
             for panel in panels]
    assert len(panels) >= 3 and all(len(r) == 1 for r in rules)
    assert any(frame.to_dict("records") == [{"step": 5}] for frame in frames(stacked(at)))
    for step in ("99999", "x"):
        unmarked = page("2_Loss_scale.py", store, monkeypatch, run="1", step=step)
        assert not unmarked.exception and "dashed line marks" not in said(unmarked)


def _loss_views(at):
    spec = json.loads(stacked(at).proto.spec)
    return [v for v, t in views(spec) if t.startswith("loss") and not t.startswith("loss scale")
            and v["mark"]["type"] == "line"]


def test_compare_smoothing_is_tensorboards_ema_of_the_stored_loss_and_norm(store, monkeypatch):
    at = page("3_Compare.py", store, monkeypatch, runs=["1", "2"])
    assert not at.exception, [e.value for e in at.exception]
    assert not page_chart_problems(at)
    assert not any("smoothed" in d for d in frames(stacked(at)))  # smoothing 0: raw curves alone
    at.slider(key="smoothing").set_value(0.6).run()
    assert not at.exception, [e.value for e in at.exception]
    assert not page_chart_problems(at)
    data = frames(stacked(at))
    for y in ("loss", "grad_norm"):
        drawn = next(d for d in data if f"{y}_smoothed" in d)
        for run in (1, 2):
            steps = Store(store).steps(run)
            mine = drawn[drawn["run"].str.startswith(f"#{run} ")].set_index("step")
            expected = tensorboard_ema(steps[y].tolist(), 0.6)
            got = mine[f"{y}_smoothed"].reindex(steps["step"]).to_numpy()
            finite = np.isfinite(expected)
            np.testing.assert_allclose(got[finite], np.asarray(expected)[finite], rtol=1e-12)
            raw = mine[y].reindex(steps["step"]).to_numpy()  # the raw curve, drawn faint behind
            np.testing.assert_array_equal(raw[np.isfinite(steps[y])], steps[y][np.isfinite(steps[y])].to_numpy())
    faint = [v for v in _loss_views(at) if v["mark"].get("opacity") == 0.25]
    assert faint and faint[0]["encoding"]["y"]["field"] == "loss"
    assert any(v["encoding"]["y"]["field"] == "loss_smoothed" for v in _loss_views(at))


def test_compare_toggles_change_the_chart(store, monkeypatch):
    at = page("3_Compare.py", store, monkeypatch, runs=["1", "2"])
    assert not at.exception, [e.value for e in at.exception]
    assert "type" not in _loss_views(at)[0]["encoding"]["y"].get("scale", {})
    at.toggle(key="loss_log").set_value(True).run()
    assert not at.exception and not page_chart_problems(at)
    scale = _loss_views(at)[0]["encoding"]["y"]["scale"]
    losses = pd.concat([Store(store).steps(run)["loss"].astype(float) for run in (1, 2)])
    drawn = losses[np.isfinite(losses) & (losses > 0)]
    # log10, whole decades around the losses: none of them on the plot's border
    assert scale["type"] == "log" and scale["nice"] is False
    assert scale["domain"][0] < drawn.min() and drawn.max() < scale["domain"][1]
    assert all(math.log10(d) == round(math.log10(d)) for d in scale["domain"])
    spec = json.loads(stacked(at).proto.spec)
    assert {v["encoding"]["x"]["field"] for v, _ in views(spec)} == {"step"}
    titles = [t for _, t in views(spec)]
    assert any(t.startswith("learning rate") for t in titles) and any(t.startswith("gradient norm") for t in titles)
    at.radio(key="x_axis").set_value("wall time (s)").run()
    assert not at.exception and not page_chart_problems(at)
    spec = json.loads(stacked(at).proto.spec)
    assert {v["encoding"]["x"]["field"] for v, _ in views(spec)} == {"wall_time_s"}
    drawn = next(d for d in frames(stacked(at)) if "lr" in d and "wall_time_s" in d)
    for run in (1, 2):
        steps = Store(store).steps(run)
        mine = drawn[drawn["run"].str.startswith(f"#{run} ")].drop_duplicates("step").set_index("step")
        assert mine["wall_time_s"].to_dict() == steps.set_index("step")["wall_time_s"].to_dict()
        assert mine["lr"].to_dict() == steps.set_index("step")["lr"].to_dict()


def test_compare_names_the_runs_without_lr_norm_or_wall_time(store, monkeypatch):
    at = page("3_Compare.py", store, monkeypatch, runs=["3", "4"])
    assert not at.exception, [e.value for e in at.exception]
    assert not page_chart_problems(at)
    text = said(at)
    assert "No learning rate recorded" in text and "#3" in text.split("No learning rate recorded")[1]
    assert "No gradient norm recorded" in text
    at.radio(key="x_axis").set_value("wall time (s)").run()
    assert not at.exception and not page_chart_problems(at)
    assert "Not on the wall-time axis" in said(at) and "older run" in said(at).split("Not on the wall-time axis")[1]


def test_the_loss_scale_view_model_counts_the_stored_steps_and_says_why_panels_are_missing(store):
    """loss_scale_model without Streamlit: run 1's events and non-finite losses are the store's; run 4 (recorded
    before mpdiag kept the lr and norm) is said to lack both panels; one process has no ranks."""
    from mpdiag.analysis import summaries
    from mpdiag.dashboard import loss_scale_model

    db = Store(store)
    runs = db.runs().set_index("run_id", drop=False)
    model = loss_scale_model.loss_scale(db, runs.loc[1], True)
    assert model.events == summaries.scale_events(db.steps(1)) and model.ranks is None
    assert model.nonfinite_losses == int((~np.isfinite(db.steps(1)["loss"].astype(float))).sum())
    old = loss_scale_model.loss_scale(db, runs.loc[4], True)
    assert any(note.startswith("No learning-rate or gradient-norm panel") for note in old.notes)


def test_the_loss_scale_page_draws_every_steps_over_and_underflow_kept_or_not(store, monkeypatch):
    """Run 1 (--every 2, GradScaler from 2**24: its first steps' gradients hold inf/NaN): the signal panel
    draws each line's stored sum at all 16 steps, the steps without full statistics included, labelled as such;
    run 4 (written without signals, as an older mpdiag did) says it has none."""
    from mpdiag.analysis.summaries import SIGNAL_LINES

    totals, logged = Store(store).step_signal_totals(1), len(Store(store).logged_steps(1))
    assert totals["step"].tolist() == list(range(STEPS)) and logged < STEPS
    assert totals["nan"].iloc[0] > 0  # its first, skipped steps' gradients overflowed FP32 itself: inf/NaN
    at = page("2_Loss_scale.py", store, monkeypatch, run="1")
    assert not at.exception and not page_chart_problems(at)
    chart = next(c for c in at.get("vega_lite_chart") if "over/underflow per step" in c.proto.spec)
    drawn = pd.concat(frames(chart))
    assert set(drawn["line"]) == {line for line, column in SIGNAL_LINES.items() if totals[column].any()}
    for line in set(drawn["line"]):
        mine = drawn[drawn["line"] == line].set_index("step")["values"]
        assert mine.to_dict() == totals.set_index("step")[SIGNAL_LINES[line]].to_dict(), line
    assert f"{STEPS} steps counted, {logged} of them with full statistics" in said(at)
    at = page("2_Loss_scale.py", store, monkeypatch, run="4")
    assert "No per-step over/underflow counts" in said(at) and not at.exception
