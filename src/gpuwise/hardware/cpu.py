"""The host CPU: model, cores, ISA extensions, RAM, and its theoretical peak, with the derivation.

No library reports a peak: ``py-cpuinfo`` reads the same /proc/cpuinfo fields but knows nothing of
FMA units, so the few rules below are written here, each stated in the derivation it prints.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
)


@dataclass
class CpuInfo:
    model: str
    vendor: str
    arch: str
    cores: int  # physical cores this process may use
    logical: int
    isa: list[str]
    ram_bytes: int
    clock_ghz: float | None
    clock_origin: str
    fp32_flop_per_cycle: int
    fp32_rule: str
    bf16_flop_per_cycle: int | None
    bf16_rule: str

    @property
    def fp32_peak_gflops(self) -> float | None:
        return self.cores * self.fp32_flop_per_cycle * self.clock_ghz if self.clock_ghz else None

    @property
    def bf16_peak_gflops(self) -> float | None:
        if not (self.clock_ghz and self.bf16_flop_per_cycle):
            return None
        return self.cores * self.bf16_flop_per_cycle * self.clock_ghz

    @property
    def bf16_native(self) -> bool:
        """Whether bf16 matmuls run on bf16 instructions (AMX or AVX512-BF16) rather than emulated at or
        below the fp32 rate: the CPU half of the one bf16 rule (`hardware.devices.bf16_native` is the GPU half)."""
        return self.bf16_flop_per_cycle is not None

    @property
    def derivation(self) -> str:
        clock = f"{self.clock_ghz:.2f} GHz" if self.clock_ghz else "unknown clock"
        peak = f" = {self.fp32_peak_gflops:.0f} GFLOP/s" if self.fp32_peak_gflops else ""
        return (
            f"{self.cores} cores x {self.fp32_flop_per_cycle} FP32 FLOP/cycle ({self.fp32_rule}) x "
            f"{clock} ({self.clock_origin}){peak}"
        )

    def as_dict(self) -> dict:
        return asdict(self) | {
            "fp32_peak_gflops": self.fp32_peak_gflops,
            "bf16_peak_gflops": self.bf16_peak_gflops,
            "derivation": self.derivation,
        }


def flop_per_cycle(vendor: str, flags: set[str]) -> tuple[int, str, int | None, str]:
    """FP32 and BF16 FLOP per cycle per core from the ISA (2 FLOP per FMA lane)."""
    amd = "amd" in vendor.lower()
    if "avx512f" in flags:
        if amd and "avx512_vp2intersect" not in flags:
            fp32, rule = 32, "AVX-512 on Zen 4: 2 FMA pipes x 256 bit"
        else:
            fp32, rule = 64, "AVX-512: 2 FMA units x 16 lanes x 2 (assumes 2 units, as on Xeon Gold/Platinum, Zen 5)"
    elif "avx2" in flags and "fma" in flags:
        fp32, rule = 32, "AVX2: 2 FMA units x 8 lanes x 2"
    elif "avx" in flags:
        fp32, rule = 16, "AVX without FMA: 8-lane add + 8-lane multiply"
    elif "asimd" in flags:
        fp32, rule = 16, "NEON: 4 FMA pipes x 4 lanes (assumption: Neoverse-class core)"
    else:
        fp32, rule = 8, "SSE: 4-lane add + 4-lane multiply"
    if "amx_bf16" in flags:
        return fp32, rule, 1024, "AMX: 1024 BF16 FLOP/cycle per core (Intel)"
    if "avx512_bf16" in flags:
        return fp32, rule, 2 * fp32, "AVX512-BF16 dot products: twice the FP32 rate"
    return fp32, rule, None, "no BF16 instructions: bf16 runs at or below the FP32 rate"


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields, and the number of distinct sockets."""
    fields: dict[str, str] = {}
    sockets = set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "physical id":
            sockets.add(value)
        fields.setdefault(key, value)
    fields["sockets"] = str(max(1, len(sockets)))
    return fields


def _clock(info: dict[str, str]) -> tuple[float | None, str]:
    max_freq = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    try:
        return int(max_freq.read_text()) / 1e6, "maximum boost, cpufreq"
    except (OSError, ValueError):
        pass
    try:
        return float(info["cpu MHz"]) / 1000, "/proc/cpuinfo current clock; boost may run faster"
    except (KeyError, ValueError):
        return None, "clock not reported"


def meminfo(key: str) -> int | None:
    """A /proc/meminfo field in bytes (MemTotal, MemAvailable, ...), or None off Linux."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _ram_bytes() -> int:
    total = meminfo("MemTotal")
    if total is not None:
        return total
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def detect_cpu() -> CpuInfo:
    info = _cpuinfo()
    flags = set(info.get("flags", info.get("Features", "")).split())
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        physical = int(info["cpu cores"]) * int(info["sockets"])
    except (KeyError, ValueError):
        physical = logical
    vendor = info.get("vendor_id", platform.machine())
    fp32, rule, bf16, bf16_rule = flop_per_cycle(vendor, flags)
    clock, origin = _clock(info)
    return CpuInfo(
        model=info.get("model name") or platform.processor() or platform.machine(),
        vendor=vendor,
        arch=platform.machine(),
        cores=min(logical, physical),  # SMT siblings share the FMA units
        logical=logical,
        isa=[f for f in ISA_FLAGS if f in flags],
        ram_bytes=_ram_bytes(),
        clock_ghz=clock,
        clock_origin=origin,
        fp32_flop_per_cycle=fp32,
        fp32_rule=rule,
        bf16_flop_per_cycle=bf16,
        bf16_rule=bf16_rule,
    )


# glibc mallopt() parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def _glibc():
    import ctypes
    import ctypes.util

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def retain_freed_memory() -> bool:
    """Keep the memory torch frees on the CPU inside the process, as CUDA's caching allocator does.

    glibc hands every block above its mmap threshold straight back to the kernel, so each training
    step maps its activations afresh and page-faults them in: slower, and by however much the host's
    memory state allows, which the plan cannot know. With mmap off and no trimming a step faults no
    pages and the peak resident set is lower (`benchmarks/cpu_allocator.py`; docs/benchmarks.md).
    A no-op off glibc."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def release_freed_memory() -> None:
    """Give freed heap memory back to the kernel now (before measuring a high-water mark from here)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
