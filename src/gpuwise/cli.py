"""The `gpuwise` command: parses, calls, prints (rich) or emits --json. Nothing else lives here."""

from __future__ import annotations

import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from gpuwise import __version__
from gpuwise.errors import GpuwiseError, first_line
from gpuwise.hardware.cpu import retain_freed_memory
from gpuwise.plan.presets import PRESETS

app = typer.Typer(
    help="Know what an AI workload needs (memory, time, cost on every accelerator), then run it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Piped output (CI logs, a README) would wrap at rich's 80-column default; a terminal keeps its own width.
console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 120)
# typer vendors click since 0.20; reach its UsageError through a public class, whichever click it is.
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")

# StrEnum: a member is its value, so the plan request takes them as plain strings.
Task = StrEnum("Task", {t: t for t in ("inference", "finetune", "lora", "qlora", "pretrain")})
Precision = StrEnum("Precision", {p: p for p in ("fp32", "bf16", "fp16", "fp8")})
Optimizer = StrEnum("Optimizer", {o: o for o in ("adamw", "adamw-8bit", "sgd")})
Checkpointing = StrEnum("Checkpointing", {c: c for c in ("none", "selective", "full")})
LoraTargets = StrEnum("LoraTargets", {t: t for t in ("all-linear", "attn")})

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
CatalogOpt = Annotated[
    Optional[list[Path]],
    typer.Option(
        "--catalog",
        help="A CSV of your own accelerators or prices (same columns as `gpuwise hardware "
        "--json` rows; see README). Repeatable; also GPUWISE_CATALOG=FILE[:FILE].",
        metavar="FILE",
    ),
]


def _emit(data) -> None:
    from gpuwise.files import to_json

    sys.stdout.write(to_json(data, indent=2) + "\n")


def _catalog(files):
    from gpuwise.hardware.catalog import load_catalog

    return load_catalog(files)


def _version(value: bool):
    if value:
        typer.echo(f"gpuwise {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    db: Annotated[
        Optional[Path],
        typer.Option("--db", help="The run record (SQLite) [user data dir; or GPUWISE_DB].", metavar="FILE"),
    ] = None,
):
    """Plan (memory, time, cost per accelerator), inspect this machine, train, bench, and keep the record."""
    if db is not None:
        os.environ["GPUWISE_DB"] = str(db)  # one switch for every command of this invocation


@app.command()
def hardware(
    slug: Annotated[
        Optional[str], typer.Argument(help="Show one accelerator with every source, e.g. h100-sxm.")
    ] = None,
    catalog: CatalogOpt = None,
    as_json: JsonOpt = False,
):
    """The accelerator catalog: memory, bandwidth, dense peaks, power, prices, each with source and date."""
    from dataclasses import asdict

    from gpuwise.views import render_accelerator, render_hardware

    cat = _catalog(catalog)
    if as_json:
        accs = [cat.get(slug)] if slug is not None else list(cat.accelerators.values())
        _emit(
            {
                "accelerators": [asdict(a) for a in accs],
                "cloud_prices": [asdict(p) for p in cat.cloud if any(p.slug == a.slug for a in accs)],
                "purchase_prices": [asdict(p) for p in cat.purchase if any(p.slug == a.slug for a in accs)],
            }
        )
    elif slug is not None:
        render_accelerator(console, cat, slug)
    else:
        render_hardware(console, cat)


@app.command()
def devices(catalog: CatalogOpt = None, as_json: JsonOpt = False):
    """What is here: CPU, CUDA GPUs, MPS, their peaks, and what `gpuwise train` would pick.

    The CPU's FP32 peak is derived as cores x FLOP/cycle (from its ISA) x clock, and printed so.
    """
    from gpuwise.hardware.devices import detect

    dev = detect(_catalog(catalog))
    if as_json:
        _emit(dev.as_dict())
    else:
        from gpuwise.views import render_devices

        render_devices(console, dev)


@app.command(epilog="Presets: " + ", ".join(PRESETS) + ".")
def plan(
    model: Annotated[
        Optional[str],
        typer.Option(
            help="A preset (listed below), a Hugging Face config.json (or its folder), "
            "or dimensions: layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256."
        ),
    ] = None,
    workload: Annotated[
        Optional[str], typer.Option(help="Trace a gpuwise workload's model instead (the names: gpuwise train --help).")
    ] = None,
    module: Annotated[
        Optional[str],
        typer.Option(help="Trace your own model: package.module:factory, a callable returning (model, example batch)."),
    ] = None,
    traced: Annotated[
        bool, typer.Option("--traced", help="Plan by running one training step on fake tensors (any PyTorch model).")
    ] = False,
    task: Annotated[
        Optional[Task], typer.Option(help="What to plan for; default: inference, or finetune when tracing.")
    ] = None,
    batch: Annotated[int, typer.Option(help="Sequences per step (per micro-batch when training).")] = 1,
    seq: Annotated[int, typer.Option(help="Tokens per sequence (the prompt, for inference).")] = 2048,
    gen: Annotated[Optional[int], typer.Option(help="Inference: tokens generated per sequence [256].")] = None,
    tokens: Annotated[
        Optional[float], typer.Option(help="Total tokens: trained on, or generated for inference.")
    ] = None,
    epochs: Annotated[Optional[float], typer.Option(help="Passes over --dataset-tokens [1].")] = None,
    dataset_tokens: Annotated[
        Optional[float], typer.Option(help="Tokens in the training set [fine-tune: 10 M; pre-train: 20 x params].")
    ] = None,
    precision: Annotated[
        Optional[Precision],
        typer.Option(
            help="Weights/compute precision (training: mixed with fp32 master weights); default: bf16, "
            "or when tracing without --gpu, what `gpuwise train` picks here.",
        ),
    ] = None,
    optimizer: Annotated[Optional[Optimizer], typer.Option(help="Training optimizer [adamw].")] = None,
    checkpointing: Annotated[Optional[Checkpointing], typer.Option(help="Activation recompute [none].")] = None,
    flash_attention: Annotated[bool, typer.Option(help="A fused attention kernel (no s x s scores kept).")] = True,
    lora_rank: Annotated[Optional[int], typer.Option(help="LoRA/QLoRA rank [16].")] = None,
    lora_targets: Annotated[
        Optional[LoraTargets], typer.Option(help="all-linear: q,k,v,o + MLP; attn: q,k,v,o [all-linear].")
    ] = None,
    gpu: Annotated[
        Optional[str],
        typer.Option(
            help="One accelerator slug (see `gpuwise hardware`); default: sweep the catalog, "
            "or when tracing, the GPU here (else this CPU)."
        ),
    ] = None,
    gpus: Annotated[Optional[int], typer.Option(help="GPU count [the fewest that fit].")] = None,
    tp: Annotated[Optional[int], typer.Option(help="Tensor-parallel degree.")] = None,
    pp: Annotated[Optional[int], typer.Option(help="Pipeline-parallel stages.")] = None,
    zero: Annotated[
        Optional[int], typer.Option(help="ZeRO stage over data parallel (3 = FSDP) [3 when DP > 1].")
    ] = None,
    efficiency: Annotated[
        Optional[float], typer.Option(help="Fraction of dense peak achieved [0.462, PaLM MFU].")
    ] = None,
    provider: Annotated[Optional[str], typer.Option(help="Only this cloud provider's prices.")] = None,
    life_years: Annotated[Optional[float], typer.Option(help="On-prem: years to amortize the purchase [4].")] = None,
    utilization: Annotated[
        Optional[float], typer.Option(help="On-prem: share of the life the GPUs are busy [0.6].")
    ] = None,
    kwh_usd: Annotated[Optional[float], typer.Option(help="On-prem: electricity, USD per kWh [0.15].")] = None,
    pue: Annotated[Optional[float], typer.Option(help="On-prem: data-centre PUE [1.4].")] = None,
    catalog: CatalogOpt = None,
    as_json: JsonOpt = False,
):
    """Memory, time and cost of a model x task on every accelerator of the catalog (or one, with --gpu).

    Example: gpuwise plan --model llama-3.1-8b --task qlora
    """
    from gpuwise.plan.model import resolve_model
    from gpuwise.plan.planner import make_plan
    from gpuwise.plan.request import PlanRequest, check_flags

    tracing = bool(workload or module or traced)
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
    from gpuwise.runs import db as rundb

    check_flags(req)  # before the catalog and the model are read: the cheapest mistakes first
    if sum(x is not None for x in (model, workload, module)) != 1:
        raise GpuwiseError("give exactly one of --model, --workload or --module")
    if tracing:
        return _traced(model, workload, module, req, _catalog(catalog), as_json, precision_given=precision is not None)
    cat = _catalog(catalog)
    try:
        cat.calibration = rundb.calibration_map()
    except GpuwiseError as e:
        # The record only refines the efficiency: a broken one must not cost the user the plan (nor a second
        # warning when the plan is not recorded in it).
        print(f"gpuwise: warning: planning without bench calibration: {e}", file=sys.stderr)
        record = False
    else:
        record = True
    result = make_plan(resolve_model(model), req, cat)
    name = result["model"]["name"]
    result["record_id"] = rundb.try_record("plan", gpu or "catalog sweep", name, result) if record else None
    if as_json:
        _emit(result)
    else:
        from gpuwise.views import render_plan

        render_plan(console, result, sweep=gpu is None)


def _workload_step(name: str):
    """The workload's bench step (model and the loss of one synthetic batch), built under the tracer's fake tensors."""
    import torch

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
        name, build = workload, _workload_step(workload)
    elif module:
        name, build = module, traced.module_factory(module)
    else:
        from gpuwise.plan.model import resolve_model

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
        _emit(result)
        return
    from gpuwise.views import render_traced

    render_traced(console, result)


import gpuwise.cli_bench  # noqa: E402,F401  (registers bench on the app)
import gpuwise.cli_export  # noqa: E402,F401  (registers export on the app)
import gpuwise.cli_report  # noqa: E402,F401  (registers report on the app)
import gpuwise.cli_runs  # noqa: E402,F401  (registers runs on the app)
import gpuwise.cli_schema  # noqa: E402,F401  (registers schema on the app)
import gpuwise.cli_serve  # noqa: E402,F401  (registers serve on the app)
import gpuwise.cli_train  # noqa: E402,F401  (registers train and predict on the app)


def main(argv: list[str] | None = None) -> int:
    """Entry point: bad input of any kind is one line on stderr and exit code 2, never a traceback."""
    command = typer.main.get_command(app)
    retain_freed_memory()
    try:
        command.main(args=argv, prog_name="gpuwise", standalone_mode=False)
    except GpuwiseError as e:
        print(f"gpuwise: error: {_one_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except UsageError as e:
        if not e.format_message():  # a bare `gpuwise`: the help was printed
            return 0
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
        print(f"gpuwise: error: {_one_line(e.format_message())}{hint}", file=sys.stderr)
        return 2
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        print("gpuwise: aborted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:
        # A bug, not bad input: still one line (and exit 1, not 2), the traceback only on request.
        if os.environ.get("GPUWISE_DEBUG"):
            raise
        print(
            f"gpuwise: error: internal error ({first_line(e)}); please report it, GPUWISE_DEBUG=1 shows where",
            file=sys.stderr,
        )
        return 1
    return 0


def _one_line(message: str) -> str:
    """A message that quotes a file or a library's error may span lines; the user gets them as one."""
    return "; ".join(line.strip() for line in message.splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
