"""The replay's cost on healthy steps, and the replay's own one-off time (mpdiag.recording.replay).

On a healthy step the replay only keeps: a forward pre-hook on the root module keeps references to its arguments,
the CPU (and CUDA) random state and the autocast state; a forward hook puts a tensor hook on the output that keeps
its gradient; ``record`` reads the loss and gradient norm back (one synchronisation on a GPU), feeds the loss to
the loss-spike rule, drops the output's gradient and keeps the arguments and random state one step longer, as the
previous step's (a loss spike's replay compares the two batches). On the bundled transformer (small by default), fp16 autocast with GradScaler on CUDA, bf16 autocast on the
CPU, it times, interleaved step by step so drift hits both alike, two identical seeded models, each with its own
Recorder:

* replay off - ``Recorder(replay=False)``: forward, backward and ``record``;
* replay on  - ``Recorder(replay=True)``: the same;

then, alone, the keeping per step (the two hooks and the check at ``record``, called directly 2,000 times), the
memory the previous step's keep holds beyond the step (its batch's tensors and random state: what would otherwise
be freed a step earlier; an upper bound - this bench's batch is the same tensor every step, so here nothing more),
and the one-off replays: the ``record`` of a step whose loss is multiplied by 100 (a loss spike outside the
model: both batches' forwards replayed, nothing named) and of a step with a planted NaN loss. Prints medians and
writes JSON.

    python bench/replay_overhead.py [--steps 100] [--device auto] [--d-model 64 --layers 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from common import add_transformer_options, print_medians, sync, timed, transformer_setup, write_result  # noqa: E402

from mpdiag import Recorder  # noqa: E402
from mpdiag.recording.replay import StepReplay  # noqa: E402


def keeping_seconds(model, inputs, device, dtype, n: int = 2000) -> float:
    """The hooks' and the check's own time per step: _before, _after (one tensor hook), triggered (the spike rule
    fed a flat loss), forget (the previous step's keep)."""
    replay = StepReplay(model)
    replay.remove()  # called directly below, not from a forward
    with torch.autocast(device.type, dtype=dtype):
        out = torch.zeros(4, device=device, requires_grad=True) * 1.0
    loss, norm = torch.ones((), device=device), torch.ones((), device=device)
    sync(device)
    start = time.perf_counter()
    for i in range(n):
        replay._before(model, (inputs,), {})
        replay._after(model, (inputs,), out)
        assert replay.triggered(i, loss, norm, scaled=True) is None
        replay.forget()
    sync(device)
    return (time.perf_counter() - start) / n


def previous_step_bytes(inputs: torch.Tensor) -> dict:
    """What the previous step's keep references: the batch's tensors and the CPU (and CUDA) random state."""
    rng = torch.get_rng_state().nbytes + (sum(s.nbytes for s in torch.cuda.get_rng_state_all())
                                           if torch.cuda.is_available() and torch.cuda.is_initialized() else 0)
    return {"batch": inputs.nbytes, "random_state": rng}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_transformer_options(parser, steps=100, out="replay_overhead.json")
    parser.set_defaults(d_model=64, layers=2)
    args = parser.parse_args()
    device, model, vocab, inputs, targets = transformer_setup(args)
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    tmp = Path(tempfile.mkdtemp())
    variants = {}
    for mode in ("off", "on"):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(device.type) if device.type == "cuda" else None
        rec = Recorder(m, store=tmp / f"{mode}.db", name=f"replay {mode}", scaler=scaler, optimizer=opt,
                       replay=mode == "on")
        variants[mode] = (m, opt, scaler, rec)

    def step(mode: str, poison: bool = False, spike: bool = False) -> float:
        m, opt, scaler, rec = variants[mode]
        sync(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            logits = m(inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
        if poison:
            loss = loss * float("nan")
        if spike:
            loss = loss * 100.0
        (loss if scaler is None else scaler.scale(loss)).backward()
        own = timed(lambda: rec.record(loss), device)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        sync(device)
        return own if poison or spike else time.perf_counter() - start

    times = {"off": [], "on": []}
    for i in range(6 + 2 * args.steps):
        mode = "on" if i % 2 else "off"
        elapsed = step(mode)
        if i >= 6:
            times[mode].append(elapsed)
    record_with_spike_replay = step("on", spike=True)
    spike = variants["on"][3].spike_replayed
    record_with_replay = step("on", poison=True)
    replayed = variants["on"][3].replayed
    for _, _, _, rec in variants.values():
        rec.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    keep = keeping_seconds(model, inputs, device, dtype)
    result = {
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "d_model": args.d_model, "layers": args.layers, "steps_per_variant": args.steps,
        "median_step_seconds": med, "step_on_vs_off": med["on"] / med["off"],
        "keeping_seconds_per_step": keep, "keeping_share_of_step": keep / med["off"],
        "previous_step_bytes": previous_step_bytes(inputs),
        "record_of_the_spike_replay_seconds": record_with_spike_replay,
        "spike_replay_note": None if spike is None else spike.note,
        "record_of_the_replayed_step_seconds": record_with_replay,
        "replayed_modules": len(replayed.modules) if replayed is not None else 0,
        "replay_first_module": None if replayed is None else replayed.first_module,
    }
    print(f"{result['device']}: transformer d_model {args.d_model}, {args.layers} layers, {args.steps} timed steps "
          "per variant, interleaved")
    print_medians([("step, replay off", med["off"]), ("step, replay on (keeping only)", med["on"]),
                   ("  the keeping alone, per step", keep, 4),
                   ("record of the spike replay (one-off)", record_with_spike_replay),
                   ("record of the replayed step (one-off)", record_with_replay)])
    print(f"step with replay armed / without:      {result['step_on_vs_off']:.3f}x")
    print(f"keeping per step / step without:       {result['keeping_share_of_step']:.2%}")
    print(f"replay: {result['replayed_modules']} module rows, first offender {result['replay_first_module']}")
    print(f"spike replay: {result['spike_replay_note']}")
    print(f"previous step's keep references: {result['previous_step_bytes']} bytes")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
