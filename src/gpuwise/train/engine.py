"""Device, precision and strategy: Lightning Fabric does the work; this picks its arguments.

Fabric rather than Accelerate because it leaves the loop in our hands (one explicit file, as in
nanoGPT) while owning what is hard: device placement, AMP and its scaler, DDP/FSDP wrapping,
torchrun/SLURM environments, and collective checkpoint save/load.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, cast

import torch

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.devices import bf16_native, computes_bf16
from gpuwise.plan.sharding import fully_shard_model
from gpuwise.train.config import TrainConfig

if TYPE_CHECKING:
    from lightning_fabric.plugins.precision.precision import _PRECISION_INPUT


def resolve_accelerator(requested: str) -> str:
    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def resolve_precision(requested: str, accelerator: str) -> str:
    """bf16-mixed where every GPU has native bf16, 16-mixed on older GPUs and MPS; on the CPU bf16-mixed
    where it has bf16 instructions, else 32-true: the choice `gpuwise devices` reports, by the same rule
    (`bf16_native`, `CpuInfo.bf16_native`)."""
    if requested != "auto":
        return requested
    if accelerator == "cuda":
        count = torch.cuda.device_count()
        native = count > 0 and all(bf16_native(i) for i in range(count))
        return "bf16-mixed" if native else "16-mixed"
    if accelerator == "mps":
        return "16-mixed"
    return "bf16-mixed" if computes_bf16("cpu") else "32-true"


def resolve_strategy(requested: str, processes: int) -> str:
    if requested != "auto":
        return requested
    return "ddp" if processes > 1 else "auto"


def make_fabric(cfg: TrainConfig):
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import ModelParallelStrategy

    accelerator = resolve_accelerator(cfg.accelerator)
    precision = resolve_precision(cfg.precision, accelerator)
    strategy = resolve_strategy(cfg.strategy, cfg.devices * cfg.num_nodes)
    plugins: list = []
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Under torchrun inside a Slurm job, Fabric would otherwise read SLURM_NTASKS (one torchrun task per
        # node) as the world size, and hang or run on one GPU (Lightning #18504, #20391): torchrun's ranks win.
        from lightning_fabric.plugins.environments import TorchElasticEnvironment

        plugins.append(TorchElasticEnvironment())
    try:
        with warnings.catch_warnings():
            # gpuwise decides how its processes start (docs/launch.md): Lightning's hint to prepend `srun`, given
            # wherever Slurm is installed, is noise to its users
            warnings.filterwarnings("ignore", message="The `srun` command is available on your system")
            fabric = Fabric(
                accelerator=accelerator,
                devices=cfg.devices,
                num_nodes=cfg.num_nodes,
                # A str to the type checker, but TrainConfig.validate allows only PRECISIONS, each one Fabric takes.
                precision=cast("_PRECISION_INPUT", precision),
                # FSDP through Fabric's FSDP2 strategy, data-parallel only (tensor parallel 1); the
                # checkpoint is then sharded: each process writes its own part, none gathers the model.
                strategy=ModelParallelStrategy(fully_shard_model, cfg.devices * cfg.num_nodes, 1)
                if strategy == "fsdp"
                else strategy,
                plugins=plugins or None,
            )
    except (ValueError, RuntimeError) as e:  # Fabric's refusals: 16-mixed under FSDP, more devices than exist, ...
        raise GpuwiseError(
            f"{accelerator} x {cfg.devices}, {precision}, {strategy}: {str(e).splitlines()[0]}"
        ) from None
    fabric.launch()  # under torchrun/SLURM this only joins the process group; alone it may spawn
    return fabric, accelerator, precision, strategy
