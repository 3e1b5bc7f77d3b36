"""Fit to memory: the largest micro-batch that fits (estimate first, then a real probe step), and
the back-off when an out-of-memory error strikes mid-run. The global batch and the learning rate
never change: only how the batch is cut into micro-batches, which gradient accumulation undoes."""

from __future__ import annotations

import os

import torch

from gpuwise.hardware.cpu import meminfo

INJECT_ENV = "GPUWISE_INJECT_OOM"  # tests: "STEP[,STEP...]" raises one OOM at each of those steps


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


class OOMInjector:
    """Raises an out-of-memory error once at each listed step, as a real one would strike."""

    def __init__(self):
        raw = os.environ.get(INJECT_ENV, "")
        self.steps = {int(s) for s in raw.split(",") if s.strip()}

    def check(self, step: int, micro: int) -> None:
        if step in self.steps and micro > 1:
            self.steps.discard(step)
            raise torch.OutOfMemoryError(f"injected out of memory at step {step} ({INJECT_ENV})")


def available_bytes(accelerator: str, device_index: int = 0) -> int | None:
    if accelerator == "cuda":
        free, _ = torch.cuda.mem_get_info(device_index)
        return int(free)

    return meminfo("MemAvailable")


def largest_fitting(share: int, estimate, budget: int | None) -> int:
    """Halve from the whole per-process share until the estimate fits in the budget."""
    micro = share
    while budget is not None and micro > 1 and estimate(micro) > budget:
        micro = max(1, micro // 2)
    return micro


def probe(micro: int, run_step) -> int:
    """Run one real forward+backward at ``micro``; halve on OOM until one passes (CUDA only: a CPU
    out of memory kills the process rather than raising)."""
    while True:
        try:
            run_step(micro)
            return micro
        except Exception as e:  # noqa: BLE001 - anything but an OOM is re-raised
            if not is_oom(e) or micro == 1:
                raise
            torch.cuda.empty_cache()
            micro = max(1, micro // 2)
