"""What every benchmark here shares: where results go and how they are written and printed."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def write_result(result: dict, out: str | Path) -> None:
    """Write ``result`` as JSON to ``out`` (folders created) and say where."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=float))
    print(f"wrote {out}")


def print_medians(rows: list[tuple], width: int = 40) -> None:
    """A bench's medians as a table: rows of (variant, seconds) or (variant, seconds, decimals), printed in ms."""
    print(f"{'variant':<{width}}{'median ms':>10}")
    for variant, seconds, *decimals in rows:
        print(f"{variant:<{width}}{seconds * 1e3:>10.{decimals[0] if decimals else 3}f}")


def sync(device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU), so wall-clock timings cover it."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def add_transformer_options(parser, steps: int, out: str) -> None:
    """The options of a benchmark that times steps of the bundled transformer."""
    parser.add_argument("--steps", type=int, default=steps, help="measured steps per variant (after 3 warm-up)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--d-model", type=int, default=352)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default=str(RESULTS / out))


def transformer_setup(args):
    """(device, model, vocab, inputs, targets): the bundled transformer at the size the options ask, seeded,
    and one fixed batch of 64-token windows (a step's cost then does not depend on the data)."""
    import torch

    from mpdiag.examples.transformer_lm import encoded_text, make_model

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(0)
    data, vocab = encoded_text(device)
    model = make_model(vocab, context=64, d_model=args.d_model, n_layers=args.layers, n_heads=8).to(device)
    starts = torch.randint(0, len(data) - 65, (args.batch,), device=device)
    window = data[starts[:, None] + torch.arange(65, device=device)]
    return device, model, vocab, window[:, :-1], window[:, 1:]


def timed(fn, device) -> float:
    """Seconds ``fn()`` takes, the device's queued work before and after it included."""
    import time

    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def bf16_step(model, optimizer, inputs, targets, vocab: int, device, recorder=None):
    """One AdamW step of the bundled transformer under BF16 autocast (``recorder.record`` before the optimizer
    step, where given); returns the loss."""
    import torch

    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(inputs)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
    loss.backward()
    if recorder is not None:
        recorder.record(loss)
    optimizer.step()
    return loss


def interleaved_times(step, names, steps: int, device, warm: int = 3) -> dict[str, list[float]]:
    """Seconds of ``step(name)`` per name, the names taken round-robin so drift hits all alike; ``warm`` rounds
    first, untimed."""
    times = {name: [] for name in names}
    for i in range(steps + warm):
        for name in names:
            elapsed = timed(lambda name=name: step(name), device)
            if i >= warm:
                times[name].append(elapsed)
    return times
