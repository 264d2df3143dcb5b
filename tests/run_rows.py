"""A run's row as the store file holds it, and the check that its columns say what its stored configuration says.

A run's configuration is stored in two shapes: the run row's columns (level, steps, seed, loss scaling, ...) and
its JSON ``config``. The expectation here is written from the documented options (docs/cli.md: the opt levels and
their loss scaling), never computed by mpdiag's own code; the row is read with sqlite3, not mpdiag's reader.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3

#: the loss scaling each opt level uses unless --loss-scale says otherwise (docs/cli.md)
LEVEL_SCALING = {"O0": None, "O1": "dynamic", "O2": "dynamic", "O3": 1.0, "bf16": None, "bf16-pure": None,
                 "fp8-sim": None}
#: the dynamic loss scaler's options, stored as columns of a dynamically scaled run
DYNAMIC_OPTIONS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "min_scale", "max_scale")


def stored_row(store_path, run_id: int) -> dict:
    """The runs table's row of ``run_id``, its JSON config parsed."""
    with contextlib.closing(sqlite3.connect(store_path)) as conn:
        conn.row_factory = sqlite3.Row
        row = dict(conn.execute("SELECT * FROM runs WHERE run_id = ?", (int(run_id),)).fetchone())
    row["config"] = json.loads(row["config"]) if row["config"] is not None else None
    return row


def assert_columns_say_the_config(row: dict) -> None:
    """The row's columns equal what its configuration says: ``mpdiag run``'s options (``config["run"]``) or
    ``mpdiag watch``'s settings (``config["watch"]``)."""
    config = row["config"]
    if "run" in config:
        _assert_run_options(row, config["run"])
    else:
        _assert_watch_settings(row, config["watch"])


def _assert_run_options(row: dict, options: dict) -> None:
    for name in ("opt_level", "seed", "steps", "every", "parent_run_id"):
        assert row[name] == options[name], (name, row[name], options[name])
    assert row["name"] == (options["name"] or os.path.basename(row["script_path"]))
    if row["status"] != "queued":  # the device is the one the run's process resolved: auto is the CPU here
        assert row["device"] == ("cpu" if options["device"] == "auto" else options["device"])
    scaling = options["loss_scale"] if options["loss_scale"] is not None else LEVEL_SCALING[options["opt_level"]]
    if scaling is None:
        assert row["scaling"] == "none" and row["loss_scale"] is None
        assert all(row[name] is None for name in DYNAMIC_OPTIONS)
    elif scaling == "dynamic":
        assert row["scaling"] == "dynamic" and row["loss_scale"] is None
        assert {name: row[name] for name in DYNAMIC_OPTIONS} == {name: options[name] for name in DYNAMIC_OPTIONS}
    else:
        assert row["scaling"] == "static" and row["loss_scale"] == scaling
        assert all(row[name] is None for name in DYNAMIC_OPTIONS)


def _assert_watch_settings(row: dict, settings: dict) -> None:
    # no level: watch leaves the script's autocast and GradScalers as they are, a level the row calls custom
    assert row["opt_level"] == (settings["opt_level"] or "custom")
    assert row["every"] == settings["every"]
    if settings["init_scale"] is not None and row["scaling"] == "dynamic":  # the script's GradScaler, started there
        assert row["init_scale"] == settings["init_scale"]
