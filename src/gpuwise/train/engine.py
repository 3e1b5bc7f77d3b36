"""Device, precision and strategy: Lightning Fabric does the work; this picks its arguments.

Fabric rather than Accelerate because it leaves the loop in our hands (one explicit file, as in
nanoGPT) while owning what is hard: device placement, AMP and its scaler, DDP/FSDP wrapping,
torchrun/SLURM environments, and collective checkpoint save/load.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from gpuwise.errors import GpuwiseError
from gpuwise.train.config import TrainConfig


def resolve_accelerator(requested: str) -> str:
    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def resolve_precision(requested: str, accelerator: str) -> str:
    """bf16-mixed where the GPU has bf16, 16-mixed on older GPUs and MPS, 32-true on the CPU."""
    if requested != "auto":
        return requested
    if accelerator == "cuda":
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    if accelerator == "mps":
        return "16-mixed"
    return "32-true"


def resolve_strategy(requested: str, processes: int) -> str:
    if requested != "auto":
        return requested
    return "ddp" if processes > 1 else "auto"


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP gathers one at a time: a transformers model's own `_no_split_modules`
    (its decoder layers), otherwise the top-level children that hold parameters."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    units = [m for m in model.modules() if type(m).__name__ in names]
    if units:
        return units
    body = model
    while len(children := list(body.children())) == 1:  # look through wrappers (peft, Sequential of one)
        body = children[0]
    return [c for c in children if any(True for _ in c.parameters())]


def fully_shard_model(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """FSDP2 (`fully_shard`): per-parameter sharding over the data-parallel processes. Unlike the
    FSDP1 wrapper, which Fabric allows on CUDA only, it runs on gloo, so the CPU tests run this path."""
    from torch.distributed.fsdp import fully_shard

    dp = mesh["data_parallel"]
    # FSDP2 warns that a view returned by forward loses its hook if changed in place; the workloads'
    # losses never change model outputs in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for unit in shard_units(model):
        fully_shard(unit, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


@contextlib.contextmanager
def whole_params(model: torch.nn.Module):
    """Gather FSDP's shards for code that reads weights outside forward (e.g. scoring every item);
    nothing to do for a model that is not sharded. Every process must enter it together."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in sharded:
        m.unshard()
    try:
        yield model
    finally:
        for m in sharded:
            m.reshard()


def make_fabric(cfg: TrainConfig):
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import ModelParallelStrategy

    accelerator = resolve_accelerator(cfg.accelerator)
    precision = resolve_precision(cfg.precision, accelerator)
    strategy = resolve_strategy(cfg.strategy, cfg.devices * cfg.num_nodes)
    try:
        fabric = Fabric(
            accelerator=accelerator,
            devices=cfg.devices,
            num_nodes=cfg.num_nodes,
            precision=precision,
            # FSDP through Fabric's FSDP2 strategy, data-parallel only (tensor parallel 1); the
            # checkpoint is then sharded: each process writes its own part, none gathers the model.
            strategy=ModelParallelStrategy(fully_shard_model, cfg.devices * cfg.num_nodes, 1)
            if strategy == "fsdp"
            else strategy,
        )
    except (ValueError, RuntimeError) as e:  # Fabric's refusals: 16-mixed under FSDP, more devices than exist, ...
        raise GpuwiseError(
            f"{accelerator} x {cfg.devices}, {precision}, {strategy}: {str(e).splitlines()[0]}"
        ) from None
    fabric.launch()  # under torchrun/SLURM this only joins the process group; alone it may spawn
    return fabric, accelerator, precision, strategy
