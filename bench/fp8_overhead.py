"""--fp8 overhead: a recorded BF16 training step with FP8 statistics against the same recorded step without.

On the bundled transformer example, three copies of the model with the same weights and batch are timed
interleaved round-robin, so drift hits all alike:

* plain    - the BF16 autocast step alone (forward, backward, optimizer step);
* recorder - the same step with ``Recorder.record`` (gradient statistics of every tensor, every step, into
  SQLite): a run without --fp8;
* fp8      - the same with ``Recorder(fp8=Fp8Settings("both"))``: every Linear's input, weight and output
  gradient, both recipes, every step: a run with --fp8 --fp8-recipe both;
* blocks   - the same with the block-scaled recipes too (``Fp8Settings(block_recipes=("mxfp8", "nvfp4"))``).

It prints medians, the ratio fp8 / recorder (what --fp8 adds to a recorded run), the ratio blocks / fp8 (what
the block-scaled recipes add to it), the capture's workspace bytes, and writes JSON.

    python bench/fp8_overhead.py [--steps 20] [--device auto] [--d-model 352 --layers 6]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from common import add_transformer_options, bf16_step, interleaved_times, transformer_setup, write_result  # noqa: E402

from mpdiag.numerics.fp8_recipes import BLOCK_RECIPES, Fp8Settings  # noqa: E402
from mpdiag.recording.fp8_capture import Fp8Feature  # noqa: E402
from mpdiag.recording.recorder import Recorder  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_transformer_options(parser, steps=20, out="fp8_overhead.json")
    args = parser.parse_args()
    device, plain_model, vocab, inputs, targets = transformer_setup(args)
    models = {"plain": plain_model, "recorder": copy.deepcopy(plain_model), "fp8": copy.deepcopy(plain_model),
              "blocks": copy.deepcopy(plain_model)}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    with tempfile.TemporaryDirectory() as folder:
        store = Path(folder) / "bench.db"
        recorders = {"recorder": Recorder(models["recorder"], store, optimizer=optimizers["recorder"]),
                     "fp8": Recorder(models["fp8"], store, optimizer=optimizers["fp8"], fp8=Fp8Settings(recipe="both")),
                     "blocks": Recorder(models["blocks"], store, optimizer=optimizers["blocks"],
                                        fp8=Fp8Settings(recipe="both", block_recipes=BLOCK_RECIPES))}
        def step(name):
            bf16_step(models[name], optimizers[name], inputs, targets, vocab, device, recorders.get(name))

        times = interleaved_times(step, list(models), args.steps, device)
        capture = next(f.capture for f in recorders["fp8"].features if isinstance(f, Fp8Feature))
        linears, workspace = len(capture.modules), capture.workspace_bytes
        for recorder in recorders.values():
            recorder.close()

    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "params": sum(p.numel() for p in plain_model.parameters()), "linear_modules": linears,
        "captured_tensors": 3 * linears, "recipes": ["current", "delayed"], "steps": args.steps,
        "median_seconds": med, "fp8_vs_recorder": med["fp8"] / med["recorder"],
        "recorder_vs_plain": med["recorder"] / med["plain"], "fp8_added_seconds": med["fp8"] - med["recorder"],
        "workspace_bytes": workspace, "block_recipes": list(BLOCK_RECIPES),
        "blocks_vs_fp8": med["blocks"] / med["fp8"], "blocks_added_seconds": med["blocks"] - med["fp8"],
    }
    print(f"{result['device']}: {result['params'] / 1e6:.1f}M parameters, {linears} Linear modules "
          f"({3 * linears} tensors), both recipes, {args.steps} steps each")
    for label, key in [("plain BF16 step", "plain"), ("recorded step", "recorder"), ("recorded step + --fp8", "fp8"),
                       ("+ mxfp8 and nvfp4", "blocks")]:
        print(f"{label:<28}{med[key] * 1e3:>10.2f} ms")
    print(f"--fp8 adds {result['fp8_added_seconds'] * 1e3:.1f} ms a step: {result['fp8_vs_recorder']:.3f}x the "
          f"recorded step ({result['recorder_vs_plain']:.3f}x plain without it)")
    print(f"mxfp8 and nvfp4 add {result['blocks_added_seconds'] * 1e3:.1f} ms a step: {result['blocks_vs_fp8']:.3f}x "
          f"the step recorded with --fp8")
    print(f"capture workspaces: {workspace / 2**20:.1f} MB, allocated once (grown to the largest step) and reused")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
