"""Our trainer against a raw PyTorch loop: same model, data, batches, optimizer and schedule.

Run: .venv/bin/python benchmarks/train_overhead.py [--steps 60] [--image-size 64] [--rounds 2]

Both loops run in this one process, alternating (raw, ours, raw, ours, ...), so that warm caches and
the machine's load fall on both alike; each reports the median step time of its steady steps.
Goal (issue #3): ours / raw throughput >= 0.98.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def raw_loop(work, steps: int, batch: int, lr: float) -> float:
    """The textbook loop on the same workload: what our trainer must not be slower than."""
    from gpuwise.plan.optim import adamw
    from gpuwise.train.loop import step_samples
    from gpuwise.train.setup import lr_lambda

    model = work.model
    opt = adamw(model.parameters(), lr, "cpu", work.defaults.get("weight_decay", 0.01))  # the same (fused) AdamW
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps))
    times = []
    for step in range(steps):
        t = time.perf_counter()
        idx, epoch = step_samples(step, batch, work.train_size, 0)
        loss = work.loss(model, work.make_batch(idx, epoch))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    # A benchmark measures; it does not belong in the user's run record.
    os.environ["GPUWISE_DB"] = str(Path(tempfile.mkdtemp()) / "benchmark-runs.sqlite")

    from gpuwise.train.config import TrainConfig
    from gpuwise.train.loop import train
    from gpuwise.workloads import build

    cfg = dict(
        workload="defects",
        image_size=args.image_size,
        batch_size=args.batch_size,
        max_steps=args.steps,
        micro_batch_size=args.batch_size,
        lr=2e-3,
        checkpoint_every=10**9,
    )
    raw_times, our_times = [], []
    for _ in range(args.rounds):
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as d:
            raw_times.append(raw_loop(build(TrainConfig(**cfg), None), args.steps, args.batch_size, 2e-3))
            summary = train(TrainConfig(**cfg, run_dir=f"{d}/run"))
        our_times.append(summary["actual"]["step_time_s"])
    raw, ours = statistics.median(raw_times), statistics.median(our_times)
    print(
        f"defects CNN, {args.image_size}x{args.image_size}, batch {args.batch_size}, {args.steps} steps x "
        f"{args.rounds} rounds, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"{'loop':<28}{'step s (median)':>16}{'samples/s':>12}")
    print(f"{'raw PyTorch':<28}{raw:>16.4f}{args.batch_size / raw:>12.1f}")
    print(f"{'gpuwise train (Fabric)':<28}{ours:>16.4f}{args.batch_size / ours:>12.1f}")
    print(f"throughput ratio ours/raw: {raw / ours:.3f} (goal >= 0.98)")
    print(json.dumps({"raw_step_s": raw_times, "ours_step_s": our_times}))


if __name__ == "__main__":
    main()
