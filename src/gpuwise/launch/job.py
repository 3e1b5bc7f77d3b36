"""A launched job: the train command it runs, the layout the plan chose, and the figures that plan rests on.

The plan is the one `gpuwise train` makes before its first step, made here for the job's layout: the
workload is built as train builds it (its data counted, its model made on the CPU), one forward and backward
on a few samples counts its FLOPs and the activations it saves, and every catalog accelerator is priced
from those (dense peak x efficiency). Each engine's artifact is written from a `Job` and nothing else.
"""

from __future__ import annotations

import math
import shlex
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import Accelerator, Catalog
from gpuwise.plan.request import ALLOCATOR_SLACK, EFFICIENCY, OVERHEAD_BYTES, Assumption
from gpuwise.train.config import TrainConfig

# Where each figure of a launch comes from, printed beside it.
TIME_MARGIN = Assumption(1.5, "assumption: the time limit is the planned training time x 1.5")
STARTUP_S = Assumption(
    900, "assumption: plus 15 minutes for start-up, data loading, the final evaluation and a checkpoint at the signal"
)
CPUS_PER_GPU = Assumption(8, "assumption: 8 CPU cores per GPU for data loading (DGX H100: 112 cores, 8 GPUs)")
HOST_MEMORY = Assumption(2.0, "assumption: host memory 2 x the planned memory of the node's processes, + 8 GiB")
RDZV_PORT = 29500  # torchrun's default rendezvous port; each job takes one of the 1,000 above it (`Job.rdzv_port`)
# After TERM (a time limit near, a preemption, a pod deleted), the time torchrun lets its processes finish
# their step and write a checkpoint before it kills them: its own default, 30 s, is too short to save a model.
SHUTDOWN_GRACE_S = 240
RDZV_JOIN_S = 1800  # nodes may start minutes apart (image pulls, provisioning): torchrun's default waits 600 s
TOP_CHOICES = 3  # the plan's best accelerators that SkyPilot may fall back to, in gpuwise's order



@dataclass(frozen=True)
class Choice:
    """One accelerator's figures for the whole job."""

    gpu: str  # catalog slug, or "cpu"
    name: str
    gpus: int  # processes in all (GPUs, or CPU processes)
    nodes: int
    per_node: int
    memory_bytes: int  # planned peak per process
    capacity_bytes: int
    fits: bool
    step_s: float
    wall_s: float  # training steps only
    gpu_hours: float
    usd: float | None
    price: dict | None  # provider, usd_per_gpu_hour, kind, as_of, source
    precision: str


@dataclass(frozen=True)
class Job:
    workload: str
    train_args: tuple[str, ...]  # the user's `gpuwise train` options after the workload, as given
    run_dir: str
    name: str  # the job's name on the engine: gpuwise-WORKLOAD-TIME
    choice: Choice
    alternatives: tuple[Choice, ...]  # the plan's other accelerators that fit, cheapest job first
    strategy: str  # ddp or fsdp (auto for one process)
    accelerator: str  # gpuwise train --accelerator: cuda or cpu
    steps: int
    global_batch: int
    cpus_per_node: int
    mem_per_node_gib: int
    time_limit_s: int
    efficiency: float
    efficiency_origin: str
    method: str

    @property
    def rdzv_port(self) -> int:
        """The rendezvous port, from the job's name: two jobs sharing a node do not join each other's store."""
        import zlib

        return RDZV_PORT + zlib.crc32(self.name.encode()) % 1000

    @property
    def threads(self) -> int:
        """OMP_NUM_THREADS for each process: the node's CPUs shared out."""
        return max(1, self.cpus_per_node // self.choice.per_node)

    def headline(self) -> str:
        """The first comment line of every artifact."""
        from gpuwise import __version__

        c = self.choice
        return (f"gpuwise {__version__}: {self.workload} on {c.nodes} x {c.per_node} {c.name}, planned "
                f"{duration(c.wall_s)} of training, {dollars(c.usd)}")  # fmt: skip

    def train_command(self) -> list[str]:
        """`gpuwise train` for a fresh run of this job on every node (after `python -m gpuwise`)."""
        return [
            "train",
            self.workload,
            *self.train_args,
            "--devices",
            str(self.choice.per_node),
            "--num-nodes",
            str(self.choice.nodes),
            "--accelerator",
            self.accelerator,
            "--strategy",
            self.strategy,
            "--run-dir",
            self.run_dir,
        ]

    def node_script(
        self, python: str, node_rank: str | None, head: str, rdzv_id: str, nodes: str | None = None, launcher: str = ""
    ) -> str:
        """The shell every node of this job runs (see `node_script`)."""
        c = self.choice
        return node_script(self.train_command(), c.nodes, c.per_node, python, node_rank, head, rdzv_id,
                           nodes, launcher, self.rdzv_port, self.threads)  # fmt: skip

    def figures(self) -> dict[str, Any]:
        """What `gpuwise launch` prints beside the artifact, and records."""
        c = self.choice
        return {
            "workload": self.workload,
            "accelerator": c.gpu,
            "accelerator_name": c.name,
            "gpus_per_node": c.per_node,
            "nodes": c.nodes,
            "memory_per_gpu_bytes": c.memory_bytes,
            "capacity_bytes": c.capacity_bytes,
            "steps": self.steps,
            "global_batch": self.global_batch,
            "step_time_s": c.step_s,
            "wall_s": c.wall_s,
            "time_limit_s": self.time_limit_s,
            "gpu_hours": c.gpu_hours,
            "cost_usd": c.usd,
            "price": c.price,
            "precision": c.precision,
            "efficiency": self.efficiency,
            "efficiency_origin": self.efficiency_origin,
            "cpus_per_node": self.cpus_per_node,
            "mem_per_node_gib": self.mem_per_node_gib,
            "method": self.method,
            "sources": {
                "time_limit": f"{TIME_MARGIN.origin}; {STARTUP_S.origin}",
                "cpus": CPUS_PER_GPU.origin,
                "host_memory": HOST_MEMORY.origin,
            },
        }

    def moved(self, run_dir: str) -> Job:
        """The same job with its run directory where the nodes see it (a bucket or volume mount)."""
        return replace(self, run_dir=run_dir)


def node_script(
    fresh: list[str],
    nodes: int,
    per_node: int,
    python: str,
    node_rank: str | None,
    head: str,
    rdzv_id: str,
    nodes_expr: str | None = None,
    launcher: str = "",
    port: int = RDZV_PORT,
    threads: int | None = None,
) -> str:
    """The shell a node runs: one torchrun, which starts the node's `per_node` processes of `fresh` (a
    `gpuwise train` command with its --run-dir). A run directory that already holds config.yaml is resumed
    from its newest checkpoint (a requeued, restarted or recovered job); no node can see one before all
    have joined, since gpuwise writes it after the rendezvous."""
    run = shlex.quote(fresh[fresh.index("--run-dir") + 1])
    if nodes == 1:
        layout = f"--standalone --nproc-per-node={per_node}"
    else:
        # The node of rank 0 hosts the store: said outright, since its own name may not resolve yet (a pod's DNS).
        host = f",is_host=$([ {node_rank} = 0 ] && echo 1 || echo 0)" if node_rank else ""
        layout = (
            f"--nnodes={nodes_expr or nodes} --nproc-per-node={per_node} "
            + (f"--node-rank={node_rank} " if node_rank else "")
            + f"--rdzv-backend=c10d --rdzv-endpoint={head}:{port} --rdzv-id={rdzv_id} "
            + f"--rdzv-conf=join_timeout={RDZV_JOIN_S}{host}"
        )
    return (
        f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={SHUTDOWN_GRACE_S}\n"
        + (f"export OMP_NUM_THREADS={threads}\n" if threads else "")
        + f"if [ -f {run}/config.yaml ]; then\n"
        f"  set -- train --resume {run}\n"
        f"else\n"
        f"  set -- {shlex.join(fresh)}\n"
        f"fi\n"
        f'{launcher}{shlex.quote(python)} -m torch.distributed.run {layout} -m gpuwise "$@"\n'
    )


def _probe(work, cfg, micro: int, precision: str, world: int, fsdp: bool, gpu: bool) -> tuple[int, float, str]:
    """Planned peak bytes a process (tensors, plus the CUDA context and allocator slack) and FLOPs a sample: what
    `gpuwise train` plans before its first step (train/runplan.py plan_run), from one real forward and backward
    on a few samples here, under the planned precision's autocast."""
    import torch

    from gpuwise.train import measure
    from gpuwise.train.runplan import analytic_plan

    n = min(micro, 4)
    batch = work.make_batch(list(range(n)), 0)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    try:
        with torch.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None):
            flops, saved = measure.probe_step(work.model, work.loss, batch)
    except Exception as e:  # noqa: BLE001 - a user's model: its failure as one line
        from gpuwise.errors import first_line

        raise GpuwiseError(f"planning the job failed: one step of {n} samples here raised {first_line(e)}") from None
    states = measure.state_bytes(work.model)
    tensors = states + saved / n * micro
    method = f"model states + activations saved for backward, counted on one step of {n} samples here"
    if work.model_spec is not None:
        fabric_precision = {"bf16": "bf16-mixed", "fp16": "16-mixed"}.get(precision, "32-true")
        tensors = analytic_plan(work, cfg, micro, fabric_precision, work.model)["peak_bytes"]
        method = "this model's states + gpuwise plan's analytic activations"
    else:  # as train plans a model the formulas do not cover: one step of micro-batch size on fake tensors
        from gpuwise.plan.traced import traced_run_memory

        try:
            tensors = traced_run_memory(work.model, work.loss, work.make_batch(list(range(micro)), 0), precision, "cpu")
            method = f"one step of {micro} samples traced on fake tensors"
        except Exception:  # noqa: BLE001 - an op with no fake-tensor kernel: the saved-activation count stands
            pass
    if fsdp:  # weights, gradients and AdamW moments sharded over the processes; activations are not
        tensors = tensors - states + states / world
        method += f", states sharded over {world} (FSDP)"
    if not gpu:  # a CPU process has no CUDA context nor caching allocator: its tensors, as train plans them
        return int(tensors), flops / n, method
    return int(tensors + OVERHEAD_BYTES.value + ALLOCATOR_SLACK.value * tensors), flops / n, method


def _candidates(catalog: Catalog, gpu: str | None) -> list[Accelerator]:
    if gpu == "cpu":
        from gpuwise.hardware.devices import cpu_accelerator, detect

        return [cpu_accelerator(detect(catalog).cpu)]
    if gpu:
        acc = catalog.get(gpu)  # an unknown slug is refused there, with the closest names
        if acc.kind != "gpu":
            raise GpuwiseError(
                f"{acc.name} is a {acc.kind}: gpuwise launch runs `gpuwise train` on GPUs (or --gpu cpu for CPU nodes)"
            )
        return [acc]
    return [a for a in catalog.accelerators.values() if a.kind == "gpu"]


def _price(catalog: Catalog, acc: Accelerator, provider: str | None) -> dict | None:
    rows = [p for p in catalog.prices(acc.slug) if not provider or p.provider.lower() == provider.lower()]
    if not rows:
        return None
    p = min(rows, key=lambda r: r.usd_per_gpu_hour)
    return {"provider": p.provider, "usd_per_gpu_hour": p.usd_per_gpu_hour, "kind": p.kind, "as_of": p.as_of,
            "source": p.source}  # fmt: skip


def layout(acc: Accelerator, gpus: int, nodes: int | None) -> tuple[int, int]:
    """(nodes, processes per node) for `gpus` processes: as few nodes as the accelerator's server holds."""
    per_server = acc.max_per_node if acc.kind == "gpu" else gpus
    nodes = nodes or math.ceil(gpus / per_server)
    if gpus % nodes:
        raise GpuwiseError(f"{gpus} GPUs do not split evenly over {nodes} nodes: give --gpus a multiple of --nodes")
    per_node = gpus // nodes
    if per_node > per_server:
        raise GpuwiseError(
            f"{per_node} {acc.name} per node: its servers hold at most {per_server} (catalog: max_per_node); "
            f"use --nodes {math.ceil(gpus / per_server)} or more"
        )
    return nodes, per_node


def plan_job(
    cfg: TrainConfig,
    options: tuple[str, ...],
    catalog: Catalog,
    gpu: str | None = None,
    gpus: int | None = None,
    nodes: int | None = None,
    provider: str | None = None,
    run_dir: str | None = None,
    efficiency: float | None = None,
    cpus_per_node: int | None = None,
    mem_per_node_gib: int | None = None,
    nameable: Collection[str] | None = None,
    time_limit_s: int | None = None,
) -> Job:
    """Plan the train command `cfg` (parsed from `options`, its flags as given) for the engines: the accelerator and
    count (given, or the cheapest whole job of the catalog among the `nameable` slugs: those the engine can
    ask for by name), and every figure the artifacts need."""
    from gpuwise.train.engine import resolve_strategy
    from gpuwise.train.setup import schedule
    from gpuwise.workloads import build as build_workload

    workload = cfg.workload
    run_dir = run_dir or cfg.run_dir
    if gpus is not None and gpus < 1 or nodes is not None and nodes < 1:
        raise GpuwiseError("--gpus and --nodes must be at least 1")
    world = gpus or nodes or 1
    candidates = _candidates(catalog, gpu)
    if not gpu and nameable is not None:
        candidates = [a for a in candidates if a.slug in nameable]
    if gpu:
        layout(candidates[0], world, nodes)  # a layout that cannot run is refused before the workload is built
    if provider:
        from gpuwise.plan.cost import check_provider

        check_provider(catalog, provider)
    # built once here, on the CPU, to count the data and trace the model
    cfg = replace(cfg, devices=1, num_nodes=1, accelerator="cpu")
    cfg.validate()
    cfg = cfg.filled(cfg.workload_def().resolve(cfg))
    print(f"gpuwise: planning {workload}: building it here to count its data and time one step", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="gpuwise-launch-") as tmp:
        work = build_workload(cfg, Path(tmp))
    cfg = cfg.filled(work.defaults)
    share, _, steps = schedule(cfg, work.train_size, work.steps, world)
    assert cfg.batch_size is not None  # schedule refuses a config without one
    strategy = resolve_strategy(cfg.strategy, world)
    micro = min(share, cfg.micro_batch_size or share)
    on_cpu = gpu == "cpu"
    precision = _plan_precision(cfg.precision, candidates[0] if on_cpu else None)
    fsdp = strategy == "fsdp"
    memory, flops_per_sample, memory_method = _probe(work, cfg, micro, precision, world, fsdp, not on_cpu)
    eff, eff_origin = (efficiency, "--efficiency") if efficiency else (EFFICIENCY.value, EFFICIENCY.origin)

    step_flops = flops_per_sample * share
    best, alternatives = _choose(candidates, catalog, world, nodes, provider, precision, memory, step_flops, steps, eff)
    if not best.fits:
        need, have = best.memory_bytes / 2**30, best.capacity_bytes / 2**30
        raise GpuwiseError(
            f"the plan does not fit {best.name}: {need:,.1f} GiB per process at micro-batch {micro}, "
            f"{have:,.0f} GiB there; pass a smaller --micro-batch-size, --strategy fsdp over more --gpus, "
            "or another --gpu"
        )
    time_limit = time_limit_s or int(math.ceil((best.wall_s * TIME_MARGIN.value + STARTUP_S.value) / 60) * 60)
    cpus = cpus_per_node or (best.per_node * int(CPUS_PER_GPU.value) if not on_cpu else best.per_node)
    host = mem_per_node_gib or math.ceil(HOST_MEMORY.value * best.per_node * memory / 2**30 + 8)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run = str(Path(run_dir).resolve()) if run_dir else str(Path.cwd() / "runs" / f"{workload}-{stamp}")
    options = _without_run_dir(options)  # the job's run directory is the one planned here
    name = f"gpuwise-{_dns(workload)}-{stamp}"
    extra = "" if on_cpu else f", + {OVERHEAD_BYTES.value / 2**30:g} GiB CUDA context, {ALLOCATOR_SLACK.value:.0%} more"
    method = (
        f"memory: {memory_method}, at micro-batch {micro} ({world} process{'es' * (world > 1)}, {strategy}){extra}; "
        f"time: {steps:,} steps x FLOPs of {share} samples (torch FlopCounterMode) / (dense peak x efficiency), "
        "as `gpuwise train` projects a run; memory-bound operations, collectives, data loading and evaluation "
        "not counted"
    )
    return Job(
        workload,
        options,
        run,
        name,
        best,
        alternatives,
        strategy,
        "cpu" if on_cpu else "cuda",
        steps,
        cfg.batch_size,
        cpus,
        host,
        time_limit,
        eff,
        eff_origin,
        method,
    )


def _choose(
    candidates: list[Accelerator],
    catalog: Catalog,
    world: int,
    nodes: int | None,
    provider: str | None,
    precision: str,
    memory: int,
    step_flops: float,
    steps: int,
    eff: float,
) -> tuple[Choice, tuple[Choice, ...]]:
    """The best accelerator for the job and the fallbacks on as many nodes: the cheapest whole job first (gpuwise
    knows its length; a per-hour price alone does not), then the fastest; one that does not fit comes last."""
    choices = []
    for acc in candidates:
        prec = precision if acc.peak_tflops(precision) else "fp16"
        peak = acc.peak_tflops(prec)
        if not peak:
            continue
        n_nodes, per_node = layout(acc, world, nodes)
        step_s = step_flops / (peak * 1e12 * eff)
        wall = steps * step_s
        hours = wall / 3600 * world
        on_cpu = acc.kind != "gpu"
        price = None if on_cpu else _price(catalog, acc, provider)
        usd = hours * price["usd_per_gpu_hour"] if price else None
        choices.append(
            Choice(acc.slug if not on_cpu else "cpu", acc.name, world, n_nodes, per_node, memory, acc.mem_bytes,
                   memory <= acc.mem_bytes, step_s, wall, hours, usd, price, prec)  # fmt: skip
        )
    if not choices:
        raise GpuwiseError(f"no accelerator to plan on: none has a {precision} or fp16 peak in the catalog")
    choices.sort(key=lambda c: (not c.fits, c.usd is None, c.usd or 0.0, c.wall_s))
    best = choices[0]
    return best, tuple(c for c in choices[1:TOP_CHOICES] if c.fits and c.nodes == best.nodes)


def _without_run_dir(options: tuple[str, ...]) -> tuple[str, ...]:
    if "--run-dir" in options:
        i = options.index("--run-dir")
        options = options[:i] + options[i + 2 :]
    return tuple(o for o in options if not o.startswith("--run-dir="))


def _plan_precision(requested: str, cpu: Accelerator | None) -> str:
    """The planner's precision for `gpuwise train --precision`: auto is bf16 on GPUs (the train rule for
    bf16 GPUs; older ones are priced at fp16), and on CPU nodes what train picks on this CPU."""
    named = {"32-true": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16"}
    if requested != "auto":
        return named[requested]
    if cpu is not None:
        from gpuwise.train.engine import resolve_precision

        return named[resolve_precision("auto", "cpu")]
    return "bf16"


def _dns(text: str) -> str:
    """A DNS-1123 label piece (Kubernetes names, Slurm and Ray job names): lower-case letters, digits, '-'."""
    import re

    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:30] or "job"


def duration(seconds: float | None) -> str:
    """A planned or actual time as people read it: 3.2e-05 s, 42.1 s, 18.5 min, 3.25 h."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.3g} s"
    return f"{seconds / 60:,.1f} min" if seconds < 7200 else f"{seconds / 3600:,.2f} h"


def dollars(usd: float | None) -> str:
    """A cost as people read it; a job of cents or less keeps two significant digits instead of $0.00."""
    if usd is None:
        return "no price"
    return f"${usd:,.2f}" if usd >= 0.01 or usd == 0 else f"${usd:.2g}"
