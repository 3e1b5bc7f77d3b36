"""The workloads: each is one module with one `Workload` subclass (the contract, in `base`); `registry`
is the only place a name is mapped to one. Nothing outside this package names a workload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuwise.workloads.base import BenchStep, OnnxSignature, Training, Workload, place
from gpuwise.workloads.registry import get, names

__all__ = ["BenchStep", "OnnxSignature", "Training", "Workload", "build", "place", "get", "names"]


def build(cfg: Any, run_dir: Path) -> Training:
    """The training side of the workload a TrainConfig names, built for this run, from its config resolved
    (`Workload.resolve`: a no-op on a config train or launch resolved already)."""
    workload = cfg.workload_def()
    return workload.build(cfg.filled(workload.resolve(cfg)), run_dir)
