"""fp8-sim's cost by recipe: an unrecorded BF16 training step against the same step with every Linear simulated.

On the bundled transformer example, copies of the model with the same weights and batch are timed interleaved
round-robin, so drift hits all alike:

* bf16    - the BF16 autocast step alone (forward, backward, optimizer step): ``--opt-level bf16``;
* delayed - every Linear through ``simulate_fp8`` with the per-tensor delayed recipe (3 casts a Linear a step);
* mxfp8   - with ``--fp8-recipe mxfp8`` (each GEMM's operands re-blocked along its reduction dimension: 6 block
  casts a Linear a step, as torchao's MXFP8 training does);
* nvfp4   - with ``--fp8-recipe nvfp4`` (the same 6 casts, NVFP4's).

It prints medians and each variant's ratio to bf16, and writes JSON. Nothing is recorded (no Recorder): what
the simulation itself costs.

    python bench/fp8_sim_cost.py [--steps 10] [--device auto] [--d-model 352 --layers 6]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from common import add_transformer_options, bf16_step, interleaved_times, transformer_setup, write_result  # noqa: E402

from mpdiag.numerics.fp8_recipes import Fp8Settings  # noqa: E402
from mpdiag.training.fp8_sim import simulate_fp8  # noqa: E402

VARIANTS = ("bf16", "delayed", "mxfp8", "nvfp4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_transformer_options(parser, steps=10, out="fp8_sim_cost.json")
    args = parser.parse_args()
    device, plain_model, vocab, inputs, targets = transformer_setup(args)
    models = {name: plain_model if name == "bf16" else copy.deepcopy(plain_model) for name in VARIANTS}
    linears = 0
    for name, model in models.items():
        if name != "bf16":
            linears = len(simulate_fp8(model, Fp8Settings(recipe=name), device))
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    losses = {}

    def step(name):
        losses[name] = float(bf16_step(models[name], optimizers[name], inputs, targets, vocab, device).detach())

    times = interleaved_times(step, list(models), args.steps, device)

    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "params": sum(p.numel() for p in plain_model.parameters()), "linear_modules": linears, "steps": args.steps,
        "median_seconds": med, "vs_bf16": {k: med[k] / med["bf16"] for k in med}, "last_loss": losses,
    }
    print(f"{result['device']}: {result['params'] / 1e6:.1f}M parameters, {linears} simulated Linear modules, "
          f"{args.steps} steps each")
    for name in VARIANTS:
        print(f"{name:<10}{med[name] * 1e3:>10.2f} ms  {result['vs_bf16'][name]:.2f}x bf16  (last loss "
              f"{losses[name]:.4f})")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
