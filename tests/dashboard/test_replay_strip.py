"""The Modules page's strip of the replayed non-finite step: from a Recorder run with an overflow planted in a
named module at a known step (no module trace), the view-model lays every module call out forward then backward
in execution order with the first offender marked, and the page draws it with that module in the chart's data; Findings' link to it (``?replay=STEP``) opens the page on that replay, above the trace."""

import json
from urllib.parse import parse_qsl, urlsplit

import pandas as pd
import pyarrow as pa
import torch
from app_helpers import app, texts
from chart_check import chart_problems
from torch import nn

from mpdiag import Recorder, Store
from mpdiag.analysis.findings import diagnose, evidence_link
from mpdiag.dashboard import charts, modules_model


class Scores(nn.Module):
    def forward(self, q, k, sharpen):
        return (q * sharpen) @ k.transpose(-1, -2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.scores, self.head = nn.Linear(8, 8), nn.Linear(8, 8), Scores(), nn.Linear(6, 1)

    def forward(self, x, sharpen=1.0):
        return self.head(self.scores(self.q(x), self.k(x), sharpen).softmax(-1)).mean()


def recorded(store, trace_modules=False) -> int:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Recorder(model, store=store, optimizer=opt, replay=True, trace_modules=trace_modules) as rec:
        for step in range(8):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(2, 6, 8), sharpen=1e6 if step == 5 else 1.0) ** 2
            loss.backward()
            rec.record(loss)
            opt.step()
            opt.zero_grad()
    return rec.run_id


def test_the_strip_lays_out_the_forward_then_the_backward_with_the_first_offender_marked(tmp_path):
    store = tmp_path / "s.db"
    run_id = recorded(store)
    run = Store(store).runs().set_index("run_id", drop=False).loc[run_id]
    model = modules_model.modules(Store(store), run, True)
    assert model.modules.empty  # no trace: the replay is shown all the same
    strip = model.replay
    assert (strip.step, strip.first_module, strip.first_phase, strip.reproduced) == (5, "scores", "forward", True)
    rows = strip.rows
    assert list(rows["pos"]) == list(range(len(rows)))
    assert list(rows[rows.phase == "forward"]["module"]) == ["q", "k", "scores", "head", "Net"]
    assert (rows["phase"] == "backward").sum() == 0  # the forward named it: no backward replayed
    assert list(rows.loc[rows.state == "first offender", "module"]) == ["scores"]
    assert set(rows.loc[rows.module.isin(["q", "k"]), "state"]) == {"finite"}
    assert set(rows.loc[rows.module.isin(["head", "Net"]), "state"]) == {"inf/NaN"}  # handed on, not born there
    assert "the first offender is module 'scores' (forward)" in strip.said()
    assert "the forward only: it went bad there, so the backward was not replayed" in strip.said()
    spec = charts.replay_strip(rows, strip.step).to_dict()
    assert "first offender" in str(spec)
    # the strip's words say what it holds: no backward row, so no "then the backward" (the gallery's strip said so)
    assert spec["title"] == "step 5 replayed: each module call's output (forward)"
    assert {layer["encoding"]["x"]["title"] for layer in spec["layer"]} == {
        "execution order of the forward (the backward was not replayed)"}
    # each cell names its module call (a first-time user reads which one without hovering)
    named = [layer for layer in spec["layer"] if layer["mark"]["type"] == "text"]
    assert len(named) == 1 and named[0]["encoding"]["text"]["field"] == "call"


def test_the_modules_page_draws_the_replayed_step(tmp_path, monkeypatch):
    store = tmp_path / "s.db"
    run_id = recorded(store)
    at = app("pages/7_Modules.py", store, monkeypatch, run=str(run_id))
    assert not at.exception, [e.value for e in at.exception]
    said = texts(at)
    assert [h.value for h in at.subheader] == ["Replay of step 5"]
    assert "the first offender is module 'scores' (forward)" in said
    frames = [pa.ipc.open_stream(d.data.data).read_all().to_pandas() for c in at.get("vega_lite_chart")
              for d in c.proto.datasets]
    strip = next(f for f in frames if "state" in f and "pos" in f)
    assert isinstance(strip, pd.DataFrame)
    assert list(strip.loc[strip.state == "first offender", "call"]) == ["scores (Scores)"]


def test_the_findings_link_opens_the_modules_page_on_the_replay_above_the_trace(tmp_path, monkeypatch):
    store = tmp_path / "s.db"
    run_id = recorded(store, trace_modules=True)
    origin = next(f for f in diagnose(Store(store), run_id) if f.rule == "nonfinite-origin")
    link = urlsplit(evidence_link(origin, run_id))
    assert link.path == "/Modules"
    query = dict(parse_qsl(link.query))
    assert query == {"run": str(run_id), "replay": "5"}
    linked = app("pages/7_Modules.py", store, monkeypatch, **query)
    assert not linked.exception, [e.value for e in linked.exception]
    assert [h.value for h in linked.subheader] == ["Replay of step 5", "Modules, forward order"]
    unlinked = app("pages/7_Modules.py", store, monkeypatch, run=str(run_id))
    assert [h.value for h in unlinked.subheader] == ["Modules, forward order", "Replay of step 5"]


def test_a_loss_spikes_strip_says_what_the_replay_found_in_its_words():
    replays = pd.DataFrame([dict(step=40, trigger="loss spike", reproduced=True, first_module="boost",
                                 first_phase="forward", low_format="bf16", format_max=None,
                                 note="boost's output at step 40 was 86.6x its output on step 39's batch")])
    modules = pd.DataFrame([dict(step=s, phase="forward", ord=i, module=m, type=t, absmax=a, nonfinite=0,
                                 in_absmax=1.0, in_nonfinite=0)
                            for s, scale in ((39, 1.0), (40, 86.6)) for i, (m, t, a) in
                            enumerate([("embed", "Linear", 1.0), ("boost", "Boost", 1.8 * scale)])])
    strip = modules_model.replay_strip(replays, modules)
    assert list(strip.rows["module"]) == ["embed", "boost"]  # the spike step's calls, not the previous step's
    assert list(strip.rows["state"]) == ["finite", "first offender"]
    assert strip.said() == ("Step 40's loss spike replayed module by module, forward only (2 calls), and step 39's "
                            "batch on the same copy: boost's output at step 40 was 86.6x its output on step 39's batch.")


def test_a_loss_spikes_replay_is_drawn_as_each_calls_rise_against_the_rule(tmp_path, monkeypatch):
    """A spike replay is all finite: the strip's cells were one colour. The page draws instead how many times each
    forward call's output and inputs were the same call's on the previous batch: ``boost`` (x100 planted at step 40,
    its inputs unchanged) is the one call meeting the 10x rule, drawn red, at the rise the stored rows give."""
    from fixtures.scripts.replay_planted import at as plant_at
    from fixtures.scripts.replay_planted import train as planted_train

    store = tmp_path / "s.db"
    rec, _, _ = planted_train(45, plant_at(40, {"boost": 100.0}), spike=True, recorder=lambda model, scaler, opt:
                              Recorder(model, store=store, scaler=scaler, optimizer=opt, replay=True))
    run = Store(store).runs().set_index("run_id", drop=False).loc[rec.run_id]
    strip = modules_model.modules(Store(store), run, True).replay
    assert strip.spike and (strip.step, strip.first_module) == (40, "boost")
    stored = Store(store).replay_modules(rec.run_id)
    boost = stored[stored.module == "boost"].set_index("step")
    rises = strip.rises.set_index("module")
    assert rises.loc["boost", "out_rise"] == boost.loc[40, "absmax"] / boost.loc[39, "absmax"]
    assert 100 / 1.5 < rises.loc["boost", "out_rise"] < 100 * 1.5  # planted x100 on two different batches
    assert rises.loc["boost", "in_rise"] < modules_model.SPIKE_FACTOR
    assert list(rises.index[rises["offender"]])[0] == "boost"  # the rule's first offender, as the replay named it
    assert list(strip.rises["pos"]) == list(strip.rows.loc[strip.rows.phase == "forward", "pos"])

    page = app("pages/7_Modules.py", store, monkeypatch, run=str(rec.run_id))
    assert not page.exception, [e.value for e in page.exception]
    (chart,) = page.get("vega_lite_chart")
    assert "loss spike replayed: each forward call's output" in chart.proto.spec
    assert not chart_problems(chart.proto)
    drawn = next(f for f in (pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in chart.proto.datasets)
                 if "out_rise" in f)
    met = drawn[drawn["offender"]]
    assert list(met["call"]) == ["boost (Boost)"]
    assert list(met["meets"]) == ["the first offender: output rose 10x or more, inputs less"]


def _deep_spike(blocks=12):
    """A spike replay of a deep model: ``blocks`` blocks each calling one shared ``act`` (GELU), block 7's gate the
    first offender (x400, its inputs not), the blocks holding it and the model meeting the rule after it, and a
    ``detour`` only the spike step's batch ran (more than REPLAY_NAMED_CALLS calls in all)."""
    def calls(spike):
        out = [("inp", "Linear", 1.0, 1.0)]
        for b in range(blocks):
            hot = spike and b >= 7
            out += [(f"blocks.{b}.ln", "LayerNorm", 1.0, 1.0), (f"blocks.{b}.fc", "Linear", 1.0, 1.0),
                    ("act", "GELU", 1.0 + 0.01 * b, 1.0)]
            if b == 7:
                out.append((f"blocks.{b}.gate", "Gate", 400.0 if spike else 1.0, 1.0))
            out.append((f"blocks.{b}", "Block", 400.0 if hot else 1.0, 400.0 if hot and b > 7 else 1.0))
        out += [("detour", "Linear", 50.0, 400.0)] if spike else []
        return out + [("Deep", "Deep", 300.0 if spike else 1.0, 1.0)]
    modules = pd.DataFrame([dict(step=s, phase="forward", ord=i, module=m, type=t, absmax=a, nonfinite=0,
                                 in_absmax=inp, in_nonfinite=0)
                            for s in (44, 45) for i, (m, t, a, inp) in enumerate(calls(s == 45))])
    replays = pd.DataFrame([dict(step=45, trigger="loss spike", reproduced=True, first_module="blocks.7.gate",
                                 first_phase="forward", low_format="bf16", format_max=None, note="gate rose 400x")])
    return modules_model.replay_strip(replays, modules)


def test_a_deep_spike_replay_gives_each_call_its_own_place_and_names_the_red_ones():
    """Past 40 calls: a shared module's 12 calls each have an x position of their own (they sat on one), named
    "act (GELU), call 7 of 12"; the red points are named beside them, the first offender drawn apart from the
    modules that merely meet the rule after it; a call only the spike's batch made is said in words; the rules'
    labels sit right of the plot, off the dots."""
    strip = _deep_spike()
    rises = strip.rises
    assert len(rises) > charts.REPLAY_NAMED_CALLS
    acts = rises[rises["module"] == "act"]["call"].tolist()
    assert acts[6] == "act (GELU), call 7 of 12" and len(set(acts)) == 12
    assert rises.loc[rises["first"], "call"].tolist() == ["blocks.7.gate (Gate)"]
    assert {"blocks.7 (Block)", "Deep (Deep)"} <= set(rises.loc[rises["offender"] & ~rises["first"], "call"])
    assert strip.undrawn_said() == ("1 call ran only on step 45's batch, not on step 44's, so it has no rise to "
                                    "draw: detour (Linear).")

    spec = charts.spike_rises(rises, strip.step, modules_model.SPIKE_FACTOR).to_dict()
    data = spec["datasets"]
    layers = spec["layer"]
    dots = next(la for la in layers if la["mark"]["type"] == "point" and "color" in la["encoding"])
    assert dots["encoding"]["x"]["field"] == "pos" and dots["encoding"]["x"]["type"] == "ordinal"
    drawn = pd.DataFrame(data[dots["data"]["name"]])
    assert drawn["pos"].is_unique and len(drawn) == len(rises) - 1  # every call but the detour, each its own place
    kinds = dots["encoding"]["color"]["scale"]["domain"]
    assert kinds[0].startswith("the first offender") and dots["encoding"]["shape"]["scale"]["range"][:2] == [
        "diamond", "circle"]
    assert drawn.loc[drawn["first"], "meets"].tolist() == [kinds[0]]
    assert set(drawn.loc[drawn["offender"] & ~drawn["first"], "meets"]) == {kinds[1]}
    named = [la for la in layers if la["mark"]["type"] == "text" and la["encoding"]["text"]["field"] == "call"]
    labelled = {c for la in named for c in pd.DataFrame(data[la["data"]["name"]])["call"]}
    assert labelled == set(drawn.loc[drawn["offender"], "call"])
    assert [la["mark"]["fontWeight"] for la in named if "blocks.7.gate (Gate)" in
            set(pd.DataFrame(data[la["data"]["name"]])["call"])] == ["bold"]
    (rule_text,) = [la for la in layers if la["mark"]["type"] == "text" and la["encoding"]["text"]["field"] == "label"]
    assert rule_text["encoding"]["x"] == {"value": "width"} and rule_text["mark"]["align"] == "left"


def test_a_short_spike_replay_names_each_call_on_its_axis_in_execution_order():
    strip = _deep_spike(blocks=3)
    assert len(strip.rises) <= charts.REPLAY_NAMED_CALLS
    spec = charts.spike_rises(strip.rises, strip.step, modules_model.SPIKE_FACTOR).to_dict()
    dots = next(la for la in spec["layer"] if la["mark"]["type"] == "point" and "color" in la["encoding"])
    axis = dots["encoding"]["x"]["axis"]
    names = json.loads(axis["labelExpr"].removesuffix("[datum.value]"))
    assert names[:5] == ["inp (Linear)", "blocks.0.ln (LayerNorm)", "blocks.0.fc (Linear)", "act (GELU), call 1 of 3",
                         "blocks.0 (Block)"]
    assert not [la for la in spec["layer"] if la["mark"]["type"] == "text" and la["encoding"]["text"]["field"] == "call"]
