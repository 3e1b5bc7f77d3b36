"""Macro benchmarks: one training step of a workload's model (`Workload.bench_step`) at a fixed size, on
synthetic inputs of the real shapes (data loading is not what is timed here), in the precision
`gpuwise train` would pick on the device (bf16 autocast on a bf16 GPU or a CPU with bf16 instructions, else fp32)."""

from __future__ import annotations

import time

import numpy as np
import torch

from gpuwise.hardware.devices import computes_bf16
from gpuwise.plan.optim import adamw
from gpuwise.workloads.registry import get


def throughput(
    name: str,
    device: torch.device,
    steps: int,
    min_time: float = 0.0,
    batch: int | None = None,
    precision: str = "auto",
) -> dict:
    """At least `steps` timed steps and at least `min_time` seconds of them: a millisecond step
    needs many to give a stable median. `precision`: auto (what `gpuwise train` picks), 32-true or bf16-mixed."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model, loss_fn, samples, tokens = get(name).bench_step(device, batch)
    opt = adamw(model.parameters(), 1e-4, device.type)  # as gpuwise train's step
    # What `gpuwise train` picks there, so that the efficiency bench calibrates is the one train runs at.
    bf16 = computes_bf16(device.type, device.index or 0) if precision == "auto" else precision == "bf16-mixed"

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as gpuwise train's step does
        opt.step()
        opt.zero_grad(set_to_none=True)

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    # Two more steps untimed: the first steps after the model's allocation also fault in the memory the
    # allocator then keeps, which would inflate a quick bench's median of 3.
    for _ in range(2):
        step()
    times: list[float] = []
    while len(times) < steps or sum(times) < min_time:
        t = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    typical = float(np.median(times))  # sustained, not best-case: calibration plans whole runs from it
    out = {
        "samples_per_s": samples / typical,
        "step_s": typical,
        "flops_per_step": float(counter.get_total_flops()),
        "precision": "bf16-mixed" if bf16 else "32-true",
        "batch": samples,
        "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    out["tflops"] = out["flops_per_step"] / typical / 1e12
    if tokens:
        out["tokens_per_s"] = samples * tokens / typical
    return out
