"""Compare's configuration table and its loss-scale, learning-rate, step-time and peak-memory charts, against a store
laid out as the Quick start leaves it: a static-scale O1 run (loss scale 1) launched with --pair, its FP32 twin (O0,
no GradScaler) and a rerun of the first with the finding's fix (dynamic scaling from 2^23). The first-time-user
review found the table hid the fix (a setting only some runs have counted as no difference) and the twin's line at
2^0 hid the static scale of 1."""

import json
import shutil

import pandas as pd
import pyarrow as pa
import pytest
from chart_check import page_chart_problems
from conftest import ROOT
from streamlit.testing.v1 import AppTest

from mpdiag import Store
from mpdiag.analysis.compare import MISSING, config_table, setting_text
from mpdiag.options import scale_text
from mpdiag.store import StepRow, StoreWriter

TIMEOUT = 60
STEPS = 12
MIB = 2**20


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """1: O1, static scale 1, paired with 2; 2: its FP32 twin (O0); 3: a rerun of 1, dynamic from 2^23. Run 1's
    peak memory is 12 MiB under the others' 602 MiB; every run's rate 6553.6 (on the top border before)."""
    path = tmp_path_factory.mktemp("compare_config") / "runs.db"
    common = dict(seed=0, steps=STEPS, every=1, device="cpu", torch_version="2.x", batch_size=64, params=9610)
    with StoreWriter(path, finish_runs=True) as writer:
        sha = writer.add_script("quick.py", "print('quick start')\n")
        runs = [
            writer.create_run(name="quick.py", script_sha256=sha, opt_level="O1", scaling="static", loss_scale=1.0,
                              config={"run": {"shadow_every": 10, "loss_scale": 1.0}}, **common),
            writer.create_run(name="quick.py (FP32 twin)", script_sha256=sha, opt_level="O0", scaling="none",
                              config={"run": {"shadow_every": 10}}, **common),
            writer.create_run(name="quick.py fixed", script_sha256=sha, opt_level="O1", scaling="dynamic",
                              init_scale=2.0**23, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                              parent_run_id=1, config={"run": {"shadow_every": 0}}, **common),
        ]
        assert runs == [1, 2, 3]
        writer._conn.execute("UPDATE runs SET pair_run_id = 2 WHERE run_id = 1")  # as --pair links them
        writer._conn.commit()
        for run, scale, memory in ((1, 1.0, 590 * MIB), (2, 1.0, 602 * MIB), (3, 2.0**23, 602 * MIB)):
            writer.write_batch(run, [StepRow(s, 1.0 - 0.01 * s * run, scale, 0, 0 if run == 3 else None, scale,
                                             0.05 + 0.001 * s, memory, 0, 6553.6, 1e-5 * (1 + s) * run, 0.1 * s)
                                     for s in range(STEPS)], [])
    return path


def chosen(path) -> pd.DataFrame:
    return Store(path).runs().set_index("run_id").loc[[1, 2, 3]].reset_index()


def test_a_setting_only_some_runs_have_is_a_difference(store):
    table = config_table(chosen(store), ["#1", "#2", "#3"], only_differences=True)
    assert table.loc["init_scale"].tolist() == [MISSING, MISSING, "2^23 (8,388,608)"]  # the fix itself
    assert table.loc["loss_scale"].tolist() == ["1", MISSING, MISSING]  # the static scale that failed
    assert table.loc["scaling"].tolist() == ["static", "none", "dynamic"]
    assert table.loc["growth_interval"].tolist() == [MISSING, MISSING, "2,000"]
    assert table.loc["shadow_every"].tolist() == ["10", "10", "0 (off)"]
    assert table.loc["rerun of"].tolist() == [MISSING, MISSING, "#1"]
    assert table.loc["paired with (--pair twin)"].tolist() == ["#2", "#1", MISSING]  # the twin names its run too
    for same in ("seed", "steps", "batch_size", "params", "device", "status"):
        assert same not in table.index
    everything = config_table(chosen(store), ["#1", "#2", "#3"], only_differences=False)
    assert everything.loc["params"].tolist() == ["9,610"] * 3 and everything.loc["seed"].tolist() == ["0"] * 3
    text = " ".join(everything.to_numpy().ravel())
    assert "nan" not in text.lower() and "None" not in text and "<NA>" not in text


def test_settings_are_written_readably():
    assert scale_text(2.0**16, digits=True) == "2^16 (65,536)" and scale_text(2.0**-20, digits=True) == "2^-20"
    assert scale_text(1.0) == "1" and scale_text(0.5) == "2^-1" and scale_text(1000.0) == "1,000"
    assert setting_text("init_scale", float("nan")) == MISSING and setting_text("gpu_name", None) == MISSING
    assert setting_text("pair_run_id", pd.NA) == MISSING and setting_text("pair_run_id", 7) == "#7"
    assert setting_text("backoff_factor", 0.5) == "0.5" and setting_text("trace_modules", True) == "yes"


def _page(path, monkeypatch, runs=("1", "2", "3")):
    monkeypatch.setenv("MPDIAG_STORE", str(path))
    at = AppTest.from_file(str(ROOT / "pages" / "3_Compare.py"), default_timeout=TIMEOUT)
    at.query_params["runs"] = list(runs)
    return at.run()


def _views(node, title="", data=None):
    """Every leaf view with its panel's title and its data (inherited from the layer that holds it)."""
    title, data = node.get("title", title), node.get("data", data)
    if "mark" in node:
        yield {**node, "data": data}, title if isinstance(title, str) else (title or {}).get("text", "")
    for key in ("layer", "vconcat", "hconcat"):
        for child in node.get(key, []):
            yield from _views(child, title, data)


def _charts(at):
    """(spec, {dataset name: frame}) of every chart on the page."""
    for chart in at.get("vega_lite_chart"):
        named = {d.name: pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in chart.proto.datasets}
        yield json.loads(chart.proto.spec), named


def _view(at, title_start):
    for spec, named in _charts(at):
        for view, title in _views(spec):
            if title.startswith(title_start) and view["mark"]["type"] == "line":
                return view, named[view["data"]["name"]]
    raise AssertionError(f"no {title_start!r} line")


def test_the_page_draws_only_scaled_runs_on_a_padded_log2_axis_and_names_the_twin(store, monkeypatch):
    at = _page(store, monkeypatch)
    assert not at.exception, [e.value for e in at.exception]
    assert not page_chart_problems(at)
    view, data = _view(at, "loss scale")
    assert sorted(data["run"].str[:2].unique()) == ["#1", "#3"]  # the O0 twin has no scale: not drawn at 2^0
    scale = view["encoding"]["y"]["scale"]
    assert scale["domain"] == [2.0**-1, 2.0**24] and scale["nice"] is False  # 2^23 and 2^0 a binade inside
    ticks = view["encoding"]["y"]["axis"]["values"]
    assert 1.0 in ticks and max(ticks) >= 2.0**23 and all(2.0**-1 <= t <= 2.0**24 for t in ticks)
    captions = " ".join(c.value for c in at.caption).replace("\\", "")
    assert "Not in the loss-scale panel (no loss scaling" in captions
    assert "#2" in captions.split("Not in the loss-scale panel")[1].split(".")[0]
    # the shown configuration: the fix and the failing static scale are there
    table = next(d.value for d in at.dataframe if "init scale" in d.value.index)
    assert table.loc["init scale"].tolist()[-1] == "2^23 (8,388,608)" and table.loc["loss scale"].tolist()[0] == "1"
    assert not any("_" in name for name in table.index)  # settings in words, not field names


def test_axes_are_plain_numbers_powers_of_ten_and_memory_from_zero(store, monkeypatch):
    at = _page(store, monkeypatch)
    assert not at.exception, [e.value for e in at.exception]
    diff, _ = _view(at, "difference to the FP32")
    assert diff["encoding"]["y"]["axis"]["format"] == ",.12~g"  # 400, not 4e+2
    lr, _ = _view(at, "learning rate")
    assert lr["encoding"]["y"]["scale"].get("zero") is True and lr["encoding"]["y"]["axis"]["format"] == ",.12~g"
    norm, data = _view(at, "gradient norm")
    ticks = norm["encoding"]["y"]["axis"]["values"]
    # powers of ten spanning 1e-5 .. 3.6e-4, nothing between; 1e-5 itself is drawn, so the axis starts a decade
    # below it (a value on the border reads as clipped)
    assert ticks == [1e-6, 1e-5, 1e-4, 1e-3]
    assert "'.0e'" in norm["encoding"]["y"]["axis"]["labelExpr"]
    memory, data = _view(at, "peak memory")
    assert memory["encoding"]["y"]["scale"]["zero"] is True
    assert sorted(data["peak_mem_mb"].unique()) == [590.0, 602.0]
    # step time and peak memory each take the page's width, one above the other, legends not cut short
    step_time, _ = _view(at, "step time")
    assert step_time["encoding"]["color"]["legend"]["labelLimit"] >= 1000
    def inside(node):
        for child in getattr(node, "children", {}).values():
            yield child.type
            yield from inside(child)

    assert not any("arrow_vega_lite_chart" in set(inside(column)) or "vega_lite_chart" in set(inside(column))
                   for column in at.columns)  # no chart in a column: side by side each was under 400 px


def test_the_view_model_says_what_the_page_draws_of_each_run(store):
    """compare_model without Streamlit's script runner: the loss-scale panel leaves out the twin without loss
    scaling and says so, both O1 runs are compared with the FP32 twin, costs and memory are each run's own."""
    from mpdiag.dashboard import compare_model

    all_runs = Store(store).runs()
    model = compare_model.compare(Store(store), chosen(store), all_runs, weight=0.0)
    assert [label[:2] for label in model.labels] == ["#1", "#2", "#3"]
    curves = model.curves("step", smooth=False)
    assert sorted(curves.scaled["run"].str[:2].unique()) == ["#1", "#3"]
    assert any(s.startswith("Not in the loss-scale panel") and "\\#2" in s for s in curves.said)
    assert len(curves.notes) == 2 and all("versus its FP32 reference \\#2" in note for note in curves.notes)
    ones = Store(store).steps(1)
    diff = curves.diffs[curves.diffs["run"] == model.labels[0]].set_index("step")["diff"]
    assert diff.tolist() == pytest.approx((ones["loss"] - Store(store).steps(2)["loss"]).tolist())
    assert curves.normed is not None and len(curves.lr) == 3 * STEPS
    costs = model.costs()
    assert sorted(costs.memory["peak_mem_mb"].unique()) == [590.0, 602.0] and len(costs.table) == 3
    assert costs.warmups.startswith("Step 0 (warm-up") and (costs.timed["step"] > 0).all()
    shares = model.fp16_shares()  # no run recorded tensor statistics
    assert shares.under is None and len(shares.no_stats) == 3


def test_one_render_reads_the_runs_table_once(store, monkeypatch):
    """The page reads the runs table for its picker; each run's FP32 reference and twin are found in it."""
    reads = []
    whole_table = Store.runs
    monkeypatch.setattr(Store, "runs", lambda self: reads.append(1) or whole_table(self))
    at = _page(store, monkeypatch)
    assert not at.exception, [e.value for e in at.exception]
    assert len(reads) == 1


def test_the_fp8_recipe_is_a_setting_where_it_applies():
    """A block-scaled fp8-sim run beside a per-tensor one and a BF16 run: the recipe is shown for the two that use
    it, MISSING for the BF16 run (its stored default recipe applies to nothing)."""
    runs = pd.DataFrame({"run_id": [1, 2, 3], "opt_level": ["bf16", "fp8-sim", "fp8-sim"], "config": [
        {"run": {"opt_level": "bf16", "fp8": False, "fp8_recipe": "delayed", "fp8_bf16_modules": ""}},
        {"run": {"opt_level": "fp8-sim", "fp8": False, "fp8_recipe": "delayed", "fp8_bf16_modules": ""}},
        {"run": {"opt_level": "fp8-sim", "fp8": True, "fp8_recipe": "mxfp8", "fp8_bf16_modules": "head"}},
    ]})
    table = config_table(runs, ["#1", "#2", "#3"], only_differences=True)
    assert table.loc["fp8_recipe"].tolist() == [MISSING, "delayed", "mxfp8"]
    assert table.loc["fp8"].tolist() == ["no", "no", "yes"]
    assert table.loc["fp8_bf16_modules"].tolist() == [MISSING, MISSING, "head"]


def test_a_plan_rounds_moments_format_and_fp16_level_are_settings():
    """A precision plan's round that holds the moments in BF16 at fp8-sim-fp16 beside its O0 source: the level, the
    moments' format and the recipe per Linear are rows of Compare's table; the source's unset format is MISSING."""
    runs = pd.DataFrame({"run_id": [1, 2], "opt_level": ["O0", "fp8-sim-fp16"], "config": [
        {"run": {"opt_level": "O0", "fp8": True, "fp8_recipe": "both", "moment_format": ""}},
        {"run": {"opt_level": "fp8-sim-fp16", "fp8": False, "fp8_recipe": "delayed", "moment_format": "bf16",
                 "fp8_modules": "head=current,body=bf16"}},
    ]})
    table = config_table(runs, ["#1", "#2"], only_differences=True)
    assert table.loc["opt_level"].tolist() == ["O0", "fp8-sim-fp16"]
    assert table.loc["moment_format"].tolist() == [MISSING, "bf16"]
    assert table.loc["fp8_modules"].tolist() == [MISSING, "head=current,body=bf16"]


def test_the_loss_axis_starts_as_a_log_one_where_the_runs_losses_are_far_apart(store, monkeypatch, tmp_path):
    """A run ending at 3e-5 beside one ending at 2 was a flat line at 0 on the linear loss axis, and so were runs
    whose losses fell three decades to final losses 3.3x apart: the toggle starts on where the losses drawn (every
    run's, every step's) span more than LOG_LOSS_SPAN, off where they do not (this store's three), and the loss
    panel's axis follows it."""
    from mpdiag.dashboard import charts

    losses = pd.concat([Store(store).steps(int(r))["loss"] for r in chosen(store)["run_id"]])
    assert not charts.losses_far_apart(losses)
    assert losses.max() / losses.min() <= charts.LOG_LOSS_SPAN
    assert charts.losses_far_apart([1.7e-4, 3e-6, 1.6e-7, 5.3e-7])  # runs 5-7 of the review: final 3.3x apart
    assert not charts.losses_far_apart([3.5e-5]) and not charts.losses_far_apart([0.0, 2.0, -1.0, float("nan")])
    at = _page(store, monkeypatch)
    assert at.toggle(key="loss_log").value is False
    store = shutil.copy(store, tmp_path / "runs.db")  # the module's store stays as the other tests read it
    with StoreWriter(store) as writer:  # a fourth run, far below the others
        run = writer.create_run(name="tiny loss", opt_level="O1", scaling="none", seed=0, steps=STEPS, device="cpu")
        writer.write_batch(run, [StepRow(s, 3e-5, 1.0, 0, None, 1.0, 0.05, MIB, 0, 1e-3, 1.0, 0.1 * s)
                                 for s in range(STEPS)], [])
        writer.end_run(run, "finished")
    at = _page(store, monkeypatch, runs=["1", str(run)])
    assert at.toggle(key="loss_log").value is True
    view, _ = _view(at, "loss")
    assert view["encoding"]["y"]["scale"]["type"] == "log"
