"""The traced planner against an independent measurement: one training step of each workload.

Run: .venv/bin/python benchmarks/traced_vs_measured.py

Traced: `gpuwise plan --traced` on fake tensors (torch MemTracker, FLOP formulas). Measured: the same
step on real tensors here, peak memory = the tensors alive at the step's start (weights, optimizer
states) + the highest running total of the profiler's per-op memory events (allocations minus frees,
in time order); FLOPs = torch's FlopCounterMode on the real step. Issue #4's goal: memory within 5 %.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode


def measured(name: str) -> tuple[float, float]:
    from gpuwise.bench.macro import WORKLOADS

    torch.manual_seed(0)
    model, loss_fn, _, _ = WORKLOADS[name](torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss_fn().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer states now exist, as in the traced step
    live = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in [*model.parameters(), *model.buffers()]
        + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    }
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    running = peak = 0
    for _, delta in sorted(
        (e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage
    ):
        running += delta
        peak = max(peak, running)
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return sum(live.values()) + peak, float(counter.get_total_flops())


def main() -> None:
    os.environ["GPUWISE_DB"] = str(Path(tempfile.mkdtemp()) / "benchmark-runs.sqlite")
    from gpuwise.bench.macro import WORKLOADS
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.plan.traced import traced_plan, workload_factory

    acc = load_catalog().get("l4")
    widths = (14, 12, 14, 8, 14, 10, 8)
    header = ("workload", "traced MiB", "measured MiB", "error", "traced GFLOP", "measured", "error")
    print(f"{header[0]:<14}" + "".join(f"{h:>{w}}" for h, w in zip(header[1:], widths[1:], strict=True)))
    for name in WORKLOADS:
        plan = traced_plan(name, workload_factory(name), acc, "fp32", None)
        traced_bytes = plan["memory"]["total"] - plan["memory"]["overhead"]  # tensors only, like the measurement
        real_bytes, real_flops = measured(name)
        traced_flops = plan["compute"]["flops_per_step"]
        flop_err = f"{(traced_flops - real_flops) / real_flops:+.1%}" if real_flops else "-"
        print(
            f"{name:<14}{traced_bytes / 2**20:>12.1f}{real_bytes / 2**20:>14.1f}"
            f"{(traced_bytes - real_bytes) / real_bytes:>+8.1%}{traced_flops / 1e9:>14.2f}{real_flops / 1e9:>10.2f}"
            f"{flop_err:>8}"
        )


if __name__ == "__main__":
    main()
