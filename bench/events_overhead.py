"""Events' cost on healthy steps, measured side by side in one run (mpdiag.recording.events).

The event rules read each completed step row the Recorder already has (no device synchronisation); what they add
is Python work per step. On the bundled transformer (small by default, so the Recorder's own time is short and the
events' share of it is the largest it gets), fp16 autocast with GradScaler on CUDA (no scaler on the CPU), it
times, interleaved step by step so drift hits both alike:

* record, events off - ``Recorder.record`` with the event rules replaced by a no-op;
* record, events on  - the same call with the rules (all five, armed: the spike windows are full after warm-up);

and, alone, the rules' cost per row on 20,000 healthy rows. It prints medians and the ratios side by side and
writes JSON.

    python bench/events_overhead.py [--steps 200] [--device auto] [--d-model 64 --layers 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from common import add_transformer_options, print_medians, timed, transformer_setup, write_result  # noqa: E402

from mpdiag import Recorder  # noqa: E402
from mpdiag.recording.events import SPIKE_WINDOW, EventLog  # noqa: E402
from mpdiag.store import StepRow  # noqa: E402


def rules_per_row_seconds(rows: int = 20_000) -> float:
    """The five rules' time per healthy row, alone (a loss and gradient norm with noise, every step stepped)."""
    gen = torch.Generator().manual_seed(0)
    noise = torch.rand(rows, 2, generator=gen).tolist()
    made = [StepRow(s, 2.0 + 0.1 * a, 65536.0, 0, s % 2000, 65536.0, 0.1, 0, 1, 1e-3, 1.0 + 0.1 * b, 0.1 * s)
            for s, (a, b) in enumerate(noise)]
    log = EventLog()
    start = time.perf_counter()
    for row in made:
        log.see(row)
    elapsed = time.perf_counter() - start
    assert not log.take(), "healthy rows raised an event"
    return elapsed / rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_transformer_options(parser, steps=200, out="events_overhead.json")
    parser.set_defaults(d_model=64, layers=2)
    args = parser.parse_args()
    device, model, vocab, inputs, targets = transformer_setup(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device.type) if device.type == "cuda" else None
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    tmp = Path(tempfile.mkdtemp())
    recorder = Recorder(model, store=tmp / "runs.db", name="events bench", scaler=scaler, optimizer=opt)
    real_see = recorder.events.see
    modes = {"events_off": lambda row: [], "events_on": real_see}  # see() returns the kinds raised: none
    times = {mode: [] for mode in modes}
    warmup = SPIKE_WINDOW + 3  # the spike rules armed and their windows full before anything is timed
    for i in range(warmup + 2 * args.steps):
        mode = "events_on" if i % 2 else "events_off"
        recorder.events.see = modes[mode]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
        (loss if scaler is None else scaler.scale(loss)).backward()
        own = timed(lambda loss=loss: recorder.record(loss), device)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        if i >= warmup:
            times[mode].append(own)
    recorder.events.see = real_see
    recorder.close()
    events = recorder.events.counts
    per_row = rules_per_row_seconds()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "tensors": len(list(model.parameters())), "steps_per_variant": args.steps,
        "median_record_seconds": med,
        "record_events_on_vs_off": med["events_on"] / med["events_off"],
        "rules_seconds_per_row": per_row,
        "rules_share_of_record": per_row / med["events_off"],
        "events_raised_on_this_healthy_run": events,
    }
    print(f"{result['device']}: {result['tensors']} tensors, {args.steps} timed steps per variant, interleaved")
    print_medians([("Recorder.record, events off", med["events_off"]), ("Recorder.record, events on", med["events_on"]),
                   ("  the five rules alone, per row", per_row, 4)], width=36)
    print(f"record with events / without:       {result['record_events_on_vs_off']:.3f}x")
    print(f"rules per row / record without:     {result['rules_share_of_record']:.2%}")
    print(f"events raised on this healthy run:  {events or 'none'}")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
