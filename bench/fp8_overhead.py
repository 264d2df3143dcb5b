"""FP8 capture overhead: a BF16 training step with ``Fp8Capture`` against the same step without it.

On the bundled transformer example (every Linear captured: input, weight and output gradient, both recipes,
every step), two copies of the model with the same weights and batch are timed interleaved round-robin, so
drift hits both alike:

* plain   - the BF16 autocast step alone (forward, backward, optimizer step);
* capture - the same step on a copy with the capture's hooks, and ``Fp8Capture.take`` before the optimizer
  step (the counts read back on the host: the cost a recorded step pays in full).

It prints medians and the ratio, the capture's own time and workspace bytes, and writes JSON.

    python bench/fp8_overhead.py [--steps 20] [--device auto] [--d-model 352 --layers 6]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from common import add_transformer_options, sync, timed, transformer_setup, write_result  # noqa: E402

from mpdiag.numerics.fp8_recipes import Fp8Settings  # noqa: E402
from mpdiag.recording.fp8_capture import Fp8Capture  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_transformer_options(parser, steps=20, out="fp8_overhead.json")
    args = parser.parse_args()
    device, plain_model, vocab, inputs, targets = transformer_setup(args)
    fp8_model = copy.deepcopy(plain_model)
    optimizers = {m: torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (plain_model, fp8_model)}
    capture = Fp8Capture(fp8_model, Fp8Settings(recipe="both"))
    times = {"plain": [], "capture_step": [], "capture_own": []}

    def step(model, step_index=None, own=None):
        opt = optimizers[model]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(inputs)
        torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1)).backward()
        if step_index is not None:
            sync(device)
            t0 = time.perf_counter()
            capture.take(step_index)
            own.append(time.perf_counter() - t0)
        opt.step()

    for i in range(args.steps + 3):
        own: list[float] = []
        plain = timed(lambda: step(plain_model), device)
        with_capture = timed(lambda i=i, own=own: step(fp8_model, i, own), device)
        if i >= 3:
            times["plain"].append(plain)
            times["capture_step"].append(with_capture)
            times["capture_own"].append(own[0])

    med = {k: statistics.median(v) for k, v in times.items()}
    linears = len(capture.modules)
    workspace = capture.workspace_bytes
    result = {
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "params": sum(p.numel() for p in plain_model.parameters()), "linear_modules": linears,
        "captured_tensors": 3 * linears, "recipes": ["current", "delayed"], "steps": args.steps,
        "median_seconds": med, "capture_step_vs_plain": med["capture_step"] / med["plain"],
        "workspace_bytes": workspace,
    }
    print(f"{result['device']}: {result['params'] / 1e6:.1f}M parameters, {linears} Linear modules "
          f"({3 * linears} tensors), both recipes, {args.steps} steps each")
    for label, key in [("plain BF16 step", "plain"), ("step + FP8 capture", "capture_step"),
                       ("  Fp8Capture.take alone", "capture_own")]:
        print(f"{label:<28}{med[key] * 1e3:>10.2f} ms")
    print(f"step with capture / plain step: {result['capture_step_vs_plain']:.3f}x")
    print(f"capture workspaces: {workspace / 2**20:.1f} MB, allocated once (grown to the largest step) and reused")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
