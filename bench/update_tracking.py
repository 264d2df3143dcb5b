"""Cost of counting weight updates against FP16/BF16 resolution (mpdiag.numerics.updates), measured side by side.

On the transformer example's parameters (~9M in 78 tensors), one tracked optimizer update (snapshot, the
update itself, counting) with the numba kernel and with the torch path, against the bare update, for FP32
master weights and for FP16 weights. Prints medians and ratios and writes JSON.

    python bench/update_tracking.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from common import write_result  # noqa: E402

from mpdiag.examples.transformer_lm import encoded_text, make_model  # noqa: E402
from mpdiag.numerics.updates import UpdateTracker  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (and the kernel's first load)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=str(ROOT / "bench/results/update_tracking.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    _, vocab = encoded_text(torch.device("cpu"))
    model = make_model(vocab, context=64, d_model=352, n_layers=6, n_heads=8)
    result = {"params": sum(p.numel() for p in model.parameters()), "tensors": len(list(model.parameters()))}
    print(f"{result['params'] / 1e6:.1f}M parameters in {result['tensors']} tensors, CPU, median of {args.repeats}")
    print(f"{'weights':<10}{'bare update':>14}{'numba':>10}{'torch':>10}{'torch/numba':>13}")
    for dtype in (torch.float32, torch.float16):
        weights = [p.detach().to(dtype).clone() for p in model.parameters()]
        for w in weights:
            w.grad = (torch.randn(w.shape) * 1e-4).to(dtype)

        def update(weights=weights):
            with torch.no_grad():
                for w in weights:
                    w.add_(w.grad, alpha=-1e-3)

        row = {"bare_update_ms": median_ms(update, args.repeats)}
        for backend in ("numba", "torch"):
            tracker = UpdateTracker(weights, "fp16", backend=backend)

            def tracked(tracker=tracker):
                tracker.before(0)
                update()
                tracker.after()
                tracker.take()

            row[f"{backend}_ms"] = median_ms(tracked, args.repeats)
        name = str(dtype).removeprefix("torch.")
        result[name] = row
        print(f"{name:<10}{row['bare_update_ms']:>11.1f} ms{row['numba_ms']:>7.1f} ms{row['torch_ms']:>7.1f} ms"
              f"{row['torch_ms'] / row['numba_ms']:>12.1f}x")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
