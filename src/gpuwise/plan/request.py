"""What the user asks the planner, the stated assumptions it rests on, and the layout of a job.

Each field maps one-to-one onto a ``gpuwise plan`` flag. ``None`` means "not given": the
validation needs to tell a flag the user set from a default.
"""

from __future__ import annotations

import math
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


# The range of every numeric flag: (flag, field, low, high, why). The highs lie far beyond any real job yet
# refuse a slip of the keyboard (three zeros too many, 1e30) before it becomes figures that mean nothing;
# the lows keep every division of the time and cost model away from zero (and so from inf).
MAX_GPUS = 1_000_000  # 5x the largest cluster yet built (xAI Colossus, about 200,000 GPUs in 2025)
MAX_TOKENS = 1e16  # 250x the largest published pre-training set (about 4e13 tokens in 2025)
MAX_CONTEXT = 10_000_000  # the longest published context window (Llama 4 Scout, 10 M tokens)
RANGES: tuple[tuple[str, str, float, float, str], ...] = (
    ("--batch", "batch", 1, 1_000_000, "sequences per step"),
    ("--seq", "seq", 1, MAX_CONTEXT, "tokens per sequence"),
    ("--gen", "gen", 0, MAX_CONTEXT, "tokens generated per sequence"),
    ("--tokens", "tokens", 1, MAX_TOKENS, "tokens in the whole job"),
    ("--dataset-tokens", "dataset_tokens", 1, MAX_TOKENS, "tokens in the training set"),
    ("--epochs", "epochs", 0.001, 10_000, "passes over the training set"),
    ("--gpus", "gpus", 1, MAX_GPUS, "GPUs in the job"),
    ("--tp", "tp", 1, MAX_GPUS, "tensor-parallel degree"),
    ("--pp", "pp", 1, MAX_GPUS, "pipeline stages"),
    ("--zero", "zero", 0, 3, "the ZeRO stage"),
    ("--lora-rank", "lora_rank", 1, 65_536, "adapter rank"),
    ("--efficiency", "efficiency", 0.001, 1, "a fraction of dense peak"),
    ("--utilization", "utilization", 0.001, 1, "a fraction of the hardware's life"),
    ("--life-years", "life_years", 0.1, 50, "years to amortize the purchase over"),
    ("--kwh-usd", "kwh_usd", 0, 10, "USD per kWh; 0 is free power, retail peaks near 1"),
    ("--pue", "pue", 1, 5, "total facility power over IT power"),
)


def _num(x: float) -> str:
    if isinstance(x, int):
        text = f"{x:,}"
        return text if len(text) <= 24 else f"{text[:12]}... ({len(str(x))} digits)"
    return f"{x:g}"


def check_flags(req: PlanRequest) -> None:
    """Every numeric flag finite and in its range, every name non-empty: the one place each is refused."""
    for flag, name, low, high, why in RANGES:
        value = getattr(req, name)
        if value is None:
            continue
        # An int is never inf or nan (and one of 400 digits does not convert to a float to ask).
        if (isinstance(value, float) and not math.isfinite(value)) or not low <= value <= high:
            raise GpuwiseError(
                f"{flag} must be at least {_num(low)} and at most {_num(high)} ({why}), not {_num(value)}"
            )
    for flag, text in (("--gpu", req.gpu), ("--provider", req.provider)):
        if text is not None and not text.strip():
            raise GpuwiseError(f"{flag} is empty: leave it out, or name one (see `gpuwise hardware`)")


def validate(req: PlanRequest, model: ModelSpec) -> None:
    """Refuse the combinations that cannot mean anything, with the reason."""

    def bad(msg: str):
        raise GpuwiseError(msg)

    if req.task not in TASKS:
        bad(f"unknown task '{req.task}' (one of: {', '.join(TASKS)})")
    check_flags(req)
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
    if req.lora_rank is not None and req.lora_rank > model.hidden:
        bad(f"--lora-rank {req.lora_rank} is wider than {model.name}'s hidden size {model.hidden}: no low-rank left")
    if req.seq > model.max_seq > 0:
        bad(f"--seq {req.seq} is longer than {model.name}'s context of {model.max_seq} tokens")
    tp, pp = req.tp or 1, req.pp or 1
    if tp > model.heads or model.heads % tp:
        bad(f"--tp {tp} must divide {model.name}'s {model.heads} attention heads")
    if pp > model.layers:
        bad(f"--pp {pp} is more pipeline stages than {model.name}'s {model.layers} layers")
    if req.gpus is not None and req.gpus % (tp * pp):
        bad(f"--gpus {req.gpus} is not a multiple of --tp x --pp = {tp * pp}")
