"""Atomic, checksummed checkpoints: write to a temp name, fsync, rename; keep the last N.

Fabric writes the state (so FSDP shards and the AMP scaler are handled by the library); this module
adds what it does not do: atomicity, a SHA-256 manifest, pruning, falling back past a corrupt one, and
loading that runs no code. A run directory is untrusted input (it may come from a colleague, a bucket, a
ticket): its manifest proves the files are whole, not that they are harmless, since whoever plants a
file can write a matching manifest. So every load is `weights_only` (tensors and plain containers),
and the state saved holds nothing else (see `loop.rng_state`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import torch

from gpuwise.errors import GpuwiseError
from gpuwise.files import open_file, read_run_file

MANIFEST = "manifest.json"
STATE = "state.ckpt"


def _sha256(path: Path) -> str:
    # No fallback loop: file_digest is Python 3.11, the floor pyproject.toml sets. It reads in blocks
    # into one reused buffer, so a shard of many GB hashes in constant memory. Never through a link (one to
    # /proc/kcore is a "regular file" of 128 TB), never a FIFO: files.open_file says why in one line.
    with open_file(path, "checkpoint file", "a file gpuwise train wrote", follow_symlinks=False) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
        text = read_run_file(path / MANIFEST, "checkpoint manifest", "the manifest.json gpuwise train writes")
        manifest = json.loads(text)["sha256"]
        items = list(manifest.items())
    except (GpuwiseError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return "no readable manifest"
    for rel, digest in items:
        if not isinstance(rel, str) or Path(rel).is_absolute() or ".." in Path(rel).parts:
            return f"its manifest names a file outside it ({str(rel)[:80]})"
        f = path / rel
        if not os.path.lexists(f):
            return f"{rel} is missing"
        try:
            if _sha256(f) != digest:
                return f"{rel} fails its checksum"
        except GpuwiseError as e:
            return str(e)
    return None


def candidates(ckpt_root: Path):
    """Newest first: (path, None) for each checkpoint that verifies, (path, why) for one that does not."""
    for path in sorted(ckpt_root.glob("step-*"), reverse=True):
        yield path, verify(path)


def load(fabric, path: Path, state: dict) -> dict:
    """Load `path` into the model and optimizer of `state`; return the rest. Runs no code from the files."""
    target = path / STATE
    if target.is_dir():  # FSDP: a distributed checkpoint, one part per process
        return _load_sharded(target, state)
    return fabric.load(target, state, weights_only=True)


class _IndexUnpickler(pickle.Unpickler):
    """PyTorch's distributed checkpoint reads its index (.metadata) with plain `pickle.load`, which calls
    whatever a planted file names. Only the classes that index is made of get through here."""

    ALLOWED = {
        ("pathlib", "PosixPath"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
    } | {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    }

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in self.ALLOWED or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


def _safe_dcp():
    """A reader and a planner for torch.distributed.checkpoint that load no code: the index through the
    allow-list above, the non-tensor items (optimizer hyper-parameters) with `weights_only=True`."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with (Path(self.path) / ".metadata").open("rb") as f:
                metadata = _IndexUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Reader, Planner


def _load_sharded(target: Path, state: dict) -> dict:
    """Fabric's own sharded load (ModelParallelStrategy), with the safe reader and planner: Fabric passes
    `weights_only` to its metadata file only, while the shards' index is read with plain pickle."""
    from lightning_fabric.utilities.load import _METADATA_FILENAME
    from lightning_fabric.wrappers import _unwrap_objects
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    Reader, Planner = _safe_dcp()
    state = _unwrap_objects(state)
    model, optimizer = state["model"], state["optimizer"]
    weights = {"model": get_model_state_dict(model)}
    dcp_load(weights, storage_reader=Reader(target), planner=Planner())
    model.load_state_dict(weights["model"])
    moments = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp_load(moments, storage_reader=Reader(target), planner=Planner())
    options = StateDictOptions(cpu_offload=True)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=moments["optimizer"], options=options)
    return torch.load(target / _METADATA_FILENAME, weights_only=True)
