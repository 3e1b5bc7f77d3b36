"""Memory per GPU: weights, gradients, optimizer states, activations, KV cache, overhead.

Activations follow Korthikanti et al. (arXiv 2205.05198), term by term, so that GQA, gated MLPs,
extra norms and missing dropout change what they change: with a GPT-style layer (MHA, 4h MLP,
dropout, 2-byte values) the per-layer sum is exactly s*b*h*(34 + 5*a*s/h).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from gpuwise.plan.model import ModelSpec
from gpuwise.plan.request import ALLOCATOR_SLACK, OVERHEAD_BYTES, Layout, PlanRequest

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
# NF4 with double quantization (QLoRA, arXiv 2305.14314): 4 bits per weight, plus 8-bit absmax per
# block of 64 and one fp32 second-level constant per 256 blocks: 4 + 8/64 + 32/(64*256) bits.
NF4_BITS = 4 + 8 / 64 + 32 / (64 * 256)
# Weights served quantized (`gpuwise serve --weights`): bits per weight of the layers' linears and of the rest
# (embedding, output layer), in llama.cpp's block formats: Q8_0 is 32 int8 and an fp16 scale (34 bytes per 32),
# Q4_1 32 nibbles, an fp16 scale and minimum (20 bytes per 32); gpuwise's int4 keeps the output layer at Q8_0.
SERVED_BITS = {"int8": (8.5, 8.5), "int4": (5.0, 8.5)}
# Optimizer state bytes per trainable parameter, before any fp32 master copy.
OPTIMIZER_STATE = {"adamw": 8, "adamw-8bit": 2, "sgd": 4}  # sgd: momentum buffer


@dataclass
class Memory:
    weights: float = 0
    gradients: float = 0
    optimizer: float = 0
    activations: float = 0
    kv_cache: float = 0
    overhead: float = 0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.kv_cache + self.overhead

    def as_dict(self) -> dict:
        return {k: int(round(v)) for k, v in asdict(self).items()} | {"total": int(round(self.total))}


def lora_trainable(model: ModelSpec, rank: int, targets: str) -> int:
    """rank x (d_in + d_out) per adapted matrix, every layer."""
    mats = dict(model.attn_matrices)
    if targets == "all-linear":
        mats |= model.mlp_matrices
    return model.layers * sum(rank * (i + o) for i, o in mats.values())


def trainable_params(model: ModelSpec, req: PlanRequest) -> int:
    if not req.training:
        return 0
    if req.adapters:
        return lora_trainable(model, req.rank, req.targets)
    return model.params


def layer_activation_bytes(model: ModelSpec, s: int, b: int, p: int, flash: bool) -> tuple[float, float]:
    """Bytes one layer keeps for backward: (everything but attention scores, attention scores)."""
    h, a, d, k, f = model.hidden, model.heads, model.head_dim, model.kv_heads, model.ffn
    sb = s * b
    drop = sb * h if model.dropout else 0  # 1-byte mask after each block's output projection
    attn = p * sb * h + p * sb * a * d + 2 * p * sb * k * d + p * sb * a * d + drop
    mlp = p * sb * h + (4 if model.gated else 2) * p * sb * f + drop
    norms = model.norms_per_layer * p * sb * h
    if flash:
        scores = 4 * a * sb  # the kernel keeps only fp32 softmax statistics, never the s x s matrix
    else:
        scores = p * a * s * s * b + ((1 + p) * a * s * s * b if model.dropout else 0)
    return attn + mlp + norms, scores


def activation_bytes(model: ModelSpec, req: PlanRequest, layout: Layout) -> float:
    s, b = req.seq, req.batch
    p = 4 if req.precision == "fp32" else 2  # fp8 recipes keep activations in bf16
    dense, scores = layer_activation_bytes(model, s, b, p, req.flash_attention)
    if not req.training:
        # Inference keeps nothing for backward: the working set is one layer at prefill
        # (its widest intermediates) and the logits of the last position.
        work = p * b * s * (2 * model.hidden + 2 * model.ffn) + (
            0 if req.flash_attention else p * model.heads * s * s * b
        )
        return work / layout.tp + (p + 4) * b * model.vocab / layout.tp
    layer = dense + scores
    if req.ckpt == "full":
        # Each layer keeps its input; backward recomputes one layer at a time.
        kept = model.layers * p * s * b * model.hidden + layer
    elif req.ckpt == "selective":
        kept = model.layers * dense  # attention core recomputed (Korthikanti's selective recompute)
    else:
        kept = model.layers * layer
    # Tensor parallel with sequence parallelism divides every term; under 1F1B pipelining the
    # first stage holds pp micro-batches of L/pp layers = the activations of L layers: no saving.
    logits = s * b * model.vocab * (p + 4 + 4)  # logits, their fp32 upcast, fp32 log-softmax
    return (kept + logits) / layout.tp


def kv_bytes_per_token(layers: float, kv_heads: int, head_dim: int, value_bytes: float, tp: int = 1) -> float:
    """The one KV formula: a token's keys and values, 2 x layers x KV heads x head dim values, on one GPU of `tp`
    (heads are replicated when tp > KV heads). Every engine's cache and `gpuwise plan` count it so."""
    return 2 * layers * math.ceil(kv_heads / tp) * head_dim * value_bytes


def kv_cache_bytes(model: ModelSpec, req: PlanRequest, layout: Layout) -> float:
    if req.training or not model.causal:
        return 0.0
    per_token = kv_bytes_per_token(model.layers / layout.pp, model.kv_heads, model.head_dim, BYTES[req.precision],
                                   layout.tp)  # fmt: skip
    return per_token * req.batch * (req.seq + req.generated)


def served_weight_bytes(model: ModelSpec, weights: str) -> float:
    """Bytes of a model's weights served in `weights` (SERVED_BITS: int8, int4; else 2-byte bf16)."""
    if weights not in SERVED_BITS:
        return model.params * 2.0
    layers_bits, rest_bits = SERVED_BITS[weights]
    linear = model.layers * model.layer_linear_params
    return (linear * layers_bits + (model.params - linear) * rest_bits) / 8


def weight_bytes(model: ModelSpec, req: PlanRequest) -> float:
    """Bytes of the weights the GPUs hold in total (before sharding)."""
    if req.task == "qlora":
        quantized = model.layers * model.layer_linear_params
        return quantized * NF4_BITS / 8 + (model.params - quantized) * BYTES[req.precision]
    if req.training and req.precision == "fp8":
        return model.params * 2  # Transformer Engine keeps bf16 weights; fp8 casts are transient
    return model.params * BYTES[req.precision]


def memory(model: ModelSpec, req: PlanRequest, layout: Layout) -> Memory:
    shard = layout.tp * layout.pp
    mem = Memory()
    mem.weights = weight_bytes(model, req)
    if req.training:
        trainable = trainable_params(model, req)
        mixed = req.precision != "fp32"
        if req.adapters:
            # PEFT keeps adapters in fp32 under autocast: fp32 weights and grads, no master copy.
            mem.weights += trainable * 4
            mem.gradients = trainable * 4
            mem.optimizer = trainable * OPTIMIZER_STATE[req.opt]
        else:
            mem.gradients = trainable * (2 if mixed else 4)
            master = 4 if mixed else 0  # fp32 master weights live with the optimizer
            mem.optimizer = trainable * (OPTIMIZER_STATE[req.opt] + master)
        zero = layout.zero
        if zero >= 1:
            mem.optimizer /= layout.dp
        if zero >= 2:
            mem.gradients /= layout.dp
        if zero >= 3:
            mem.weights /= layout.dp
    mem.weights /= shard
    mem.gradients /= shard
    mem.optimizer /= shard
    mem.activations = activation_bytes(model, req, layout)
    mem.kv_cache = kv_cache_bytes(model, req, layout)
    tensors = mem.total
    mem.overhead = OVERHEAD_BYTES.value + ALLOCATOR_SLACK.value * tensors
    return mem
