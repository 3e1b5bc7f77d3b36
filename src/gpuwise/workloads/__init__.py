"""The workloads: each is one module with one `Workload` subclass (the contract, in `base`); `registry`
is the only place a name is mapped to one. Nothing outside this package names a workload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuwise.workloads.base import BenchStep, OnnxSignature, Training, Workload, place
from gpuwise.workloads.registry import get, names

__all__ = ["BenchStep", "OnnxSignature", "Training", "Workload", "build", "place", "get", "names"]


def build(cfg: Any, run_dir: Path, planning: bool = False) -> Training:
    """The training side of the workload a TrainConfig names, built for this run, from its config resolved
    (`TrainConfig.resolved`: a no-op on a config train or launch resolved already). `planning`: as `gpuwise
    launch` plans a job on the machine that submits it (`Workload.plan_build`: no weights downloaded)."""
    cfg = cfg.resolved()
    workload = cfg.workload_def()
    return workload.plan_build(cfg, run_dir) if planning else workload.build(cfg, run_dir)
