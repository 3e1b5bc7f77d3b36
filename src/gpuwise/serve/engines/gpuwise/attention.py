"""Decode attention on a CPU: one new token per sequence against its cached keys and values, by a small AVX-512
kernel (kernels/decode_attention.cpp; on a CPU with AVX2 alone the same source through SIMDe, `isa`) built here on
first use; and in the same library, the product of a decode
step's few rows by a weight (`gemv`): oneDNN's packed bf16 product of one row read the weight at a third of the
memory's speed, the output layer's worst (docs/serving.md, "One stream").

Why by hand: PyTorch's CPU attention (`scaled_dot_product_attention`, its flash kernel) is built for prompts,
many queries against many keys; at one query a sequence it is a large share of a decode step, and no library
offers a decode kernel for PyTorch's CPU tensors (IPEX, which had one, is retired). The kernel takes a sequence
at a time: each position's keys and values, every head's, are contiguous in the cache and read once, for all
the query heads that share them, into fp32 registers. It is within one rounding of fp32 attention
(tests/test_decode_attention.py); its speed against SDPA is in docs/serving.md ("Decode attention on a CPU").

Built with the system's C++ compiler against PyTorch's own headers and libraries (its parallel loop runs on
PyTorch's thread pool), cached under gpuwise's cache directory by a hash of the source, the flags and the
PyTorch version, in a directory of the user's own and checked against the SHA-256 recorded at build before it
is loaded (`load`, below), then against SDPA on a small input. Where it cannot be built, loaded or trusted (no
compiler, neither AVX-512 nor AVX2 with SIMDe's headers, `GPUWISE_KERNELS=0`, a cache others can write, a
library that is not the one built, a failed self-check), `load` says why in one line and the decoder keeps
SDPA; a kernel that fails a call later hands that decoder back to SDPA too (decoder.py)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import logging
import math
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import torch

from gpuwise.serve.engines.gpuwise.quant import QuantWeight
from gpuwise.workloads.pretrained import cache_root

log = logging.getLogger("gpuwise.serve")

SOURCE = Path(__file__).with_name("kernels") / "decode_attention.cpp"
SHIM = SOURCE.with_name("avx512_on_avx2.h")  # the same kernels on a CPU with AVX2 alone, through SIMDe
SIMDE = "simde/x86/avx512.h"
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp"]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def _avx512() -> bool:
    # PyTorch's own dispatch level for this CPU: AVX512 where the CPU has AVX-512 F/BW/DQ/VL
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX", "AVX512_AMX")


def _avx2() -> bool:
    return {"avx2", "fma", "f16c"} <= _cpu_flags()


if _avx512():
    FLAGS += ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mf16c"]  # f16c: the block formats' scales
    if "avx512_vnni" in _cpu_flags():  # int8 dot products in one instruction (the kernel has a two-step fallback)
        FLAGS.append("-mavx512vnni")
    if {"amx_tile", "amx_bf16"} <= _cpu_flags():  # many rows by quantized weights on AMX's tiles (else the library's)
        FLAGS += ["-mamx-tile", "-mamx-bf16", "-mavx512bf16"]
else:
    FLAGS += ["-mavx2", "-mfma", "-mf16c"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
GEMV_ROWS = 8  # kernels/decode_attention.cpp kMaxRows: the whole-step kernel's rows at most
# A product alone (a step the whole-step kernel does not take: LoRA rows) goes to the product kernel up to this
# many rows, to oneDNN or MKL above: against oneDNN's packed bf16 product 1.02x, 1.10x, 0.96x, 0.79x at 1, 2, 4,
# 8 rows (benchmarks/engine_step.py, docs/serving.md "One stream")
GEMV_ROWS_ALONE = 2
PLAIN = 0  # the kernels' weight format for a weight in the activations' own dtype (quant.py's ggml type ids else)
PLAIN_X4 = 100  # the same laid out four rows at a time (quant.py: interleave_rows)


class DecodeAttention:
    """The loaded kernel: `__call__(q, keys, values, lens, table)` for q [n, H, D] and one layer of the paged KV
    cache (or one row of keys and values per sequence)."""

    def __init__(self, lib: ctypes.CDLL):
        self.fn = lib.gpuwise_decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        # dtype; q, keys, values, the block table, its row stride, the block size; lens, out; shapes and strides
        self.fn.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64, ptr, ptr, *[i64] * 11, ctypes.c_float]
        self.fn.restype = ctypes.c_int
        self.gemv_fn = lib.gpuwise_gemv
        self.gemv_fn.argtypes = [ctypes.c_int, ctypes.c_int, ptr, ptr, ptr, ptr, *[i64] * 4]
        self.gemv_fn.restype = ctypes.c_int
        self.dequantize_fn = lib.gpuwise_dequantize
        self.dequantize_fn.argtypes = [ctypes.c_int, ctypes.c_int, ptr, ptr, i64, i64, i64]
        self.dequantize_fn.restype = ctypes.c_int
        self.step_fn = lib.gpuwise_decode_step
        f32 = ctypes.c_float
        c_int = ctypes.c_int
        formats = [c_int, c_int, c_int]  # the activations' dtype, the layers' and the output layer's weight formats
        # x, cos, sin, pos; the block table, its row stride, the block size; the layers' addresses, eps, layers;
        # the final norm, its eps, the output layer, the logits
        pointers: list[type] = [ptr, ptr, ptr, ptr, ptr, i64, i64, ptr, ptr, i64, ptr, f32, ptr, ptr]
        self.step_fn.argtypes = [*formats, *pointers, *[i64] * 10, c_int]  # the last: the step's threads
        self.step_fn.restype = ctypes.c_int
        caps = lib.gpuwise_caps
        caps.restype = ctypes.c_int
        # products of many rows by quantized weights on AMX's tiles (kernels/decode_attention.cpp, amx_gemv): built
        # in, and granted by Linux (a kernel before 5.16, or a sandbox that refuses arch_prctl, does not)
        self.amx_built, self.amx = bool(caps() & 4), bool(caps() & 2)

    def supports(self, dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in DTYPES and head_dim % 16 == 0 and head_dim <= 256

    def __call__(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        lens: torch.Tensor,
        table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [n, H, D]; keys, values: one layer of a `PagedCache`, [blocks, block size, K, D] with the same strides,
        and `table` [n, blocks a row] int64, row i's blocks in order; or, without a table, [n, length, K, D], a row
        per sequence. lens: [n] int64, row i attends to positions 0 .. lens[i]-1, each at least 1 and within its
        table's blocks (the caller checks it once per step: the kernel reads what it is told). Returns [n, H, D],
        softmax(q k / sqrt(D)) v."""
        n, H, D = q.shape
        K = keys.shape[2]
        if table is None:  # a row per sequence: each a block of its own
            table = torch.arange(n, dtype=torch.int64).view(n, 1)
            if keys.shape[0] != n:
                raise ValueError(f"decode attention: shapes q {tuple(q.shape)}, keys {tuple(keys.shape)} do not match")
        if (
            keys.shape != values.shape
            or keys.stride() != values.stride()
            or table.dtype != torch.int64
            or table.dim() != 2
            or table.shape[0] != n
            or not table.is_contiguous()
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
            table.data_ptr(),
            table.shape[1],
            keys.shape[1],
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

    def gemv(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, x4: bool = False
    ) -> torch.Tensor:
        """F.linear(x, weight, bias) for x [..., I] of at most GEMV_ROWS rows (a decode step's), weight [O, I]
        with contiguous rows, all of one dtype (fp32 or bf16): the weight read once, at the memory's speed. In
        bf16 where AMX's tiles are granted (`amx`) and I is whole blocks of 32, any number of rows: on the tiles,
        the weight's rows read as they are stored. `x4`: the weight is laid out four rows at a time
        (quant.interleave_rows; O a multiple of 4, I of 32), at most GEMV_ROWS rows."""
        width = x.shape[-1]
        outs = weight.shape[0]
        rows = x.numel() // width if width else 0
        amx_rows = self.amx and x.dtype == torch.bfloat16 and width % 32 == 0 and not x4
        most = GEMV_ROWS if not amx_rows else rows
        if x4 and (outs % 4 or width % 32 or not weight.is_contiguous()):
            raise ValueError(f"gemv: a weight {tuple(weight.shape)} is not laid out four rows at a time")
        if (
            x.dtype != weight.dtype
            or x.dtype not in DTYPES
            or weight.dim() != 2
            or weight.shape[1] != width
            or weight.stride(1) != 1
            or not 1 <= rows <= most
            or (bias is not None and (bias.dtype != x.dtype or bias.shape != (outs,) or not bias.is_contiguous()))
        ):
            raise ValueError(f"gemv: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
        x = x.contiguous()
        out = torch.empty((*x.shape[:-1], outs), dtype=x.dtype)
        b = 0 if bias is None else bias.data_ptr()
        ptrs = (x.data_ptr(), weight.data_ptr(), b, out.data_ptr())
        rc = self.gemv_fn(DTYPES[x.dtype], PLAIN_X4 if x4 else PLAIN, *ptrs, rows, outs, width, weight.stride(0))
        if rc:
            raise ValueError(f"gemv: the kernel does not take {rows} x {width} by {outs} x {width}")
        return out

    def dequantize(
        self, weight: QuantWeight, rows: slice, dtype: torch.dtype, scratch: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows of a block-format weight as a plain [n, I] tensor in `dtype` (fp32 or bf16), written into the
        front of `scratch` (contiguous, of `dtype`, large enough) where given: a fresh tensor of a chunk's size
        each call cost as much again as the dequantizing, in page faults."""
        r0, r1, _ = rows.indices(weight.rows)
        shape = (max(0, r1 - r0), weight.cols)
        size = math.prod(shape)
        if scratch is not None and scratch.dtype == dtype and scratch.is_contiguous() and scratch.numel() >= size:
            out = scratch.view(-1)[:size].view(shape)
        else:
            out = torch.empty(shape, dtype=dtype)
        if self.dequantize_fn(DTYPES[dtype], weight.fmt.kernel, weight.data.data_ptr(), out.data_ptr(), r0,
                              out.shape[0], weight.cols):  # fmt: skip
            raise ValueError(f"dequantize: the kernel does not take {weight.fmt.name} rows of {weight.cols}")
        return out

    def qgemv(self, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, dequantize(weight), bias) for x [..., I] of any number of rows (fp32 or bf16) and a weight
        in one of llama.cpp's block formats (quant.py), read as it is stored: a few rows read it once at the
        memory's speed, more rows dequantize a few of its rows at a time into the cache and multiply them there."""
        width, outs = x.shape[-1], weight.rows
        rows = x.numel() // width if width else 0
        if (
            x.dtype not in DTYPES
            or weight.cols != width
            or weight.data.dtype != torch.uint8
            or not weight.data.is_contiguous()
            or rows < 1
            or (bias is not None and (bias.dtype != x.dtype or bias.shape != (outs,) or not bias.is_contiguous()))
        ):
            shape = f"{weight.rows}x{weight.cols} {weight.fmt.name}"
            raise ValueError(f"qgemv: x {tuple(x.shape)} {x.dtype}, weight {shape}")
        x = x.contiguous()
        out = torch.empty((*x.shape[:-1], outs), dtype=x.dtype)
        b = 0 if bias is None else bias.data_ptr()
        ptrs = (x.data_ptr(), weight.data.data_ptr(), b, out.data_ptr())
        if self.gemv_fn(DTYPES[x.dtype], weight.fmt.kernel, *ptrs, rows, outs, width, 0):
            raise ValueError(f"qgemv: the kernel does not take {rows} x {width} by {weight.fmt.name} {outs} x {width}")
        return out


def isa() -> str:
    """The instruction set the kernels are built for on this CPU: AVX-512, or AVX2 (through SIMDe's headers,
    kernels/avx512_on_avx2.h) where it has no AVX-512. `unavailable` says whether they can be built at all."""
    return "AVX-512" if _avx512() else "AVX2"


def _simde() -> bool:
    """SIMDe's headers where the compiler looks by default (Debian's libsimde-dev puts them in /usr/include)."""
    dirs = ["/usr/include", "/usr/local/include", *os.environ.get("CPATH", "").split(os.pathsep)]
    return any(d and (Path(d) / SIMDE).is_file() for d in dirs)


def _cache_dir() -> Path:
    return cache_root() / "kernels"


# A library is loaded by running its code (its constructors run at dlopen), so what is loaded must be what
# gpuwise built: the cache directory is this user's own (mode 0700, no symlink), each build is recorded by its
# SHA-256 in `decode_attention-KEY.sha256` (KEY: a hash of the source, flags, compiler and PyTorch version, so a
# changed source is a new build) beside the library, named by its digest (`decode_attention-KEY-DIGEST.so`,
# mode 0600: dlopen reads it, nothing executes the file itself), and the bytes are checked against the record
# before they are loaded. A record is replaced atomically after its library is in place: two servers building
# at once each leave a whole pair.
MAX_LIBRARY = 64 << 20  # the built library is ~100 KB: a bigger file is not one gpuwise built, and is not read whole
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _private_dir(path: Path) -> tuple[int | None, str]:
    """A descriptor of the directory `path`, made where missing, owned by this user, not a symlink and writable by
    no one else (one this user owns but others may read is made 0700); or None and why it cannot be used."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        # the checks are on the descriptor, and what is read or written below is opened relative to it
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except OSError as e:  # a symlink (ELOOP, or ENOTDIR with O_DIRECTORY), a file, no permission
        symlink = e.errno == errno.ELOOP or (path.is_symlink() if e.errno == errno.ENOTDIR else False)
        return None, f"the kernel cache {path} {'is a symlink' if symlink else f'cannot be used ({e.strerror})'}"
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        os.close(fd)
        return None, f"the kernel cache {path} is owned by uid {info.st_uid}, not this user ({os.geteuid()})"
    if info.st_mode & 0o022:
        os.close(fd)
        return None, f"the kernel cache {path} is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    if info.st_mode & 0o077:  # an earlier gpuwise made it 0755: this user's own, so it is made private
        os.fchmod(fd, 0o700)
    return fd, ""


def _read_private(dir_fd: int, name: str, limit: int) -> bytes:
    """A file of the private cache, read through one descriptor that does not follow a symlink and was checked to
    be a regular file of this user's, writable and readable by no one else. OSError or ValueError: why not."""
    fd = os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{name} is not a regular file")
        if info.st_uid != os.geteuid():
            raise ValueError(f"{name} is owned by uid {info.st_uid}, not this user")
        if info.st_mode & 0o077:
            raise ValueError(f"{name} has mode {stat.S_IMODE(info.st_mode):o}, not 600")
        if info.st_size > limit:
            raise ValueError(f"{name} is {info.st_size:,} bytes, more than {limit:,}")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit)
    finally:
        os.close(fd)


def _cached(dir_fd: int, key: str) -> tuple[bytes | None, str]:
    """The recorded build of `key` and its digest checked, or None and what is wrong ("" where none is recorded)."""
    record = f"decode_attention-{key}.sha256"
    try:
        digest = _read_private(dir_fd, record, 100).decode("ascii", errors="replace").strip()
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as e:
        return None, str(e) if isinstance(e, ValueError) else f"{record}: {e.strerror}"
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        return None, f"{record} holds no SHA-256 digest"
    name = f"decode_attention-{key}-{digest[:16]}.so"
    try:
        data = _read_private(dir_fd, name, MAX_LIBRARY)
    except (OSError, ValueError) as e:
        return None, str(e) if isinstance(e, ValueError) else f"{name}: {e.strerror}"
    if hashlib.sha256(data).hexdigest() != digest:
        return None, f"{name} does not match the SHA-256 recorded when it was built"
    return data, ""


def _write_private(dir_fd: int, name: str, data: bytes) -> None:
    """Write `name` in the private cache: a fresh 0600 file beside it, then renamed over it."""
    tmp = f".{name}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _dlopen(data: bytes, name: str, spare: Path) -> ctypes.CDLL:
    """Load the checked bytes. Loading the checked file by its path would leave a gap between the check and the
    dlopen in which the file could change (a TOCTOU race), so what is loaded is a copy only this process holds: an
    anonymous memfd, loaded through /proc/self/fd; where that cannot be (no memfd, or the kernel refuses to map
    one executable), a fresh 0600 file in a new 0700 directory under `spare`, removed once loaded."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            _write_all(fd, data)
            return ctypes.CDLL(f"/proc/self/fd/{fd}")
        except OSError as e:  # vm.memfd_noexec, no /proc: the fallback below
            log.debug("loading the kernel from a memfd failed: %s", e)
        finally:
            os.close(fd)
    with tempfile.TemporaryDirectory(dir=spare) as tmp:
        path = Path(tmp) / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        _write_all(fd, data)
        os.close(fd)
        return ctypes.CDLL(str(path))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _build(compiler: list[str], where: Path) -> tuple[bytes | None, str]:
    """Compile the kernel in a fresh directory under `where` (private): its bytes, or None and why not."""
    from torch.utils import cpp_extension

    torch_lib = Path(torch.__file__).parent / "lib"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    links = [f"-L{torch_lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_lib}"]
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        built = Path(tmp) / "decode_attention.so"
        cmd = [*compiler, *FLAGS, _abi(), *includes, str(SOURCE), "-o", str(built), *links]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"building it failed: {e}"
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["?"])[-1]
            log.debug("building the decode attention kernel failed: %s", done.stderr[-2000:])
            return None, f"building it failed: {last}"
        try:
            data = built.read_bytes()
        except OSError as e:
            return None, f"building it failed: {e.strerror}"
    return data, ""


def _abi() -> str:
    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def self_check(kernel: DecodeAttention) -> str:
    """Empty where the kernel gives SDPA's attention on a small cache (grouped heads, rows of unequal lengths, fp32
    and bf16); else what it got wrong. Run once at load, before the decoder may use it."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    n, H, K, D, length = 3, 4, 2, 32, 9
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 2**-6)):
        q = torch.randn(n, H, D, generator=gen).to(dtype)
        keys = torch.randn(n, length, K, D, generator=gen).to(dtype)
        values = torch.randn(n, length, K, D, generator=gen).to(dtype)
        lens = torch.tensor([1, 9, 5])
        try:
            got = kernel(q, keys, values, lens)
        except (ValueError, RuntimeError) as e:
            return str(e)
        allowed = torch.arange(length).view(1, 1, 1, length) < lens.view(n, 1, 1, 1)
        bias = torch.zeros(n, 1, 1, length).masked_fill_(~allowed, float("-inf"))
        want = F.scaled_dot_product_attention(
            q.float().view(n, K, H // K, D), keys.float().transpose(1, 2), values.float().transpose(1, 2), bias
        ).view(n, H, D)
        if got.shape != want.shape:
            return f"{dtype}: shape {tuple(got.shape)}, SDPA's {tuple(want.shape)}"
        off = float((got.float() - want).abs().max() / want.abs().max())
        if not off <= tolerance:  # a nan is off too
            return f"{dtype}: {off:.1e} off SDPA (tolerance {tolerance:.0e})"
        # the product, at a width that is no multiple of 16 (its tail) and a bias
        x, w, b = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((3, 37), (21, 37), (21,)))
        try:
            got = kernel.gemv(x, w, b)
        except (ValueError, RuntimeError) as e:
            return str(e)
        want = F.linear(x.float(), w.float(), b.float())
        off = float((got.float() - want).abs().max() / want.abs().max())
        if not off <= tolerance:
            return f"{dtype}: the product is {off:.1e} off F.linear (tolerance {tolerance:.0e})"
    return ""


@functools.lru_cache(maxsize=1)
def load() -> tuple[DecodeAttention | None, str]:
    """The kernel, built or found in the cache and checked; or None and why not. Whatever goes wrong (a cache that
    is not private, a library that is not the one recorded, a build or a self-check that fails) is at most one
    log line, and the decoder keeps SDPA: never an exception."""
    try:
        return _load()
    except OSError as e:  # a read-only or full file system, a cache removed meanwhile: never the end of `serve`
        return _refused("", f"its cache failed: {e}")


def _compiler() -> list[str]:
    found = shutil.which("g++") or shutil.which("c++")
    return shlex.split(os.environ.get("CXX", "")) or ([found] if found else [])  # CXX may be "ccache g++"


def unavailable() -> str:
    """Why the kernels cannot run on this host at all (empty where they may: `load` still builds and checks
    them), without building anything: what `--engine auto` asks before it trusts speeds measured with them."""
    if os.environ.get("GPUWISE_KERNELS", "1") == "0":
        return "GPUWISE_KERNELS=0"
    if not _avx512():
        level = torch.backends.cpu.get_cpu_capability()
        if not _avx2():
            return f"this CPU's PyTorch dispatch level is {level}: neither AVX-512 nor AVX2 with FMA and F16C"
        if not _simde():
            return (
                f"this CPU's PyTorch dispatch level is {level}, not AVX-512, and SIMDe's headers, which build the "
                "kernels for AVX2, are not installed (apt install libsimde-dev)"
            )
    if not hasattr(os, "O_NOFOLLOW") or not hasattr(os, "geteuid"):
        return "its private cache needs a POSIX system"
    if not _compiler():
        return "no C++ compiler (g++) to build it with"
    return ""


def _load() -> tuple[DecodeAttention | None, str]:
    why_not = unavailable()
    if why_not:
        return None, why_not
    compiler = _compiler()
    key = hashlib.sha256(
        SOURCE.read_bytes() + SHIM.read_bytes() + " ".join([*compiler, *FLAGS, _abi(), torch.__version__]).encode()
    ).hexdigest()[:16]
    cache = _cache_dir()
    dir_fd, problem = _private_dir(cache)
    private = dir_fd is not None
    with contextlib.ExitStack() as stack:
        if dir_fd is None:  # built for this process alone, in a directory of its own
            where = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpuwise-kernels-")))
            data = None
        else:
            stack.callback(os.close, dir_fd)
            where = cache
            data, rejected = _cached(dir_fd, key)
            problem = f"the cached {rejected}" if rejected else ""
        source = "cached"
        if data is None:
            data, failed = _build(compiler, where)
            if data is None:
                return _refused(problem, failed)
            source = "built"
            if dir_fd is not None:
                digest = hashlib.sha256(data).hexdigest()
                try:
                    _write_private(dir_fd, f"decode_attention-{key}-{digest[:16]}.so", data)
                    _write_private(dir_fd, f"decode_attention-{key}.sha256", f"{digest}\n".encode())
                except OSError as e:  # a full disk: the build still serves this process
                    log.debug("caching the decode attention kernel failed: %s", e)
        try:
            kernel = DecodeAttention(_dlopen(data, f"decode_attention-{key}.so", where))
        except (OSError, AttributeError) as e:
            return _refused(problem, f"loading it failed: {e}")
        wrong = self_check(kernel)
        if wrong:
            return _refused(problem, f"its self-check against SDPA failed ({wrong})")
    if problem:
        log.warning("decode attention kernel: %s; %s", problem, "rebuilt it" if private else "built a private one")
    built_for = "AVX-512" if _avx512() else "AVX2 (through SIMDe)"
    return kernel, f"gpuwise's {built_for} decode attention ({source}, checked against SDPA at load)"


def _refused(problem: str, failed: str) -> tuple[None, str]:
    """SDPA, and the one log line saying why (with the cache's problem where there was one)."""
    log.warning("decode attention kernel: %s: serving with SDPA", f"{problem}; {failed}" if problem else failed)
    return None, failed
