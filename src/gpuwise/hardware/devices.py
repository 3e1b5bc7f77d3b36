"""What is here: the CPU, every CUDA GPU and MPS, and what `gpuwise train` would run on.

torch is imported only inside the functions that query it, so `gpuwise plan` never pays for it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import Accelerator, Catalog, match_device
from gpuwise.hardware.cpu import CpuInfo, detect_cpu, meminfo


@dataclass
class GpuInfo:
    index: int
    name: str
    memory_bytes: int
    compute_capability: str
    multiprocessors: int
    bf16: bool  # native bf16: see bf16_native
    catalog_slug: str | None
    peak_bf16_tflops: float | None  # the catalog's dense peak, when the card is in it


@dataclass
class Devices:
    cpu: CpuInfo
    cuda: list[GpuInfo]
    mps: bool
    torch_version: str | None

    def train_default(self) -> dict:
        return choose_engine(self.cuda, self.mps, self.cpu.bf16_native)

    def as_dict(self) -> dict:
        return {
            "cpu": self.cpu.as_dict(),
            "cuda": [asdict(g) for g in self.cuda],
            "mps": self.mps,
            "torch": self.torch_version,
            "train_default": self.train_default(),
        }


def bf16_native(index: int = 0) -> bool:
    """Whether CUDA device `index` computes bf16 in hardware: compute capability 8.0 (Ampere) or later.

    The one rule for bf16, for `gpuwise devices` and `gpuwise train` alike. Not
    `torch.cuda.is_bf16_supported()`: it also says yes where bf16 is only emulated (a T4 or a V100),
    where bf16 matmuls run on the CUDA cores at a fraction of the fp16 tensor-core rate (the catalog
    lists no bf16 peak for a T4); fp16 with a loss scaler is the fast choice there.
    """
    import torch

    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability(index)
    return major >= 8


def computes_bf16(device_type: str, index: int = 0) -> bool:
    """The one bf16 rule, for any device: a CUDA GPU by `bf16_native`, a CPU by its instructions
    (`CpuInfo.bf16_native`); MPS and others no. `train`, `bench` and `serve` all ask this."""
    if device_type == "cuda":
        return bf16_native(index)
    return device_type == "cpu" and detect_cpu().bf16_native


def free_memory(device: str) -> int:
    """Bytes free on `device` now: the GPU's free memory on CUDA, the system's MemAvailable on a CPU (8 GiB
    where it cannot be read). What a server may take of it is the serving plan's (plan/serving.py)."""
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0])
    return meminfo("MemAvailable") or 8 << 30


def llm_device_dtype(dtype: str) -> tuple[str, str]:
    """(device, dtype) a language model is served on: CUDA where there is one; `auto` is bf16 where the
    hardware computes it, fp32 elsewhere (emulated bf16 is slower; benchmarks/engine_step.py,
    docs/benchmarks.md)."""
    device = serving_device()
    return device, ("bf16" if computes_bf16(device) else "fp32") if dtype == "auto" else dtype


def serving_device() -> str:
    """Where a language model is served: CUDA where there is one, else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def choose_engine(cuda: list[GpuInfo], mps: bool, cpu_bf16: bool = False) -> dict:
    """cuda > mps > cpu; bf16-mixed where every GPU has native bf16, 16-mixed on older GPUs; on a CPU,
    bf16-mixed where it has bf16 instructions (`CpuInfo.bf16_native`), else 32-true."""
    if cuda:
        bf16 = all(g.bf16 for g in cuda)
        return {
            "accelerator": "cuda",
            "devices": len(cuda),
            "precision": "bf16-mixed" if bf16 else "16-mixed",
            "why": "native bf16 (compute capability >= 8.0)"
            if bf16
            else "no native bf16 before compute capability 8.0 (emulated bf16 is slower than fp16)",
        }
    if mps:
        return {"accelerator": "mps", "devices": 1, "precision": "16-mixed", "why": "Apple GPU: fp16 autocast"}
    if cpu_bf16:
        # Native bf16 makes the CPU's steps faster than fp32 at the same held-out quality (docs/train.md:
        # "bf16 on a CPU").
        return {
            "accelerator": "cpu",
            "devices": 1,
            "precision": "bf16-mixed",
            "why": "no GPU found: bf16 autocast on the CPU, which has bf16 instructions (AMX or AVX512-BF16)",
        }
    return {
        "accelerator": "cpu",
        "devices": 1,
        "precision": "32-true",
        "why": "no GPU found: full fp32 on the CPU (no bf16 instructions: emulated bf16 is slower)",
    }


def detect(catalog: Catalog) -> Devices:
    cpu = detect_cpu()
    try:
        import torch
    except ImportError:
        return Devices(cpu, [], False, None)
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            acc = match_device(catalog, p.name)
            gpus.append(
                GpuInfo(
                    index=i,
                    name=p.name,
                    memory_bytes=p.total_memory,
                    compute_capability=f"{p.major}.{p.minor}",
                    multiprocessors=p.multi_processor_count,
                    bf16=bf16_native(i),
                    catalog_slug=acc.slug if acc else None,
                    peak_bf16_tflops=acc.bf16_tflops if acc else None,
                )
            )
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    return Devices(cpu, gpus, mps, torch.__version__)


# `gpuwise train`'s precisions in the planner's names: a plan of "here" assumes what train would pick.
PLAN_PRECISION = {"bf16-mixed": "bf16", "16-mixed": "fp16", "32-true": "fp32"}


def cpu_accelerator(cpu: CpuInfo) -> Accelerator:
    """This CPU as a catalog row, for the planner: its RAM and its derived peaks. Its memory bandwidth
    cannot be detected from inside the machine (see `gpuwise bench`), so it is left infinite: a roofline
    then times the step by its FLOPs alone, a lower bound, rather than by a made-up figure."""
    if not cpu.fp32_peak_gflops:
        raise GpuwiseError(
            f"no peak known for this CPU ({cpu.model}: {cpu.clock_origin}): pass --gpu SLUG (see `gpuwise hardware`)"
        )
    return Accelerator(
        slug="cpu",
        name=f"{cpu.model} (this CPU)",
        vendor=cpu.vendor,
        kind="cpu",
        mem_gb=cpu.ram_bytes / 2**30,
        mem_bw_gbs=math.inf,
        fp32_tflops=cpu.fp32_peak_gflops / 1e3,
        tf32_tflops=None,
        bf16_tflops=cpu.bf16_peak_gflops / 1e3 if cpu.bf16_peak_gflops else None,
        fp16_tflops=None,
        fp8_tflops=None,
        int8_tops=None,
        tdp_w=None,
        interconnect="",
        nvlink_domain=1,
        max_per_node=1,
        launch_year=0,
        device_names="",
        source=f"detected here: {cpu.derivation}",
        as_of="now",
        origin="this machine",
    )


def here(catalog: Catalog) -> tuple[Accelerator, str]:
    """What `gpuwise train` would run on here, as a catalog row, and the precision it would pick there
    (planner names): the first CUDA GPU's row, else this CPU. A GPU the catalog does not know is
    refused rather than planned as the CPU, which train would not use."""
    dev = detect(catalog)
    if dev.cuda:
        gpu = dev.cuda[0]
        if gpu.catalog_slug is None:
            raise GpuwiseError(
                f"this machine's GPU ({gpu.name}) is not in the catalog: pass --gpu SLUG, or add it with --catalog FILE"
            )
        return catalog.get(gpu.catalog_slug), PLAN_PRECISION[choose_engine(dev.cuda, mps=False)["precision"]]
    return cpu_accelerator(dev.cpu), PLAN_PRECISION[choose_engine([], False, dev.cpu.bf16_native)["precision"]]
