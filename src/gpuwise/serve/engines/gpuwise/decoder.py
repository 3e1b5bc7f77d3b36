"""A fused forward pass for Llama-family decoders (Llama, Mistral, Qwen2, SmolLM), for the serving engine.

Why by hand: at decoding's small batches a step is mostly dispatch, not arithmetic. transformers' forward makes
~100 tensor-op calls per layer (module hooks, mask and cache bookkeeping, separate q/k/v and gate/up products);
this one makes ~25: one product for q, k and v together, one for gate and up, rotary embedding applied to q
and k in one go, the cache written in place and read as a view, grouped-query attention by folding a
single query's heads into the key/value heads (as transformers' own SDPA path does) instead of repeating
the keys. Only the last column's logits are computed. LoRA adapters (peft's, plain LoRA on the seven
projections) are applied row by row as peft's mixed-adapter batch does: each adapter's rows get
scaling * B(A(x)) on their columns of the fused product.

It reads the model's own weights: q/k/v and gate/up are concatenated once (the model's modules are then
given views of the concatenated tensor, so nothing is held twice), and on a CPU every product is packed for
oneDNN (bf16, fp32) or MKL (fp32) where `pack` says so (packed.py). `FusedDecoder.check` compares it with
transformers' forward at load on a short prompt, for the base and each adapter; a model it does not cover, or
one that disagrees, is served by transformers' forward."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpuwise.plan import serving
from gpuwise.serve.engines.gpuwise import attention
from gpuwise.serve.engines.gpuwise.attention import GEMV_ROWS, GEMV_ROWS_ALONE
from gpuwise.serve.engines.gpuwise.kvcache import PagedCache, additive_mask
from gpuwise.serve.engines.gpuwise.packed import ONEDNN, Packed, PackedLinear
from gpuwise.serve.engines.gpuwise.quant import (
    FORMATS,
    WEIGHTS,
    QuantWeight,
    dequantize,
    interleave,
    interleave_rows,
    quantize,
    rows_interleavable,
    rows_of_interleaved,
    unpermute,
)

log = logging.getLogger("gpuwise.serve")

# Decoders whose layer is exactly: x += o(attn(rope(q), rope(k), v)) on rmsnorm(x); x += down(silu(gate) * up)
# on rmsnorm(x). Gemma (scaled embeddings, GELU, 1 + w norms), Qwen3 (q/k norms) and others differ.
FAMILY = {"llama", "mistral", "qwen2"}


# How far the fused forward may be from transformers' at load (largest |difference| of the logits over the largest
# |logit|). Measured on SmolLM2-135M and tiny Llama / Qwen2 / Mistral models: 2e-7 to 2e-6 in fp32, 3e-3 to
# 2.1e-2 in bf16, where transformers' own bf16 forward is 1.3e-2 from its fp32 one. A wrong forward (a head
# order, a missed bias, the wrong rotary half) is off by the size of the logits themselves.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


class NotQuantizable(ValueError):
    """`--weights int8/int4` asked of a model or a machine the quantized kernels do not serve: why, in one line."""


def fused_decoder(
    model, pack: str | None, weights: str = "bf16", shipped: dict[str, QuantWeight] | None = None
) -> tuple[FusedDecoder | None, str]:
    """The fused forward for `model` where it covers it and agrees with transformers' at load, else None;
    and one line saying which forward serves it, and why. `weights` int8 or int4: its products then hold
    quantized weights alone (quant.py), checked against transformers' before they are quantized; a model or
    machine that cannot serve them raises NotQuantizable. `shipped`: a GGUF's own blocks, taken as they ship where
    they are in the format asked for (FusedDecoder.quantize)."""
    why = unsupported(model)
    quantized = WEIGHTS.get(weights) is not None
    if why is not None:
        if quantized:
            raise NotQuantizable(f"--weights {weights} runs on gpuwise's fused decoder, which does not take it: {why}")
        return None, f"transformers' ({why})"
    decoder = FusedDecoder(model, None if quantized else pack)
    dtype = decoder.dtype
    off = decoder.check(model)
    if not off <= TOLERANCE.get(dtype, 5e-2):  # a nan is off too
        if quantized:
            raise NotQuantizable(f"--weights {weights}: the fused decoder was {off:.1e} off transformers' at load")
        log.warning("the fused decoder is %.2g off transformers' forward: serving with transformers'", off)
        return None, f"transformers' (the fused one was {off:.1e} off it at load)"
    if quantized:
        decoder.quantize(weights, shipped)
    else:
        decoder.interleave_rows()
    decoder.release(model)
    agree = f"its logits within {off * 100:.2g} % of transformers' at load, of the largest"
    held = f"; weights {decoder.weights}" if quantized else ""
    return decoder, f"gpuwise's fused decoder ({agree}{held}; decode attention: {decoder.why})"


def unsupported(model) -> str | None:
    """Why `FusedDecoder` cannot run `model`, or None when it can."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in FAMILY:
        return f"model type {getattr(cfg, 'model_type', '?')!r} is not one of {sorted(FAMILY)}"
    if hasattr(model, "peft_config"):
        why = _lora_unsupported(model)
        if why is not None:
            return why
        model = model.get_base_model()
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


# Quantized products of this many rows or more go to the library a chunk of weight rows at a time (`_qlinear`);
# below, the kernel's own. In fp32 the kernel's products are fp32 and the library's blocking wins from LIBRARY_ROWS.
# In bf16 the kernel's are int8 activations' integer dot products (VNNI), which keep up with the library's to more
# rows, by the format's ggml type (KERNEL_ROWS; others LIBRARY_ROWS); and where the CPU has AMX, the kernel's
# up to AMX_ROWS (from 9 rows, on AMX's tiles), where it outran the library. The crossovers, measured
# (benchmarks/quant_products.py): docs/serving.md, "Fewer bytes per token".
LIBRARY_ROWS = 16
KERNEL_ROWS = {FORMATS["Q8_0"].ggml_type: 128, FORMATS["Q4_1"].ggml_type: 64}  # also as quant.interleave lays them
AMX_ROWS = 128
# rope types whose frequencies do not change with the sequence's length (transformers' ROPE_INIT_FUNCTIONS; the
# dynamic ones recompute them): their cos and sin at a position can be kept
STATIC_ROPE = ("default", "linear", "llama3")
EMBED_BY_KERNEL = 8  # token rows up to which a quantized embedding's rows are dequantized one by one (_embed)
CHUNK_ROWS = 1024  # 1024 x 576 bf16 weights: 1.2 MB, in the L2 cache

# which rows each LoRA adapter updates (None: every row)
Groups = tuple[tuple[str, torch.Tensor | None], ...]

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_unsupported(model) -> str | None:
    """Why the fused forward cannot apply this peft model's adapters itself, or None: it takes plain LoRA
    (out += scaling * B(A(x)), no bias on B, unmerged) on the seven projections over plain linear layers."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    for name, module in model.get_base_model().named_modules():
        if not hasattr(module, "lora_A"):
            continue
        if type(module) is not LoraLinear or name.rsplit(".", 1)[-1] not in PROJECTIONS:
            return f"LoRA on {name} ({type(module).__name__}): adapters run through transformers' forward"
        if type(module.base_layer) is not nn.Linear:
            return f"{name} is a {type(module.base_layer).__name__} (quantized?), not a plain linear layer"
        if getattr(module, "lora_variant", None) or module.merged or module.fan_in_fan_out:
            return f"{name}: a LoRA variant (DoRA...), merged weights or fan-in-fan-out"
        if any(b.bias is not None for b in module.lora_B.values()):
            return f"{name}: LoRA with a bias"
    return None


class _Linear:
    """One product, packed where `pack` names a packing (packed.py), and its LoRA adapters' low-rank
    updates: per adapter, the products A and B (the scaling folded into B). With `kernel` (attention.py),
    a product of at most GEMV_ROWS_ALONE rows is the kernel's, which reads the plain weight once at the memory's
    speed, and the whole-step kernel reads it too: the plain weight is then kept beside a packed copy, for the
    wider products. Quantized (`quantize`), the weight is held once, in a block format, and every product
    of it is the kernel's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: str | None, kernel=None):
        self.bias = bias
        self.packed = Packed(weight, bias, pack) if pack else None
        self.kernel = kernel if kernel is not None and weight.stride(-1) == 1 else None
        dropped = self.packed is not None and self.packed.weight is None
        self.weight: torch.Tensor | None = None if dropped and self.kernel is None else weight
        self.quant: QuantWeight | None = None
        self.x4 = False  # the plain weight laid out four rows at a time for the kernels (interleave_rows)
        self.loras: dict[str, tuple[_Linear, _Linear]] = {}

    def interleavable(self) -> bool:
        """Whether the plain weight can be laid out four rows at a time: the kernels read it alone (oneDNN's
        packed copy, which keeps no plain weight, serves the wider products) and its shape takes it."""
        w = self.weight
        return (
            self.kernel is not None
            and self.quant is None
            and self.packed is not None
            and self.packed.weight is None
            and w is not None
            and w.is_contiguous()
            and rows_interleavable(w)
        )

    def interleave_rows(self) -> None:
        """Lay the plain weight out four rows at a time, in place (transformers' modules that view it no longer
        read it right: FusedDecoder.release moves them out)."""
        assert self.weight is not None and self.interleavable()
        self.weight.copy_(interleave_rows(self.weight))
        self.x4 = True

    def plain(self) -> torch.Tensor:
        """The plain weight as rows [O, I] (a copy where it is laid out four rows at a time)."""
        assert self.weight is not None
        return rows_of_interleaved(self.weight) if self.x4 else self.weight

    def quantize(self, fmt: str, shipped: QuantWeight | None = None) -> bool:
        """Hold the weight in llama.cpp's `fmt` alone (the plain and any packed copy dropped): `shipped`, the
        blocks a GGUF holds for it, where they are in `fmt` and its shape; else quantized now (Q8_0 then laid out
        four rows at a time for the kernels where its shape allows: quant.interleave). Whether shipped."""
        if self.kernel is None or self.weight is None:
            raise NotQuantizable("quantized weights are read by gpuwise's CPU kernel, which this product lacks")
        rows, cols = self.weight.shape
        taken = shipped is not None and (shipped.fmt.name, shipped.rows, shipped.cols) == (fmt, rows, cols)
        held = shipped if shipped is not None and taken else quantize(self.weight, fmt)
        self.quant = interleave(held)
        self.weight = self.packed = None
        return taken

    @property
    def nbytes(self) -> int:
        """Bytes its weight is held in: the quantized weight, or the plain weight and the packed copy, each where
        held (a bf16 product packed for oneDNN keeps its plain weight for the decode kernels: held twice)."""
        if self.quant is not None:
            return self.quant.nbytes
        held = 0 if self.weight is None else self.weight.numel() * self.weight.element_size()
        if self.packed is not None:
            held += self.packed.packed.numel() * self.packed.packed.element_size()
        return held

    def __call__(self, x: torch.Tensor, groups: Groups = ()) -> torch.Tensor:
        if self.quant is not None:
            out = self._qgemv(x)
        elif self.kernel is not None and x.numel() <= GEMV_ROWS_ALONE * x.shape[-1]:
            out = self._gemv(x)
        elif self.packed is not None:
            out = self.packed(x)
        else:
            assert self.weight is not None
            out = F.linear(x, self.weight, self.bias)
        # as peft's mixed-adapter batch: each adapter's rows (None: every row) get scaling * B(A(x))
        for name, rows in groups:
            if name not in self.loras:
                continue
            a, b = self.loras[name]
            if rows is None:
                out += b(a(x))
            else:
                out.index_add_(0, rows, b(a(x[rows])))
        return out

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None and self.kernel is not None
        try:
            return self.kernel.gemv(x, self.weight, self.bias, x4=self.x4)
        except (ValueError, RuntimeError) as e:  # refused: this product goes the other way from now on
            log.warning("the decode product kernel failed (%s): this product uses the library's", e)
            self.kernel = None
            return self.packed(x) if self.packed is not None else F.linear(x, self.plain(), self.bias)

    def _qgemv(self, x: torch.Tensor) -> torch.Tensor:
        assert self.quant is not None
        if self.kernel is not None:
            try:
                rows = x.numel() // x.shape[-1]
                if rows >= self._library_rows(x.dtype):
                    return self._qlinear(x)
                return self.kernel.qgemv(x, self.quant, self.bias)
            except (ValueError, RuntimeError) as e:
                log.warning("the quantized product kernel failed (%s): dequantizing for each product", e)
                self.kernel = None
        # no copy kept: dequantized for this product only (slow, but the answer is the same)
        return F.linear(x, dequantize(self.quant, x.dtype), self.bias)

    def _library_rows(self, dtype: torch.dtype) -> int:
        """The rows from which this quantized product is the library's (`_qlinear`) rather than the kernel's."""
        assert self.quant is not None and self.kernel is not None
        if dtype != torch.bfloat16:
            return LIBRARY_ROWS
        if self.kernel.amx:
            return AMX_ROWS + 1
        return KERNEL_ROWS.get(self.quant.fmt.ggml_type, LIBRARY_ROWS)

    def _qlinear(self, x: torch.Tensor) -> torch.Tensor:
        """A product of many rows (a prompt's, many streams'): CHUNK_ROWS of the weight's rows at a time
        dequantized into the cache and multiplied by the library's product (oneDNN's AMX or AVX-512 kernels),
        which outruns the kernel's own products there (`_library_rows`)."""
        assert self.quant is not None and self.kernel is not None
        out = torch.empty((*x.shape[:-1], self.quant.rows), dtype=x.dtype)
        scratch = _scratch(x.dtype, CHUNK_ROWS * self.quant.cols)
        for o in range(0, self.quant.rows, CHUNK_ROWS):
            part = self.kernel.dequantize(self.quant, slice(o, o + CHUNK_ROWS), x.dtype, scratch)
            bias = None if self.bias is None else self.bias[o : o + part.shape[0]]
            out[..., o : o + part.shape[0]] = F.linear(x, part, bias)
        return out


def _shipped_products(blocks: dict[str, QuantWeight], layers: int, heads: int, kv_heads: int, tied: bool) -> dict:
    """A GGUF's blocks (llama.cpp's names) as the fused decoder's products: "N.qkv" (q and k unpermuted), "N.o",
    "N.gate_up", "N.down", "head"; a product whose parts the file does not all hold in one format is left out."""
    out: dict[str, QuantWeight] = {}

    def joined(parts: list[QuantWeight | None]) -> QuantWeight | None:
        if any(p is None for p in parts):
            return None
        fmt = {p.fmt for p in parts if p is not None}
        if len(fmt) != 1:
            return None
        data = torch.cat([p.data for p in parts if p is not None])
        return QuantWeight(fmt.pop(), data, data.shape[0], parts[0].cols)  # type: ignore[union-attr]

    for i in range(layers):

        def get(name: str, i: int = i) -> QuantWeight | None:
            return blocks.get(f"blk.{i}.{name}.weight")

        q, k = get("attn_q"), get("attn_k")
        qkv = joined([q and unpermute(q, heads), k and unpermute(k, kv_heads), get("attn_v")])
        for name, product in (("qkv", qkv), ("o", get("attn_output")), ("down", get("ffn_down")),
                              ("gate_up", joined([get("ffn_gate"), get("ffn_up")]))):  # fmt: skip
            if product is not None:
                out[f"{i}.{name}"] = product
    head = blocks.get("token_embd.weight" if tied else "output.weight")
    if head is not None:
        out["head"] = head
    return out


_SCRATCH = threading.local()


def _scratch(dtype: torch.dtype, numel: int) -> torch.Tensor:
    """One chunk's room for dequantized rows, kept between products by each thread that runs forwards (an
    engine's): a chunk, not a copy of the weights (CHUNK_ROWS x the widest input: 3 MB for SmolLM2-135M)."""
    held: dict[torch.dtype, torch.Tensor] = _SCRATCH.__dict__.setdefault("held", {})
    if dtype not in held or held[dtype].numel() < numel:
        held[dtype] = torch.empty(numel, dtype=dtype)
    return held[dtype]


def _format(x: _Linear) -> int:
    """The kernels' weight format of a product: PLAIN (PLAIN_X4 laid out four rows at a time), or its block
    format's."""
    if x.quant is not None:
        return x.quant.fmt.kernel
    return attention.PLAIN_X4 if x.x4 else attention.PLAIN


def _held(x: _Linear) -> torch.Tensor:
    """The tensor the kernels read for a product: its quantized blocks or its plain weight."""
    held = x.quant.data if x.quant is not None else x.weight
    assert held is not None
    return held


class Moved(nn.Module):
    """Where a linear layer was, once its weights live only in the fused decoder's packed copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this layer's weights were moved into gpuwise's fused decoder (decoder.py)")


def _plain(module: Any) -> Any:
    """The linear layer itself: a LoRA wrapper's base layer, or the module."""
    return getattr(module, "base_layer", module)


def _weight(linear: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    linear = _plain(linear)
    if isinstance(linear, PackedLinear):
        raise ValueError("FusedDecoder needs the model's plain weights: build it before packing")
    return linear.weight.detach(), None if linear.bias is None else linear.bias.detach()


def _fuse(parent: Any, names: list[str], pack: str | None, kernel=None) -> _Linear:
    """One product for several linears that read the same input; the modules keep views of the joint weight,
    and their LoRA adapters update their own columns of it."""
    parts = [_weight(getattr(parent, n)) for n in names]
    weight = torch.cat([w for w, _ in parts])
    has_bias = any(b is not None for _, b in parts)
    bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b for w, b in parts]) if has_bias else None
    fused = _Linear(weight, bias, pack, kernel)
    low_rank: dict[str, list[tuple[slice, torch.Tensor, torch.Tensor]]] = {}
    start = 0
    for n, (w, _) in zip(names, parts, strict=True):
        module = getattr(parent, n)
        stop = start + w.shape[0]
        _plain(module).weight = nn.Parameter(weight[start:stop], requires_grad=False)
        if bias is not None:
            _plain(module).bias = nn.Parameter(bias[start:stop], requires_grad=False)
        for adapter, a in getattr(module, "lora_A", {}).items():
            b = module.lora_B[adapter].weight.detach() * module.scaling[adapter]
            low_rank.setdefault(adapter, []).append((slice(start, stop), a.weight.detach(), b))
        start = stop
    # Per adapter, two products for the whole fused product rather than two per part: the parts' A stacked
    # (they read the same input), their B (scaling folded in) block-diagonal over the output columns.
    for adapter, pieces in low_rank.items():
        a = torch.cat([a for _, a, _ in pieces])
        b = weight.new_zeros(weight.shape[0], a.shape[0])
        r = 0
        for cols, part_a, part_b in pieces:
            b[cols, r : r + part_a.shape[0]] = part_b
            r += part_a.shape[0]
        fused.loras[adapter] = (_Linear(a, None, pack), _Linear(b, None, pack))
    return fused


class _Layer:
    def __init__(self, layer: Any, pack: str | None, kernel=None):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _fuse(attn, ["q_proj", "k_proj", "v_proj"], pack, kernel)
        self.o = _fuse(attn, ["o_proj"], pack, kernel)
        self.gate_up = _fuse(mlp, ["gate_proj", "up_proj"], pack, kernel)
        self.down = _fuse(mlp, ["down_proj"], pack, kernel)
        self.norm1 = (layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon)
        self.norm2 = (layer.post_attention_layernorm.weight.detach(), layer.post_attention_layernorm.variance_epsilon)


def _rms(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    # as transformers' LlamaRMSNorm: the statistics in fp32, the scale applied in the model's dtype
    weight, eps = norm
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _check_bounds(part: Part, cache) -> None:
    """A pass's rows write and read only blocks of the cache, within their tables, and each row attends to its
    own positions: the kernels read and write where they are told, so this is checked once a pass."""
    table, pos = part.table, part.pos
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= cache.blocks):
        raise ValueError(f"a block table names blocks outside the cache's {cache.blocks}")
    if part.length > table.shape[1] * cache.block or int(pos.max()) + 1 > part.length:
        raise ValueError(
            f"a row attends to {int(pos.max()) + 1} positions of {part.length} bound, its table holds "
            f"{table.shape[1] * cache.block}"
        )


@dataclass
class Part:
    """One group of rows in a forward pass: ids and positions [n, q], the additive mask [n, 1, q, length], its
    rows' block tables in the paged cache [n, w] (int64), how far its rows attend, and each row's LoRA adapter
    (None: the base)."""

    ids: torch.Tensor
    pos: torch.Tensor
    bias: torch.Tensor
    table: torch.Tensor
    length: int
    adapters: list[str | None]


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


class FusedDecoder:
    """The forward pass of a Llama-family model over the engine's `PagedCache`: logits of each row's last column."""

    def __init__(self, model, pack: str | None):
        self.adapters = set(model.peft_config) if hasattr(model, "peft_config") else set()
        model = model.get_base_model() if self.adapters else model
        cfg = model.config
        inner = model.model
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.embed: torch.Tensor | None = inner.embed_tokens.weight.detach()
        self.embed_q: QuantWeight | None = None  # a quantized output layer tied to the embedding: looked up in it
        self.embed_x4 = False  # the embedding is the output layer laid out four rows at a time: looked up in it
        self.dtype, self.device, self.vocab = self.embed.dtype, self.embed.device, self.embed.shape[0]
        self.weights = f"{self.dtype}".removeprefix("torch.")
        self.rotary = inner.rotary_emb
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # _rotary_rows's table
        # one query per row (a decode step): gpuwise's CPU kernel where it builds (attention.py), else SDPA;
        # the same library's product for a decode step's few rows
        self.attention, self.why, products = None, "SDPA", None
        if self.device.type == "cpu":
            kernel, why = attention.load()
            if kernel is not None and not kernel.supports(self.dtype, self.head_dim, self.device):
                kernel, why = None, f"{self.dtype} or head dim {self.head_dim} is not one the kernel takes"
            self.attention, self.why = kernel, why if kernel is not None else f"SDPA ({why})"
            products = kernel
        self.layers = [_Layer(layer, pack, products) for layer in inner.layers]
        self.norm = (inner.norm.weight.detach(), inner.norm.variance_epsilon)
        self.tied = model.lm_head.weight is inner.embed_tokens.weight
        self.head = _Linear(*_weight(model.lm_head), pack, products)
        self.vocab_out = model.lm_head.weight.shape[0]
        self.inner = inner.layers[0].mlp.down_proj.in_features if inner.layers else 0
        self.step_formats = (attention.PLAIN, attention.PLAIN)
        self.step = self._step_pointers()  # a whole decode step in one call of the kernel library, where it can

    def linears(self) -> list[_Linear]:
        return [x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    def quantize(self, weights: str, shipped: dict[str, QuantWeight] | None = None) -> None:
        """Hold every product's weight in `weights`' block formats alone (quant.py's WEIGHTS: the layers', the
        output layer's); an output layer tied to the embedding is then the embedding too, looked up in it.
        `shipped`: a GGUF's blocks by name (quant.gguf_blocks): a product whose blocks the file holds in the
        format asked for takes them as they ship, the others are quantized from the model's weights."""
        layers_fmt, head_fmt = WEIGHTS[weights] or (None, None)
        if layers_fmt is None or head_fmt is None:
            return
        if self.attention is None:
            raise NotQuantizable(f"--weights {weights} needs gpuwise's CPU kernel ({self.why})")
        files = _shipped_products(shipped or {}, len(self.layers), self.heads, self.kv_heads, self.tied)
        taken = 0
        for i, layer in enumerate(self.layers):
            for name in ("qkv", "o", "gate_up", "down"):
                taken += getattr(layer, name).quantize(layers_fmt, files.get(f"{i}.{name}"))
        taken += self.head.quantize(head_fmt, files.get("head"))
        if self.tied:
            self.embed_q, self.embed = self.head.quant, None
        total = 4 * len(self.layers) + 1
        where = "" if not shipped else f", {taken} of {total} products as the GGUF ships them"
        self.weights = f"{weights}: layers {layers_fmt}, output layer {head_fmt}{where}"
        self.step = self._step_pointers()

    def interleave_rows(self) -> None:
        """Lay the plain weights the decode kernels read out four rows at a time (_Linear.interleave_rows): the
        layers' all or none (the whole-step kernel reads them in one format), the output layer on its own; an
        embedding tied to it is then looked up in that layout."""
        linears = self.linears()
        if linears and all(x.interleavable() for x in linears):
            for x in linears:
                x.interleave_rows()
        if self.head.interleavable():
            self.head.interleave_rows()
            self.embed_x4 = self.tied
        self.step = self._step_pointers()

    def held_bytes(self) -> int:
        """Bytes of weights this decoder holds: its products', the embedding's (once where tied), the norms'."""
        held = sum(x.nbytes for x in [*self.linears(), self.head])
        if self.embed is not None and not (self.tied and self.head.weight is not None):
            held += self.embed.numel() * self.embed.element_size()
        norms = [n for layer in self.layers for n in (layer.norm1[0], layer.norm2[0])] + [self.norm[0]]
        return held + sum(n.numel() * n.element_size() for n in norms)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `ids` [...] as [..., hidden]: rows of the embedding, or of the quantized output layer
        tied to it, dequantized (a few rows a step)."""
        if self.embed_q is None:
            assert self.embed is not None
            if self.embed_x4:
                return rows_of_interleaved(self.embed, ids.reshape(-1)).view(*ids.shape, self.embed.shape[1])
            return F.embedding(ids, self.embed)
        flat = ids.reshape(-1)
        if self.attention is not None and flat.numel() <= EMBED_BY_KERNEL:
            # a decode step's few rows: each dequantized by the kernel where it lies, rather than gathered into
            # Q8_0 rows first (a step's largest Python cost then); the same values (tests/test_quant.py)
            one = [self.attention.dequantize(self.embed_q, slice(i, i + 1), self.dtype) for i in flat.tolist()]
            rows = torch.cat(one) if len(one) > 1 else one[0]
        else:
            rows = dequantize(self.embed_q.take(flat), self.dtype)
        return rows.view(*ids.shape, rows.shape[-1])

    def _step_pointers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per layer the 12 addresses `gpuwise_decode_step` reads (the cache's two filled in at each step) and the
        norms' epsilons; None where the kernel library cannot run this model's decode steps (no kernel, a dtype
        or head dim it does not take, a weight it does not hold plainly or in one block format)."""
        if self.attention is None or self.dtype not in attention.DTYPES or self.head_dim > 256:
            return None
        linears = self.linears()
        if len({_format(x) for x in linears}) != 1:
            return None
        for x in [*linears, self.head]:
            if x.kernel is None:
                return None
            if x.quant is None and (x.weight is None or x.weight.stride() != (x.weight.shape[1], 1)):
                return None
            if x.bias is not None and (not x.bias.is_contiguous() or x.bias.dtype != self.dtype):
                return None
        rows = []
        for layer in self.layers:
            row = [layer.norm1[0]]
            for x in (layer.qkv, layer.o):
                row += [_held(x), x.bias]
            row.append(layer.norm2[0])
            for x in (layer.gate_up, layer.down):
                row += [_held(x), x.bias]
            rows.append([0 if t is None else t.data_ptr() for t in row] + [0, 0])
        eps = [e for layer in self.layers for e in (layer.norm1[1], layer.norm2[1])]
        self.step_formats = (_format(linears[0]), _format(self.head))
        return torch.tensor(rows, dtype=torch.int64), torch.tensor(eps, dtype=torch.float32)

    def _rotary_rows(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding's cos and sin [n, head_dim] at positions `pos` [n], in x's dtype: rows of a table
        made once (and doubled as positions grow) where the rope's frequencies are fixed, for a step's few rows
        (rather than the module's call, a dozen tensor ops a step); each row is the module's at that position bitwise
        (a position's angles are one product each: tests/test_decoder.py holds the step to the forward)."""
        if getattr(self.rotary, "rope_type", None) not in STATIC_ROPE:
            cos, sin = self.rotary(x.unsqueeze(1), pos.reshape(-1, 1))
            return cos.reshape(pos.numel(), -1).contiguous(), sin.reshape(pos.numel(), -1).contiguous()
        need = int(pos.max()) + 1
        if self._rope is None or self._rope[0].shape[0] < need or self._rope[0].dtype != x.dtype:
            size = max(need, 256, 2 * (0 if self._rope is None else self._rope[0].shape[0]))
            cos, sin = self.rotary(x[:1].unsqueeze(1), torch.arange(size).unsqueeze(0))
            self._rope = (cos[0].contiguous(), sin[0].contiguous())
        return self._rope[0][pos], self._rope[1][pos]

    def _decode_step(self, part: Part, cache) -> torch.Tensor | None:
        """One decode step of part's rows (one token each, no adapter) in one call of the kernel library: the
        logits [n, vocab] in fp32, or None where the kernel refused it (its Python forward serves from now on)."""
        assert self.step is not None and self.attention is not None
        ptrs, eps = self.step
        n, D = part.ids.shape[0], self.head_dim
        x = self._embed(part.ids.reshape(-1)).contiguous()  # [n, hidden]
        cos, sin = self._rotary_rows(x, part.pos.reshape(-1))
        keys, values, table = cache.keys, cache.values, part.table
        if not (keys.is_contiguous() and values.is_contiguous() and keys.shape == values.shape):
            return None
        if not (table.dtype == torch.int64 and table.is_contiguous() and table.shape[0] == n):
            return None
        size = keys.element_size()
        ptrs[:, 10] = keys.data_ptr() + torch.arange(len(self.layers)) * keys.stride(0) * size
        ptrs[:, 11] = values.data_ptr() + torch.arange(len(self.layers)) * values.stride(0) * size
        pos = part.pos.reshape(-1).contiguous()
        head = _held(self.head)
        logits = torch.empty((n, self.vocab_out), dtype=x.dtype)
        blocks = (table.data_ptr(), table.shape[1], keys.shape[2])  # the tables, their width, the block size
        args = (x.data_ptr(), cos.data_ptr(), sin.data_ptr(), pos.data_ptr(), *blocks, ptrs.data_ptr())
        final = (self.norm[0].data_ptr(), self.norm[1], head.data_ptr())
        shape = (n, x.shape[1], self.heads, self.kv_heads, D, self.inner)
        strides = (keys.stride(1), keys.stride(2), keys.stride(3))  # a block, a position, a key/value head
        rc = self.attention.step_fn(
            attention.DTYPES[x.dtype], *self.step_formats, *args, eps.data_ptr(), len(self.layers), *final,
            logits.data_ptr(),
            *shape, logits.shape[1], *strides, serving.ONE_STREAM_THREADS if n == 1 else 0,
        )  # fmt: skip
        if rc:
            log.warning("the decode step kernel refused a step: serving its steps with the Python forward")
            self.step = None
            return None
        return logits.float()

    def _drop_kernel(self, error: Exception) -> None:
        """The decode kernel failed a call (its own shape check, or anything it raised): this decoder serves with
        SDPA from now on, and says so in one log line, where the error used to end `serve`."""
        log.warning("the decode attention kernel failed (%s): serving with SDPA", str(error).splitlines()[0])
        self.attention, self.why = None, f"SDPA (the kernel failed: {error})"

    def packed(self) -> tuple[int, int]:
        """(products packed, bytes packing added: MKL's packed copies, or for oneDNN the tied output layer's
        weight and the plain weights kept for the decode product kernel, held twice)."""
        linears = [x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.head]
        n = sum(x.packed is not None for x in linears)
        added = sum(x.packed.added for x in linears if x.packed is not None)
        # oneDNN's copy beside a plain weight kept for the decode product kernel: held twice
        added += sum(
            x.weight.numel() * x.weight.element_size()
            for x in linears
            if x.packed is not None and x.packed.kind == ONEDNN and x.weight is not None and x is not self.head
        )
        if self.head.packed is not None and self.head.packed.kind == ONEDNN and self.tied and self.embed is not None:
            added += self.embed.numel() * self.embed.element_size()
        return n, added

    def release(self, model) -> None:
        """Once packed copies serve every product alone (oneDNN's), drop the model's plain weights of the same
        layers (an output layer tied to the embedding stays: the embedding reads it; LoRA's matrices stay); so too
        once the plain weights left are laid out four rows at a time, which transformers' modules no longer read."""
        if any(x.weight is not None and not x.x4 for x in self.linears()):
            return
        model = model.get_base_model() if self.adapters else model
        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for n in PROJECTIONS:
                    module = getattr(parent, n, None)
                    if module is None:
                        continue
                    if hasattr(module, "base_layer"):
                        module.base_layer = Moved()
                    else:
                        setattr(parent, n, Moved())
        if self.head.weight is not None and not self.head.x4:
            return
        if not self.tied:
            model.lm_head = Moved()
        elif self.embed is None or self.embed_x4:  # the embedding is the output layer now: held there alone
            model.lm_head = Moved()
            model.model.embed_tokens = Moved()

    def check(self, model, length: int = 16) -> float:
        """How far this forward is from transformers' own (peft's, with adapters) on one prompt of `length`
        tokens, a prefill of all but the last then one decode step, for the base and every adapter: the
        largest |difference| of the logits over the largest |logit|."""
        device, dtype = self.device, self.dtype
        ids = (torch.arange(length, device=device) * 7919 + 11).remainder(self.vocab).unsqueeze(0)
        pos = torch.arange(length, device=device).unsqueeze(0)
        causal = pos.view(1, 1, length, 1) >= pos.view(1, 1, 1, length)
        offs = []
        for adapter in [None, *sorted(self.adapters)]:
            kw = {"adapter_names": [adapter or "__base__"]} if self.adapters else {}
            with torch.inference_mode():
                theirs = model(input_ids=ids, use_cache=False, **kw).logits[0, -2:].float()
                cache = PagedCache.for_rows(model.config, 1, dtype, device, context=length)
                cache.bind(cache.row_table, pos[:, :-1], length - 1)
                first = self(ids[:, :-1], pos[:, :-1], additive_mask(causal[:, :, :-1, :-1], dtype), cache, [adapter])
                cache.bind(cache.row_table, pos[:, -1:], length)
                step = self(ids[:, -1:], pos[:, -1:], additive_mask(causal[:, :, -1:], dtype), cache, [adapter])
            ours = torch.cat([first, step])
            offs.append((ours - theirs).abs().max() / theirs.abs().max())
        return float(torch.stack(offs).max())  # a nan anywhere is the answer: torch's max keeps it

    def _groups(self, adapters: list[str | None] | None, n: int) -> Groups:
        """Which rows each adapter updates: None for all of them (one adapter for the whole batch)."""
        names = [a for a in adapters or [] if a is not None and a in self.adapters]
        if not names:
            return ()
        if len(names) == n and len(set(names)) == 1:
            return ((names[0], None),)
        assert adapters is not None
        return tuple(
            (name, torch.tensor([i for i, a in enumerate(adapters) if a == name], device=self.device))
            for name in sorted(set(names))
        )

    def __call__(
        self, ids: torch.Tensor, pos: torch.Tensor, bias: torch.Tensor, cache, adapters: list[str | None] | None = None
    ) -> torch.Tensor:
        """ids, pos: [n, q]; bias: [n, 1, q, length] additive, and at q == 1 causal (row i sees stored positions
        0 .. pos[i], as the engine builds it: the decode kernel takes pos + 1 as each row's length instead);
        `cache` bound to these rows' tables and positions; `adapters`: each row's LoRA adapter (None: the base)."""
        n = ids.shape[0]
        return self.run([Part(ids, pos, bias, cache.table, cache.length, adapters or [None] * n)], cache)[0]

    def run(self, parts: list[Part], cache, every: bool = False) -> list[torch.Tensor]:
        """One forward pass over several groups of rows, each with its own width, positions and mask (the
        decode step's rows, one token each, and the rows of prompts being prefilled, a chunk each): their tokens
        go through every matmul together, so the weights are read once for all (a pass at a few tokens is bound
        by that read: docs/serving.md), and each group attends over its own rows of `cache`. The logits of each
        row's last column, [rows, vocab] in fp32, per group; `every` (one group): every column's, [rows, q, vocab]
        (benchmarks/quant_quality.py scores a text with them)."""
        H, K, D = self.heads, self.kv_heads, self.head_dim
        for part in parts:  # once a pass: the kernels read and write where they are told
            _check_bounds(part, cache)
        if self.step is not None and len(parts) == 1 and parts[0].ids.shape[1] == 1 and not every:
            part = parts[0]
            if part.ids.shape[0] <= GEMV_ROWS and all(a is None or a not in self.adapters for a in part.adapters):
                logits = self._decode_step(part, cache)
                if logits is not None:
                    return [logits]
        sizes = [part.ids.numel() for part in parts]
        x = _cat([self._embed(part.ids.reshape(-1, 1)) for part in parts])  # [tokens, 1, hidden]
        cos, sin = self.rotary(x, _cat([part.pos.reshape(-1, 1) for part in parts]))  # [tokens, 1, D]
        groups = self._groups([a for part in parts for a in part.adapters for _ in range(part.ids.shape[1])], len(x))
        kernel = self.attention
        # each group's slots written and read in a layer's flat view of the cache, and (one token a row) lengths,
        # once for every layer
        where = []
        for part in parts:
            n, q = part.ids.shape
            lens = part.pos[:, 0] + 1 if q == 1 else None
            reads = torch.arange(part.length, device=x.device).expand(n, part.length)
            where.append((cache.slots(part.table, part.pos), cache.slots(part.table, reads), lens))
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(_rms(x, layer.norm1), groups).view(len(x), H + 2 * K, D)
            qk = qkv[:, : H + K]
            half = D // 2
            rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = qk * cos + rotated * sin
            outs, start = [], 0
            for part, size, at in zip(parts, sizes, where, strict=True):
                n, q = part.ids.shape
                mine = slice(start, start + size) if len(parts) > 1 else slice(None)  # one group: no slicing
                v = qkv[mine, H + K :].view(n, q, K, D)
                out, kernel = self._attend(i, part, at, qk[mine].view(n, q, H + K, D), v, cache, kernel)
                outs.append(out.view(size, 1, H * D))
                start += size
            x = x + layer.o(_cat(outs), groups)
            gate, up = layer.gate_up(_rms(x, layer.norm2), groups).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up, groups)
        if len(parts) == 1:  # a step of one group (most steps): its rows' last columns as a view
            n, q = parts[0].ids.shape
            if every:
                return [self.head(_rms(x.view(n, q, -1), self.norm)).float()]
            return [self.head(_rms(x.view(n, q, -1)[:, -1], self.norm)).float()]
        last, start = [], 0
        for part, size in zip(parts, sizes, strict=True):
            last.append(torch.arange(start + part.ids.shape[1] - 1, start + size, part.ids.shape[1]))
            start += size
        logits = self.head(_rms(x[torch.cat(last).to(x.device), 0], self.norm)).float()
        return list(logits.split([part.ids.shape[0] for part in parts]))

    def _attend(self, i: int, part: Part, at: tuple, qk: torch.Tensor, v: torch.Tensor, cache, kernel):
        """Layer i's attention for one group of rows: its keys and values stored, then read back for its rows.
        at: its (slots written, slots read, lengths); qk: [n, q, H + K, D] (rotated); v: [n, q, K, D]. The output
        [n, q, H * D], and the kernel still in use."""
        H, K, D = self.heads, self.kv_heads, self.head_dim
        n, q = part.ids.shape
        (write, read, lens), length = at, part.length
        k_cache, v_cache = cache.flat(i)
        k_cache[write] = qk[:, :, H:]
        v_cache[write] = v
        if q == 1 and kernel is not None:  # through the block tables, nothing gathered
            try:
                out = kernel(qk[:, 0, :H], cache.keys[i], cache.values[i], lens, part.table)
                return out.view(n, 1, H * D), kernel
            except (ValueError, RuntimeError) as e:  # the kernel refused this call: SDPA from here on
                self._drop_kernel(e)
                kernel = None
        keys, values = k_cache[read], v_cache[read]  # [n, length, K, D], gathered from the rows' blocks
        if q == 1 and H != K:  # one query: its H heads become H/K queries of each key/value head
            query = qk[:, 0, :H].reshape(n, K, H // K, D)
            out = F.scaled_dot_product_attention(
                query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=part.bias
            )
            return out.reshape(n, 1, H * D), kernel
        if H != K:
            # A prompt's chunk: the G = H/K heads that share a key/value head become G x q queries of it, the
            # mask repeated G times, rather than SDPA's enable_gqa, which expands the keys and values G times
            G = H // K
            query = qk[:, :, :H].reshape(n, q, K, G, D).permute(0, 2, 3, 1, 4).reshape(n, K, G * q, D)
            mask = part.bias.unsqueeze(2).expand(n, 1, G, q, length).reshape(n, 1, G * q, length)
            out = F.scaled_dot_product_attention(query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask)
            return out.view(n, K, G, q, D).permute(0, 3, 1, 2, 4).reshape(n, q, H * D), kernel
        query = qk[:, :, :H].transpose(1, 2)
        out = F.scaled_dot_product_attention(query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=part.bias)
        return out.transpose(1, 2).reshape(n, q, H * D), kernel
