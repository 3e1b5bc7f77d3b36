"""The workloads `gpuwise train` runs. Each module builds a :class:`Workload` from a TrainConfig:
its data, its model, its loss, its metrics and baseline, its defaults. The loop knows nothing else."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Workload:
    name: str
    model: Any  # torch.nn.Module, built on the CPU; the loop hands it to Fabric
    train_size: int
    # (sample indices, epoch) -> a batch of CPU tensors; augmentation is seeded by (seed, epoch, index)
    make_batch: Callable[[Sequence[int], int], dict]
    loss: Callable[[Any, dict], Any]  # (model, batch on device) -> mean loss over the batch
    evaluate: Callable[[Any, Any], dict]  # (model, device) -> metrics on the held-out split
    save: Callable[[Any, Path], list[str]]  # (model, run dir) -> files written
    defaults: dict  # epochs, batch_size, lr
    baseline: dict = field(default_factory=dict)
    tokens_per_sample: int | None = None
    model_spec: Any = None  # a plan.model.ModelSpec when the analytic planner applies
    info: dict = field(default_factory=dict)  # what the summary should say about data and model
    eval_before: bool = False  # also evaluate before the first step (the "before" of a fine-tune)


def build(cfg, run_dir: Path) -> Workload:
    if cfg.workload == "defects":
        from gpuwise.workloads import defects

        return defects.build(cfg, run_dir)
    if cfg.workload == "recommender":
        from gpuwise.workloads import recommender

        return recommender.build(cfg, run_dir)
    from gpuwise.workloads import product_lm

    return product_lm.build(cfg, run_dir)
