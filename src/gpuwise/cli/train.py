"""`gpuwise train` and `gpuwise predict`: thin wrappers over gpuwise.train and the workloads."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from gpuwise.cli.options import JsonOpt, WorkloadOpt, console, emit
from gpuwise.errors import GpuwiseError, first_line
from gpuwise.train.mlflow_live import ENV_VAR as MLFLOW_ENV
from gpuwise.train.mlflow_live import LIVE_FILE, bare
from gpuwise.workloads.registry import described

EPILOG = (
    "Examples: gpuwise train WORKLOAD · gpuwise train WORKLOAD --max-steps 200 --batch-size 16 · "
    "gpuwise train --resume runs/WORKLOAD-20261130-101500"
)
WORKLOAD_HELP = f"{described()}; or package.module:Class, your own (docs/development.md: Add a workload)."


def train(
    workload: Annotated[str | None, typer.Argument(help=WORKLOAD_HELP, show_default=False)] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            help="Your own data, in the form the workload reads (an image folder, a CSV/Parquet table, "
            "JSONL/CSV text; see docs/train.md). Default: the workload's PyPI data set."
        ),
    ] = None,
    run_dir: Annotated[Path | None, typer.Option(help="Where the run is written [runs/WORKLOAD-TIME].")] = None,
    epochs: Annotated[float | None, typer.Option(help="Passes over the training set [per workload].")] = None,
    max_steps: Annotated[int | None, typer.Option(help="Optimizer steps; overrides --epochs.")] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(help="Global batch: samples per optimizer step, all processes together [per workload]."),
    ] = None,
    micro_batch_size: Annotated[
        str,
        typer.Option(
            help="Samples per forward pass, or auto: the largest that fits; "
            "gradient accumulation keeps the global batch."
        ),
    ] = "auto",
    lr: Annotated[float | None, typer.Option(help="Peak learning rate (warm-up, then cosine) [per workload].")] = None,
    seed: Annotated[int, typer.Option(help="Seeds weights, data order, augmentation.")] = 0,
    checkpoint_every: Annotated[
        int | None, typer.Option(help="Steps between checkpoints [a tenth of the run].")
    ] = None,
    keep_checkpoints: Annotated[int, typer.Option(help="Checkpoints kept.")] = 3,
    eval_every: Annotated[int | None, typer.Option(help="Steps between evaluations [end only].")] = None,
    devices: Annotated[int, typer.Option(help="Processes (GPUs) per node; launch with torchrun for N > 1.")] = 1,
    num_nodes: Annotated[int, typer.Option(help="Nodes (torchrun or SLURM sets the rendezvous).")] = 1,
    accelerator: Annotated[str, typer.Option(help="auto (cuda > mps > cpu), cpu, cuda, mps.")] = "auto",
    precision: Annotated[
        str,
        typer.Option(
            help="auto (bf16-mixed on bf16 GPUs and on CPUs with AMX or AVX512-BF16, 16-mixed on "
            "older GPUs, else 32-true), 32-true, bf16-mixed, 16-mixed, bf16-true."
        ),
    ] = "auto",
    strategy: Annotated[str, typer.Option(help="auto (DDP when several processes), ddp, fsdp.")] = "auto",
    image_size: Annotated[int, typer.Option(help="Image workloads: images are resized to this square.")] = 128,
    init_from: Annotated[
        Path | None,
        typer.Option(
            help="Ranking workloads: last week's run directory to start from; new users and items get new embeddings."
        ),
    ] = None,
    base: Annotated[
        str | None,
        typer.Option(
            help="The pretrained model to start from: a named base (smollm2-135m-instruct, the language model "
            "default), a .gguf file, a local model directory or a hub id; scratch: a small model from a config."
        ),
    ] = None,
    method: Annotated[
        str | None,
        typer.Option(help="Language models: full, lora or qlora (4-bit NF4 base) [lora on a pretrained base]."),
    ] = None,
    lora_rank: Annotated[int, typer.Option(help="Language models: LoRA rank.")] = 16,
    merge: Annotated[bool, typer.Option("--merge", help="lora/qlora: also save the merged model.")] = False,
    block_size: Annotated[int, typer.Option(help="Language models: tokens per training sequence.")] = 128,
    model: Annotated[
        str | None,
        typer.Option(
            help="Recommender: sasrec (self-attention over each user's latest items) or mf (matrix "
            "factorization) [sasrec]. Defects: cnn; multiscale (two CNNs trained apart, at --image-size and 1.5x "
            "it); or ensemble (three at 1.5x --image-size, seeds --seed to --seed + 2); each member a run of its "
            "own in RUN/parts, 60 epochs at 192 px or more [cnn]."
        ),
    ] = None,
    resume: Annotated[
        Path | None, typer.Option(help="Continue the run in this directory from its newest whole checkpoint.")
    ] = None,
    mlflow: Annotated[
        str | None,
        typer.Option(
            help="Also log the run to this MLflow tracking server while it trains (http://HOST:5000): metrics per "
            "step, then parameters, plan against actual and artifacts; gpuwise's record stays the source of truth.",
            metavar="URI",
        ),
    ] = None,
    confirmed: WorkloadOpt = None,
    as_json: JsonOpt = False,
):
    """Train a workload on the best device here: data -> forward -> loss -> update, checkpoints, evaluation."""
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.train.loop import resume as resume_run
    from gpuwise.train.loop import train as train_run
    from gpuwise.train.report import render

    progress_console = Console(stderr=True)
    if mlflow:
        os.environ[MLFLOW_ENV] = mlflow  # read by the run's recorder, on rank 0 (torchrun's workers inherit it)
    if resume is not None:
        if workload is not None:
            raise GpuwiseError(
                "--resume continues a run with its saved config: give no WORKLOAD with it "
                "(your own package.module:Class goes in --workload)"
            )
        summary = resume_run(resume, console=progress_console)
    else:
        if workload is None:
            raise GpuwiseError(f"name a workload: {WORKLOAD_HELP} (or --resume RUN_DIR)")
        if confirmed is not None:
            raise GpuwiseError(
                "--workload confirms the workload of a run read from disk (--resume): name it as WORKLOAD"
            )
        cfg = config_of(workload, locals())
        summary = train_run(cfg, console=progress_console)
    if summary is None:  # not rank 0: the first process reports
        return
    live = Path(summary["run_dir"]) / LIVE_FILE
    if os.environ.get(MLFLOW_ENV) and summary.get("record_id") is not None and live.is_file():
        _complete_mlflow(os.environ[MLFLOW_ENV], summary["record_id"])
    if as_json:
        emit(summary)
    else:
        render(console, summary)


def _complete_mlflow(uri: str, record_id: int) -> None:
    """The live MLflow run, completed with what the record holds: a server that went down is one line."""
    # here, not at the top: only a run logged to MLflow needs it
    from gpuwise.report.mlflow import export

    try:
        export(uri, [record_id])
    except Exception as e:  # noqa: BLE001 - the run is done and recorded; MLflow is only a view of it
        print(f"gpuwise: warning: MLflow at {bare(uri)}: {first_line(e)}; `gpuwise runs export --mlflow` later",
              file=sys.stderr)  # fmt: skip


def config_of(workload: str, params: dict):
    """The TrainConfig of a `gpuwise train` command line, from its parsed options (`train`'s parameters:
    `gpuwise launch` parses the train command it is given with the same options)."""
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.train.config import TrainConfig
    from gpuwise.workloads.registry import name_given

    micro = params["micro_batch_size"]
    # str.isdigit() holds for '²' and '٣', which int() then refuses or reads as 3: only 0-9 are a number here
    if micro != "auto" and not (micro.isascii() and micro.isdigit()):
        raise GpuwiseError(f"--micro-batch-size must be a positive integer or auto, not '{micro}'")
    name_given(workload)  # the parts of a run (Workload.parts) read it back from their config.yaml
    paths: dict = {k: str(params[k]) if params[k] else None for k in ("data", "run_dir", "init_from")}
    same = ("epochs", "max_steps", "batch_size", "lr", "seed", "checkpoint_every", "keep_checkpoints", "eval_every",
            "devices", "num_nodes", "accelerator", "precision", "strategy", "image_size", "base", "method",
            "lora_rank", "merge", "block_size", "model")  # fmt: skip
    return TrainConfig(
        workload=workload,
        micro_batch_size=None if micro == "auto" else int(micro),
        **paths,
        **{k: params[k] for k in same},
    )


def predict(
    run_dir: Annotated[Path, typer.Argument(help="A finished `gpuwise train` run.")],
    inputs: Annotated[
        list[str], typer.Argument(help="What the run's workload takes: image files, user ids, prompts...")
    ],
    k: Annotated[int, typer.Option(min=1, max=10_000, help="Ranking workloads: items per user.")] = 10,
    max_tokens: Annotated[int, typer.Option(min=1, max=100_000, help="Language models: tokens to generate.")] = 40,
    confirmed: WorkloadOpt = None,
    as_json: JsonOpt = False,
):
    """Run a trained model on new inputs."""
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.errors import loading_model
    from gpuwise.train.records import open_finished

    cfg = open_finished(run_dir)
    workload = cfg.workload_def()
    with loading_model(run_dir):
        results = workload.predict(run_dir, cfg, inputs, k=k, max_tokens=max_tokens)
    if as_json:
        emit(results)
        return
    for r in results:
        console.print(workload.describe(r), markup=False, highlight=False)
