"""Atomic, checksummed checkpoints: write to a temp name, fsync, rename; keep the last N.

Fabric writes the state (so FSDP shards and the AMP scaler are handled by the library); this module
adds what it does not do: atomicity, a SHA-256 manifest, pruning, and falling back past a corrupt one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

MANIFEST = "manifest.json"
STATE = "state.ckpt"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir(ckpt_root: Path, step: int) -> Path:
    return ckpt_root / f"step-{step:06d}"


def save(fabric, ckpt_root: Path, step: int, state: dict, keep: int) -> Path:
    """Every rank calls this (Fabric's save is collective under FSDP)."""
    final, tmp = step_dir(ckpt_root, step), ckpt_root / f".tmp-step-{step:06d}"
    if fabric.is_global_zero:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    fabric.barrier()
    fabric.save(tmp / STATE, state)
    fabric.barrier()
    if fabric.is_global_zero:
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        for p in files:
            _fsync(p)
        manifest = {str(p.relative_to(tmp)): _sha256(p) for p in files}
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "sha256": manifest}, indent=1))
        _fsync(tmp / MANIFEST)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(ckpt_root)
        for old in sorted(ckpt_root.glob("step-*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    fabric.barrier()
    return final


def verify(path: Path) -> str | None:
    """None when the checkpoint is whole, else why not."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())["sha256"]
    except (OSError, ValueError, KeyError):
        return "no readable manifest"
    for rel, digest in manifest.items():
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if _sha256(f) != digest:
            return f"{rel} fails its checksum"
    return None


def latest_valid(ckpt_root: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and one line for each newer one that did not."""
    skipped = []
    for path in sorted(ckpt_root.glob("step-*"), reverse=True):
        why = verify(path)
        if why is None:
            return path, skipped
        skipped.append(f"checkpoint {path.name} is corrupt ({why}); using the one before it")
    return None, skipped
