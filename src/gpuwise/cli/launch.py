"""`gpuwise launch`: a planned training job written as Slurm, Ray, SkyPilot or Kubernetes would run it,
and with --submit handed to that engine's own client and recorded."""

from __future__ import annotations

import sys
from dataclasses import replace
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from gpuwise.cli.options import CatalogOpt, JsonOpt, console, emit, load_catalog
from gpuwise.errors import GpuwiseError

EngineName = StrEnum("EngineName", ["slurm", "ray", "skypilot", "k8s"])
EPILOG = (
    "Examples: gpuwise launch slurm --gpu h100-sxm --gpus 8 -- train WORKLOAD · "
    "gpuwise launch k8s --image IMAGE --rps 5 --profile chat -- serve llama-3.1-8b · "
    "gpuwise launch slurm --gpu cpu --submit -- serve smollm2-135m-instruct · gpuwise launch --stop ID · "
    "gpuwise launch ray --gpu cpu --gpus 2 --submit -- train WORKLOAD --max-steps 20 · "
    "gpuwise launch skypilot --max-cost 50 --bucket NAME -- train WORKLOAD · "
    "gpuwise launch k8s --gpu a100-80gb --image IMAGE -- train WORKLOAD"
)
SLURM, RAY, SKY, K8S = "Slurm", "Ray", "SkyPilot", "Kubernetes"


# Flags of `gpuwise train` that the launch sets from the layout; given by the user they would contradict it.
SET_BY_LAUNCH = {
    "--devices": "--gpus and --nodes",
    "--num-nodes": "--nodes",
    "--accelerator": "--gpu",
    "--resume": "the job itself (a requeued or recovered job resumes its run)",
}


def parse_train(argv: list[str]) -> tuple[str, tuple[str, ...], dict]:
    """The train command given after `--`: its workload, its options as given, and their parsed values,
    parsed by `gpuwise train`'s own options (so a typo is the same error as there)."""
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.cli import train as train_cli

    if not argv or argv[0] != "train":
        raise GpuwiseError("give the job after --: gpuwise launch ENGINE [options] -- train WORKLOAD [train options]")
    for arg in argv[1:]:
        flag = arg.split("=", 1)[0]
        if flag in SET_BY_LAUNCH:
            raise GpuwiseError(f"train {flag} is set by the launch: use {SET_BY_LAUNCH[flag]} instead")
    app = typer.Typer(add_completion=False)
    app.command()(train_cli.train)
    command = typer.main.get_command(app)
    try:
        ctx = command.make_context("gpuwise train", list(argv[1:]))
    except Exception as e:  # click's usage errors: one line, as `gpuwise train` gives them
        format_message = getattr(e, "format_message", None)
        message = format_message() if callable(format_message) else str(e)
        raise GpuwiseError(f"the train command: {message}") from None
    params = ctx.params
    if params.get("workload") is None:
        raise GpuwiseError("name the workload: -- train WORKLOAD [train options]")
    if params.get("as_json"):
        raise GpuwiseError("train --json has no reader in a launched job: drop it (gpuwise runs shows the summary)")
    options = list(argv[1:])
    options.remove(params["workload"])
    return params["workload"], tuple(options), params


def plan_command(argv: list[str], catalog, **kw):
    """The job `argv` (["train", WORKLOAD, options...]) parsed as `gpuwise train` parses it, then planned."""
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.cli.train import config_of
    from gpuwise.launch.job import plan_job

    workload, options, params = parse_train(argv)
    return plan_job(config_of(workload, params), options, catalog, **kw)


# `gpuwise launch`'s arguments and options, each with its help
EngineArg = Annotated[
    EngineName | None,
    typer.Argument(help="Where the job runs: slurm, ray, skypilot or k8s.", metavar="ENGINE", show_default=False),
]

JobArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="After --: the job, as you would run it here: train WORKLOAD [train options], or an endpoint: serve "
        "MODEL [serve options].",
        show_default=False,
        metavar="-- train WORKLOAD | serve MODEL [OPTIONS]",
    ),
]

GpuOpt = Annotated[
    str | None,
    typer.Option(help="Accelerator slug (gpuwise hardware), or cpu for CPU nodes [the cheapest whole job]."),
]

OutOpt = Annotated[Path | None, typer.Option(help="Where the artifact is written [./JOBNAME + the engine's suffix].")]

RunDirOpt = Annotated[
    Path | None, typer.Option(help="The run directory, on storage every node sees [./runs/WORKLOAD-TIME].")
]

MaxCostOpt = Annotated[
    float | None, typer.Option(min=0, help="Refuse a plan whose cloud cost for the whole job exceeds this, USD.")
]

TimeLimitOpt = Annotated[
    int | None,
    typer.Option(min=1, max=525_600, help="The job's time limit, minutes [the planned time x 1.5 + 15]."),
]

EfficiencyOpt = Annotated[
    float | None, typer.Option(min=1e-4, max=1, help="Fraction of dense peak achieved [0.462, PaLM MFU].")
]

MemPerNodeOpt = Annotated[
    int | None, typer.Option(min=1, help="Host memory per node, GiB [2 x the planned memory + 8].")
]

PythonOpt = Annotated[
    str | None,
    typer.Option(help="The Python with gpuwise on the nodes [this one for Slurm, a shared file system; python]."),
]

GresTypeOpt = Annotated[str | None, typer.Option(help=f"{SLURM}: your site's GPU type name (--gpus-per-node=TYPE:N).")]

AddressOpt = Annotated[
    str | None, typer.Option(help=f"{RAY}: the cluster's dashboard address [RAY_ADDRESS, else http://127.0.0.1:8265].")
]

ManagedOpt = Annotated[
    bool, typer.Option("--managed", help=f"{SKY}: a managed job (sky jobs launch), recovered after preemption.")
]

PvcOpt = Annotated[
    str | None, typer.Option(help=f"{K8S}: an existing PersistentVolumeClaim for the runs [one is created].")
]


SERVE = "An endpoint (-- serve MODEL)"
RpsOpt = Annotated[
    float | None, typer.Option(help="Requests a second at the busy hour: the serving plan sizes the endpoint.",
                               rich_help_panel=SERVE)  # fmt: skip
]


def launch(
    engine: EngineArg = None,
    job: JobArg = None,
    gpu: GpuOpt = None,
    gpus: Annotated[
        int | None, typer.Option(min=1, max=100_000, help="Training: processes (GPUs) in all [1]. An endpoint: GPUs a "
                                 "replica [1, or the serving plan's].")  # fmt: skip
    ] = None,
    nodes: Annotated[int | None, typer.Option(min=1, max=10_000, help="Nodes [as few as the servers hold].")] = None,
    submit: Annotated[bool, typer.Option("--submit", help="Hand the job to the engine and record it.")] = False,
    out: OutOpt = None,
    run_dir: RunDirOpt = None,
    max_cost: MaxCostOpt = None,
    provider: Annotated[str | None, typer.Option(help="Price with this cloud provider only.")] = None,
    time_limit: TimeLimitOpt = None,
    efficiency: EfficiencyOpt = None,
    cpus_per_node: Annotated[int | None, typer.Option(min=1, help="CPU cores per node [8 per GPU].")] = None,
    mem_per_node: MemPerNodeOpt = None,
    python: PythonOpt = None,
    partition: Annotated[str | None, typer.Option(help=f"{SLURM}: partition.", rich_help_panel=SLURM)] = None,
    account: Annotated[str | None, typer.Option(help=f"{SLURM}: account.", rich_help_panel=SLURM)] = None,
    qos: Annotated[str | None, typer.Option(help=f"{SLURM}: QoS.", rich_help_panel=SLURM)] = None,
    gres_type: GresTypeOpt = None,
    address: AddressOpt = None,
    managed: ManagedOpt = False,
    spot: Annotated[bool, typer.Option("--spot", help=f"{SKY}: spot instances (with --managed).")] = False,
    bucket: Annotated[str | None, typer.Option(help=f"{SKY}: the bucket that holds the run directory.")] = None,
    autostop: Annotated[int, typer.Option(min=1, help=f"{SKY}: idle minutes before the cluster stops.")] = 10,
    setup: Annotated[str | None, typer.Option(help=f"{SKY}: the command that installs gpuwise on a node.")] = None,
    image: Annotated[str | None, typer.Option(help=f"{K8S}: the container image with gpuwise installed.")] = None,
    namespace: Annotated[str | None, typer.Option(help=f"{K8S}: namespace.")] = None,
    pvc: PvcOpt = None,
    pvc_size: Annotated[int, typer.Option(min=1, help=f"{K8S}: GiB of the created claim.")] = 100,
    storage_class: Annotated[str | None, typer.Option(help=f"{K8S}: storage class of the created claim.")] = None,
    replicas: Annotated[
        int | None, typer.Option(min=1, max=10_000, help="Replicas [1, or the serving plan's].", rich_help_panel=SERVE)
    ] = None,
    max_replicas: Annotated[
        int | None,
        typer.Option(min=1, max=10_000, help="k8s, SkyPilot: scale up to this many replicas under load [--replicas].",
                     rich_help_panel=SERVE),  # fmt: skip
    ] = None,
    rps: RpsOpt = None,
    users: Annotated[float | None, typer.Option(help="People using it (with --requests-per-user-hour).",
                                                 rich_help_panel=SERVE)] = None,  # fmt: skip
    requests_per_user_hour: Annotated[float | None, typer.Option(help="Requests one person sends an hour.",
                                                                  rich_help_panel=SERVE)] = None,  # fmt: skip
    prompt_tokens: Annotated[int | None, typer.Option(help="Mean prompt tokens.", rich_help_panel=SERVE)] = None,
    output_tokens: Annotated[int | None, typer.Option(help="Mean answer tokens.", rich_help_panel=SERVE)] = None,
    profile: Annotated[str | None, typer.Option(help="Request lengths of a public trace: chat, code, summarize, rag.",
                                                rich_help_panel=SERVE)] = None,  # fmt: skip
    ttft: Annotated[float, typer.Option(help="Target seconds to the first token.", rich_help_panel=SERVE)] = 2.0,
    tpot: Annotated[float, typer.Option(help="Target seconds a token after it.", rich_help_panel=SERVE)] = 0.2,
    percentile: Annotated[float, typer.Option(help="Share of requests (%) meeting both.", rich_help_panel=SERVE)] = 95,
    port: Annotated[
        int | None, typer.Option(min=0, max=65535, help="The replicas' port [Slurm, Ray: any free one, announced in "
                                 "the record; k8s, SkyPilot: 8000].", rich_help_panel=SERVE)  # fmt: skip
    ] = None,
    api_key_file: Annotated[
        Path | None, typer.Option(help="A file (mode 600) holding the key the replicas require [a new key, written "
                                  "beside the record; GPUWISE_API_KEY's where set].",
                                  rich_help_panel=SERVE)  # fmt: skip
    ] = None,
    key_secret: Annotated[
        str | None, typer.Option(help=f"{K8S}: an existing Secret holding the key (key api-key) [one made from the "
                                 "key file].", rich_help_panel=SERVE)  # fmt: skip
    ] = None,
    stop: Annotated[
        int | None, typer.Option(help="End a launched job or endpoint (its record id from gpuwise runs) through its "
                                 "engine; an endpoint drains its in-flight requests.")  # fmt: skip
    ] = None,
    catalog: CatalogOpt = None,
    as_json: JsonOpt = False,
):
    """Write a planned training job (-- train) or endpoint (-- serve) as an engine runs it (an sbatch script, a
    Ray job, a SkyPilot task or service, Kubernetes manifests), with the plan's figures beside it; --submit hands
    it to the engine and records it; --stop ID ends it."""
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.launch.engines import Options, record_note
    from gpuwise.launch.job import dollars
    from gpuwise.launch.registry import engines

    if stop is not None:
        if engine is not None or job:
            raise GpuwiseError("--stop ID ends a recorded job: give it alone (gpuwise launch --stop ID)")
        _stop(stop, as_json)
        return
    if engine is None:
        raise GpuwiseError("name the engine: gpuwise launch slurm|ray|skypilot|k8s [options] -- train|serve ...")
    if spot and not managed:
        raise GpuwiseError("--spot needs --managed: an unmanaged spot cluster is not recovered after a preemption")
    chosen = engines()[str(engine)]
    opts = Options(
        python=python or (sys.executable if str(engine) == "slurm" else "python"),
        partition=partition,
        account=account,
        qos=qos,
        gres_type=gres_type,
        address=address,
        managed=managed,
        spot=spot,
        bucket=bucket,
        autostop_min=autostop,
        setup=setup,
        image=image,
        namespace=namespace,
        pvc=pvc,
        pvc_size_gib=pvc_size,
        storage_class=storage_class,
    )
    if submit and chosen.name != "ray":  # the cheapest refusal first: before the job is built and traced
        chosen.need_client()
    serving = dict(rps=rps, users=users, requests_per_user_hour=requests_per_user_hour, prompt_tokens=prompt_tokens,
                   output_tokens=output_tokens, profile=profile)  # fmt: skip
    if job and job[0] == "serve":
        sized = dict(replicas=replicas, max_replicas=max_replicas, serving=serving, targets=(ttft, tpot, percentile),
                     port=port, api_key_file=api_key_file, key_secret=key_secret)  # fmt: skip
        # here, not at the top: `gpuwise --help` and the other commands start without it
        from gpuwise.cli.launch_serve import launch_endpoint

        launch_endpoint(chosen, list(job or []), opts, sized, gpu, gpus, nodes, submit, out, run_dir, time_limit,
                         cpus_per_node, mem_per_node, catalog, as_json, max_cost)  # fmt: skip
        return
    endpoint_only = {"--replicas": replicas, "--max-replicas": max_replicas, "--port": port,
                     "--api-key-file": api_key_file, "--key-secret": key_secret,
                     **{f"--{k.replace('_', '-')}": v for k, v in serving.items()}}  # fmt: skip
    given = [flag for flag, v in endpoint_only.items() if v is not None]
    if given:
        raise GpuwiseError(f"{given[0]} sizes an endpoint (-- serve MODEL), not a training job")
    planned = plan_command(
        list(job or []),
        load_catalog(catalog),
        gpu=gpu,
        gpus=gpus,
        nodes=nodes,
        provider=provider,
        run_dir=str(run_dir) if run_dir else None,
        efficiency=efficiency,
        cpus_per_node=cpus_per_node,
        mem_per_node_gib=mem_per_node,
        nameable=chosen.names,
        time_limit_s=time_limit * 60 if time_limit else None,
    )
    figures = planned.figures()
    if max_cost is not None:
        cost = planned.choice.usd
        if cost is None:
            raise GpuwiseError(f"--max-cost: no cloud price is known for {planned.choice.name} (see gpuwise hardware)")
        if cost > max_cost:
            raise GpuwiseError(
                f"the plan costs {dollars(cost)} on {planned.choice.gpus} x {planned.choice.name} "
                f"({planned.choice.price and planned.choice.price['provider']}), over --max-cost {dollars(max_cost)}"
            )
        # The fallbacks an engine may run on must keep within it too.
        kept = tuple(a for a in planned.alternatives if a.usd is not None and a.usd <= max_cost)
        planned = replace(planned, alternatives=kept)
    chosen.check(planned, opts)
    if chosen.name == "k8s":
        for i, arg in enumerate(planned.train_args[:-1]):
            if arg in ("--data", "--init-from", "--base") and Path(planned.train_args[i + 1]).exists():
                print(f"gpuwise: warning: {arg} {planned.train_args[i + 1]} is a path on this machine; the pods read "
                      "it in their image or volume: put it there, under the same path", file=sys.stderr)  # fmt: skip
    if submit:
        chosen.preflight(planned, opts)
    text = chosen.render(planned, opts)
    path = out or Path(planned.name + chosen.suffix)
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.files import write_atomic

    write_atomic(path, text)
    job_id = record_id = None
    if submit:
        job_id = chosen.submit(path, planned, opts)
        record_id = _record(chosen.name, job_id, planned, path, opts)
    if as_json:
        emit({"engine": chosen.name, "artifact": str(path), "text": text, "plan": figures, "job_id": job_id,
              "record_id": record_id})  # fmt: skip
        return
    _show(planned, figures, gpu is not None)
    console.print(f"# {path}", style="bold", highlight=False)
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    if submit:
        console.print(
            f"submitted to {chosen.name}: job {job_id}; run record #{record_id}: gpuwise runs", highlight=False
        )
        note = record_note(chosen.name)
        if note:
            console.print(note, highlight=False)
    else:
        console.print(f"not submitted: add --submit to hand {path} to {chosen.name}", highlight=False)


def _record(engine: str, job_id: str, job, path: Path, opts) -> int | None:
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.results import LaunchRecord
    from gpuwise.runs import db

    found = {"address": opts.address} if engine == "ray" else {}
    if engine == "ray" and not opts.address:
        # here, not at the top: `gpuwise --help` and the other commands start without it
        from gpuwise.launch.rayjob import address_of

        found = {"address": address_of(opts)}
    found |= {"namespace": opts.namespace} if opts.namespace else {}
    found |= {"managed": True} if opts.managed else {}
    data = LaunchRecord(
        engine=engine,
        job_id=job_id,
        name=job.name,
        workload=job.workload,
        run_dir=job.run_dir,
        artifact=str(path.resolve()),
        command=job.train_command(),
        plan=job.figures(),
        engine_options=found,
    )
    return db.try_record("launch", job.choice.gpu, job.workload, data, run_dir=job.run_dir)


def _show(job, f: dict, given: bool) -> None:
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.launch.job import dollars, duration

    c = job.choice
    title = f"plan: {job.workload}, {job.steps:,} steps"
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=title, title_justify="left")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_column("where it comes from")
    price = c.price
    rows = [
        ("accelerator", c.name, "--gpu" if given else "the cheapest whole job of the catalog"),
        ("GPUs per node x nodes", f"{c.per_node} x {c.nodes}", "--gpus/--nodes, or 1"),
        ("memory per GPU", f"{c.memory_bytes / 2**30:,.2f} of {c.capacity_bytes / 2**30:,.0f} GiB", job.method),
        ("step time", duration(c.step_s), f"{c.precision}, efficiency {job.efficiency:g}: {job.efficiency_origin}"),
        ("wall time", duration(c.wall_s), f"{job.steps:,} steps x the step time"),
        ("time limit", duration(job.time_limit_s), f["sources"]["time_limit"]),
        ("GPU-hours", f"{c.gpu_hours:,.3f}", f["sources"]["cost"].removesuffix(", x the price")),
        (
            "cost",
            dollars(c.usd) if c.usd is not None else "-",
            f"{price['provider']} {price['kind']}, ${price['usd_per_gpu_hour']:.2f}/GPU-h as of {price['as_of']}: "
            f"{price['source']}"
            if price
            else "no cloud price in the catalog",
        ),
        (
            "CPUs, memory per node",
            f"{job.cpus_per_node}, {job.mem_per_node_gib} GiB",
            f"{f['sources']['cpus']}; {f['sources']['host_memory']}",
        ),  # fmt: skip
    ]
    for alt in job.alternatives:
        rows.append(("fallback", alt.name, f"{duration(alt.wall_s)}, {dollars(alt.usd)}"))
    for r in rows:
        t.add_row(*r)
    console.print(t)


def _stop(record_id: int, as_json: bool) -> None:
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.launch.status import stop

    said, rec = stop(record_id)
    if as_json:
        emit({"record_id": record_id, "engine": rec.engine, "job_id": rec.job_id, "said": said})
    else:
        console.print(said, highlight=False)
