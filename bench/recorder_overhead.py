"""Recorder overhead, measured side by side in one run: full statistics of every tensor at every step.

On the bundled transformer example at ~9M parameters (~80 tensors), fp16 autocast with GradScaler, it
times, interleaved round-robin so drift hits all of them alike:

* plain     - the AMP step alone (forward, scaled backward, scaler.step, update);
* recorder  - the same step with ``Recorder.record`` (every tensor, every step, writing to SQLite);
* tb        - TensorBoard ``add_histogram`` of every gradient (the usual way people do this);
* yardstick - one read of all gradients: ``torch._foreach_norm`` over the grads.

It prints medians and the ratios the recording issue targets, the Recorder's workspace bytes and the peak
RSS it added, and writes JSON.

    python bench/recorder_overhead.py [--steps 30] [--device auto] [--d-model 352 --layers 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from common import add_transformer_options, timed, transformer_setup, write_result  # noqa: E402

from mpdiag import Recorder, Store  # noqa: E402
from mpdiag.recording.recorder import peak_memory_bytes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_transformer_options(parser, steps=30, out="recorder_overhead.json")
    args = parser.parse_args()
    device, model, vocab, inputs, targets = transformer_setup(args)
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    scaler = torch.amp.GradScaler(device.type)

    def forward_backward():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16):
            logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
        scaler.scale(loss).backward()
        return loss

    def finish():
        scaler.step(opt)
        scaler.update()

    tmp = Path(tempfile.mkdtemp())
    from torch.utils.tensorboard import SummaryWriter

    tb = SummaryWriter(str(tmp / "tb"))
    rss_before = peak_memory_bytes(device)
    recorder = Recorder(model, store=tmp / "runs.db", name="overhead bench", scaler=scaler, optimizer=opt)
    names = [n for n, _ in model.named_parameters()]
    times = {k: [] for k in ("plain", "recorder_step", "recorder_own", "tb_step", "tb_own", "yardstick_own")}

    for i in range(args.steps + 3):
        record = {}

        def plain():
            forward_backward()
            finish()

        def with_recorder(record=record):
            loss = forward_backward()
            record["own"] = timed(lambda: recorder.record(loss), device)
            finish()

        def with_tb(record=record, step=i):
            forward_backward()
            record["tb"] = timed(lambda: [tb.add_histogram(n, p.grad, step) for n, p in zip(names, params, strict=True)], device)
            finish()

        def yardstick(record=record):
            forward_backward()
            record["norm"] = timed(lambda: torch._foreach_norm([p.grad for p in params]), device)
            finish()

        samples = {"plain": timed(plain, device), "recorder_step": timed(with_recorder, device), "tb_step": timed(with_tb, device)}
        timed(yardstick, device)
        if i >= 3:
            for k, v in samples.items():
                times[k].append(v)
            times["recorder_own"].append(record["own"])
            times["tb_own"].append(record["tb"])
            times["yardstick_own"].append(record["norm"])
    recorder.close()
    tb.close()
    extra_rss = peak_memory_bytes(device) - rss_before

    med = {k: statistics.median(v) for k, v in times.items()}
    workspaces = sum(c.workspace_bytes for c in recorder._computers.values())
    backends = sorted({c.backend for c in recorder._computers.values()})
    n_params = sum(p.numel() for p in params)
    stored = Store(tmp / "runs.db").tensor_stats(recorder.run_id)
    result = {
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "params": n_params, "tensors": len(params), "steps": args.steps, "statistics_backend": backends,
        "median_seconds": med,
        "recorder_step_vs_plain": med["recorder_step"] / med["plain"],
        "tb_own_vs_recorder_own": med["tb_own"] / med["recorder_own"],
        "recorder_own_vs_yardstick": med["recorder_own"] / med["yardstick_own"],
        "tb_step_vs_plain": med["tb_step"] / med["plain"],
        "recorder_workspace_bytes": workspaces,
        "peak_memory_added_bytes": extra_rss,
        "rows_recorded": len(stored),
    }
    print(f"{result['device']}: {n_params / 1e6:.1f}M parameters in {len(params)} tensors, {args.steps} steps each, "
          f"statistics backend {', '.join(backends)}")
    print(f"{'variant':<34}{'median ms':>10}")
    for label, key in [("plain AMP step", "plain"), ("step + Recorder.record", "recorder_step"),
                       ("  Recorder.record alone", "recorder_own"), ("step + TensorBoard add_histogram", "tb_step"),
                       ("  add_histogram alone", "tb_own"), ("  _foreach_norm yardstick alone", "yardstick_own")]:
        print(f"{label:<34}{med[key] * 1e3:>10.2f}")
    print(f"step with Recorder / plain step:        {result['recorder_step_vs_plain']:.3f}x  (target <= 1.10 CPU, 1.05 GPU)")
    print(f"TensorBoard own time / Recorder own:    {result['tb_own_vs_recorder_own']:.1f}x  (target >= 10)")
    print(f"Recorder own time / foreach_norm:       {result['recorder_own_vs_yardstick']:.1f}x  (target <= 10 CPU, 3 GPU)")
    print(f"Recorder's extra memory: {workspaces / 2**20:.1f} MB of workspaces, allocated once and reused every step")
    print(f"peak memory added during the whole loop, all variants (TensorBoard's host copies included): "
          f"{extra_rss / 2**20:.1f} MB ({'CUDA allocator' if device.type == 'cuda' else 'process RSS'})")
    print(f"rows recorded: {len(stored)} (= steps x tensors, every step)")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
