"""Files a user names, and the JSON gpuwise writes: one reader that never hangs or eats memory on the wrong
file, one writer that only ever writes standard JSON."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

from gpuwise.errors import GpuwiseError

# A catalog CSV, a config.json or a run's config.yaml is a few kB; anything this large is the wrong file,
# and reading it whole (a disk image, /dev/zero) would take the memory instead of giving an answer.
MAX_FILE_BYTES = 10 * 2**20


def read_text_file(path: str | Path, what: str, expected: str, limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of a file a user named, or one line saying why not: a device, FIFO or directory is
    refused before it is opened (/dev/zero never ends, a FIFO blocks), and so is a file over ``limit``."""

    def refuse_odd(mode: int) -> None:
        if stat.S_ISDIR(mode):
            raise GpuwiseError(f"cannot read {what} {path}: it is a directory ({expected} is expected)")
        if not stat.S_ISREG(mode):
            raise GpuwiseError(f"cannot read {what} {path}: not a regular file (a device, FIFO or socket)")

    try:
        refuse_odd(os.stat(path).st_mode)
        # Checked again on what was opened, should the path change in between; O_NONBLOCK so that even
        # then a FIFO cannot hang the open (a regular file reads the same without it).
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            refuse_odd(os.fstat(fd).st_mode)
            data = f.read(limit + 1)  # /proc files report size 0: the read, not stat, enforces the limit
    except OSError as e:
        raise GpuwiseError(f"cannot read {what} {path}: {e.strerror}") from None
    if len(data) > limit:
        raise GpuwiseError(f"cannot read {what} {path}: over {limit // 2**20} MiB ({expected} is expected)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = "\0"
    if "\0" in text:  # valid UTF-8 may hold NUL bytes; text never does
        raise GpuwiseError(f"{path}: not a UTF-8 text file ({expected} is expected)")
    return text


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
