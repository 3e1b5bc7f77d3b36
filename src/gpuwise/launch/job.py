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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpuwise import __version__
from gpuwise.errors import GpuwiseError, first_line
from gpuwise.hardware.catalog import Accelerator, Catalog
from gpuwise.plan.cost import check_provider
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
    billed_s: float  # what the GPUs are held, and billed, for: the training, start-up and end (STARTUP_S)
    gpu_hours: float  # billed
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
    # what `gpuwise train` will set beside what it measures, as the one planner planned it here: peak_bytes and
    # flops_per_step; on CPU nodes also step_time_s, data_s and the efficiency behind them
    plan: dict = field(default_factory=dict)

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
            "billed_s": c.billed_s,
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
                "cost": f"GPU-hours billed: the planned training + {STARTUP_S.value / 60:g} min ({STARTUP_S.origin}), "
                "x GPUs, x the price",
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


def _candidates(catalog: Catalog, gpu: str | None) -> list[Accelerator]:
    if gpu == "cpu":
        # torch and the workloads: `gpuwise runs`, which reads jobs, starts without them
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


@dataclass(frozen=True)
class RunPlanned:
    """The run a job runs, planned by train's one planner here: its config resolved and laid out, the
    micro-batch, the strategy, and the figures train will set beside what it measures."""

    cfg: TrainConfig
    share: int
    steps: int
    micro: int
    strategy: str
    figures: dict[str, Any]
    memory_method: str


def _plan_run(cfg: TrainConfig, world: int, on_cpu: bool, precision: str) -> RunPlanned:
    """The workload built as train builds it, its data counted here; a model with weights to download is built
    from its config on fake tensors (`Workload.plan_build`), so nothing is downloaded or allocated for it. Then
    train's own rules: the layout (`lay_out`), the memory (`probe`, `plan_memory`) and, on CPU nodes, the step
    time (`plan_step`)."""
    # torch and the workloads: `gpuwise runs`, which reads jobs, starts without them
    from gpuwise.train.engine import resolve_strategy
    from gpuwise.train.runplan import plan_memory, plan_step, probe
    from gpuwise.train.setup import lay_out
    from gpuwise.workloads import build as build_workload

    strategy = resolve_strategy(cfg.strategy, world)
    fabric_precision = {"bf16": "bf16-mixed", "fp16": "16-mixed"}.get(precision, "32-true")
    print(f"gpuwise: planning {cfg.workload}: counting its data and one step of its model here", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="gpuwise-launch-") as tmp:
        work = build_workload(cfg, Path(tmp), planning=True)
    lay = lay_out(cfg, work, world, "cpu" if on_cpu else "cuda", fabric_precision, strategy)
    micro = min(lay.share, lay.cfg.micro_batch_size or lay.share)
    batch = lambda n: work.make_batch(list(range(n)), 0)  # noqa: E731
    try:
        probed = probe(work.model, work.loss, batch, lay.share)
        say = lambda line: print(line, file=sys.stderr)  # noqa: E731
        memory = plan_memory(work.model, work.loss, batch, probed, lay.cfg, micro, fabric_precision, world,
                             strategy == "fsdp", work.model_spec, say)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a user's model: its failure as one line
        raise GpuwiseError(f"planning the job failed: one step of its model here raised {first_line(e)}") from None
    figures: dict[str, Any] = {
        "peak_bytes": memory.peak_bytes,
        "flops_per_step": probed.flops_per_sample * lay.batch_size,
    }
    if on_cpu:
        trainable = sum(p.numel() for p in work.model.parameters() if p.requires_grad)
        step = plan_step(lay.cfg, figures["flops_per_step"], fabric_precision, "cpu", 0, world, lay.share, trainable,
                         lambda: batch(lay.share))  # fmt: skip
        figures |= {k: step.get(k) for k in ("step_time_s", "data_s", "efficiency", "efficiency_origin")}
    return RunPlanned(lay.cfg, lay.share, lay.total, micro, strategy, figures, memory.method)


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
    workload = cfg.workload
    run_dir = run_dir or cfg.run_dir
    if gpus is not None and gpus < 1 or nodes is not None and nodes < 1:
        raise GpuwiseError("--gpus and --nodes must be at least 1")
    world = gpus or nodes or 1
    candidates = _candidates(catalog, gpu)
    if not gpu and nameable is not None:
        candidates = [a for a in candidates if a.slug in nameable]
    # Everything that needs no model first: the flags, the layout, the provider, the batch over the processes.
    if gpu:
        layout(candidates[0], world, nodes)
    if provider:
        check_provider(catalog, provider)
    cfg = replace(cfg, devices=1, num_nodes=1, accelerator="cpu")
    cfg.validate()
    cfg = cfg.resolved()
    if cfg.batch_size is not None and cfg.batch_size % world:
        raise GpuwiseError(
            f"the global batch {cfg.batch_size} must be divisible by the {world} processes (--batch-size)"
        )
    on_cpu = gpu == "cpu"
    precision = _plan_precision(cfg.precision, candidates[0] if on_cpu else None)
    run_plan = _plan_run(cfg, world, on_cpu, precision)
    cfg, share, steps, micro, strategy = run_plan.cfg, run_plan.share, run_plan.steps, run_plan.micro, run_plan.strategy
    figures = run_plan.figures
    assert cfg.batch_size is not None  # laid out: the workload's default filled in
    eff, eff_origin = (efficiency, "--efficiency") if efficiency else (EFFICIENCY.value, EFFICIENCY.origin)
    if on_cpu:  # this CPU's nodes: the step time train plans here, calibrated by `gpuwise bench` where it ran
        eff, eff_origin = figures["efficiency"] or eff, figures["efficiency_origin"] or eff_origin
    step_flops = figures["flops_per_step"] / world
    memory_bytes = figures["peak_bytes"]
    if not on_cpu:  # a CUDA process adds its context and the caching allocator's slack
        memory_bytes = int(memory_bytes + OVERHEAD_BYTES.value + ALLOCATOR_SLACK.value * memory_bytes)
    step_s = figures.get("step_time_s")
    memory_method = run_plan.memory_method
    best, alternatives = _choose(
        candidates, catalog, world, nodes, provider, precision, memory_bytes, step_flops, steps, eff, step_s
    )
    if not best.fits:
        need, have = best.memory_bytes / 2**30, best.capacity_bytes / 2**30
        raise GpuwiseError(
            f"the plan does not fit {best.name}: {need:,.1f} GiB per process at micro-batch {micro}, "
            f"{have:,.0f} GiB there; pass a smaller --micro-batch-size, --strategy fsdp over more --gpus, "
            "or another --gpu"
        )
    time_limit = time_limit_s or int(math.ceil((best.wall_s * TIME_MARGIN.value + STARTUP_S.value) / 60) * 60)
    cpus = cpus_per_node or (best.per_node * int(CPUS_PER_GPU.value) if not on_cpu else best.per_node)
    host = mem_per_node_gib or math.ceil(HOST_MEMORY.value * best.per_node * memory_bytes / 2**30 + 8)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run = str(Path(run_dir).resolve()) if run_dir else str(Path.cwd() / "runs" / f"{workload}-{stamp}")
    options = _without_run_dir(options)  # the job's run directory is the one planned here
    name = f"gpuwise-{_dns(workload)}-{stamp}"
    extra = "" if on_cpu else f", + {OVERHEAD_BYTES.value / 2**30:g} GiB CUDA context, {ALLOCATOR_SLACK.value:.0%} more"
    method = (
        f"memory: {memory_method}, at micro-batch {micro} ({world} process{'es' * (world > 1)}, {strategy}){extra}; "
        + (
            f"time: {steps:,} steps x the step `gpuwise train` plans on this CPU (FLOPs / (peak x efficiency) + data "
            "preparation timed here)"
            if on_cpu
            else f"time: {steps:,} steps x FLOPs of {share} samples (torch FlopCounterMode) / (dense peak x "
            "efficiency), "
            "as `gpuwise train` projects a run; memory-bound operations, collectives, data loading and evaluation "
            "not counted"
        )
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
        figures,
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
    cpu_step_s: float | None = None,
) -> tuple[Choice, tuple[Choice, ...]]:
    """The best accelerator for the job and the fallbacks on as many nodes: the cheapest whole job first (gpuwise
    knows its length; a per-hour price alone does not), then the fastest; one that does not fit comes last.
    `cpu_step_s`: CPU nodes' step time as `gpuwise train` plans it here (else FLOPs / (peak x efficiency))."""
    choices = []
    for acc in candidates:
        prec = precision if acc.peak_tflops(precision) else "fp16"
        peak = acc.peak_tflops(prec)
        if not peak:
            continue
        n_nodes, per_node = layout(acc, world, nodes)
        step_s = cpu_step_s if cpu_step_s and acc.kind != "gpu" else step_flops / (peak * 1e12 * eff)
        wall = steps * step_s
        # the GPUs are held, and billed, from start-up to the last checkpoint: the training is not all of it
        billed = wall + STARTUP_S.value
        hours = billed / 3600 * world
        on_cpu = acc.kind != "gpu"
        price = None if on_cpu else _price(catalog, acc, provider)
        usd = hours * price["usd_per_gpu_hour"] if price else None
        choices.append(
            Choice(
                acc.slug if not on_cpu else "cpu",
                acc.name,
                world,
                n_nodes,
                per_node,
                memory,
                acc.mem_bytes,
                memory <= acc.mem_bytes,
                step_s,
                wall,
                billed,
                hours,
                usd,
                price,
                prec,
            )  # fmt: skip
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
        # torch and the workloads: `gpuwise runs`, which reads jobs, starts without them
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
