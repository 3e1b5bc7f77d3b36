"""How gpuwise shards a model with FSDP2: one rule, used by `gpuwise train --strategy fsdp` and by
`plan --traced` (which plans the memory of exactly the sharding that training will do)."""

from __future__ import annotations

import warnings

import torch


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP gathers one at a time: a transformers model's own `_no_split_modules`
    (its decoder layers), otherwise the top-level children that hold parameters (a list's members)."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    units = [m for m in model.modules() if type(m).__name__ in names]
    if units:
        return units
    body = model
    while len(children := list(body.children())) == 1:  # look through wrappers (peft, Sequential of one)
        body = children[0]
    # a ModuleList or ModuleDict has no forward of its own, which fully_shard refuses: its members are the units
    containers, units = torch.nn.ModuleList | torch.nn.ModuleDict, []
    for c in children:
        units += list(c.children()) if isinstance(c, containers) else [c]
    return [u for u in units if any(True for _ in u.parameters())]


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
