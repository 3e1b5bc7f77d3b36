"""The traced planner against an independent measurement: one training step of each workload.

Run: .venv/bin/python benchmarks/traced_vs_measured.py

Traced: `gpuwise plan --traced` on fake tensors (torch MemTracker, FLOP formulas). Measured: the same
step on real tensors here: peak memory = the model's and optimizer's states plus the highest running sum
of the profiler's allocation events over the step (not the tracker the planner uses), FLOPs from
FlopCounterMode on the real step. Issue #4's goal: memory within 5 %, FLOPs within 2 %.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from gpuwise.train.measure import real_step


def main() -> None:
    os.environ["GPUWISE_DB"] = str(Path(tempfile.mkdtemp()) / "benchmark-runs.sqlite")
    from gpuwise.cli.plan import workload_step
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.plan.traced import traced_plan
    from gpuwise.workloads import names

    acc = load_catalog().get("l4")
    widths = (14, 12, 14, 8, 14, 10, 8)
    header = ("workload", "traced MiB", "measured MiB", "error", "traced GFLOP", "measured", "error")
    print(f"{header[0]:<14}" + "".join(f"{h:>{w}}" for h, w in zip(header[1:], widths[1:], strict=True)))
    for name in names():
        plan = traced_plan(name, workload_step(name), acc, "fp32", None)
        traced_bytes = plan["memory"]["total"] - plan["memory"]["overhead"]  # tensors only, like the measurement
        real_bytes, real_flops = real_step(name)
        traced_flops = plan["compute"]["flops_per_step"]
        flop_err = f"{(traced_flops - real_flops) / real_flops:+.1%}" if real_flops else "-"
        print(
            f"{name:<14}{traced_bytes / 2**20:>12.1f}{real_bytes / 2**20:>14.1f}"
            f"{(traced_bytes - real_bytes) / real_bytes:>+8.1%}{traced_flops / 1e9:>14.2f}{real_flops / 1e9:>10.2f}"
            f"{flop_err:>8}"
        )


if __name__ == "__main__":
    main()
