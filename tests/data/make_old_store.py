"""Writes a small real store with a historical mpdiag, for the migration tests (run once; the .db files are kept).

Run it against the old code, never the current one, from a scratch copy of that commit:

    git archive 4ce313f | tar -x -C /tmp/v1 && PYTHONPATH=/tmp/v1 python tests/data/make_old_store.py tests/data/store_v1.db
    git archive dbd1e3f | tar -x -C /tmp/v2 && PYTHONPATH=/tmp/v2 python tests/data/make_old_store.py tests/data/store_v2.db

4ce313f is the last commit with schema version 1, dbd1e3f the last with version 2 (mpdiag/store.py, flat layout).
The rows are seeded random counts, so every representability column holds distinct values.
"""

import sys

import numpy as np

from mpdiag.store import REPRESENTABILITY_COLUMNS, SCHEMA_VERSION, StoreWriter, encode_hist

rng = np.random.default_rng(7)
writer = StoreWriter(sys.argv[1])
sha = writer.add_script("tiny.py", "def build(device):\n    raise NotImplementedError\n")
for run in (1, 2):
    run_id = writer.create_run(name=f"old v{SCHEMA_VERSION} run {run}", script_sha256=sha, opt_level="O1",
                               scaling="dynamic", init_scale=65536.0, seed=run, steps=3, every=1, device="cpu",
                               parent_run_id=1 if run == 2 else None, config={"run": {"steps": 3}})
    writer.add_tensors(run_id, [(0, "0.weight", [4, 3], 12, "float32", "float32"),
                                (1, "0.bias", [4], 4, "float32", "float32")])
    steps = [(s, 2.5 - s / 2 if s != 1 or run == 1 else None, 65536.0, 0, s, 65536.0, 0.01 * (s + 1), 1000 + s, 1)
             for s in range(3)]
    tensors = []
    for s in range(3):
        for t, numel in ((0, 12), (1, 4)):
            hist = np.zeros(277, dtype=np.int64)
            hist[120 + s + t] = numel - 1
            tensors.append((s, t, encode_hist(hist), 1, 0, 0, 0, 2.0**-s, 2.0**-20, 1.5 + s + t,
                            *(int(v) for v in rng.integers(0, numel, size=len(REPRESENTABILITY_COLUMNS)))))
    writer.write_batch(run_id, steps, tensors)
    if SCHEMA_VERSION >= 2:
        writer.add_update_steps(run_id, [(s, t, 10, s, t) for s in range(3) for t in (0, 1)])
        writer.add_shadow_steps(run_id, [(s, t, 0.001 * (s + 1), 0.99, 2.0 + t) for s in range(3) for t in (0, 1)])
    writer.write_summary(run_id)
    writer.update_run(run_id, status="finished" if run == 1 else "failed", error=None if run == 1 else "boom",
                      finished_at=1.7e9 + run)
writer.close()
