"""Decode attention on a CPU: one new token per sequence against its cached keys and values, by a small AVX-512
kernel (kernels/decode_attention.cpp) built here on first use.

Why by hand: PyTorch's CPU attention (`scaled_dot_product_attention`, its flash kernel) is built for prompts,
many queries against many keys. A decode step has one query per sequence (three per key/value head with
SmolLM2's grouped queries), and there it spent 0.6 ms a layer at batch 32 on 2 AMD EPYC cores (Zen 5,
AVX-512), 35 % of a bf16 decode step (51 ms; 33 ms with attention left out). The kernel takes a sequence at a
time: each position's keys and values, every head's, are contiguous in the cache and read once, for all the
query heads that share them, into fp32 registers. On the same calls it ran 3.0-3.9x SDPA's speed at batch
32 in bf16, 2.0-2.4x in fp32, 0.94-1.45x at batch 1 (`benchmarks/decode_attention.py`), and a bf16 decode
step of SmolLM2 at batch 32 took 46.6 ms against 59.1 (67-97-token sequences, one process, interleaved). It
is within one rounding of fp32 attention (tests/test_decode_attention.py). No library offers this for
PyTorch's CPU tensors: IPEX, which had one, is retired.

Built with the system's C++ compiler against PyTorch's own headers and libraries (about 2 s; its parallel
loop runs on PyTorch's thread pool), cached under gpuwise's cache directory by a hash of the source, the flags
and the PyTorch version. Where it cannot be built or loaded (no compiler, no AVX-512, `GPUWISE_KERNELS=0`),
`load` says why and the decoder keeps SDPA."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("gpuwise.serve")

SOURCE = Path(__file__).with_name("kernels") / "decode_attention.cpp"
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class DecodeAttention:
    """The loaded kernel: `__call__(q, keys, values, lens)` for q [n, H, D] and one layer's cache view."""

    def __init__(self, lib: ctypes.CDLL):
        self.fn = lib.gpuwise_decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.fn.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, ptr, *[i64] * 11, ctypes.c_float]
        self.fn.restype = ctypes.c_int

    def supports(self, dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in DTYPES and head_dim % 16 == 0 and head_dim <= 256

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """q: [n, H, D]; keys, values: [n, length, K, D] with the same strides (views of a `SlotCache` layer);
        lens: [n] int64, row i attends to positions 0 .. lens[i]-1, each 1 .. length (the caller checks it once
        per step: the kernel reads what it is told). Returns [n, H, D], softmax(q k / sqrt(D)) v."""
        n, H, D = q.shape
        K = keys.shape[2]
        if (
            keys.shape != values.shape
            or keys.stride() != values.stride()
            or keys.shape[0] != n
            or keys.shape[3] != D
            or q.stride(2) != 1
            or keys.stride(3) != 1
            or lens.dtype != torch.int64
            or not lens.is_contiguous()
            or lens.shape != (n,)
            or q.dtype != keys.dtype
            or keys.dtype != values.dtype
        ):
            raise ValueError(f"decode attention: shapes q {tuple(q.shape)}, keys {tuple(keys.shape)} do not match")
        out = torch.empty((n, H, D), dtype=q.dtype)
        rc = self.fn(
            DTYPES[q.dtype],
            q.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            lens.data_ptr(),
            out.data_ptr(),
            n,
            H,
            K,
            D,
            q.stride(0),
            q.stride(1),
            keys.stride(0),
            keys.stride(1),
            keys.stride(2),
            out.stride(0),
            out.stride(1),
            D**-0.5,
        )
        if rc:
            raise ValueError(f"decode attention: the kernel does not take H={H}, K={K}, D={D}")
        return out


def _avx512() -> bool:
    # PyTorch's own dispatch level for this CPU: AVX512 where the CPU has AVX-512 F/BW/DQ/VL
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX", "AVX512_AMX")


def _cache_dir() -> Path:
    from gpuwise.workloads.pretrained import cache_root

    return cache_root() / "kernels"


@functools.lru_cache(maxsize=1)
def load() -> tuple[DecodeAttention | None, str]:
    """The kernel, built or found in the cache; or None and why not."""
    if os.environ.get("GPUWISE_KERNELS", "1") == "0":
        return None, "GPUWISE_KERNELS=0"
    if not _avx512():
        return None, f"this CPU's PyTorch dispatch level is {torch.backends.cpu.get_cpu_capability()}, not AVX-512"
    found = shutil.which("g++") or shutil.which("c++")
    compiler = shlex.split(os.environ.get("CXX", "")) or ([found] if found else [])  # CXX may be "ccache g++"
    if not compiler:
        return None, "no C++ compiler (g++) to build it with"
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    links = [f"-L{torch_lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_lib}"]
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join([*compiler, *FLAGS, abi, torch.__version__]).encode()
    ).hexdigest()[:16]
    path = _cache_dir() / f"decode_attention-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # built beside its final name and renamed into place: two servers starting at once never load half a file
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            cmd = [*compiler, *FLAGS, abi, *includes, str(SOURCE), "-o", str(built), *links]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired) as e:
                return None, f"building it failed: {e}"
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["?"])[-1]
                log.warning("building the decode attention kernel failed: %s", done.stderr[-2000:])
                return None, f"building it failed: {last}"
            os.replace(built, path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"loading it failed: {e}"
    return DecodeAttention(lib), f"gpuwise's AVX-512 decode attention ({path.name})"
