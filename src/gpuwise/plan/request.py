"""What the user asks the planner, the stated assumptions it rests on, and the layout of a job.

Each field maps one-to-one onto a ``gpuwise plan`` flag. ``None`` means "not given": the
validation needs to tell a flag the user set from a default.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gpuwise.errors import GpuwiseError
from gpuwise.plan.model import ModelSpec

TASKS = ("inference", "finetune", "lora", "qlora", "pretrain")
TRAINING = ("finetune", "lora", "qlora", "pretrain")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
OPTIMIZERS = ("adamw", "adamw-8bit", "sgd")
CHECKPOINTING = ("none", "selective", "full")


@dataclass(frozen=True)
class Assumption:
    value: float
    origin: str


# Every default a figure rests on, with where it comes from; the CLI prints the ones it used.
EFFICIENCY = Assumption(0.462, "PaLM 540B, 46.2 % model FLOPs utilization (arXiv 2204.02311)")
BANDWIDTH_EFFICIENCY = Assumption(0.8, "assumption: decode reads weights + KV cache at 80 % of peak bandwidth")
OVERHEAD_BYTES = Assumption(2**30, "assumption: 1 GiB per GPU for the CUDA context and cuBLAS/NCCL workspaces")
ALLOCATOR_SLACK = Assumption(0.05, "assumption: caching-allocator slack, 5 % of tensor memory")
PRETRAIN_TOKENS_PER_PARAM = Assumption(20, "Chinchilla-optimal 20 tokens/parameter (arXiv 2203.15556)")
FINETUNE_TOKENS = Assumption(10e6, "assumption: a 10 M-token fine-tuning set (pass --dataset-tokens)")
INFERENCE_TOKENS = Assumption(1e6, "assumption: cost quoted per 1 M generated tokens (pass --tokens)")
LIFE_YEARS = Assumption(4, "assumption: hardware amortized over 4 years")
KWH_USD = Assumption(0.15, "assumption: electricity at 0.15 USD/kWh")
PUE = Assumption(1.4, "assumption: data-centre PUE 1.4")
HOST_POWER = Assumption(1.5, "assumption: server draws 1.5 x its GPUs' TDP (CPUs, fans, NICs)")
UTILIZATION = Assumption(0.6, "assumption: owned GPUs busy 60 % of the hours of their life")


@dataclass(frozen=True)
class PlanRequest:
    task: str = "inference"
    batch: int = 1
    seq: int = 2048
    gen: int | None = None
    tokens: float | None = None
    epochs: float | None = None
    dataset_tokens: float | None = None
    precision: str = "bf16"
    optimizer: str | None = None
    checkpointing: str | None = None
    flash_attention: bool = True
    lora_rank: int | None = None
    lora_targets: str | None = None
    gpu: str | None = None
    gpus: int | None = None
    tp: int | None = None
    pp: int | None = None
    zero: int | None = None
    efficiency: float | None = None
    provider: str | None = None
    life_years: float | None = None
    kwh_usd: float | None = None
    pue: float | None = None
    utilization: float | None = None

    @property
    def training(self) -> bool:
        return self.task in TRAINING

    @property
    def adapters(self) -> bool:
        return self.task in ("lora", "qlora")

    # Resolved values: the defaults live here, once.
    @property
    def opt(self) -> str:
        return self.optimizer or "adamw"

    @property
    def ckpt(self) -> str:
        # peft's prepare_model_for_kbit_training turns gradient checkpointing on: QLoRA's usual setting.
        return self.checkpointing or ("full" if self.task == "qlora" else "none")

    @property
    def rank(self) -> int:
        return self.lora_rank or 16

    @property
    def targets(self) -> str:
        return self.lora_targets or "all-linear"

    @property
    def generated(self) -> int:
        return 256 if self.gen is None else self.gen

    def with_batch(self, batch: int) -> PlanRequest:
        return replace(self, batch=batch)


@dataclass(frozen=True)
class Layout:
    """How a job is spread: gpus = dp x tp x pp; ZeRO stage shards states over dp."""

    gpus: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def describe(self) -> str:
        parts = []
        if self.dp > 1:
            parts.append(f"DP {self.dp}" + (f" ZeRO-{self.zero}" if self.zero else ""))
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        if self.pp > 1:
            parts.append(f"PP {self.pp}")
        return " x ".join(parts) or "single GPU"


def validate(req: PlanRequest, model: ModelSpec) -> None:
    """Refuse the combinations that cannot mean anything, with the reason."""

    def bad(msg: str):
        raise GpuwiseError(msg)

    if req.task not in TASKS:
        bad(f"unknown task '{req.task}' (one of: {', '.join(TASKS)})")
    if req.batch < 1 or req.seq < 1:
        bad("--batch and --seq must be at least 1")
    if req.training:
        if req.gen is not None:
            bad(f"--gen (tokens generated) applies to inference, not to {req.task}")
        if req.tokens is not None and (req.epochs is not None or req.dataset_tokens is not None):
            bad("give either --tokens, or --dataset-tokens with --epochs, not both")
        if req.task == "pretrain" and req.epochs is not None and req.dataset_tokens is None:
            bad("--epochs needs --dataset-tokens for pre-training (or give --tokens)")
    else:
        for flag, value in (
            ("--optimizer", req.optimizer),
            ("--checkpointing", req.checkpointing),
            ("--epochs", req.epochs),
            ("--dataset-tokens", req.dataset_tokens),
            ("--zero", req.zero),
        ):
            if value is not None:
                bad(f"{flag} applies to training tasks, not to inference")
        if req.gen is not None and req.gen < 0:
            bad("--gen must be 0 or more")
        if not model.causal and req.gen:
            bad(f"{model.name} is an encoder ({model.family}): it generates no tokens, use --gen 0")
    if not req.adapters and (req.lora_rank is not None or req.lora_targets is not None):
        hint = " (QLoRA is a fine-tuning method; pre-training trains every weight)" if req.task == "pretrain" else ""
        bad(f"--lora-rank/--lora-targets apply to --task lora or qlora, not to {req.task}{hint}")
    if req.task == "qlora" and req.precision not in ("bf16", "fp16", "fp32"):
        bad(f"QLoRA computes in bf16, fp16 or fp32 over an NF4 base, not {req.precision}")
    if req.precision == "fp8" and req.adapters:
        bad("fp8 training is for full fine-tuning and pre-training (Transformer Engine), not LoRA/QLoRA")
    if req.lora_targets not in (None, "all-linear", "attn"):
        bad(f"--lora-targets must be all-linear or attn, not '{req.lora_targets}'")
    if req.lora_rank is not None and req.lora_rank < 1:
        bad("--lora-rank must be at least 1")
    if req.seq > model.max_seq > 0:
        bad(f"--seq {req.seq} is longer than {model.name}'s context of {model.max_seq} tokens")
    tp, pp = req.tp or 1, req.pp or 1
    if tp < 1 or pp < 1:
        bad("--tp and --pp must be at least 1")
    if tp > model.heads or model.heads % tp:
        bad(f"--tp {tp} must divide {model.name}'s {model.heads} attention heads")
    if pp > model.layers:
        bad(f"--pp {pp} is more pipeline stages than {model.name}'s {model.layers} layers")
    if req.gpus is not None:
        if req.gpus < 1:
            bad("--gpus must be at least 1")
        if req.gpus % (tp * pp):
            bad(f"--gpus {req.gpus} is not a multiple of --tp x --pp = {tp * pp}")
    if req.zero is not None and req.zero not in (0, 1, 2, 3):
        bad("--zero must be 0, 1, 2 or 3")
    for flag, value in (
        ("--tokens", req.tokens),
        ("--epochs", req.epochs),
        ("--dataset-tokens", req.dataset_tokens),
        ("--life-years", req.life_years),
        ("--kwh-usd", req.kwh_usd),
        ("--pue", req.pue),
    ):
        if value is not None and not value > 0:
            bad(f"{flag} must be positive, not {value:g}")
    if req.pue is not None and req.pue < 1:
        bad("--pue is total facility power over IT power: 1 or more")
    if req.efficiency is not None and not 0 < req.efficiency <= 1:
        bad("--efficiency is a fraction of peak: 0 < F <= 1")
    if req.utilization is not None and not 0 < req.utilization <= 1:
        bad("--utilization is a fraction: 0 < F <= 1")
