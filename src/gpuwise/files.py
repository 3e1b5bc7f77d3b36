"""Files a user names, the files of a run directory, and the JSON gpuwise writes: one reader that never
hangs or eats memory on the wrong file, one writer that only ever writes standard JSON.

A run directory is untrusted input (from a colleague, a bucket, a ticket): its files are opened without
following a symbolic link, only regular files are read or written, and every read is bounded. A file a
user names on the command line (a catalog, a model's config.json in the hub cache) may be a link.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from gpuwise.errors import GpuwiseError

# A catalog CSV, a config.json or a run's config.yaml is a few kB; anything this large is the wrong file,
# and reading it whole (a disk image, /dev/zero) would take the memory instead of giving an answer.
MAX_FILE_BYTES = 10 * 2**20
# A long run logs a line per step: a million steps is ~200 MB. Past this, the file is not a metrics log.
MAX_METRICS_BYTES = 512 * 2**20
# A run's files hold no nesting deeper than this (config.yaml is flat); a deeper YAML document is planted,
# and PyYAML's composer recurses once per level (100,000 '[' end in a RecursionError).
MAX_YAML_DEPTH = 32

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def _refuse_odd(path: str | Path, what: str, expected: str, mode: int) -> None:
    if stat.S_ISDIR(mode):
        raise GpuwiseError(f"cannot read {what} {path}: it is a directory ({expected} is expected)")
    if stat.S_ISLNK(mode):
        raise GpuwiseError(f"refused {what} {path}: a symbolic link, which a run directory gpuwise writes never holds")
    if not stat.S_ISREG(mode):
        raise GpuwiseError(f"cannot read {what} {path}: not a regular file (a device, FIFO or socket)")


def _oserror(path: str | Path, what: str, e: OSError, verb: str = "read") -> GpuwiseError:
    # O_NOFOLLOW on a link fails with ELOOP (EMLINK on FreeBSD): say what was there, not "too many links".
    if e.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
        return GpuwiseError(f"refused {what} {path}: a symbolic link, which a run directory gpuwise writes never holds")
    if e.errno == errno.ENXIO:  # O_WRONLY | O_NONBLOCK on a FIFO with no reader: it would have hung
        return GpuwiseError(f"cannot {verb} {what} {path}: not a regular file (a FIFO)")
    return GpuwiseError(f"cannot {verb} {what} {path}: {e.strerror or e}")


def open_file(path: str | Path, what: str, expected: str, follow_symlinks: bool = True) -> io.BufferedReader:
    """A regular file opened for reading, or one line saying why not: a device, FIFO or directory is refused
    before it is opened (/dev/zero never ends, a FIFO blocks), and, with `follow_symlinks=False` (a run's
    files), so is a symbolic link."""
    try:
        _refuse_odd(path, what, expected, (os.stat if follow_symlinks else os.lstat)(path).st_mode)
        # Checked again on what was opened, should the path change in between; O_NONBLOCK so that even
        # then a FIFO cannot hang the open (a regular file reads the same without it).
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | (0 if follow_symlinks else _NOFOLLOW))
    except OSError as e:
        raise _oserror(path, what, e) from None
    try:
        _refuse_odd(path, what, expected, os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    return io.BufferedReader(io.FileIO(fd, "rb"))


def _text(path: str | Path, data: bytes, expected: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = "\0"
    if "\0" in text:  # valid UTF-8 may hold NUL bytes; text never does
        raise GpuwiseError(f"{path}: not a UTF-8 text file ({expected} is expected)")
    return text


def read_text_file(
    path: str | Path, what: str, expected: str, limit: int = MAX_FILE_BYTES, follow_symlinks: bool = True
) -> str:
    """The UTF-8 text of a file, or one line saying why not (see `open_file`), also for a file over `limit`."""
    with open_file(path, what, expected, follow_symlinks) as f:
        try:
            data = f.read(limit + 1)  # /proc files report size 0: the read, not stat, enforces the limit
        except OSError as e:
            raise _oserror(path, what, e) from None
    if len(data) > limit:
        raise GpuwiseError(f"cannot read {what} {path}: over {_mib(limit)} ({expected} is expected)")
    return _text(path, data, expected)


def read_run_file(path: str | Path, what: str, expected: str, limit: int = MAX_FILE_BYTES) -> str:
    """`read_text_file` for a file of a run directory: never through a symbolic link."""
    return read_text_file(path, what, expected, limit, follow_symlinks=False)


def run_file_lines(path: str | Path, what: str, expected: str, limit: int, line_limit: int = 2**20) -> Iterator[str]:
    """A run file's lines (metrics.jsonl), read a block at a time: no more than `limit` bytes in all, and
    a line longer than `line_limit` (no newline in a planted file of zeros) is skipped, not held whole. The
    last line is given as it is, with no newline, when the file does not end in one (a run still writing)."""
    with open_file(path, what, expected, follow_symlinks=False) as f:
        total, pending, skipping = 0, b"", False
        while True:
            try:
                block = f.read(1 << 20)
            except OSError as e:
                raise _oserror(path, what, e) from None
            if not block:
                break
            total += len(block)
            if total > limit:
                raise GpuwiseError(f"cannot read {what} {path}: over {_mib(limit)} ({expected} is expected)")
            *lines, tail = (pending + block).split(b"\n")
            for n, line in enumerate(lines):
                if not (skipping and n == 0):
                    yield line.decode("utf-8", errors="replace") + "\n"
            skipping = skipping and not lines
            pending = tail
            if len(pending) > line_limit:
                pending, skipping = b"", True
        if pending and not skipping:
            yield pending.decode("utf-8", errors="replace")


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"


def open_run_file_for_append(path: str | Path, what: str) -> int:
    """A descriptor to append to a run's file (metrics.jsonl), created if absent: never through a symbolic
    link, and never a FIFO (O_NONBLOCK: a FIFO with no reader fails at once instead of blocking the open)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK, 0o644)
    except OSError as e:
        raise _oserror(path, what, e, "write") from None
    return _regular_fd(fd, path, what, "write")


def open_lock_file(path: str | Path, what: str, create: bool = True) -> int:
    """A descriptor for a run's lock file (read and write; created if absent and `create`), or one line: a
    symbolic link is never followed (the PID written to it would overwrite the link's target) and a FIFO or
    device is refused (it would hang or take the write)."""
    flags = (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY) | _NOFOLLOW | _NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        raise _oserror(path, what, e, "open") from None
    return _regular_fd(fd, path, what, "open")


def _regular_fd(fd: int, path: str | Path, what: str, verb: str) -> int:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise GpuwiseError(f"cannot {verb} {what} {path}: not a regular file (a device, FIFO or socket)")
    os.set_blocking(fd, True)
    return fd


def write_atomic(path: Path, text: str, what: str = "run file") -> None:
    """`path` replaced whole by `text` (a temp file, fsync, rename): a killed process never leaves half of it.
    The temp is created new (O_EXCL, O_NOFOLLOW): a stale one, or a symbolic link planted under its name, is
    removed first and never written through."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # the link itself, not its target
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # a link at `path` is itself replaced: its target is left as it was
    except OSError as e:
        raise _oserror(tmp, what, e, "write") from None


def parse_yaml(text: str, where: str, max_depth: int = MAX_YAML_DEPTH):
    """`yaml.safe_load` with a nesting limit: deeper than `max_depth` collections is one line, not the
    RecursionError of PyYAML's recursive composer. The limit is counted where nodes are composed, so it
    holds alike for block and flow style, and for aliases (composed once, referenced after)."""
    import yaml

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            self.depth += 1
            if self.depth > max_depth:
                raise GpuwiseError(f"cannot read {where}: nested deeper than {max_depth} levels")
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise GpuwiseError(f"cannot read {where}: {str(e).splitlines()[0]}") from None


def finite(data):
    """The same data with every inf and nan as None (JSON null): JSON has no such numbers, and json.dumps
    would write the non-standard Infinity and NaN that strict parsers (JavaScript, jq, Go) refuse."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [finite(v) for v in data]
    return data


def to_json(data, indent: int | None = None) -> str:
    """Standard JSON, the one way gpuwise writes it (stdout, the record, bench.json)."""
    return json.dumps(finite(data), indent=indent, default=str, allow_nan=False)


def read_key_file(path: Path) -> str:
    """An API key from a file's first line (serve --api-key-file, a launched endpoint's key), as one line when it
    cannot be read."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the read for ever
            raise GpuwiseError(f"--api-key-file {path}: not a regular file")
        with open(path, encoding="utf-8") as f:
            key = f.readline().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        raise GpuwiseError(f"--api-key-file {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not key:
        raise GpuwiseError(f"--api-key-file {path}: its first line is empty")
    return key
