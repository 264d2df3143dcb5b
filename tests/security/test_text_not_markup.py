"""Text, not markup: every user-supplied string reaches the browser as text.

A store is filled with runs whose run name, script file name, script ``name``, tensor (module) names, error
text, tags and note are Markdown/HTML payloads: an image beacon, an onerror handler, a link, a closing code fence. Every page
is rendered (the Upload page with its check done, so the check's summary and problems show) and every string
the page sends in an element that Streamlit renders as Markdown is inspected: no image, no HTML element and no
link to anything but the app's own pages may be built from them. Elements that Streamlit shows as text
(st.code, st.text, dataframes, chart specs, selectbox and multiselect options: checked in a browser, 1.67
draws those as plain text) are exempt.
"""

import re
import textwrap

import pytest
from conftest import ROOT
from google.protobuf.json_format import MessageToDict
from streamlit.testing.v1 import AppTest

from mpdiag.dashboard.actions import store_code
from mpdiag.dashboard.frame import HOME_LABEL_CSS
from mpdiag.dashboard.untrusted import plain
from mpdiag.store import Store, StoreWriter
from mpdiag.training.runner import RunConfig, train
from mpdiag.training.script import ModelScript

PAYLOADS = ["![x](http://evil/beacon.png)", "<img src=x onerror=alert(1)>", "[link](http://evil)", "```\n# after the fence",
            ":red[colour] $x^2$ **bold**"]
EVIL = " ".join(PAYLOADS)
#: module names cannot contain '.', so the tensor-name payloads avoid it
EVIL_MODULE = "<img src=x onerror=alert(1)> [link](http:evil) ![x](http:evil)"
MODEL_SCRIPT = "A model script (build(device))"  # the Upload page's second kind
PAGES = ["app.py", "pages/1_Gradients.py", "pages/2_Loss_scale.py", "pages/3_Compare.py", "pages/4_Upload.py",
         "pages/5_Findings.py", "pages/6_FP8.py"]
#: element kinds Streamlit renders as text, and proto fields that carry no displayed text
TEXT_ELEMENTS = {"code", "text", "dataframe", "arrow_data_frame", "vega_lite_chart", "arrow_vega_lite_chart", "json"}
PLAIN_TEXT_FIELDS = {"options", "default", "rawValue", "rawValues", "value", "id", "formId", "elementType", "type", "pageName",
                     "pageScriptHash", "queryString", "url"}

SCRIPT = textwrap.dedent(f"""
    import torch
    from torch import nn

    from mpdiag.examples.data import digits, labelled_batches

    FAIL_AT = {{fail_at}}


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({{{EVIL_MODULE!r}: nn.Linear(64, 32), "out": nn.Linear(32, 10)}})

        def forward(self, x):
            return self.layers["out"](torch.relu(self.layers[{EVIL_MODULE!r}](x.flatten(1))))


    def build(device):
        x, y, _, _ = digits(device)
        calls = []

        def loss_fn(model, batch):
            calls.append(1)
            if FAIL_AT is not None and len(calls) > FAIL_AT:
                raise RuntimeError({EVIL!r})
            inputs, labels = batch
            return nn.functional.cross_entropy(model(inputs), labels)

        return {{"name": {EVIL!r}, "model": Net(), "optimizer": lambda p: torch.optim.Adam(p, lr=1e-3),
                 "batches": labelled_batches(x, y, batch_size=32, device=device), "loss_fn": loss_fn}}
""")


@pytest.fixture(scope="module")
def evil_store(tmp_path_factory):
    """Run 1: a finished O1 run (with --fp8) named EVIL of a script named EVIL.py whose model's name and a module are
    payloads; run 2 its twin at O0; run 3 the failing variant whose error text is EVIL."""
    path = tmp_path_factory.mktemp("evil") / "runs.db"
    good = ModelScript(filename=EVIL + ".py", source=SCRIPT.replace("{fail_at}", "None"))
    train(good, RunConfig(opt_level="O1", steps=4, device="cpu", name=EVIL, fp8=True), path)  # FP8 page: module names
    train(good, RunConfig(opt_level="O0", steps=4, device="cpu", name=EVIL + " fp32"), path)
    failing = ModelScript(filename=EVIL + " fails.py", source=SCRIPT.replace("{fail_at}", "2"))
    train(failing, RunConfig(opt_level="O1", steps=4, device="cpu", name=EVIL + " fails"), path)
    # what a person says about a run: payload tags (each within the tag limit; no line breaks in a tag) and note
    with StoreWriter(path) as writer:
        for run_id in (1, 3):
            writer.tag_run(run_id, [p for p in PAYLOADS if "\n" not in p])
            writer.set_user_note(run_id, EVIL)
    # training code whose name and files are payloads, with an import its check will name
    store_code(Store(path), [(EVIL_MODULE + ".py", b"x = 1\n"),
                             ("train.py", b'import not_installed_anywhere\nif __name__ == "__main__":\n    pass\n')])
    return path


def markdown_strings(at) -> list[str]:
    """Every string the rendered page sends in an element Streamlit renders as Markdown (labels, help, bodies,
    captions, alerts, toasts, progress text, metric and expander labels, radio options)."""
    found, types = [], set()

    def strings(obj, field=None):
        if isinstance(obj, str):
            if field not in PLAIN_TEXT_FIELDS:
                found.append(obj)
        elif isinstance(obj, dict):
            for key, value in obj.items():
                strings(value, key)
        elif isinstance(obj, list):
            for value in obj:
                strings(value, field)

    def walk(node):
        proto = getattr(node, "proto", None)
        if proto is not None:
            as_dict = MessageToDict(proto)
            if node.type == "radio":  # radio options render Markdown, unlike selectbox/multiselect options
                as_dict["labels"] = as_dict.pop("options", [])
            constant = as_dict.get("body") == HOME_LABEL_CSS  # the app's own stylesheet, built from no input
            if node.type not in TEXT_ELEMENTS and not constant:
                strings(as_dict)
            types.add(node.type)
        for child in getattr(node, "children", {}).values():
            walk(child)

    walk(at._tree)
    assert "selectbox" in types and "caption" in types, types  # the walk reached the page's elements
    return found


def built_markup(markdown: str) -> list[str]:
    """Images, HTML elements, links to other sites and code fences that ``markdown`` would build. Escaped
    characters (backslash + ASCII punctuation) are inert and removed first."""
    live = re.sub(r"\\[!-/:-@\[-`{-~]", "\x00", markdown)
    problems = re.findall(r"!\[[^\]]*\]\([^)]*\)", live)  # image
    problems += re.findall(r"<[A-Za-z!/][^>]*>?", live)  # HTML element or comment
    problems += re.findall(r"\[[^\]]*\]\((?![/#])[^)]*\)", live)  # a link, unless to one of the app's own pages
    problems += re.findall(r"```", live)  # a fence that could close or open a code block
    return problems


def test_the_checker_sees_each_payload_unescaped_and_nothing_escaped():
    for payload in PAYLOADS[:4]:  # the last one styles text only: escaped like the rest, not flagged here
        assert built_markup(payload), payload
    for payload in PAYLOADS:
        assert not built_markup(plain(payload)), payload
        assert re.sub(r"\\(.)", r"\1", plain(payload)).replace("  \n", "\n") == payload  # reads as typed
    assert not built_markup("[See the evidence on the Loss scale page](/Loss_scale?run=1)")


@pytest.mark.parametrize("page", PAGES)
def test_user_supplied_text_builds_no_markup_on_any_page(page, evil_store, monkeypatch):
    monkeypatch.setenv("MPDIAG_STORE", str(evil_store))
    views = []
    for run in ("1", "3"):
        at = AppTest.from_file(str(ROOT / page), default_timeout=120)
        at.query_params["run"] = run
        if page.endswith("Compare.py"):
            at.query_params["runs"] = ["1", "2"]
        at.run()
        if page.endswith("Upload.py"):
            # training code (the default kind), its arguments a payload, checked; then a model script, checked
            at.text_input(key=f"args_{at.selectbox(key='code').value}").set_value(EVIL).run()
            at.button(key="code_check").click().run()
            at.button(key="code_check_confirm").click().run()
            assert not at.exception, [e.value for e in at.exception]
            assert any("anywhere" in w.value for w in at.warning), "the check names the missing import"
            views.append(at)
            at = AppTest.from_file(str(ROOT / page), default_timeout=120)
            at.query_params["run"] = run
            at.run()
            at.radio(key="kind").set_value(MODEL_SCRIPT).run()
            at.button(key="check").click().run()
            at.button(key="check_confirm").click().run()
        assert not at.exception, [e.value for e in at.exception]
        views.append(at)
    said = [s for at in views for s in markdown_strings(at)]
    assert any("evil" in s for s in said) or page.endswith(("Loss_scale.py", "Compare.py")), \
        "the payload should reach this page's Markdown (escaped)"
    bad = {s: built_markup(s) for s in said if built_markup(s)}
    assert not bad, bad


def test_renaming_tagging_and_noting_a_run_on_the_runs_page_builds_no_markup(evil_store, tmp_path, monkeypatch):
    """The Runs page's management panel with payloads typed in: the name, tags and note it saves, and every
    message it says about them, reach the browser as text."""
    path = tmp_path / "runs.db"
    path.write_bytes(evil_store.read_bytes())
    monkeypatch.setenv("MPDIAG_STORE", str(path))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120).run()
    at.selectbox(key="manage_run").set_value(1).run()
    views = []
    for kind, key, value, button in (("text_input", "name", EVIL.replace("\n", " "), "manage_rename"),
                                     ("multiselect", "tags", [p for p in PAYLOADS if "\n" not in p], "manage_tag"),
                                     ("text_area", "note", EVIL, "manage_note"),
                                     ("text_input", "name", "\x1b" + EVIL.replace("\n", " "), "manage_rename")):
        getattr(at, kind)(key=f"manage_{key}_1").set_value(value).run()
        at.button(key=button).click().run()
        assert not at.exception, [e.value for e in at.exception]
        views.append(markdown_strings(at))
    at.button(key="manage_delete").click().run()  # the confirmation names the run (as st.text)
    views.append(markdown_strings(at))
    run = Store(path).run(1)
    assert run["name"] == EVIL.replace("\n", " ") and run["user_note"] == EVIL  # saved as typed
    said = [s for view in views for s in view]
    assert any("evil" in s and "is now named" in s for s in said) and any("control characters" in s for s in said)
    bad = {s: built_markup(s) for s in said if built_markup(s)}
    assert not bad, bad


def test_console_output_reaches_the_pages_as_text_only(evil_store, tmp_path, monkeypatch):
    """A run's console output (what its script printed: payloads, an ANSI colour, a bidi override) is shown in
    st.code on the Findings page and the Runs page, never in an element that renders Markdown; the escape
    characters are written out, not sent."""
    path = tmp_path / "runs.db"
    path.write_bytes(evil_store.read_bytes())
    printed = EVIL + "\n\x1b[31mred\x1b[0m \u202eevil\n"
    with StoreWriter(path) as writer:
        writer.set_run_output(1, printed, len(printed.encode()))
    monkeypatch.setenv("MPDIAG_STORE", str(path))
    for page in ("pages/5_Findings.py", "app.py"):
        at = AppTest.from_file(str(ROOT / page), default_timeout=120)
        at.query_params["run"] = "1"
        at.run()
        if page == "app.py":
            at.selectbox(key="output_run").set_value(1).run()
        assert not at.exception, [e.value for e in at.exception]
        codes = [c.value for c in at.code if "onerror" in c.value and "\\x1b[31mred" in c.value]
        assert codes and "\x1b" not in codes[0] and "\\u202eevil" in codes[0] and "```" in codes[0]
        said = markdown_strings(at)
        assert not any("\\x1b[31mred" in s or "\x1b[31mred" in s for s in said)  # the output is in no Markdown
        bad = {s: built_markup(s) for s in said if built_markup(s)}
        assert not bad, bad
