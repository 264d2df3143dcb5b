"""The FP8 page under AppTest on every kind of run, and what each FP8 finding says visible where it links."""

from __future__ import annotations

import json
from urllib.parse import parse_qsl, urlsplit

import numpy as np
import pandas as pd
import pytest
from app_helpers import app, shown, texts
from chart_check import chart_problems
from conftest import EXAMPLES

from mpdiag import Store
from mpdiag.analysis import fp8_summaries
from mpdiag.analysis.findings import diagnose, evidence_link
from mpdiag.dashboard.reads import store_key
from mpdiag.store import StoreWriter
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript


@pytest.fixture(scope="module")
def fp8_store(tmp_path_factory):
    """1: bf16 recorded with --fp8 under both recipes (the amax jump); 2: fp8-sim delayed recorded with --fp8;
    3: fp8-sim without --fp8; 4: O1 without --fp8; 5: a run still running with --fp8 and no rows yet;
    6: a failed --fp8 run (its script raised before the first step)."""
    from mpdiag.examples.fp8_amax_jump import JUMP

    path = tmp_path_factory.mktemp("fp8") / "runs.db"
    script = ModelScript.from_path(EXAMPLES / "fp8_amax_jump.py")
    base = RunConfig(steps=JUMP + 4, device="cpu")
    train(script, base.with_options(opt_level="bf16", fp8=True, fp8_recipe="both"), path)
    train(script, base.with_options(opt_level="fp8-sim", fp8=True), path)
    train(script, base.with_options(opt_level="fp8-sim"), path)
    train(script, base.with_options(opt_level="O1", steps=4), path)
    with StoreWriter(path) as w:
        w.create_run(name="still running", opt_level="bf16", config={"run": {"fp8": True}})
    broken = ModelScript(filename="broken.py", source="def build(device):\n    raise RuntimeError('no data')\n")
    train(broken, RunConfig(steps=3, device="cpu", fp8=True), path)
    return path


def page(store, monkeypatch, **query):
    at = app("pages/6_FP8.py", store, monkeypatch, **query)
    assert not at.exception, [e.value for e in at.exception]
    return at


@pytest.mark.parametrize("run_id, says", [
    (3, "ran with FP8 simulated (fp8-sim) but did not record FP8 statistics"),
    (4, "recorded without FP8 statistics"),
    (5, "No FP8 statistics recorded yet"),
    (6, "was started with FP8 statistics but recorded none: it ended (failed)"),
])
def test_runs_without_fp8_rows_say_why_and_how_to_get_them(fp8_store, monkeypatch, run_id, says):
    at = page(fp8_store, monkeypatch, run=str(run_id))
    assert says in texts(at)
    assert not at.get("vega_lite_chart") and not at.get("arrow_vega_lite_chart")


@pytest.mark.parametrize("run_id", [1, 2])
def test_every_fp8_finding_is_visible_where_it_links(fp8_store, monkeypatch, run_id):
    store = Store(fp8_store)
    findings = [f for f in diagnose(store, run_id) if f.page == "FP8"]
    assert findings  # both runs see the amax jump at the head's input under delayed scaling
    for finding in findings:
        link = urlsplit(evidence_link(finding, run_id))
        assert link.path == "/FP8"
        query = dict(parse_qsl(link.query))
        at = page(fp8_store, monkeypatch, **query)
        said = texts(at)
        assert finding.title in said  # the finding itself, on the page it links to
        assert at.selectbox(key="layer").value == query["layer"]
        assert at.radio(key="role").value == query["role"] and at.radio(key="recipe").value == query["recipe"]
        overflowing = store.fp8(run_id)
        overflowing = overflowing[(overflowing["module"] == query["layer"]) & (overflowing["role"] == query["role"])
                                  & (overflowing["recipe"] == query["recipe"]) & (overflowing["overflow"] > 0)]
        # the amax chart's caption counts the same overflowing steps the finding's evidence rests on
        assert f"{len(overflowing)} of " in said and f"first at step {int(overflowing['step'].min())}" in said


def test_whatif_controls_change_the_counts_and_the_recorded_settings_give_the_recorded_count(fp8_store, monkeypatch):
    from mpdiag.examples.fp8_amax_jump import JUMP

    at = page(fp8_store, monkeypatch, run="1", layer="head", role="input", recipe="delayed")
    rows = Store(fp8_store).fp8(1)
    rows = rows[(rows["module"] == "head") & (rows["role"] == "input") & (rows["recipe"] == "delayed")]
    recorded = int((rows['underflow'] + rows['overflow']).sum())
    assert f"the recorded count is exactly {recorded:,} (the layer table's underflow + overflow of this row)" in texts(at)
    # the table the what-if points to shows that sum in the row, and says which columns count steps, which values
    (table,) = [d.value for d in at.dataframe if "subnormal" in d.value.columns]
    row = table[(table["layer"] == "head") & (table["role"] == "input") & (table["recipe"] == "delayed")].iloc[0]
    assert row["underflow"] + row["overflow"] == recorded
    assert fp8_summaries.TABLE_CAPTION in [c.value for c in at.caption]
    (whatif,) = [c for c in at.get("vega_lite_chart") if "values lost per recorded step" in c.proto.spec]
    assert not chart_problems(whatif.proto)  # at least 150 px tall, rows with finite positions
    before = [c.value for c in at.caption]
    at.number_input(key="whatif_margin").set_value(9).run()  # 2^9 > the jump's ratio: underflow instead
    said = texts(at)
    assert "recorded count is exactly" not in said and [c.value for c in at.caption] != before
    at.radio(key="whatif_recipe").set_value("current").run()
    assert not at.exception and "current scaling:" in texts(at)
    assert JUMP  # the store's runs cover the jump


def test_a_runs_data_downloads_from_any_run_page_after_a_click(fp8_store, monkeypatch):
    import io
    import zipfile

    import pandas as pd

    def run_download(at):  # the run's zip, not the charts' PNG/SVG buttons (those render only on their click)
        return [b for b in at.get("download_button") if b.key == "download_zip"]

    at = page(fp8_store, monkeypatch, run="1")
    assert not run_download(at)  # nothing is prepared by loading the page
    at.button(key="download_prepare").click().run()
    assert not at.exception and run_download(at)
    data = at.session_state[f"download:{store_key(Store(fp8_store))}:1"]
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = set(archive.namelist())
        steps = pd.read_csv(archive.open("run1_steps.csv"))
        fp8 = pd.read_parquet(io.BytesIO(archive.read("run1_fp8.parquet")))
    assert {"run1_run.csv", "run1_tensor_stats.parquet", "run1_fp8_histograms.csv"} <= names
    store = Store(fp8_store)
    assert len(steps) == len(store.steps(1)) and len(fp8) == len(store.fp8(1))


def head_input_truth(steps: int) -> pd.DataFrame:
    """Run 1 of ``fp8_store`` retraced here: the head Linear's input at each step, cast by torch at the delayed
    scale computed here (448 / the largest earlier amax, in fp32; its own at step 0). Per step: amax, numel,
    underflow (torch's cast gives 0), overflow (past 464, the midpoint from 448 to 480: torch's E4M3 cast
    saturates, so it cannot show overflow itself)."""
    import torch

    from mpdiag.examples import EXAMPLES_DIR
    from mpdiag.training.policies import make_policy
    from mpdiag.training.runner import seed_everything
    from mpdiag.training.script import build_model

    seed_everything(RunConfig().seed)
    cpu = torch.device("cpu")
    built = build_model(ModelScript.from_path(EXAMPLES_DIR / "fp8_amax_jump.py"), cpu)
    policy = make_policy(RunConfig(opt_level="bf16"), cpu)
    model, optimizer = policy.prepare(built.model, built.make_optimizer)
    seen = []
    model.head.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().float().clone()))
    batches = built.batches()
    for _ in range(steps):
        batch = next(batches)
        policy.zero_grad(optimizer)
        with policy.autocast():
            loss = built.loss_fn(model, batch)
        policy.backward(loss)
        policy.step(optimizer)
    rows, amaxes = [], []
    for step, x in enumerate(seen):
        amaxes.append(float(x.abs().max()))
        scale = np.float32(448.0) / np.float32(max(amaxes[:-1]) if step else amaxes[-1])
        y = x * torch.tensor(scale)
        rows.append({"step": step, "amax": amaxes[-1], "numel": x.numel(),
                     "underflow": int(((y.to(torch.float8_e4m3fn).float() == 0) & (x != 0)).sum()),
                     "overflow": int((y.abs() > 464.0).sum())})
    return pd.DataFrame(rows)


def test_every_count_of_steps_on_the_page_is_torchs_casts_and_each_is_named_once(fp8_store, monkeypatch):
    """Issue 27: on the FP8 demo (head's input jumps 256x at JUMP), for head / input / delayed, torch's casts give
    three different counts of steps: overflowing, past the lost-values threshold, losing any value (a single
    underflow at an early step). Each is shown under its own name and equals torch's, wherever it is shown: the
    amax-jump finding and the amax chart (caption and markers) the first, the lost-values finding the second,
    the heatmap the third, the table all three; the jump finding names the jump at JUMP first."""
    import re

    from chart_check import _filtered, datasets, page_chart_problems

    from mpdiag.examples.fp8_amax_jump import JUMP

    rows = Store(fp8_store).fp8(1)
    recorded = rows[(rows["module"] == "head") & (rows["role"] == "input") & (rows["recipe"] == "delayed")]
    truth = head_input_truth(JUMP + 4)
    assert recorded["amax"].tolist() == truth["amax"].tolist()  # the same tensors as the recording's
    over = truth.loc[truth["overflow"] > 0, "step"].tolist()
    losing = truth.loc[truth["underflow"] + truth["overflow"] > 0, "step"].tolist()
    past = truth.loc[(truth["underflow"] / truth["numel"] > 0.01) | (truth["overflow"] > 0), "step"].tolist()
    steps = len(truth)
    # the demo tells them apart: small rises overflow before the jump, and one value underflows at another step
    assert over[0] < JUMP and JUMP in over and len(losing) > len(over)

    at = page(fp8_store, monkeypatch, run="1", layer="head", role="input", recipe="delayed")
    said = texts(at)
    (jump,) = [shown(w.value) for w in at.warning if "amax jump of head's input" in shown(w.value)]
    others = [s for s in over if s != JUMP]
    assert (f"Its amax jumps, worst at step {JUMP}: {truth.loc[JUMP, 'amax']:g}, "
            f"{truth.loc[JUMP, 'amax'] / truth.loc[:JUMP - 1, 'amax'].max():.4g} times the largest") in jump
    assert (f"{truth.loc[JUMP, 'overflow']:,} of {truth.loc[JUMP, 'numel']:,} values overflowed E4M3. In all, "
            f"{len(over)} of {steps} recorded steps overflow (the amax chart's ▲, the layer table's \"overflowing\" "
            f"steps): the other {len(others)} "
            f"(steps {', '.join(map(str, others))}) are small rises") in jump
    assert f"losing {int(truth.loc[others, 'overflow'].sum())} value" in jump
    (lost,) = [shown(w.value) for w in at.warning if "(delayed scaling) loses values of head's input" in shown(w.value)]
    assert lost.startswith(f"FP8 (delayed scaling) loses values of head's input. {len(past)} of {steps} recorded "
                           "steps lose more than 1 % of the values")
    assert "(the layer table's \"flagged\" steps)" in lost
    assert (f"head input, delayed scaling: {len(over)} of {steps} recorded steps overflow (first at step {over[0]}; "
            f"the most values at step {JUMP}: {truth.loc[JUMP, 'overflow']:,}), the layer table's \"overflowing\" steps.") in said

    table = at.dataframe[0].value.set_index(["layer", "role", "recipe"])
    assert table.loc[("head", "input", "delayed"), ["steps", "overflowing", "flagged", "losing"]
                     ].tolist() == [steps, len(over), len(past), len(losing)]
    charts = {c.proto.spec: c.proto for c in at.get("vega_lite_chart")}
    (amax,) = [p for spec, p in charts.items() if "amax of head's input" in spec]
    (markers,) = [v for v in json.loads(amax.spec)["layer"] if v["mark"].get("shape") == "triangle-up"]
    assert datasets(amax)[markers["data"]["name"]]["step"].tolist() == over
    assert "largest |value|" in amax.spec and '"|x|"' not in amax.spec  # a bare "|x|" on its side read as a box
    # the step axis is not rounded out past the last recorded step (47 drew an axis to 50)
    assert all(layer["encoding"]["x"]["scale"]["nice"] is False for layer in json.loads(amax.spec)["layer"])
    (heatmap,) = [p for spec, p in charts.items() if "share of input values lost" in spec]
    (coloured,) = [v for v in json.loads(heatmap.spec)["layer"] if v.get("transform") == [{"filter": "!datum.lossless"}]]
    cells = _filtered(datasets(heatmap)[json.loads(heatmap.spec)["data"]["name"]], coloured["transform"])
    assert sorted(cells.loc[cells["module"] == "head", "step"]) == losing
    assert not page_chart_problems(at)
    # every number from 1,000 up has its thousands separators
    assert not re.findall(r"(?<![\d.,^])\d{4,}(?!\d)", said), re.findall(r".{30}(?<![\d.,^])\d{4,}(?!\d).{10}", said)
    for role in ("weight", "grad_output"):  # no overflow, nothing lost: still charts with data, or a sentence
        at.radio(key="role").set_value(role).run()
        assert not at.exception and not page_chart_problems(at), page_chart_problems(at)
        assert f"head {role}, delayed scaling: 0 of {steps} recorded steps overflow, the layer table's" in texts(at)


def test_the_layer_table_names_fit_and_say_what_they_count(fp8_store, monkeypatch):
    """The table's columns are short (the whole table fits a 1,280 px window; checked in Chromium by hand) and
    each has a help text; no "None" or "nan"."""
    from mpdiag.analysis.fp8_summaries import TABLE_COLUMNS

    at = page(fp8_store, monkeypatch, run="1")
    table = at.dataframe[0].value
    assert list(table.columns) == list(TABLE_COLUMNS) and max(len(c) for c in table.columns) <= 11
    config = json.loads(at.dataframe[0].proto.columns)
    assert {name: config.get(name, {}).get("help") for name in TABLE_COLUMNS} == TABLE_COLUMNS
    assert not any(v in ("None", "nan") for v in table.astype(str).to_numpy().ravel())
    # a row that lost nothing has no worst step (blank, not "step 0"); a row that lost values names its step
    nothing = table["losing"] == 0
    assert nothing.any() and (table.loc[nothing, "at step"] == "").all()
    assert (table.loc[~nothing, "at step"] != "").all()


def test_the_view_model_counts_what_the_recorded_settings_lost_and_says_why_nothing_else_was_read(fp8_store):
    """fp8_model without Streamlit: the recorded settings on run 1's head input give the stored count; a run
    started without --fp8 (run 4) has no settings and no records read."""
    import dataclasses

    from mpdiag.dashboard import fp8_model

    store = Store(fp8_store)
    runs = store.runs()
    model = fp8_model.fp8(store, runs[runs["run_id"] == 1].iloc[0], True)
    rows = store.fp8(1)
    rows = rows[(rows["module"] == "head") & (rows["role"] == "input") & (rows["recipe"] == "delayed")]
    whatif = model.whatif("head", "input", dataclasses.replace(model.settings, recipe="delayed"))
    assert f"the recorded count is exactly {int((rows['underflow'] + rows['overflow']).sum()):,}" in whatif.said
    assert model.recipes == ["delayed", "current"] and "current and delayed scaling" in model.recorded
    layer = model.layer("head", "input", "delayed")
    assert len(layer.series) == rows["step"].nunique() and layer.said.startswith("head input, delayed scaling")
    none = fp8_model.fp8(store, runs[runs["run_id"] == 4].iloc[0], True)
    assert none.settings is None and none.records.empty


def test_block_scaled_recipes_show_their_exact_counts_beside_the_per_tensor_page(tmp_path, monkeypatch):
    """A Recorder run with mxfp8 and nvfp4: the page's block table holds, per layer, role and recipe, the worst
    recorded shares and clipped sums of Store.fp8's block rows and Store.fp8_blocks; the per-tensor parts of
    the page (recipes, findings) keep to current and delayed."""
    import torch

    from mpdiag.numerics.fp8_recipes import Fp8Settings
    from mpdiag.recording.recorder import Recorder

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.Linear(24, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "blocks.db"
    settings = Fp8Settings(recipe="current", block_recipes=("mxfp8", "nvfp4"))
    with Recorder(model, Store(path), optimizer=optimizer, fp8=settings) as recorder:
        for _ in range(2):
            optimizer.zero_grad()
            x = torch.randn(4, 40) * torch.exp2(torch.randint(-20, 20, (4, 40)).float())
            loss = model(x).square().mean()
            loss.backward()
            recorder.record(loss)
            optimizer.step()
    store = Store(path)
    rows = store.fp8(1)
    at = page(path, monkeypatch, run="1")
    assert at.radio(key="recipe").options == ["current"]
    assert "Block-scaled recipes: MXFP8 and NVFP4" in [h.value for h in at.subheader]
    assert "block-scaled too: MXFP8 and NVFP4 (their table is at the end of the page)." in texts(at)  # said on top
    assert "equal to torchao's reference casts" in texts(at)
    table = at.dataframe[-1].value.set_index(["layer", "role", "recipe"])
    assert len(table) == 2 * 3 * 2
    for (layer, role, recipe), shown_row in table.iterrows():
        one = rows[(rows["module"] == layer) & (rows["role"] == role) & (rows["recipe"] == recipe)]
        assert shown_row["steps"] == 2 and shown_row["clipped"] == one["overflow"].sum()
        assert shown_row["worst underflow"] == (one["underflow"] / one["numel"]).max()
    assert table["worst underflow"].max() > 0  # the wide inputs lose values in blocks: not a table of zeros


def test_without_a_run_named_the_page_opens_on_a_run_that_recorded_fp8_statistics(fp8_store, monkeypatch):
    """The newest runs (#5 still running, #6 failed) have no FP8 rows: the page opened on #6 and said it had none,
    though #1 and #2 had. It opens on one of those, and the Plan page (which needs them too) the same way."""
    assert Store(fp8_store).runs_with("fp8") == {1, 2}
    for path in ("pages/6_FP8.py", "pages/8_Plan.py"):
        at = app(path, fp8_store, monkeypatch)
        assert not at.exception, [e.value for e in at.exception]
        assert at.query_params["run"] in ("1", "2"), path
        assert "recorded without FP8 statistics" not in texts(at) and "recorded no FP8 statistics" not in texts(at)
