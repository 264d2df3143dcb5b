"""The one options table: torch-free, and the CLI (run, rerun and watch), both forms, watch's validation and the
stored config all follow it."""

import argparse
import dataclasses
import json
import re

import pytest
from conftest import EXAMPLES, ROOT, imports_torch
from streamlit.testing.v1 import AppTest

from mpdiag import Store
from mpdiag.cli import build_parser
from mpdiag.dashboard.frame import FORM_KEYS
from mpdiag.options import (
    COMMAND_OPTIONS,
    LEVELS,
    MAX_NAME_CHARS,
    OPTIONS,
    WATCH_OPTIONS,
    WATCH_RERUN_OPTIONS,
    ConfigError,
    RunConfig,
    fix_said,
    flag,
    scale_text,
)
from mpdiag.training.policies import POLICIES
from mpdiag.training.runner import rerun_plan, train
from mpdiag.training.script import ModelScript
from mpdiag.training.watch import WatchConfig


def test_the_configuration_validates_without_importing_torch():
    assert not imports_torch("from mpdiag.options import RunConfig\n"
                             "RunConfig(opt_level='O2', init_scale=1024.0, device='cuda:1').validate()")


def test_one_policy_class_per_level_of_the_table():
    assert list(POLICIES) == list(LEVELS)


def test_the_option_table_is_the_dataclass():
    assert list(OPTIONS) == [f.name for f in dataclasses.fields(RunConfig)]
    assert all(getattr(RunConfig(), name) == spec.default for name, spec in OPTIONS.items())


def _flags(parser: argparse.ArgumentParser, command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {a.dest: a for a in sub._actions}


@pytest.mark.parametrize("command", ["run", "rerun"])
def test_every_option_has_a_flag_or_says_why_not(command):
    actions = _flags(build_parser(), command)
    for name, spec in OPTIONS.items():
        if spec.no_flag:
            assert name not in actions
        else:
            assert flag(name) in actions[name].option_strings and spec.help in actions[name].help


@pytest.mark.parametrize("command", ["run", "watch"])
def test_every_flag_of_a_command_is_an_option_of_its_mode_with_the_tables_help_and_default(command):
    """No flag is written by hand beside the table: each option of the mode has its flag, help and default, and
    the command has no other option flags but -m (watch's module), --pair (run's twin) and --store."""
    actions = _flags(build_parser(), command)
    table = WATCH_OPTIONS if command == "watch" else {n: s for n, s in OPTIONS.items() if not s.no_flag}
    for name, spec in table.items():
        assert actions[name].option_strings[0] == flag(name)
        assert spec.help in actions[name].help and actions[name].default == spec.default
    flags = {dest for dest, action in actions.items() if action.option_strings}
    assert flags - set(table) <= {"help", "module", "pair", "store"}


def _watch_form():
    import streamlit as st

    from mpdiag.dashboard.frame import watch_options_form

    st.session_state["options"] = watch_options_form("t")


def test_every_watch_option_has_a_widget_built_from_its_entry_or_says_why_not():
    at = AppTest.from_function(_watch_form, default_timeout=30).run()
    widgets = {w.key: w for kind in ("selectbox", "number_input", "checkbox", "text_input", "multiselect")
               for w in getattr(at, kind)}
    shown = [name for name, spec in WATCH_OPTIONS.items() if not spec.no_widget]
    assert set(widgets) == {f"t_watch_{FORM_KEYS[name]}" for name in shown}
    for name in shown:
        hints = dict(WATCH_OPTIONS[name].widget)
        widget = widgets[f"t_watch_{FORM_KEYS[name]}"]
        assert (widget.label, widget.help) == (hints["label"], hints.get("help", WATCH_OPTIONS[name].help))
    assert at.session_state["options"] == {name: WATCH_OPTIONS[name].default for name in shown}


def test_a_watch_config_holds_the_tables_watch_options_and_stores_them_for_a_rerun():
    defaults = {f.name: f.default for f in dataclasses.fields(WatchConfig)}
    assert {name: defaults[name] for name in WATCH_RERUN_OPTIONS} == \
        {name: WATCH_OPTIONS[name].default for name in WATCH_RERUN_OPTIONS}
    assert set(WATCH_RERUN_OPTIONS) - {"name"} <= set(WatchConfig(target="train.py").settings())


@pytest.mark.parametrize("name", WATCH_RERUN_OPTIONS)
def test_watch_refuses_what_the_table_refuses_naming_the_flag(name, tmp_path):
    spec = WATCH_OPTIONS[name]
    script = tmp_path / "train.py"
    script.write_text("")
    bad = {"int": (spec.minimum or 0) - 1, "float": spec.above, "level": "O9", "flag": "yes", "text": 5,
           "events": "nan"}[spec.kind]
    assert not spec.accepts(bad)
    with pytest.raises(ConfigError, match=re.escape(flag(name))):
        WatchConfig(target=str(script), **{name: bad}).validate()
    WatchConfig(target=str(script), **{name: spec.default}).validate()


def test_a_bad_watch_flag_is_refused_in_one_line_before_a_store_is_created(tmp_path, capsys):
    from mpdiag.cli import main

    script, db = tmp_path / "train.py", tmp_path / "runs.db"
    script.write_text("")
    assert main(["watch", "--store", str(db), "--every", "x", str(script)]) == 2
    assert "--every must be an integer >= 1, got 'x'" in capsys.readouterr().err and not db.exists()


def test_every_option_has_a_widget_in_the_run_form_or_says_why_not(tmp_path, monkeypatch):
    monkeypatch.setenv("MPDIAG_STORE", str(tmp_path / "form.db"))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=30).run()
    assert at.selectbox(key="new_level").value == "O1"  # a level with a dynamic scale: every widget is shown
    keys = {w.key for kind in ("selectbox", "number_input", "radio", "select_slider", "checkbox", "text_input",
                               "multiselect")
            for w in getattr(at, kind)}
    without = {name for name, spec in OPTIONS.items() if spec.no_widget}
    assert set(FORM_KEYS) == set(OPTIONS) - without
    assert {f"new_{suffix}" for suffix in FORM_KEYS.values()} <= keys


def _run_form():
    import streamlit as st

    from mpdiag.dashboard.frame import run_options_form

    st.session_state["options"] = run_options_form("t")


def _with_widget(monkeypatch, name: str, table: dict = OPTIONS, **hints) -> None:
    """Change option ``name``'s widget hints in the options table (``table``: OPTIONS or COMMAND_OPTIONS) for this
    test."""
    spec = table[name]
    monkeypatch.setitem(table, name, dataclasses.replace(spec, widget=tuple({**dict(spec.widget), **hints}.items())))


def test_the_run_forms_widgets_come_from_the_table(monkeypatch):
    """The widgets read their rows of the options table: relabelled there, offered other devices, parallelisms or
    another static scale to start from, given another name length, the form follows (the FP32 twin's checkbox
    too, from the command's own row); the values they set are the command line's."""
    at = AppTest.from_function(_run_form, default_timeout=30).run()
    level, device, mode = at.selectbox(key="t_level"), at.selectbox(key="t_device"), at.radio(key="t_mode")
    assert (level.label, level.value, level.options) == ("Opt level", "O1", list(LEVELS))
    assert (device.label, device.value, device.options) == ("Device", "auto", ["auto", "cpu", "cuda"])
    assert device.help.startswith(OPTIONS["device"].help + ". A CUDA device must exist")
    assert (mode.label, mode.value, mode.help) == ("Loss scaling", "level default", OPTIONS["loss_scale"].help)
    parallel, name, pair = at.selectbox(key="t_parallel"), at.text_input(key="t_name"), at.checkbox(key="t_pair")
    assert (parallel.label, parallel.value, parallel.options, parallel.disabled) == ("Parallel", "ddp",
                                                                                     ["ddp", "fsdp"], True)
    assert parallel.help.startswith(OPTIONS["parallel"].help + " (FSDP2 runs O0, O1, bf16, bf16-pure). Disabled:")
    assert (name.label, name.value, name.max_chars) == ("Run name (optional)", "", MAX_NAME_CHARS)
    assert (pair.label, pair.value) == ("Also run an FP32 (O0) twin on identical weights and batches", False)

    _with_widget(monkeypatch, "opt_level", label="Precision", help="the level")
    _with_widget(monkeypatch, "device", label="Where", choices=("cpu", "cuda:3"))
    _with_widget(monkeypatch, "loss_scale", label="Scaling", static_label="Fixed scale", static_value=2.0**5)
    _with_widget(monkeypatch, "init_scale", label="First scale")
    _with_widget(monkeypatch, "parallel", label="Sharing", choices=("fsdp", "ddp"), help="how")
    _with_widget(monkeypatch, "name", label="Call it", max_chars=12)
    _with_widget(monkeypatch, "pair", COMMAND_OPTIONS, label="With a twin", help="two runs")
    at = AppTest.from_function(_run_form, default_timeout=30).run()
    level, device = at.selectbox(key="t_level"), at.selectbox(key="t_device")
    assert (level.label, level.help, device.label, device.options) == ("Precision", "the level", "Where",
                                                                        ["cpu", "cuda:3", "auto"])  # auto: the value
    assert at.radio(key="t_mode").label == "Scaling" and at.select_slider(key="t_init").label == "First scale"
    parallel, name, pair = at.selectbox(key="t_parallel"), at.text_input(key="t_name"), at.checkbox(key="t_pair")
    assert (parallel.label, parallel.options, parallel.help) == ("Sharing", ["fsdp", "ddp"], "how. Disabled: one "
                                                                 "process has nothing to parallelize; set Processes "
                                                                 "above 1.")
    assert (name.label, name.max_chars, pair.label, pair.help) == ("Call it", 12, "With a twin", "two runs")
    device.set_value("cuda:3").run()
    at.radio(key="t_mode").set_value("static").run()
    at.text_input(key="t_name").input("short").run()
    at.checkbox(key="t_pair").check().run()
    static = at.select_slider(key="t_mode_static")
    assert (static.label, static.value) == ("Fixed scale", 2.0**5)
    assert at.session_state["options"] == {"opt_level": "O1", "device": "cuda:3", "loss_scale": 32.0,
                                           "name": "short", "pair": True}
    assert RunConfig().with_options(**{k: v for k, v in at.session_state["options"].items() if k != "pair"}) \
        .validate() is None
    at.selectbox(key="t_level").set_value("O0").run()  # O0 is the FP32 run: the twin's checkbox is disabled
    twin = at.checkbox(key="t_pair_off")
    assert (twin.label, twin.value, twin.disabled, twin.help) == ("With a twin", False, True,
                                                                  "two runs. Disabled: O0 is the FP32 run itself.")


@pytest.mark.parametrize("form, key", [(_run_form, "t_stop_on"), (_watch_form, "t_watch_stop_on")])
def test_both_forms_set_stop_on_as_the_command_line_takes_it(form, key):
    """--stop-on from a form: the events picked, skips with its count, in the text StopOn parses (the CLI's)."""
    at = AppTest.from_function(form, default_timeout=30).run()
    assert at.session_state["options"].get("stop_on", "") == ""  # default: never stop, only record
    at.multiselect(key=key).set_value(["nonfinite", "skips"]).run()
    assert at.number_input(key=f"{key}_skips").value == 5  # the events' own streak until changed
    at.number_input(key=f"{key}_skips").set_value(3).run()
    assert at.session_state["options"]["stop_on"] == "nonfinite,skips:3"
    assert RunConfig(stop_on="nonfinite,skips:3").validate() is None


def test_the_run_form_disables_stop_on_for_several_processes():
    at = AppTest.from_function(_run_form, default_timeout=30).run()
    at.multiselect(key="t_stop_on").set_value(["spike"]).run()
    assert at.session_state["options"]["stop_on"] == "spike"
    at.number_input(key="t_nproc").set_value(2).run()
    stop = at.multiselect(key="t_stop_on_off")
    assert stop.disabled and "every process would have to stop" in stop.help
    assert "stop_on" not in at.session_state["options"] and not at.error


def test_the_form_refuses_a_bad_combination_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("MPDIAG_STORE", str(tmp_path / "form.db"))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=30).run()
    at.number_input(key="new_min_scale").set_value(1024.0).run()
    at.number_input(key="new_max_scale").set_value(2.0).run()
    assert "--min-scale 1024.0 is above --max-scale 2.0" in [e.value for e in at.error]
    assert at.button(key="new_start").disabled
    at.number_input(key="new_growth_factor").set_value(1.0).run()
    assert any("--growth-factor must be a finite number > 1" in e.value for e in at.error)


def test_the_stored_config_of_a_run_round_trips(store_path):
    config = RunConfig(opt_level="O2", steps=2, seed=5, device="cpu", init_scale=512.0, growth_interval=3,
                       min_scale=2.0, name="round trip", trace_modules=True)
    run_id = train(ModelScript.from_path(EXAMPLES / "mlp_digits.py"), config, store_path)
    stored = Store(store_path).run(run_id)["config"]["run"]
    assert RunConfig.from_dict(json.loads(json.dumps(stored))) == config


def test_a_config_stored_before_the_table_is_read():
    legacy = {"opt_level": "O1", "scaling": {"loss_scale": 64.0, "init_scale": 65536.0, "growth_factor": 2.0,
                                             "backoff_factor": 0.5, "growth_interval": 2000, "min_scale": None,
                                             "max_scale": None},
              "steps": 3, "seed": 0, "every": 1, "device": "cpu", "name": None, "parent_run_id": None,
              "trace_modules": False, "shadow_every": 0}
    # every=1 was the default then; stored, it stays what that run recorded (the default is now None: thinned)
    assert RunConfig.from_dict(legacy) == RunConfig(opt_level="O1", loss_scale=64.0, steps=3, every=1, device="cpu")
    with pytest.raises(ConfigError, match="unknown run options: colour"):
        RunConfig.from_dict({**legacy, "colour": "red"})


def test_options_the_new_level_does_not_use_are_dropped_unless_given():
    parent = RunConfig(opt_level="O1", loss_scale=128.0, init_scale=1024.0, steps=7)
    assert parent.with_options(opt_level="bf16") == RunConfig(opt_level="bf16", steps=7)
    with pytest.raises(ConfigError, match="bf16 does not scale the loss; drop --init-scale"):
        parent.with_options(opt_level="bf16", init_scale=8.0).validate()
    assert parent.with_options(opt_level="O2").init_scale == 1024.0


def test_rerun_overrides_are_merged_and_checked(store_path):
    parent = train(ModelScript.from_path(EXAMPLES / "mlp_digits.py"),
                   RunConfig(opt_level="O1", steps=2, device="cpu", loss_scale=64.0, min_scale=1.0), store_path)
    _, config = rerun_plan(Store(store_path), parent, opt_level="O2", min_scale=None)
    assert (config.opt_level, config.loss_scale, config.min_scale, config.steps, config.parent_run_id) == \
        ("O2", 64.0, None, 2, parent)
    with pytest.raises(ConfigError, match="--backoff-factor must be a finite number between 0 and 1"):
        rerun_plan(Store(store_path), parent, backoff_factor=1.5)


def test_default_on_the_command_line_clears_an_inherited_optional_number():
    args = build_parser().parse_args(["rerun", "1", "--min-scale", "default", "--loss-scale", "default"])
    assert args.min_scale is None and args.loss_scale is None
    assert build_parser().parse_args(["rerun", "1", "--no-trace-modules"]).trace_modules is False
    assert not hasattr(build_parser().parse_args(["rerun", "1"]), "trace_modules")  # untyped: inherited


@pytest.mark.parametrize("form, key", [(_run_form, "t_every"), (_watch_form, "t_watch_every")])
def test_every_defaults_to_the_thinned_retention_in_the_table_the_flags_and_both_forms(form, key):
    """Issue 28: no --every means the default retention (every step to DENSE_START_STEPS, then every THIN_EVERY);
    the table's help says those numbers, both commands' flags and both forms leave it unset, and a form's typed
    value is the command line's (1: every step, as before)."""
    from mpdiag.recording.retention import DENSE_START_STEPS, THIN_EVERY

    assert OPTIONS["every"].default is None and WATCH_OPTIONS["every"].default is None
    assert f"every step for the first {DENSE_START_STEPS}, then every {THIN_EVERY}th" in OPTIONS["every"].help
    for command in ("run", "watch"):
        assert _flags(build_parser(), command)["every"].default is None
    at = AppTest.from_function(form, default_timeout=30).run()
    widget = at.number_input(key=key)
    assert widget.value is None and at.session_state["options"].get("every") is None  # unset: the default
    widget.set_value(1).run()
    assert at.session_state["options"]["every"] == 1
    assert RunConfig(every=1).validate() is None and RunConfig().validate() is None


def test_a_loss_scale_is_written_one_way_everywhere():
    """options.scale_text is the one writer of a loss scale (runs table, Compare, findings, events, rerun names):
    powers of two but 1 as 2^k, so GradScaler's 2^16 never reads 65,536 beside a 2^28 in one column, nor 0.125
    beside 2^-6 in two findings (a user's trial); other scales as their number."""
    assert [scale_text(2.0**k) for k in (16, 15, 35, 3, -1, -3, -83)] == ["2^16", "2^15", "2^35", "2^3", "2^-1",
                                                                          "2^-3", "2^-83"]
    assert [scale_text(v) for v in (1.0, 1000.0, 0.0, 3.0, 0.3)] == ["1", "1,000", "0", "3", "0.3"]
    assert scale_text(2.0**16, digits=True) == "2^16 (65,536)" and scale_text(2.0**-20, digits=True) == "2^-20"
    assert (scale_text(float("nan")), scale_text(float("inf")), scale_text("dynamic")) == ("not recorded",
                                                                                          "not finite", "dynamic")
    assert scale_text(134217728.0) == "2^27"  # an event wrote 134217728.0, which read as a streak's length


def test_a_fix_is_said_as_the_way_the_run_was_recorded_can_make_it():
    """Findings state a fix once, as data (Finding.fix), and their advice names it through options.fix_said: as
    mpdiag's options, runnable as written, for `mpdiag run` and watch; as the change in the loop for a Recorder's
    run, which takes no option (--init-scale 2^15 was advised to one)."""
    rescale = {"loss_scale": "dynamic", "init_scale": 2.0**23}
    for how in ("run", "watch"):
        assert fix_said({"opt_level": "bf16"}, how) == "--opt-level bf16"
        assert fix_said(rescale, how) == "--loss-scale dynamic --init-scale 8388608 (2^23)"
    assert fix_said({"init_scale": 0.125}, "run") == "--init-scale 0.125 (2^-3)"
    assert fix_said({"opt_level": "bf16"}, "recorder") == "BF16 autocast without a GradScaler"
    assert fix_said({"opt_level": "O2"}, "recorder").startswith("O2-style mixed precision")
    assert fix_said(rescale, "recorder") == "a dynamic GradScaler(init_scale=2**23)"
    assert "--" not in " ".join(fix_said({"opt_level": level}, "recorder") for level in ("O0", "O1", "O2", "bf16"))


def test_a_watched_runs_rerun_takes_a_name_of_its_own(tmp_path):
    """rerun_config's parent name is positional only: the Plan page's Verify passed the rerun's name too, which
    met it as a second ``name`` (TypeError, shown as a traceback)."""
    from mpdiag.training.watch_config import rerun_config

    (tmp_path / "train.py").write_text("")
    settings = {"argv": ["train.py"], "cwd": str(tmp_path), "opt_level": None, "init_scale": None}
    assert rerun_config(3, "train.py", settings, name="my rerun", opt_level="bf16").name == "my rerun"
    assert rerun_config(3, "train.py", settings, opt_level="bf16").name == "train.py ↻ bf16"
