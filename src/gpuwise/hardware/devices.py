"""What is here: the CPU, every CUDA GPU and MPS, and what `gpuwise train` would run on.

torch is imported inside ``detect()`` only, so `gpuwise plan` never pays for it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from gpuwise.hardware.catalog import Catalog, match_device
from gpuwise.hardware.cpu import CpuInfo, detect_cpu


@dataclass
class GpuInfo:
    index: int
    name: str
    memory_bytes: int
    compute_capability: str
    multiprocessors: int
    bf16: bool
    catalog_slug: str | None
    peak_bf16_tflops: float | None  # the catalog's dense peak, when the card is in it


@dataclass
class Devices:
    cpu: CpuInfo
    cuda: list[GpuInfo]
    mps: bool
    torch_version: str | None

    def train_default(self) -> dict:
        return choose_engine(self.cuda, self.mps)

    def as_dict(self) -> dict:
        return {
            "cpu": self.cpu.as_dict(),
            "cuda": [asdict(g) for g in self.cuda],
            "mps": self.mps,
            "torch": self.torch_version,
            "train_default": self.train_default(),
        }


def choose_engine(cuda: list[GpuInfo], mps: bool) -> dict:
    """cuda > mps > cpu; bf16-mixed where the GPU has bf16, 16-mixed on older GPUs, 32-true on CPU."""
    if cuda:
        bf16 = all(g.bf16 for g in cuda)
        return {
            "accelerator": "cuda",
            "devices": len(cuda),
            "precision": "bf16-mixed" if bf16 else "16-mixed",
            "why": "bf16 supported (compute capability >= 8.0)" if bf16 else "no bf16 before compute capability 8.0",
        }
    if mps:
        return {"accelerator": "mps", "devices": 1, "precision": "16-mixed", "why": "Apple GPU: fp16 autocast"}
    return {
        "accelerator": "cpu",
        "devices": 1,
        "precision": "32-true",
        "why": "no GPU found: full fp32 on the CPU",
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
                    bf16=p.major >= 8,
                    catalog_slug=acc.slug if acc else None,
                    peak_bf16_tflops=acc.bf16_tflops if acc else None,
                )
            )
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    return Devices(cpu, gpus, mps, torch.__version__)
