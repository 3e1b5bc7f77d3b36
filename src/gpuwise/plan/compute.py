"""FLOPs and time: training from 6*N*D plus attention (PaLM appendix B), inference as a compute-
bound prefill and a decode bounded by the slower of compute and memory bandwidth."""

from __future__ import annotations

from dataclasses import dataclass

from gpuwise.hardware.catalog import Accelerator
from gpuwise.plan.memory import Memory, trainable_params
from gpuwise.plan.model import ModelSpec
from gpuwise.plan.request import (
    BANDWIDTH_EFFICIENCY,
    EFFICIENCY,
    FINETUNE_TOKENS,
    INFERENCE_TOKENS,
    PRETRAIN_TOKENS_PER_PARAM,
    Layout,
    PlanRequest,
)


@dataclass
class Compute:
    tokens: float  # trained on, or generated (processed, for an encoder)
    tokens_origin: str
    flops: float  # model FLOPs of the whole job (no recompute)
    hardware_flops: float  # what the GPUs execute, recompute included
    peak_tflops: float  # per GPU, dense, at the plan's precision
    efficiency: float
    efficiency_origin: str
    gpu_hours: float
    wall_hours: float
    tokens_per_s: float
    prefill_flops: float | None = None  # inference: the job's prompt processing
    decode_flops: float | None = None  # inference: the job's generated tokens
    prefill_s: float | None = None  # inference: time to first token of a batch
    decode_step_s: float | None = None
    decode_bound: str | None = None  # "memory" or "compute"

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def job_tokens(model: ModelSpec, req: PlanRequest) -> tuple[float, str]:
    if req.tokens is not None:
        return req.tokens, "--tokens"
    if not req.training:
        return INFERENCE_TOKENS.value, INFERENCE_TOKENS.origin
    epochs = req.epochs or 1
    if req.dataset_tokens is not None:
        return req.dataset_tokens * epochs, f"--dataset-tokens x {epochs:g} epochs"
    if req.task == "pretrain":
        return PRETRAIN_TOKENS_PER_PARAM.value * model.params, PRETRAIN_TOKENS_PER_PARAM.origin
    return FINETUNE_TOKENS.value * epochs, f"{FINETUNE_TOKENS.origin} x {epochs:g} epochs"


def attention_flops_per_token(model: ModelSpec, context: float) -> float:
    """Forward QK^T and AV matmuls for one token attending to ``context`` tokens."""
    return 4 * model.layers * model.heads * model.head_dim * context


def training_flops_per_token(model: ModelSpec, req: PlanRequest) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per token. Frozen weights skip their weight-gradient matmul,
    so LoRA costs 4*N + 6*trainable instead of 6*N."""
    n = model.compute_params
    attn = 3 * attention_flops_per_token(model, req.seq)  # forward + backward = 12*L*H*Q*T
    if req.adapters:
        dense = 4 * n + 6 * trainable_params(model, req)
    else:
        dense = 6 * n
    model_flops = dense + attn
    recompute = 0.0
    if req.ckpt == "full":
        recompute = 2 * n + attn / 3
    elif req.ckpt == "selective" and not req.flash_attention:
        recompute = attn / 3
    return model_flops, model_flops + recompute


def compute(
    model: ModelSpec,
    req: PlanRequest,
    acc: Accelerator,
    layout: Layout,
    mem: Memory,
    calibrated: tuple[float, str] | None = None,
) -> Compute | None:
    """None when the accelerator has no peak for the precision (e.g. bf16 on a T4)."""
    peak_tflops = acc.peak_tflops(req.precision)
    if not peak_tflops:
        return None
    if req.efficiency is not None:
        eff, eff_origin = req.efficiency, "--efficiency"
    else:  # a fraction gpuwise bench calibrated on this kind of card beats the published default
        eff, eff_origin = calibrated or (EFFICIENCY.value, EFFICIENCY.origin)
    peak = peak_tflops * 1e12
    tokens, tokens_origin = job_tokens(model, req)

    if req.training:
        per_tok, per_tok_hw = training_flops_per_token(model, req)
        seconds = tokens * per_tok_hw / (layout.gpus * peak * eff)
        return Compute(
            tokens,
            tokens_origin,
            tokens * per_tok,
            tokens * per_tok_hw,
            peak_tflops,
            eff,
            eff_origin,
            gpu_hours=seconds * layout.gpus / 3600,
            wall_hours=seconds / 3600,
            tokens_per_s=tokens / seconds,
        )

    # Inference. Pipeline stages run one after the other for a batch, so only TP adds speed.
    b, s, g = req.batch, req.seq, req.generated if model.causal else 0
    n = model.compute_params
    width = layout.tp * peak * eff
    prefill_flops = b * s * (2 * n + attention_flops_per_token(model, s / 2))  # causal: half the context
    prefill = prefill_flops / width
    if g == 0:
        per_batch, batch_tokens, step, bound, step_flops = prefill, b * s, None, None, 0.0
    else:
        ctx = s + g / 2  # the average context over the generated tokens
        step_flops = b * (2 * n + attention_flops_per_token(model, ctx))
        kv_avg = mem.kv_cache * ctx / (s + g)
        step_bytes = (mem.weights + kv_avg) * layout.pp  # each stage streams its shard in turn
        t_compute = step_flops / width
        t_memory = step_bytes / (acc.mem_bw_gbs * 1e9 * BANDWIDTH_EFFICIENCY.value)
        step = max(t_compute, t_memory)
        bound = "memory" if t_memory >= t_compute else "compute"
        per_batch, batch_tokens = prefill + g * step, b * g
    batches = tokens / batch_tokens
    seconds = batches * per_batch / layout.dp  # data-parallel replicas serve batches side by side
    flops = batches * (prefill_flops + g * step_flops)
    return Compute(
        tokens,
        tokens_origin,
        flops,
        flops,
        peak_tflops,
        eff,
        eff_origin,
        gpu_hours=seconds * layout.gpus / 3600,
        wall_hours=seconds / 3600,
        tokens_per_s=layout.dp * batch_tokens / per_batch,
        prefill_flops=batches * prefill_flops,
        decode_flops=batches * g * step_flops,
        prefill_s=prefill,
        decode_step_s=step,
        decode_bound=bound,
    )
