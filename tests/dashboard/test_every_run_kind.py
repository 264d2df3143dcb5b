"""Every page renders every kind of run (issue 15): each gallery script at its failing and fixed settings,
the bundled models, a collapsed loss scale, an all-skipped run, a run that failed at step k, one that crashed,
one still running, a --trace-modules run, FP8 recordings and a watched script (with its FP32 shadow); under
AppTest and in real Chromium, on one store. Then the interactions only a browser shows, and the live and cached reads.

A page passes when it raises nothing and every chart it draws passes the chart check (tests/chart_check.py: each
view has finite data to draw, is at least 150 px each way, and puts no log scale over zeros); a chart of
nothing, or of nothing but NaN, must be a sentence instead."""

import contextlib
import importlib
import json
import math
import os
import re
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest
from app_helpers import app
from chart_check import page_chart_problems
from conftest import EXAMPLES, ROOT, run_cli

from mpdiag import Store
from mpdiag.store import StoreWriter
from mpdiag.training.runner import RunConfig, train, train_pair
from mpdiag.training.script import ModelScript

pytestmark = pytest.mark.slow
PAGES = ["app.py", "pages/1_Gradients.py", "pages/2_Loss_scale.py", "pages/3_Compare.py", "pages/4_Upload.py",
         "pages/5_Findings.py", "pages/6_FP8.py", "pages/7_Modules.py", "pages/8_Plan.py"]
GALLERY = sorted(path.stem for path in EXAMPLES.glob("gallery_*.py"))
#: pages that read no ?run=: the home page lists every kind at once (its panels choose runs by widgets of their own),
#: Upload shows none; a render with each kind's ?run= drew the same page 28 times over (~27 s of CPU)
READS_NO_RUN = {"app.py", "pages/4_Upload.py"}

FAILS_AT_STEP_3 = """
    from mpdiag.examples.mlp_digits import build as build_mlp


    def build(device):
        spec = build_mlp(device)
        plain, calls = spec["loss_fn"], []

        def loss_fn(model, batch):
            calls.append(1)
            if len(calls) == 4:
                raise RuntimeError("the data loader gave an empty batch at step 3")
            return plain(model, batch)

        spec["loss_fn"] = loss_fn
        return spec
"""

WATCHED_LOOP = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(6):
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
"""


def cli(store, command, *args):
    done = run_cli(command, "--store", str(store), *args)  # before the script: watch hands what follows it to the script
    return done.returncode, done.stdout + done.stderr


def own_loop(path, name: str):
    """The Recorder in a user's own loop (no planned total) on a small seeded model: (recorder, one step)."""
    import torch

    from mpdiag.recording.recorder import Recorder

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = Recorder(model, Store(path), optimizer=optimizer, name=name)

    def train_step() -> None:
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        recorder.record(loss)
        optimizer.step()
        optimizer.zero_grad()

    return recorder, train_step


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    """(store path, {kind: run id}, {run id: the run Compare shows beside it}); the running run's Recorder
    stays open (this process is its writer, alive) until the module's tests are done."""
    folder = tmp_path_factory.mktemp("kinds")
    path = folder / "runs.db"
    runs, partner = {}, {}
    base = RunConfig(steps=6, device="cpu")
    for name in GALLERY:
        module = importlib.import_module(f"mpdiag.examples.{name}")
        script = ModelScript.from_path(EXAMPLES / f"{name}.py")
        failing = train(script, base.with_options(**module.FAILING), path)
        fixed = train(script, base.with_options(**module.FIXED), path)
        runs[f"{name} failing"], runs[f"{name} fixed"] = failing, fixed
        partner[failing], partner[fixed] = fixed, failing
    mlp = ModelScript.from_path(EXAMPLES / "mlp_digits.py")
    mixed, twin = train_pair(mlp, base.with_options(opt_level="O1"), path)
    runs["mlp_digits O1"], runs["mlp_digits FP32 twin"] = mixed, twin
    partner[mixed], partner[twin] = twin, mixed
    runs["cnn_digits O2"] = train(ModelScript.from_path(EXAMPLES / "cnn_digits.py"),
                                  base.with_options(opt_level="O2", steps=3), path)
    runs["transformer_lm bf16"] = train(ModelScript.from_path(EXAMPLES / "transformer_lm.py"),
                                        base.with_options(opt_level="bf16", steps=2), path)
    fp8 = ModelScript.from_path(EXAMPLES / "fp8_amax_jump.py")
    runs["fp8 recorded"] = train(fp8, base.with_options(opt_level="bf16", fp8=True, fp8_recipe="both"), path)
    runs["fp8-sim"] = train(fp8, base.with_options(opt_level="fp8-sim"), path)
    runs["fp8 block-scaled"] = train(fp8, base.with_options(opt_level="bf16", fp8=True, fp8_blocks="mxfp8,nvfp4",
                                                            steps=3), path)
    partner[runs["fp8 recorded"]], partner[runs["fp8-sim"]] = runs["fp8-sim"], runs["fp8 recorded"]
    runs["collapsed scale 2^-83"] = train(ModelScript.from_path(EXAMPLES / "gallery_underflow.py"),
                                          base.with_options(opt_level="O1", loss_scale=2.0**-83, steps=3), path)
    runs["all skipped"] = runs["gallery_activation_overflow failing"]
    # GradScaler's fp32 scale backs off 1000x a step from 1e-40 and reaches exactly 0 (a log axis cannot show 0)
    runs["scale collapsed to 0"] = train(ModelScript.from_path(EXAMPLES / "gallery_activation_overflow.py"),
                                         base.with_options(opt_level="O1", init_scale=1e-40, backoff_factor=1e-3,
                                                           steps=4), path)
    # an FP32 run with an FP32 shadow: every gradient error is exactly 0 (a log axis of zeros)
    runs["O0 with shadow"] = train(mlp, base.with_options(opt_level="O0", shadow_every=2, steps=4), path)
    runs["traced O3 NaN"] = train(mlp, base.with_options(opt_level="O3", trace_modules=True, steps=4), path)
    runs["stopped at an event"] = train(mlp, base.with_options(opt_level="O3", stop_on="nonfinite"), path)

    broken = folder / "fails_at_step_3.py"
    broken.write_text(textwrap.dedent(FAILS_AT_STEP_3))
    code, out = cli(path, "run", broken, "--opt-level", "O1", "--steps", "6")
    assert code != 0 and "empty batch at step 3" in out, out
    runs["failed at step 3"] = int(Store(path).runs()["run_id"].max())
    loop = folder / "train_loop.py"
    loop.write_text(textwrap.dedent(WATCHED_LOOP))
    code, out = cli(path, "watch", "--shadow-every", "2", loop)  # with its FP32 shadow, for Findings' section
    assert code == 0, out
    runs["watched script"] = int(Store(path).runs()["run_id"].max())
    assert sorted(set(Store(path).shadow_stats(runs["watched script"])["step"])) == [2, 4]
    import subprocess

    subprocess.run([sys.executable, "-c", "import sys; from mpdiag.store import StoreWriter; "
                    "StoreWriter(sys.argv[1]).create_run(name='dies at step 0', opt_level='O1')", str(path)],
                   check=True, cwd=ROOT)
    runs["crashed at step 0"] = int(Store(path).runs()["run_id"].max())

    import torch

    from mpdiag.recording.recorder import Recorder

    recorder, train_step = own_loop(path, "still running")
    for _ in range(3):
        train_step()
    recorder.flush()
    runs["running"] = recorder.run_id
    waiting = Recorder(torch.nn.Linear(2, 2), Store(path), name="running, no step yet")  # its heartbeat keeps it running
    runs["running, no step yet"] = waiting.run_id
    with pytest.MonkeyPatch.context() as patch:
        # the running run takes no step while the module's tests run (minutes): it stays 'running', not 'stalled'
        # (tests/dashboard/test_app.py has the stalled run)
        patch.setattr("mpdiag.store.reader.STALL_S", 24 * 3600.0)
        yield path, runs, partner
    recorder.close()
    waiting.close()


def page_query(page: str, run_id: int, partner: dict) -> dict:
    if page.endswith("Compare.py"):
        return {"runs": [str(run_id), str(partner.get(run_id, 1 if run_id != 1 else 2))]}
    return {"run": str(run_id)}


def render(page, store, monkeypatch, **query):
    return app(page, store, monkeypatch, **query)


@contextlib.contextmanager
def chromium_on(store):
    """A streamlit server on ``store`` and a 1400 x 1800 page in Debian's headless Chromium: (server, page)."""
    from browser_helpers import CHROMIUM, CHROMIUM_ARGS, Server
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    server = Server(store)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            yield server, browser.new_page(viewport={"width": 1400, "height": 1800})
            browser.close()
    finally:
        server.stop()


def finite_points(chart) -> int:
    """Finite numbers in the data a chart element ships: Streamlit moves an Altair chart's datasets out of
    the spec into Arrow tables beside it; inline values stay in the spec."""
    count = 0
    for dataset in chart.datasets:
        table = pa.ipc.open_stream(dataset.data.data).read_all()
        for column in table.columns:
            if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
                values = column.to_numpy(zero_copy_only=False).astype(float)
                count += int(np.isfinite(values).sum())
    spec = json.loads(chart.spec)
    for layer in [spec, *spec.get("layer", []), *spec.get("vconcat", []), *spec.get("hconcat", [])]:
        for row in layer.get("data", {}).get("values", []) if isinstance(layer.get("data"), dict) else []:
            count += sum(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                         for v in row.values())
    return count


def empty_charts(at) -> list[str]:
    """Titles (or marks) of the charts drawn without a single finite data point."""
    empty = []
    for element in at.get("vega_lite_chart"):
        if finite_points(element.proto) == 0:
            spec = json.loads(element.proto.spec)
            empty.append(str(spec.get("title") or spec.get("mark") or spec.get("layer", [{}])[0].get("mark")))
    return empty


def layout(node) -> tuple:
    """The kinds of elements a rendered page shows, in order, nested as on the page (no text, no data)."""
    children = getattr(node, "children", None)
    inner = tuple(layout(child) for child in children.values()) if isinstance(children, dict) else ()
    return (getattr(node, "type", type(node).__name__), inner)


@pytest.fixture(scope="module")
def rendered(kinds):
    """Per page, per kind (one entry, "every kind", for a page that reads no run): what the page rendered under
    AppTest (its problems, whether it drew a chart, its layout), rendered once for the module: the AppTest test
    judges it, the Chromium sweep reads which views draw charts."""
    store, runs, partner = kinds
    cache: dict[str, dict[str, tuple[list | str, bool, tuple]]] = {}

    def of(page_file: str) -> dict[str, tuple[list | str, bool, tuple]]:
        if page_file not in cache:
            with pytest.MonkeyPatch.context() as monkeypatch:
                if page_file in READS_NO_RUN:  # one render shows them all, as the browser sweep's one load does
                    cache[page_file] = {"every kind": _judged(render(page_file, store, monkeypatch))}
                else:
                    cache[page_file] = {kind: _judged(render(page_file, store, monkeypatch,
                                                             **page_query(page_file, run_id, partner)))
                                        for kind, run_id in runs.items()}
        return cache[page_file]

    return of


def _judged(at) -> tuple[list | str, bool, tuple]:
    """(what is wrong with a rendered page, whether it drew a chart, its layout)."""
    if at.exception:
        problems = [e.value for e in at.exception]
    elif empty := empty_charts(at):
        problems = f"charts without a finite point: {empty}"
    else:
        problems = page_chart_problems(at)
    return problems, bool(at.get("vega_lite_chart")), layout(at.main)


@pytest.mark.parametrize("page_file", PAGES)
def test_the_page_renders_every_kind_of_run(page_file, rendered):
    problems = {kind: found for kind, (found, _, _) in rendered(page_file).items() if found}
    assert not problems, problems


def test_the_store_holds_every_kind(kinds):
    """The fixture made what it says: statuses and the runs' own evidence."""
    store, runs, _ = kinds
    table = Store(store).runs().set_index("run_id")
    status = lambda kind: table.loc[runs[kind], "status"]  # noqa: E731
    assert status("failed at step 3") == "failed" and status("crashed at step 0") == "crashed"
    assert status("running") == "running" and status("watched script") == "finished"
    steps = Store(store).steps(runs["failed at step 3"])
    assert steps["step"].tolist() == [0, 1, 2]
    assert (Store(store).steps(runs["all skipped"])["skipped"] == 1).all()
    assert (Store(store).steps(runs["collapsed scale 2^-83"])["loss_scale"] == 2.0**-83).all()
    assert Store(store).steps(runs["scale collapsed to 0"])["loss_scale"].iloc[-1] == 0.0
    assert (Store(store).shadow_stats(runs["O0 with shadow"])["rel_error"] == 0).all()
    assert not Store(store).fp8(runs["fp8 recorded"]).empty
    assert set(Store(store).fp8(runs["fp8 block-scaled"])["recipe"]) >= {"mxfp8", "nvfp4"}
    stopped = Store(store).runs().set_index("run_id").loc[runs["stopped at an event"]]
    assert stopped["status"] == "stopped" and stopped["steps_done"] < 6
    assert "nonfinite" in set(Store(store).events(runs["stopped at an event"])["kind"])


def test_home_shows_a_running_runs_progress_without_a_planned_total(kinds, monkeypatch):
    """The Recorder in a user's loop (and watch) stores no total: the home page once crashed on it."""
    store, runs, _ = kinds
    at = render("app.py", store, monkeypatch)
    assert not at.exception
    captions = re.sub(r"\\(.)", r"\1", " ".join(c.value for c in at.caption))  # plain() escapes markdown
    recorded = len(Store(store).steps(runs["running"]))  # steps 0 .. recorded - 1, as its loss curve draws them
    assert f"still running · custom: {recorded} steps recorded (its script decides how many)" in captions, captions
    assert "No step recorded yet." in captions


URL_PATHS = {"app.py": "", "pages/1_Gradients.py": "Gradients", "pages/2_Loss_scale.py": "Loss_scale",
             "pages/3_Compare.py": "Compare", "pages/5_Findings.py": "Findings", "pages/6_FP8.py": "FP8",
             "pages/7_Modules.py": "Modules", "pages/8_Plan.py": "Plan"}
SINGLE_RUN_PAGES = {"pages/1_Gradients.py", "pages/2_Loss_scale.py", "pages/5_Findings.py", "pages/6_FP8.py",
                    "pages/7_Modules.py", "pages/8_Plan.py"}  # a "Run" selector; Compare picks several, the home page none


@pytest.fixture(scope="module")
def chromium(kinds):
    """One server on the kinds store and one Chromium page for the module's browser tests: (server, page,
    console), where console collects the page's errors, failed responses and uncaught exceptions."""
    store, _, _ = kinds
    with chromium_on(store) as (server, page):
        console: list[str] = []
        page.on("console", lambda message: console.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda error: console.append(str(error)))
        page.on("response", lambda response: console.append(f"{response.status} {response.url}")
                if response.status >= 400 else None)
        yield server, page, console


def views(page_file: str, runs: dict, partner: dict, drawn: dict) -> list[tuple[str, dict | None]]:
    """What the browser sweep opens on a page: (what it shows, the query opening it by URL or None when the
    page's own run picker chooses it). The home page reads no ?run= (it lists every kind in its table and live
    panels): one load. A single-run page is opened once by its URL and every other kind is chosen in its picker,
    as a user switches runs (no reload: ~1.5 s of the browser's CPU a kind saved), each kind whose page draws a
    chart (``drawn``: the AppTest render's (problems, charted, layout) by kind), and of the kinds that draw none
    one per layout (the FP8 page says the same two sentences to the 28 kinds without FP8 statistics: what a
    browser adds there, a console error, one view of that layout shows). Compare shows four runs at once, kinds
    and their partners together, each kind in one selection: a load of Compare costs the most."""
    if page_file == "app.py":
        return [("every kind", {})]
    if page_file == "pages/3_Compare.py":
        ids = list(runs.items())
        groups = [ids[i:i + 4] for i in range(0, len(ids), 4)]
        return [(" + ".join(kind for kind, _ in group), {"runs": [str(run_id) for _, run_id in group]
                                                          + ([] if len(group) > 1 else [str(partner.get(group[0][1], 1))])})
                for group in groups]
    layouts, shown = set(), []
    for kind in runs:
        _, charted, page_layout = drawn[kind]
        if charted or page_layout not in layouts:
            layouts.add(page_layout)
            shown.append(kind)
    return [(kind, page_query(page_file, runs[kind], partner) if i == 0 else None) for i, kind in enumerate(shown)]


@pytest.mark.browser
@pytest.mark.parametrize("page_file", list(URL_PATHS))
def test_the_page_shows_every_kind_in_chromium(page_file, kinds, chromium, rendered):
    """Real Chromium, 1400 px wide: no exception on the page, no error in the browser console, no chart
    drawn past its element: for every kind of run whose page draws a chart, and one kind of each layout that draws
    none (``views``). With MPDIAG_SCREENSHOTS=1, one full-page screenshot per view
    (artifacts/screenshots/kinds/) to look at. One test a page, so that each stays well inside the per-test timeout
    on CI's two cores."""
    from browser_helpers import SHOTS, charts_fit, choose_run, settle

    _, runs, partner = kinds
    server, page, console = chromium
    path = URL_PATHS[page_file]
    problems, shots = {}, SHOTS / "kinds"
    shots.mkdir(parents=True, exist_ok=True)
    # Streamlit's own probe, opening a page by its URL: /<Page>/_stcore/... answers 404 before it tries
    # /_stcore/... (streamlit/streamlit#7074); each gives one more console line, which is all it may add
    benign = re.compile(rf"404 {re.escape(server.url)}/\w+/_stcore/")
    drawn = rendered(page_file) if page_file in SINGLE_RUN_PAGES else {}
    for shown, query in views(page_file, runs, partner, drawn):
        console.clear()
        if query is None:
            choose_run(page, runs[shown])
        else:
            page.goto(f"{server.url}/{path}?" + "&".join(f"{k}={v}" for k, vs in query.items()
                                                         for v in (vs if isinstance(vs, list) else [vs])))
            settle(page)
        found = []
        if page.locator("[data-testid='stException']").count():
            found.append(page.locator("[data-testid='stException']").first.inner_text()[:300])
        probes = [text for text in console if benign.match(text)]
        said = [text for text in console if not benign.match(text)]
        for _ in probes:
            if "status of 404" in " ".join(said):
                said.remove(next(text for text in said if "status of 404" in text))
        found += [f"console: {text[:200]}" for text in said]
        found += charts_fit(page)
        if found:
            problems[shown] = found
        if os.environ.get("MPDIAG_SCREENSHOTS"):
            name = re.sub(r"[^\w+-]+", "_", shown)[:120]
            page.screenshot(path=str(shots / f"{name}-{path or 'home'}.png"), full_page=True)
    assert not problems, problems


def test_runs_table_counts_whole_steps_and_leaves_out_an_unknown_total(kinds):
    from mpdiag.analysis.summaries import runs_table

    store, runs, _ = kinds
    everything = Store(store).runs()
    table = runs_table(everything, [[] for _ in range(len(everything))]).set_index("run")
    assert table.loc[runs["failed at step 3"], "steps"] == "3 / 6"
    assert table.loc[runs["watched script"], "steps"] == "6"  # the script decided: no planned total
    assert table.loc[runs["all skipped"], "skipped"] == "6 of 6"


def test_a_final_runs_health_badge_follows_a_probe_stored_after_it_was_cached(tmp_path, monkeypatch):
    """Badges of final runs are cached; a probe stored afterwards (by the Findings page or `diagnose`, in
    another process) adds a finding, and the badge must show it on the next render, not the cached one."""
    path = tmp_path / "runs.db"
    run_id = train(ModelScript.from_path(EXAMPLES / "mlp_digits.py"), RunConfig(opt_level="O1", steps=3, device="cpu"),
                   path)

    def badge():
        at = render("app.py", path, monkeypatch)
        assert not at.exception
        return at.dataframe[0].value.set_index("run").loc[run_id, "health"]

    assert badge() == "healthy"
    with StoreWriter(path) as writer:
        writer.add_probe(run_id, "scale-linearity", {"ok": True, "failing": ["0.weight"], "scales": [1.0, 1024.0],
                                                     "ratios": {"0.weight": 1024.0}})
    assert badge() == "1 error"


@pytest.mark.browser
def test_zooming_one_loss_scale_panel_zooms_them_all_in_chromium(kinds, chromium):
    """Scrolling over the loss panel rescales the steps of the loss-scale panel above it (one shared x scale
    bound to a zoom): the top panel's pixels change although the mouse never touched it."""
    import io

    from browser_helpers import settle
    from PIL import Image, ImageChops

    _, runs, _ = kinds
    server, page, _ = chromium
    page.goto(f"{server.url}/Loss_scale?run={runs['mlp_digits O1']}")
    settle(page)
    chart = page.locator("[data-testid='stVegaLiteChart']").first
    box = chart.bounding_box()
    top = lambda: Image.open(io.BytesIO(chart.screenshot())).convert("RGB").crop((0, 0, int(box["width"]), 200))  # noqa: E731
    before = top()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] - 120)  # over the loss panel
    page.mouse.wheel(0, -400)
    page.wait_for_timeout(800)
    assert ImageChops.difference(before, top()).getbbox() is not None, "the loss-scale panel did not zoom"


@pytest.mark.browser
def test_clicking_a_heatmap_column_shows_that_step_below_in_chromium(kinds, chromium):
    """On Gradients, a click on the heatmap's first column (step 0) moves the step slider and the step's
    histogram to step 0 (the page opens on the last step). The click height is searched: cells lie only
    where the gradient's exponents are."""
    from browser_helpers import settle

    _, runs, _ = kinds
    server, page, _ = chromium
    page.goto(f"{server.url}/Gradients?run={runs['mlp_digits O1']}")
    settle(page, "click a column")
    # the histogram's title: a loss-scaled run opens on S·g, what its FP16 backward held
    assert page.get_by_text(re.compile("step 5: S·g at this step's loss scale .*, coloured")).count() == 1
    box = page.locator("[data-testid='stVegaLiteChart']").first.bounding_box()
    for y in range(int(box["y"] + 30), int(box["y"] + box["height"] - 60), 12):
        page.mouse.click(box["x"] + 75, y)  # just right of the y axis: inside step 0's column
        page.wait_for_timeout(700)
        if page.get_by_text(re.compile("step 0: S·g at this step's loss scale .*, coloured")).count():
            break
    else:
        raise AssertionError("no click on the heatmap's first column showed step 0")


def test_a_live_gradients_page_reads_only_the_steps_logged_since_its_last_read(tmp_path, monkeypatch):
    """The issue's 'live refresh reads only new steps': the second render of a running run's Gradients page
    asks the store for the chosen tensor's histograms after the last step it already holds, and shows all."""
    import time


    path = tmp_path / "live.db"
    recorder, train_step = own_loop(path, "live")

    def train_until(logged: int) -> None:
        while len(Store(path).logged_steps(recorder.run_id)) < logged:
            train_step()
            recorder.flush()
            time.sleep(0.2)

    asked = []
    real = Store.histogram_columns  # the heatmap's read since schema 15 (the bucket sums or the exact rows)
    monkeypatch.setattr(Store, "histogram_columns", lambda self, run_id, tensor, max_columns, split_at=(), from_step=0: (
        asked.append((tensor, from_step, None)), real(self, run_id, tensor, max_columns, split_at, from_step))[1])
    try:
        train_until(2)
        at = render("pages/1_Gradients.py", path, monkeypatch, run=str(recorder.run_id), tensor="weight")
        assert not at.exception
        first = Store(path).logged_steps(recorder.run_id)
        train_until(len(first) + 2)
        asked.clear()
        at.run()
        assert not at.exception
        whole = [a for a in asked if a[0] == "weight" and a[2] is None]
        # from_step is the first step read: an exact row after the last one held
        assert whole and all(since > first[-1] for _, since, _ in whole), asked
        heat = next(c.proto for c in at.get("vega_lite_chart") if "click a column" in c.proto.spec)
        drawn = set()
        for dataset in heat.datasets:
            table = pa.ipc.open_stream(dataset.data.data).read_all()
            if "step_start" in table.column_names:
                drawn |= set(table.column("step_start").to_pylist())
        # the heatmap is drawn from the rows already held plus the new ones: every logged step
        assert set(range(len(first) + 2)) <= drawn, drawn
    finally:
        recorder.close()

