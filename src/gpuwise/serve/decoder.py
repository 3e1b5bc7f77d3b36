"""A fused forward pass for Llama-family decoders (Llama, Mistral, Qwen2, SmolLM), for the serving engine.

Why by hand: at decoding's small batches a step is mostly dispatch, not arithmetic. transformers' forward makes
~100 tensor-op calls per layer (module hooks, mask and cache bookkeeping, separate q/k/v and gate/up products);
this one makes ~25: one product for q, k and v together, one for gate and up, rotary embedding applied to q
and k in one go, the cache written in place and read as a view, grouped-query attention by folding a
single query's heads into the key/value heads (as transformers' own SDPA path does) instead of repeating
the keys. Only the last column's logits are computed.

It reads the model's own weights: q/k/v and gate/up are concatenated once (the model's modules are then
given views of the concatenated tensor, so nothing is held twice), and on a CPU in bf16 every product is
packed for oneDNN (serve/packed.py). `FusedDecoder.check` compares it with transformers' forward at load
on a short prompt; a model it does not cover, or one that disagrees, is served by transformers' forward.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpuwise.serve.packed import PackedLinear

log = logging.getLogger("gpuwise.serve")

# Decoders whose layer is exactly: x += o(attn(rope(q), rope(k), v)) on rmsnorm(x); x += down(silu(gate) * up)
# on rmsnorm(x). Gemma (scaled embeddings, GELU, 1 + w norms), Qwen3 (q/k norms) and others differ.
FAMILY = {"llama", "mistral", "qwen2"}


# How far the fused forward may be from transformers' at load (largest |difference| of the logits over the largest
# |logit|). Measured on SmolLM2-135M and tiny Llama / Qwen2 / Mistral models: 2e-7 to 2e-6 in fp32, 3e-3 to
# 2.1e-2 in bf16, where transformers' own bf16 forward is 1.3e-2 from its fp32 one. A wrong forward (a head
# order, a missed bias, the wrong rotary half) is off by the size of the logits themselves.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


def fused_decoder(model, pack: bool) -> tuple[FusedDecoder | None, str]:
    """The fused forward for `model` where it covers it and agrees with transformers' at load, else None;
    and one line saying which forward serves it, and why."""
    why = unsupported(model)
    if why is not None:
        return None, f"transformers' ({why})"
    decoder = FusedDecoder(model, pack)
    dtype = decoder.embed.dtype
    off = decoder.check(model)
    if not off <= TOLERANCE.get(dtype, 5e-2):  # a nan is off too
        log.warning("the fused decoder is %.2g off transformers' forward: serving with transformers'", off)
        return None, f"transformers' (the fused one was {off:.1e} off it at load)"
    decoder.release(model)
    return decoder, f"gpuwise's fused decoder ({off:.1e} from transformers' at load)"


def unsupported(model) -> str | None:
    """Why `FusedDecoder` cannot run `model`, or None when it can."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in FAMILY:
        return f"model type {getattr(cfg, 'model_type', '?')!r} is not one of {sorted(FAMILY)}"
    if hasattr(model, "peft_config"):
        return "LoRA adapters run through transformers' forward"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True) and window < cfg.max_position_embeddings:
        return f"sliding-window attention ({window} tokens)"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "not a decoder with .model.layers and .model.rotary_emb"
    return None


class _Linear:
    """One product, packed for oneDNN where that applies (then the plain weight is not kept)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool):
        self.bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if pack else None
        self.weight = None if pack else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)


class Moved(nn.Module):
    """Where a linear layer was, once its weights live only in the fused decoder's packed copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this layer's weights were moved into gpuwise's fused decoder (serve/decoder.py)")


def _weight(linear: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(linear, PackedLinear):
        raise ValueError("FusedDecoder needs the model's plain weights: build it before packing")
    return linear.weight.detach(), None if linear.bias is None else linear.bias.detach()


def _fuse(parent: Any, names: list[str], pack: bool) -> _Linear:
    """One product for several linears that read the same input; the modules keep views of the joint weight."""
    parts = [_weight(getattr(parent, n)) for n in names]
    weight = torch.cat([w for w, _ in parts])
    has_bias = any(b is not None for _, b in parts)
    bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b for w, b in parts]) if has_bias else None
    start = 0
    for n, (w, _) in zip(names, parts, strict=True):
        module = getattr(parent, n)
        stop = start + w.shape[0]
        module.weight = nn.Parameter(weight[start:stop], requires_grad=False)
        if bias is not None:
            module.bias = nn.Parameter(bias[start:stop], requires_grad=False)
        start = stop
    return _Linear(weight, bias, pack)


class _Layer:
    def __init__(self, layer: Any, pack: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _fuse(attn, ["q_proj", "k_proj", "v_proj"], pack)
        self.o = _Linear(*_weight(attn.o_proj), pack)
        self.gate_up = _fuse(mlp, ["gate_proj", "up_proj"], pack)
        self.down = _Linear(*_weight(mlp.down_proj), pack)
        self.norm1 = (layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon)
        self.norm2 = (layer.post_attention_layernorm.weight.detach(), layer.post_attention_layernorm.variance_epsilon)


def _rms(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    # as transformers' LlamaRMSNorm: the statistics in fp32, the scale applied in the model's dtype
    weight, eps = norm
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class FusedDecoder:
    """The forward pass of a Llama-family model over the engine's `SlotCache`: logits of each row's last column."""

    def __init__(self, model, pack: bool):
        cfg = model.config
        inner = model.model
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.embed = inner.embed_tokens.weight.detach()
        self.rotary = inner.rotary_emb
        self.layers = [_Layer(layer, pack) for layer in inner.layers]
        self.norm = (inner.norm.weight.detach(), inner.norm.variance_epsilon)
        self.tied = model.lm_head.weight is inner.embed_tokens.weight
        self.head = _Linear(*_weight(model.lm_head), pack)

    def packed(self) -> tuple[int, int]:
        """(products packed for oneDNN, bytes of the tied output layer's weight that are held twice for it)."""
        linears = [x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.head]
        n = sum(x.packed is not None for x in linears)
        tied = self.head.packed is not None and self.tied
        return n, self.embed.numel() * self.embed.element_size() if tied else 0

    def release(self, model) -> None:
        """Once packed copies serve every product, drop the model's plain weights of the same layers (an output
        layer tied to the embedding stays: the embedding reads it)."""
        if self.head.packed is None:
            return
        for layer in model.model.layers:
            for parent, names in (
                (layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                (layer.mlp, ("gate_proj", "up_proj", "down_proj")),
            ):
                for n in names:
                    setattr(parent, n, Moved())
        if not self.tied:
            model.lm_head = Moved()

    def check(self, model, length: int = 16) -> float:
        """How far this forward is from transformers' own on one prompt of `length` tokens (a prefill of all but
        the last, then one decode step): the largest |difference| of the logits over the largest |logit|."""
        from gpuwise.serve.engine import SlotCache, additive_mask

        device = self.embed.device
        ids = (torch.arange(length, device=device) * 7919 + 11).remainder(self.embed.shape[0]).unsqueeze(0)
        pos = torch.arange(length, device=device).unsqueeze(0)
        causal = pos.view(1, 1, length, 1) >= pos.view(1, 1, 1, length)
        with torch.inference_mode():
            theirs = model(input_ids=ids, use_cache=False).logits[0, -2:].float()
            cache = SlotCache(model.config, 1, self.embed.dtype, device, context=length, start=length)
            cache.bind(0, pos[:, :-1], length - 1)
            prefill = self(ids[:, :-1], pos[:, :-1], additive_mask(causal[:, :, :-1, :-1], self.embed.dtype), cache)
            cache.bind(0, pos[:, -1:], length)
            step = self(ids[:, -1:], pos[:, -1:], additive_mask(causal[:, :, -1:], self.embed.dtype), cache)
        ours = torch.cat([prefill, step])
        return float((ours - theirs).abs().max() / theirs.abs().max())

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, bias: torch.Tensor, cache) -> torch.Tensor:
        """ids, pos: [n, q]; bias: [n, 1, q, length] additive; `cache` bound to these rows and positions."""
        n, q = ids.shape
        H, K, D = self.heads, self.kv_heads, self.head_dim
        x = F.embedding(ids, self.embed)
        cos, sin = self.rotary(x, pos)  # [n, q, D], in x's dtype
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        rows, length, index, at = cache.rows, cache.length, cache.index, cache.pos
        fold = q == 1 and H != K  # one query: its H heads become H/K queries of each key/value head
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(_rms(x, layer.norm1)).view(n, q, H + 2 * K, D)
            qk = qkv[:, :, : H + K]
            half = D // 2
            rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = qk * cos + rotated * sin
            k_cache, v_cache = cache.keys[i], cache.values[i]
            k_cache[index, at] = qk[:, :, H:]
            v_cache[index, at] = qkv[:, :, H + K :]
            keys = k_cache[rows, :length].transpose(1, 2)  # [n, K, length, D]
            values = v_cache[rows, :length].transpose(1, 2)
            if fold:
                query = qk[:, 0, :H].reshape(n, K, H // K, D)
                out = F.scaled_dot_product_attention(query, keys, values, attn_mask=bias)
                out = out.reshape(n, 1, H * D)
            else:
                query = qk[:, :, :H].transpose(1, 2)
                out = F.scaled_dot_product_attention(query, keys, values, attn_mask=bias, enable_gqa=H != K)
                out = out.transpose(1, 2).reshape(n, q, H * D)
            x = x + layer.o(out)
            gate, up = layer.gate_up(_rms(x, layer.norm2)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return self.head(_rms(x[:, -1], self.norm)).float()
