"""The header of a GGUF file (llama.cpp's format), read without touching the weights.

A GGUF file opens with its metadata: the magic b"GGUF", a version, the tensor and
key/value counts, every key/value, then each tensor's name, shape, type and offset; the weights follow.
Only that header is read, by plain reads in pieces of at most 1 MiB: the weights are never touched, and a file
that shrinks while it is read ends the read early ("truncated"), where a memory map would kill the process with
SIGBUS. gguf.GGUFReader reads the same header but memory-maps the file and builds a NumPy view of every string
of the tokenizer (seconds for a 49 k vocabulary: docs/benchmarks.md); this reader skips what it does not
need, without NumPy, in milliseconds. tests/test_open_models.py holds the two readers to the same
answer on the real file.

The file is not trusted (tests/test_kernel_gguf_untrusted.py): every count and length is checked against the
bytes that remain before anything is read, allocated or looped over, arrays nest at most _GGUF_MAX_DEPTH deep,
and the header may take at most _GGUF_MAX_HEADER bytes, so a sparse file of terabytes declaring a huge list
answers at once rather than after reading (or looping over) gigabytes of holes. Real headers are far smaller:
SmolLM2's, a 49 k-token vocabulary with its merges, takes 1.8 MB; a 262 k one (Gemma 3's) scales to about 10 MB.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gpuwise.errors import GpuwiseError


def shown(value) -> str:
    """A value of an untrusted file, quoted and cut short for an error line."""
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_MAX_HEADER = 64 << 20
# llama.cpp reads no nested array at all; the gguf package writes them. A few levels is any real use.
_GGUF_MAX_DEPTH = 4
_GGUF_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS: llama.cpp refuses a tensor of more
_GGUF_PIECE = 1 << 20  # one plain read at most


class _Truncated(Exception):
    pass


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array: its element type and length; the values only when short and numeric."""

    type: int
    length: int
    values: tuple = ()


def read_gguf_header(path: Path) -> tuple[dict[str, object], dict[str, tuple[int, ...]]]:
    """The metadata (key -> value) and the tensors (name -> shape, GGUF order) of a GGUF file, or one line."""
    import os
    import stat

    try:
        # O_NONBLOCK: a FIFO put in the file's place opens at once (and is refused below) instead of waiting for a
        # writer; the checks are on the descriptor read from, so nothing can be swapped in between.
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
        try:
            fd = os.open(path, flags)
        except IsADirectoryError:
            raise GpuwiseError(f"cannot read GGUF file {path}: it is a directory") from None
        try:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                raise GpuwiseError(f"cannot read GGUF file {path}: it is a directory")
            if not stat.S_ISREG(info.st_mode):
                raise GpuwiseError(f"cannot read GGUF file {path}: not a regular file (a device, FIFO or socket)")
            header = _GGUFHeader(fd, info.st_size, path)
            try:
                header.need(4)
                magic = header.take(4)
            except _Truncated:
                magic = b""
            if magic != b"GGUF":
                raise GpuwiseError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
            try:
                return _parse_gguf(header, path)
            except _Truncated:
                raise GpuwiseError(  # its size said more at open: it shrank while it was read
                    f"{path}: truncated GGUF file (it ended at byte {header.end:,} while its header was read)"
                ) from None
        finally:
            os.close(fd)
    except OSError as e:
        raise GpuwiseError(f"cannot read GGUF file {path}: {e.strerror}") from None


# llama.cpp's names of a GGUF's general.file_type (llama.h, enum llama_ftype; the K-quants' "mostly" types)
FILE_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 7: "q8_0", 8: "q5_0", 9: "q5_1", 10: "q2_k", 11: "q3_k_s",
              12: "q3_k_m", 13: "q3_k_l", 14: "q4_k_s", 15: "q4_k_m", 16: "q5_k_s", 17: "q5_k_m", 18: "q6_k",
              32: "bf16"}  # fmt: skip
PLAIN_TYPES = ("f32", "f16", "bf16")


def gguf_file_type(path: Path) -> str:
    """A GGUF's file type as llama.cpp names it (q4_1, bf16...) from its header's general.file_type; "gguf"
    where the header does not say or cannot be read."""
    try:
        meta, _ = read_gguf_header(path)
    except (OSError, ValueError, GpuwiseError):
        return "gguf"
    code = meta.get("general.file_type")
    return FILE_TYPES.get(code, f"gguf file type {code}") if isinstance(code, int) else "gguf"


class _GGUFHeader:
    """The header's bytes from a file descriptor, read forward in plain reads of at most _GGUF_PIECE bytes and
    kept only from the current position on; `pos` is the offset in the file. `left()` is what the header may
    still take: the smaller of the file's size (at open) and _GGUF_MAX_HEADER, less `pos`."""

    def __init__(self, fd: int, size: int, path: Path):
        self.fd, self.size, self.path = fd, size, path
        self.limit = min(size, _GGUF_MAX_HEADER)
        self.buf, self.at, self.pos = b"", 0, 0  # buf holds the file's bytes from offset `at`
        self.end = 0  # how far the file has been read: where a shrunk file ended

    def left(self) -> int:
        return self.limit - self.pos

    def check(self, n: int, what: str) -> None:
        """One line at once where `what` (n bytes) cannot fit what is left of the file, or of the header limit."""
        if n <= self.left():
            return
        if self.pos + n <= self.size:
            raise GpuwiseError(
                f"{self.path}: GGUF header too large: {what} at byte {self.pos:,} would take it past "
                f"{_GGUF_MAX_HEADER >> 20} MiB (real headers take a few MB; a damaged or hostile file)"
            )
        raise GpuwiseError(
            f"{self.path}: truncated or damaged GGUF file ({what} at byte {self.pos:,}, where "
            f"{self.size - self.pos:,} bytes remain)"
        )

    def need(self, n: int) -> None:
        """Make the next n bytes (n <= left()) readable from buf, by plain reads."""
        start = self.pos - self.at
        if start + n <= len(self.buf):
            return
        if n > self.left():
            raise _Truncated
        import os

        kept = self.buf[start:] if start < len(self.buf) else b""  # after a skip past buf: nothing kept
        pieces, got = [kept], len(kept)
        self.at, offset = self.pos, self.pos + got
        # a piece ahead where the header allows: the many small reads of a token list take one read per MiB
        want = min(max(n - got, _GGUF_PIECE), self.limit - offset)
        while got < n or want > 0:
            os.lseek(self.fd, offset, os.SEEK_SET)
            piece = os.read(self.fd, min(want, _GGUF_PIECE))
            if not piece:  # the file ends before its size at open said: it shrank while read
                self.end = offset
                if got < n:
                    raise _Truncated
                break
            pieces.append(piece)
            got, offset, want = got + len(piece), offset + len(piece), want - len(piece)
        self.buf = b"".join(pieces)
        self.end = max(self.end, offset)

    def take(self, n: int) -> bytes:
        self.need(n)
        start = self.pos - self.at
        self.pos += n
        return self.buf[start : start + n]

    def skip(self, n: int) -> None:
        self.pos += n  # checked by the caller against left(); nothing is read

    def unpack(self, fmt: str, width: int) -> tuple:
        import struct

        self.need(width)
        out = struct.unpack_from(fmt, self.buf, self.pos - self.at)
        self.pos += width
        return out

    def skip_strings(self, n: int) -> None:
        """Skip n strings (a tokenizer's list: 100 k of them), each a length then its bytes, never decoded.
        The loop runs on locals over what is read, so the worst a 64 MiB header holds (8 M empty strings) takes
        seconds, not minutes."""
        import struct

        length = struct.Struct("<Q").unpack_from
        while n:
            self.need(8)
            buf, at, pos, limit = self.buf, self.at, self.pos, self.limit
            end = at + len(buf)
            while n and pos + 8 <= end:
                (k,) = length(buf, pos - at)
                if k > limit - pos - 8:
                    self.pos = pos + 8
                    self.check(k, f"a string of {k:,} bytes")
                pos += 8 + k
                n -= 1
            self.pos = pos


def _parse_gguf(header: _GGUFHeader, path: Path) -> tuple[dict[str, object], dict[str, tuple[int, ...]]]:
    import struct

    header.check(20, "the version and counts")
    version, tensor_count, kv_count = header.unpack("<IQQ", 20)
    if version not in (2, 3):
        raise GpuwiseError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")

    def u32() -> int:
        header.check(4, "a value type")
        return header.unpack("<I", 4)[0]

    def string(what: str) -> str:
        header.check(8, f"the length of {what}")
        (n,) = header.unpack("<Q", 8)
        header.check(n, f"{what} of {n:,} bytes")
        return header.take(n).decode("utf-8", errors="replace")

    def value(kind: int, depth: int) -> object:
        if kind in _GGUF_SCALARS:
            fmt = _GGUF_SCALARS[kind]
            width = struct.calcsize(fmt)
            header.check(width, "a value")
            return header.unpack(fmt, width)[0]
        if kind == _GGUF_STRING:
            return string("a string")
        if kind == _GGUF_ARRAY:
            if depth >= _GGUF_MAX_DEPTH:
                raise GpuwiseError(
                    f"{path}: GGUF arrays nested more than {_GGUF_MAX_DEPTH} deep at byte {header.pos:,} "
                    "(a damaged or hostile file)"
                )
            header.check(12, "an array's type and length")
            item, n = header.unpack("<IQ", 12)
            if item in _GGUF_SCALARS:
                width = struct.calcsize(_GGUF_SCALARS[item])
                header.check(n * width, f"an array of {n:,} values")
                if n <= 4096:
                    values = header.unpack(f"<{n}{_GGUF_SCALARS[item][1]}", n * width)
                else:
                    values = ()
                    header.skip(n * width)
                return GGUFArray(item, n, values)
            if item == _GGUF_STRING:  # skipped by their lengths, never decoded (the tokenizer's 100 k strings)
                header.check(n * 8, f"an array of {n:,} strings")  # each at least its 8-byte length
                header.skip_strings(n)
            elif item == _GGUF_ARRAY:
                header.check(n * 12, f"an array of {n:,} arrays")  # each at least its type and length
                for _ in range(n):
                    value(item, depth + 1)
            else:
                raise GpuwiseError(f"{path}: unknown GGUF value type {item} (a damaged or newer file)")
            return GGUFArray(item, n)
        raise GpuwiseError(f"{path}: unknown GGUF value type {kind} (a damaged or newer file)")

    header.check(kv_count * 12, f"{kv_count:,} metadata entries")  # key length + value type: 12 bytes each at least
    meta: dict[str, object] = {}
    for _ in range(kv_count):
        key = string("a key")
        meta[key] = value(u32(), 0)
    header.check(tensor_count * 24, f"{tensor_count:,} tensors")  # name length + dims count + type + offset
    tensors: dict[str, tuple[int, ...]] = {}
    for _ in range(tensor_count):
        name = string("a tensor name")
        header.check(4, "a tensor's dimension count")
        (n_dims,) = header.unpack("<I", 4)
        if n_dims > _GGUF_MAX_DIMS:
            raise GpuwiseError(
                f"{path}: GGUF tensor {shown(name)} has {n_dims:,} dimensions (at most {_GGUF_MAX_DIMS})"
            )
        header.check(8 * n_dims + 12, "a tensor's shape, type and offset")
        tensors[name] = header.unpack(f"<{n_dims}Q", 8 * n_dims)
        header.skip(12)  # the type and the data offset
    return meta, tensors
