"""Micro benchmarks: matmul per dtype, memory bandwidth (copy, triad), host<->device copies.

Each result is reported as achieved and as a fraction of the device's physical peak: for the CPU the
peak `gpuwise devices` derives (at the clock the CPU reports, so boost can exceed 100 %: `gpuwise bench` stars
such a share and says why), for a GPU the catalog's
dense peak. Timing: warm up, then repeat until ``min_time`` seconds have passed; the best repetition
counts (the least disturbed by the other tenants of a shared machine).
"""

from __future__ import annotations

import time

import torch

from gpuwise.hardware.devices import bf16_native

PCIE_GBS = {"gen3": 15.75, "gen4": 31.5, "gen5": 63.0}  # x16, one direction (PCI-SIG line rates)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, device: torch.device, min_time: float, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    best, spent = float("inf"), 0.0
    while spent < min_time:
        t = time.perf_counter()
        fn()
        _sync(device)
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    return best


def dtypes_for(device: torch.device, cpu_isa: list[str]) -> dict[str, torch.dtype]:
    """fp32 everywhere; tf32, bf16, fp16 where the device runs them natively."""
    out = {"fp32": torch.float32}
    if device.type == "cuda":
        if bf16_native(device.index or 0):  # the rule `devices` and `train` use
            out |= {"tf32": torch.float32, "bf16": torch.bfloat16}
        out["fp16"] = torch.float16
    elif {"avx512_bf16", "amx_bf16"} & set(cpu_isa):
        out["bf16"] = torch.bfloat16
    return out


def matmul(device: torch.device, name: str, dtype: torch.dtype, n: int, min_time: float) -> dict:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
    try:
        seconds = best_time(lambda: torch.mm(a, b), device, min_time)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return {"tflops": 2 * n**3 / seconds / 1e12, "n": n, "seconds": seconds}


def bandwidth(device: torch.device, n_bytes: int, min_time: float) -> dict:
    """STREAM-style copy (read + write) and triad a = b + s*c (two reads + one write), fp32."""
    n = n_bytes // 4
    a, b, c = (torch.rand(n, device=device) for _ in range(3))
    copy = best_time(lambda: a.copy_(b), device, min_time)
    triad = best_time(lambda: torch.add(b, c, alpha=3.0, out=a), device, min_time)
    return {"copy_gbs": 2 * n * 4 / copy / 1e9, "triad_gbs": 3 * n * 4 / triad / 1e9, "bytes": n * 4}


def host_device(device: torch.device, n_bytes: int, min_time: float) -> dict:
    host = torch.empty(n_bytes // 4, pin_memory=True)
    dev = torch.empty(n_bytes // 4, device=device)
    h2d = best_time(lambda: dev.copy_(host, non_blocking=True), device, min_time)
    d2h = best_time(lambda: host.copy_(dev, non_blocking=True), device, min_time)
    return {"h2d_gbs": n_bytes / h2d / 1e9, "d2h_gbs": n_bytes / d2h / 1e9, "bytes": n_bytes}


def pcie_peak(interconnect: str) -> tuple[float | None, str]:
    low = interconnect.lower().replace(" ", "")
    for gen, gbs in PCIE_GBS.items():
        if f"pcie{gen}" in low:
            return gbs, f"PCIe {gen[3:]} x16 line rate, one direction"
    return None, "PCIe generation not in the catalog row"
