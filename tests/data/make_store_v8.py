"""Writes a small real store with mpdiag at schema version 8, for the migration test to version 9 (run once;
the .db file is kept). Run it against the old code, never the current one, from a scratch copy of that commit:

    git archive 28cda13 mpdiag | tar -x -C /tmp/v8 && PYTHONPATH=/tmp/v8 python tests/data/make_store_v8.py tests/data/store_v8.db

28cda13 is the last commit with schema version 8. Three runs: 1 at O1 and 2 its FP32 twin (linked both ways),
3 a rerun of 1 (parent 1); each with rows in every per-run table, so a migration or a deletion that loses or
touches a row is seen; run 1 has tags and a note.
"""

import sys

import numpy as np

from mpdiag.store import SCHEMA_VERSION, Representability, StepRow, StoreWriter, TensorRow, encode_hist

assert SCHEMA_VERSION == 8, SCHEMA_VERSION
rng = np.random.default_rng(8)
writer = StoreWriter(sys.argv[1])
sha = writer.add_script("tiny.py", "def build(device):\n    raise NotImplementedError\n")
writer.add_bundle("code.zip", b"PK\x05\x06" + bytes(18))
ids = []
for run, (level, name) in enumerate((("O1", "tiny.py"), ("O0", "tiny.py (FP32 twin)"), ("bf16", "tiny.py ↻ bf16"))):
    run_id = writer.create_run(name=name, script_path="tiny.py", script_sha256=sha, opt_level=level, seed=1, steps=3,
                               every=1, device="cpu", parent_run_id=1 if run == 2 else None,
                               config={"run": {"steps": 3, "opt_level": level}})
    ids.append(run_id)
    writer.add_tensors(run_id, [(0, "0.weight", [4, 3], 12, "float32", "float32"),
                                (1, "0.bias", [4], 4, "float32", "float32")])
    steps = [StepRow(s, 2.5 - s / 2, 65536.0, 0, s, 65536.0, 0.01 * (s + 1), 1000 + s, 1) for s in range(3)]
    tensors = []
    for s in range(3):
        for t, numel in ((0, 12), (1, 4)):
            hist = np.zeros(277, dtype=np.int64)
            hist[120 + s + t + run] = numel - 1
            counts = {fmt: Representability(*(int(v) for v in rng.integers(0, numel, size=6)))
                      for fmt in ("fp16", "bf16")}
            tensors.append(TensorRow(s, t, encode_hist(hist), 1, 0, 0, 0, 2.0**-s, 2.0**-20, 1.5 + s + t, counts))
    writer.write_batch(run_id, steps, tensors)
    writer.add_update_steps(run_id, [(s, t, 10, s, t) for s in range(3) for t in (0, 1)])
    writer.add_shadow_steps(run_id, [(s, t, 0.001 * (s + 1), 0.99, 2.0 + t) for s in range(3) for t in (0, 1)])
    writer.add_modules(run_id, [(0, "0", "Linear")])
    writer.add_module_steps(run_id, [(s, 0, 0, 1.0 + s, 1, 0, 2.0 + s, 1) for s in range(3)])
    writer.add_rank_steps(run_id, [(s, r, 1.0 + s, 0) for s in range(3) for r in (0, 1)])
    writer.add_fp8_steps(run_id, [(s, "0", "input", "fp8_e4m3", "current", 2.0, 1.5, 12, 1, 2, 0) for s in range(3)],
                         [(s, "0", "input", -3, 12) for s in range(3)])
    writer.add_probe(run_id, "scale-linearity", {"run": run_id})
    writer.end_run(run_id, "finished", note="stopped early" if run == 2 else None)
writer.update_run(ids[0], pair_run_id=ids[1])
writer.update_run(ids[1], pair_run_id=ids[0])
writer.tag_run(ids[0], ["fp16", "baseline"])  # schema 8's run management, kept by the migration
writer.set_user_note(ids[0], "first try")
writer.close()
