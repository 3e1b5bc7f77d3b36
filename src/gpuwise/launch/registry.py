"""The only place an engine's name is mapped to its module: `gpuwise launch ENGINE` and `gpuwise runs` ask here."""

from __future__ import annotations

from gpuwise.launch.engines import Engine
from gpuwise.launch.k8s import Kubernetes
from gpuwise.launch.rayjob import Ray
from gpuwise.launch.skypilot import SkyPilot
from gpuwise.launch.slurm import Slurm


def engines() -> dict[str, Engine]:
    return {e.name: e for e in (Slurm(), Ray(), SkyPilot(), Kubernetes())}
