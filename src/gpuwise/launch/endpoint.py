"""A launched endpoint: the `gpuwise serve` command each replica runs, the layout it runs in, and the figures that
layout rests on.

The layout is the serving plan's when traffic and targets are given (plan/endpoint.py: `serving_plan`, the same
plan `gpuwise plan --task serve` prints): the accelerator, GPUs per replica, replicas, the engine and its
scheduler's limit. Otherwise it is the flags', checked against the model's memory (`gpu_replica`: the weights
must leave room for a KV cache). Each engine's artifact is written from an `Endpoint` and nothing else.

The key never travels inline: a replica reads it from a file only its owner can read (Slurm, Ray: on storage
the nodes share), from a Kubernetes Secret, or from a SkyPilot secret given at `sky serve up`.
"""

from __future__ import annotations

import math
import os
import secrets
import shlex
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwise import __version__
from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import Catalog
from gpuwise.launch.job import _dns, dollars
from gpuwise.plan.capacity import gpu_replica, hours_per_month, option_costs
from gpuwise.plan.endpoint import serving_plan
from gpuwise.plan.memory import BYTES
from gpuwise.plan.model import resolve_model
from gpuwise.plan.request import Assumption

# uvicorn's drain after TERM (serve --grace) on an engine that kills a job KillWait seconds after TERM: Slurm's
# default KillWait is 30 s, so a replica drains within it; Kubernetes' grace period is set above it.
DRAIN_S = 25
CPUS_PER_GPU = Assumption(8, "assumption: 8 CPU cores per GPU, for the front end and tokenizing (DGX H100: 112, 8)")
CPU_REPLICA_CORES = Assumption(2, "assumption: 2 cores a CPU replica (the engine's threads and its front end)")
HOST_MEMORY = Assumption(2.0, "assumption: host memory 2 x the weights (loaded through it), + 8 GiB")
KEY_NAME = "api-key"  # the key's file in the endpoint's folder, and its key in a Kubernetes Secret
PORT = 8000  # the port a replica listens on where the engine routes to it (Kubernetes, SkyPilot)
PROBE_PATHS = {"live": "/livez", "ready": "/readyz"}  # serve/app.py's Guard answers them without the key


@dataclass(frozen=True)
class Endpoint:
    model: str  # RUN_OR_MODEL as given to serve
    serve_args: tuple[str, ...]  # the user's serve options after the model, as given
    run_dir: str  # where the replicas write their addresses (and Slurm its log): storage the nodes share
    name: str  # gpuwise-serve-MODEL-TIME
    gpu: str  # catalog slug, or "cpu"
    gpu_name: str
    gpus: int  # per replica (tensor parallel), 0 on a CPU
    replicas: int
    max_replicas: int
    accelerator: str  # cuda or cpu
    cpus: int  # per replica
    mem_gib: int  # host memory per replica
    key_file: str | None  # where the replicas read the key (Slurm, Ray); None: the engine's own secret
    figures: dict[str, Any] = field(default_factory=dict)
    set_args: tuple[str, ...] = ()  # serve options the plan sets (--engine, --max-seqs)

    def serve_command(self, host: str = "0.0.0.0", port: int = 0, announce: str | None = None) -> list[str]:
        """`gpuwise serve` as a replica runs it (after `python -m gpuwise`): bound where the cluster reaches it,
        the key read from its file (or GPUWISE_API_KEY from the engine's secret), draining within the engine's
        kill timeout, and announcing its address."""
        cmd = ["serve", self.model, *self.serve_args, *self.set_args, "--host", host, "--port", str(port),
               "--grace", str(DRAIN_S)]  # fmt: skip
        if self.key_file:
            cmd += ["--api-key-file", self.key_file]
        if announce:
            cmd += ["--announce", announce]
        return cmd

    def shell(self, python: str, **kw) -> str:
        return shlex.join([python, "-m", "gpuwise", *self.serve_command(**kw)])

    def headline(self) -> str:
        where = f"{self.gpus} x {self.gpu_name}" if self.accelerator == "cuda" else f"{self.cpus} CPU cores"
        cost = self.figures.get("usd_per_month")
        tail = f", {dollars(cost)}/month" if cost is not None else ""
        return (f"gpuwise {__version__}: endpoint {self.model}, {self.replicas} replica{'s' * (self.replicas > 1)} "
                f"of {where}{tail}")  # fmt: skip

    def address_file(self, replica: str) -> str:
        return str(Path(self.run_dir) / f"replica-{replica}.json")


def addresses(run_dir: str) -> list[dict[str, Any]]:
    """The addresses the replicas announced (serve --announce), newest first; a damaged file is skipped."""
    import json

    found = []
    for p in sorted(Path(run_dir).glob("replica-*.json")):
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and isinstance(d.get("url"), str):
            found.append(d | {"replica": p.stem.removeprefix("replica-")})
    return sorted(found, key=lambda d: str(d.get("since", "")), reverse=True)


def key_file_checked(path: Path) -> Path:
    """A key file the user gives: readable, not empty, and readable by its owner alone (as ssh asks of a key)."""
    try:
        st = path.stat()
        first = path.read_text(encoding="utf-8").splitlines()[:1]
    except (OSError, UnicodeDecodeError) as e:
        raise GpuwiseError(f"--api-key-file {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not first or not first[0].strip():
        raise GpuwiseError(f"--api-key-file {path}: its first line is empty")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise GpuwiseError(f"--api-key-file {path}: others can read it; chmod 600 {shlex.quote(str(path))}")
    return path.resolve()


def new_key_file(run_dir: Path) -> Path:
    """A fresh key, in a file of the endpoint's folder that only its owner can read."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / KEY_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def plan_endpoint(
    model: str,
    options: tuple[str, ...],
    params: dict[str, Any],
    catalog: Catalog,
    gpu: str | None,
    gpus: int | None,
    replicas: int | None,
    max_replicas: int | None,
    demand=None,
    goal=None,
    run_dir: str | None = None,
    cpus: int | None = None,
    mem_gib: int | None = None,
    nameable=None,
    rented: bool = False,
) -> Endpoint:
    """The endpoint's layout: the serving plan's for `demand` and `goal` (a Traffic and Targets), else the flags'.
    Everything is refused here, in one line, before an artifact is written."""
    dtype = params.get("dtype") or "auto"
    precision = dtype if dtype in ("fp32", "bf16", "fp16") else "bf16"
    try:
        spec = resolve_model(model)
    except GpuwiseError as e:
        spec, unplanned = None, str(e)
    if spec is not None and not spec.causal:
        raise GpuwiseError(f"{spec.name} is an encoder: gpuwise launch -- serve serves language models")
    set_args: list[str] = []
    figures: dict[str, Any] = {"model": model, "precision": precision, "max_seqs": params.get("max_seqs")}
    sources: dict[str, str] = {}
    if demand is not None:
        if spec is None:
            raise GpuwiseError(f"the serving plan needs the model's shape: {unplanned}")
        if gpus is not None or replicas is not None:
            raise GpuwiseError("--gpus/--replicas come from the serving plan when --rps or --users is given: drop them")
        for flag in ("--engine", "--max-seqs"):
            if any(o.split("=", 1)[0] == flag for o in options):
                raise GpuwiseError(f"serve {flag} is set by the serving plan when --rps or --users is given: drop it")
        plan = serving_plan(model, demand, goal, catalog, precision, gpu=gpu)
        options_ = [o for o in plan["options"]
                    if nameable is None or o["gpu"].startswith("cpu") or o["gpu"] in nameable]  # fmt: skip
        pick = next((o for o in options_ if o.get("cheapest")), None) or next((o for o in options_ if o["meets"]), None)
        if rented:  # an engine that rents the GPUs (SkyPilot): the cheapest cloud price, never owning them
            priced = [(min(c["usd_per_month"] for c in o["costs"] if c["provider"] != "on-prem"), i)
                      for i, o in enumerate(options_) if o["meets"] and any(c["provider"] != "on-prem"
                                                                           for c in o.get("costs") or [])]  # fmt: skip
            pick = options_[min(priced)[1]] if priced else pick
        if pick is None:
            why = "; ".join(f"{o['gpu']}: {o.get('why')}" for o in options_[:3]) or "no accelerator"
            raise GpuwiseError(f"no layout meets the targets at {demand.rps:g} requests/s: {why}")
        on_cpu = pick["gpu"].startswith("cpu")
        gpu_slug, per, reps = ("cpu" if on_cpu else pick["gpu"]), (0 if on_cpu else pick["tp"]), pick["replicas"]
        set_args += ["--engine", pick["engine"], "--max-seqs", str(pick["max_seqs"])]
        figures |= {
            "goodput_per_replica": pick["goodput_per_replica"],
            "traffic": demand.as_dict(),
            "targets": goal.as_dict(),
            "at_traffic": pick.get("at_traffic"),
            "engine": pick["engine"],
            "max_seqs": pick["max_seqs"],
            "concurrency_per_replica": pick.get("concurrency"),
            "kv_tokens": pick.get("kv_tokens"),
        }
        plan_line = f"the serving plan ({pick.get('step_source') or 'gpuwise plan --task serve'})"
        sources |= {"layout": plan_line, "replicas": f"{demand.rps:g} requests/s / the goodput a replica holds "
                    f"({pick['goodput_per_replica']:.3g}/s at the targets)", "engine": plan_line}  # fmt: skip
        acc = None if on_cpu else catalog.get(gpu_slug)
    else:
        gpu_slug = gpu or ("cpu" if spec is None else None)
        acc = None
        if gpu_slug is None:
            acc, _ = _cheapest_fit(spec, catalog, precision, gpus or 1, nameable)  # cloud prices: never owning
            gpu_slug = acc.slug
            sources["layout"] = "the cheapest catalog GPU an hour whose memory holds the weights and a KV cache"
        elif gpu_slug != "cpu":
            acc = catalog.get(gpu_slug)
            if acc.kind != "gpu":
                raise GpuwiseError(f"{acc.name} is a {acc.kind}: gpuwise launch -- serve runs on GPUs or --gpu cpu")
            sources["layout"] = "--gpu, --gpus, --replicas"
        else:
            sources["layout"] = "--gpu cpu, --replicas"
        on_cpu = gpu_slug == "cpu"
        per, reps = (0 if on_cpu else gpus or 1), replicas or 1
        sources["replicas"] = "--replicas" if replicas else "one replica (give --rps or --users to plan them)"
        if acc is not None and spec is not None and gpu_replica(spec, acc, precision, per) is None:
            need = spec.params * _bytes(precision) / per / 2**30
            raise GpuwiseError(
                f"{spec.name} does not fit {per} x {acc.name}: {need:,.1f} GiB of {precision} weights per GPU "
                f"leave no room for a KV cache in {acc.mem_bytes / 2**30:,.0f} GiB; give more --gpus or another --gpu"
            )
        if acc is not None and spec is None:
            figures["memory"] = f"not planned: {unplanned}"
    if on_cpu and gpus:
        raise GpuwiseError("--gpus counts GPUs: a CPU replica has none (give --cpus-per-node)")
    top = max_replicas or reps
    if top < reps:
        raise GpuwiseError(f"--max-replicas {top} is below the {reps} replicas planned")
    weights = spec.params * _bytes(precision) if spec is not None else None
    n_cpus = cpus or (int(CPU_REPLICA_CORES.value) if on_cpu else per * int(CPUS_PER_GPU.value))
    host = mem_gib or (math.ceil(HOST_MEMORY.value * (weights or 0) / 2**30 + 8))
    sources |= {"cpus": "--cpus-per-node" if cpus else (CPU_REPLICA_CORES.origin if on_cpu else CPUS_PER_GPU.origin),
                "host_memory": "--mem-per-node" if mem_gib else HOST_MEMORY.origin}  # fmt: skip
    if acc is not None:
        costs = option_costs(catalog, acc, per * reps, 24)  # the serving plan's own rows, cheapest first
        costs = [c for c in costs if not rented or c["provider"] != "on-prem"]
        if costs:
            c = costs[0]
            figures |= {"usd_per_month": c["usd_per_month"], "cheapest_provider": c["provider"]}
            sources["cost"] = (f"{c['provider']} ({c['kind']}, as of {c['as_of']}): {per * reps} GPUs x "
                               f"{hours_per_month(24):.0f} hours a month; every price: gpuwise hardware")  # fmt: skip
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"gpuwise-serve-{_dns(Path(model).name)[:24].strip('-')}-{stamp}"
    run = str(Path(run_dir).resolve()) if run_dir else str(Path.cwd() / "runs" / name.removeprefix("gpuwise-"))
    figures |= {
        "accelerator": gpu_slug,
        "accelerator_name": acc.name if acc is not None else "CPU",
        "gpus_per_replica": per,
        "replicas": reps,
        "max_replicas": top,
        "weights_bytes": weights,
        "cpus_per_replica": n_cpus,
        "mem_per_replica_gib": host,
        "sources": sources,
    }
    return Endpoint(model, options, run, name, gpu_slug, figures["accelerator_name"], per, reps, top,
                    "cpu" if on_cpu else "cuda", n_cpus, host, None, figures, tuple(set_args))  # fmt: skip


def _bytes(precision: str) -> float:
    return BYTES[precision]


def _cheapest_fit(spec, catalog: Catalog, precision: str, per: int, nameable):
    """The catalog GPU with the lowest hourly price whose memory holds the model with room for a KV cache."""
    best = None
    for acc in catalog.accelerators.values():
        if acc.kind != "gpu" or (nameable is not None and acc.slug not in nameable):
            continue
        if gpu_replica(spec, acc, precision, per) is None:
            continue
        prices = [p.usd_per_gpu_hour for p in catalog.prices(acc.slug)]
        if prices and (best is None or min(prices) < best[1]):
            best = (acc, min(prices))
    if best is None:
        raise GpuwiseError(f"{spec.name} fits no priced GPU of the catalog at {per} a replica: give --gpus or --gpu")
    return best
