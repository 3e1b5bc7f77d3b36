"""`gpuwise bench`: CPU vs GPU, timed, each figure as a fraction of the device's physical peak.

On a CPU-only machine the GPU column is a projection from the catalog, marked as such, never mixed
with measurements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gpuwise.bench import macro, micro
from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import Catalog, match_device
from gpuwise.hardware.cpu import detect_cpu
from gpuwise.hardware.reference import LAMBDA_RESNET50, LAMBDA_SOURCE, RESNET50_TRAIN_FLOPS
from gpuwise.results import BenchResult
from gpuwise.workloads import names as workload_names
from gpuwise.workloads.registry import get

PROJECT_ON = ("l4", "a100-80gb", "h100-sxm")
# Matmul projection: the share of the dense bf16 peak a tuned matmul reaches on an H100 (stas00/ml-engineering).
MATMUL_SHARE = (795 / 989, "measured bf16 matmul on H100, 795 of 989 TFLOPS (stas00/ml-engineering)")
SIZES = {  # (matmul n, bandwidth bytes, host-device bytes, workload steps, min seconds per test)
    "quick": {"cpu": (1024, 64 << 20, 0, 3, 0.2), "cuda": (4096, 256 << 20, 64 << 20, 5, 0.2)},
    "full": {"cpu": (2048, 256 << 20, 0, 8, 1.0), "cuda": (8192, 1 << 30, 256 << 20, 20, 1.0)},
}


def parse_devices(spec: str) -> list[torch.device]:
    cuda = [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    if spec == "all":
        return [torch.device("cpu"), *cuda]
    if spec == "cpu":
        return [torch.device("cpu")]
    if spec == "cuda" or spec.startswith("cuda:"):
        try:
            dev = torch.device(spec if ":" in spec else "cuda:0")
        except RuntimeError:  # cuda:abc, cuda:-1
            raise GpuwiseError(f"--device must be cpu, cuda:N or all, not '{spec}'") from None
        if dev not in cuda:
            raise GpuwiseError(f"--device {spec}: no such CUDA device here ({len(cuda)} found)")
        return [dev]
    raise GpuwiseError(f"--device must be cpu, cuda:N or all, not '{spec}'")


def _peaks(device: torch.device, catalog: Catalog) -> dict:
    if device.type == "cpu":
        cpu = detect_cpu()
        fp32 = cpu.fp32_peak_gflops and cpu.fp32_peak_gflops / 1e3
        bf16 = cpu.bf16_peak_gflops and cpu.bf16_peak_gflops / 1e3
        return {
            "name": cpu.model,
            "fp32_tflops": fp32,
            "tf32_tflops": None,
            "bf16_tflops": bf16,
            "fp16_tflops": None,
            "bandwidth_gbs": None,
            "origin": cpu.derivation,
            "bandwidth_origin": "a CPU's memory-bandwidth peak is not detectable from inside a machine",
        }
    name = torch.cuda.get_device_name(device)
    acc = match_device(catalog, name)
    if acc is None:
        return {"name": name, "origin": f"{name} is not in the catalog: fractions of peak unknown"}
    return {
        "name": name,
        "slug": acc.slug,
        "fp32_tflops": acc.fp32_tflops,
        "tf32_tflops": acc.tf32_tflops,
        "bf16_tflops": acc.bf16_tflops,
        "fp16_tflops": acc.fp16_tflops,
        "bandwidth_gbs": acc.mem_bw_gbs,
        "origin": f"catalog {acc.slug}: {acc.source}",
        "interconnect": acc.interconnect,
    }


def _share(value: float, peak: float | None) -> float | None:
    return value / peak if peak else None


def per_step_split(large: dict, small: dict, peak_tflops: float | None) -> dict:
    """Two timed batches -> seconds per step + the share of peak the FLOPs beyond them run at; {} where the
    two do not give a usable line (the larger batch no slower per FLOP, or a fixed part that is negative)."""
    dflops = large["flops_per_step"] - small["flops_per_step"]
    if not peak_tflops or dflops <= 0:
        return {}
    per_flop = (large["step_s"] - small["step_s"]) / dflops
    fixed = large["step_s"] - per_flop * large["flops_per_step"]
    if per_flop <= 0 or fixed <= 0:
        return {}
    return {"s_per_step": fixed, "flop_fraction": 1 / (per_flop * peak_tflops * 1e12), "small_batch": small["batch"]}


def measure_device(
    device: torch.device,
    catalog: Catalog,
    size: str,
    progress=lambda msg: None,
    workloads: list[str] | None = None,
    precision: str = "auto",
) -> dict:
    """Matmul per dtype, bandwidth, host <-> device copies, and a training step of each workload named
    (default: every workload installed)."""
    n, bw_bytes, hd_bytes, steps, min_time = SIZES[size]["cuda" if device.type == "cuda" else "cpu"]
    peak = _peaks(device, catalog)
    isa = detect_cpu().isa if device.type == "cpu" else []
    key = f"cpu:{peak['name']}" if device.type == "cpu" else f"cuda:{peak.get('slug') or peak['name']}"
    out: dict = {"key": key, "peak": peak, "matmul": {}, "workloads": {}}
    for name, dtype in micro.dtypes_for(device, isa).items():
        progress(f"{device}: matmul {name} {n}x{n}")
        r = micro.matmul(device, name, dtype, n, min_time)
        out["matmul"][name] = r | {"fraction_of_peak": _share(r["tflops"], peak.get(f"{name}_tflops"))}
    progress(f"{device}: memory bandwidth")
    bw = micro.bandwidth(device, bw_bytes, min_time)
    out["bandwidth"] = bw | {"fraction_of_peak": _share(bw["triad_gbs"], peak.get("bandwidth_gbs"))}
    if device.type == "cuda":
        progress(f"{device}: host <-> device")
        hd = micro.host_device(device, hd_bytes, min_time)
        link, origin = micro.pcie_peak(peak.get("interconnect", ""))
        out["host_device"] = hd | {"fraction_of_peak": _share(hd["h2d_gbs"], link), "peak_origin": origin}
    for name in workload_names() if workloads is None else workloads:
        progress(f"{device}: {name} training step")
        w = macro.throughput(name, device, steps, min_time, precision=precision)
        key = "bf16_tflops" if w["precision"] == "bf16-mixed" else "fp32_tflops"
        if w["flops_per_step"] and w["batch"] >= 4:
            # A second, 4x smaller batch splits the step into a part per step (the optimizer, clipping, the
            # weights' own transforms: what does not grow with the batch) and a part per FLOP: one share of
            # peak alone plans a run at another batch size too fast (a CNN's step at half the batch: 15-19 % short).
            small = macro.throughput(name, device, steps, min_time, batch=w["batch"] // 4, precision=precision)
            split = per_step_split(w, small, peak.get(key))
            for _ in range(2 if not split else 0):
                # no usable line: a shared VM's speed can move between the two timings (seen once in CI, where
                # the split was missing); both batches timed again, back to back
                again = macro.throughput(name, device, steps, min_time, precision=precision)
                small = macro.throughput(name, device, steps, min_time, batch=w["batch"] // 4, precision=precision)
                if split := per_step_split(again, small, peak.get(key)):
                    break
            w |= split
        if not w["flops_per_step"]:
            # No FLOPs to scale by (embedding lookups): a second, 4x larger batch splits the step into a
            # part per step (dense embedding gradients, clipping, AdamW over every row: per parameter)
            # and a part per sample, so a plan for another batch size or catalogue size holds.
            large = macro.throughput(name, device, steps, min_time, batch=w["batch"] * 4, precision=precision)
            slope = max(0.0, (large["step_s"] - w["step_s"]) / (large["batch"] - w["batch"]))
            w |= {"s_per_sample": slope, "s_per_param": (w["step_s"] - slope * w["batch"]) / w["params"]}
        out["workloads"][name] = w | {"fraction_of_peak": _share(w["tflops"], peak.get(key)) if w["tflops"] else None}
    return out


def project_gpu(slug: str, catalog: Catalog, cpu: dict) -> dict:
    """What the catalog says a GPU would do on the same tests: projections, never measurements."""
    acc = catalog.get(slug)
    share, share_origin = MATMUL_SHARE
    out: dict[str, Any] = {
        "peak": {"name": acc.name, "slug": slug, "origin": f"catalog {slug}: {acc.source}"},
        "projected": True,
        "matmul": {},
        "workloads": {},
    }
    for name in cpu["matmul"]:
        peak = acc.peak_tflops(name)
        if peak:
            out["matmul"][name] = {"tflops": peak * share, "basis": f"dense peak x {share:.2f} ({share_origin})"}
    out["bandwidth"] = {"triad_gbs": acc.mem_bw_gbs, "basis": "catalog peak (an upper bound)"}
    for name, r in cpu["workloads"].items():
        if not get(name).convolutional or slug not in LAMBDA_RESNET50:
            # No published rate to project from: PaLM's 46 % is a large model's figure, far above what a
            # small LM sustains, and a ranking model's step is memory-bound lookups.
            continue
        rate, basis = LAMBDA_RESNET50[slug][1] * RESNET50_TRAIN_FLOPS, LAMBDA_SOURCE
        seconds = r["flops_per_step"] / rate
        out["workloads"][name] = {"samples_per_s": r["batch"] / seconds, "basis": basis}
    return out


def speedups(base: dict, other: dict) -> dict:
    out = {}
    for name, r in other["matmul"].items():
        if name in base["matmul"]:
            out[f"matmul {name}"] = r["tflops"] / base["matmul"][name]["tflops"]
    out["bandwidth (triad)"] = other["bandwidth"]["triad_gbs"] / base["bandwidth"]["triad_gbs"]
    for name, r in other["workloads"].items():
        out[f"{name} step"] = r["samples_per_s"] / base["workloads"][name]["samples_per_s"]
    return out


def run_bench(
    device_spec: str,
    quick: bool,
    catalog: Catalog,
    progress: Callable[[str], object] = lambda msg: None,
    workloads: list[str] | None = None,
    precision: str = "auto",
) -> BenchResult:
    devices = parse_devices(device_spec)
    size = "quick" if quick else "full"
    result: dict[str, Any] = {
        "size": size,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "devices": {},
    }
    for dev in devices:
        result["devices"][str(dev)] = measure_device(dev, catalog, size, progress, workloads, precision)
    if "cpu" in result["devices"] and len(result["devices"]) > 1:
        cpu = result["devices"]["cpu"]
        result["speedup"] = {d: speedups(cpu, r) for d, r in result["devices"].items() if d != "cpu"}
    elif list(result["devices"]) == ["cpu"]:
        cpu = result["devices"]["cpu"]
        result["projections"] = {slug: project_gpu(slug, catalog, cpu) for slug in PROJECT_ON}
        result["speedup"] = {f"{slug} (projected)": speedups(cpu, p) for slug, p in result["projections"].items()}
    return BenchResult.build(result)
