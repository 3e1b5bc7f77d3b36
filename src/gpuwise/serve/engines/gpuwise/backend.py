"""gpuwise's own engine behind the OpenAI front: one `GpuwiseBackend` per loaded base (with the LoRA adapters that
share it), its weights cast and packed, its forward fused where the model allows, and its continuous-batching
`Engine` sized by the serving plan (plan/serving.py)."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.devices import free_memory
from gpuwise.plan.memory import BYTES, served_weight_bytes, weight_bytes
from gpuwise.plan.request import PlanRequest
from gpuwise.plan.serving import KV_BLOCK, ServingPlan, plan_server, usable_bytes
from gpuwise.serve.engines.base import EngineStats
from gpuwise.serve.engines.gpuwise.decoder import NotQuantizable, fused_decoder
from gpuwise.serve.engines.gpuwise.engine import Engine, release_freed_memory
from gpuwise.serve.engines.gpuwise.packed import MKL, ONEDNN, mkl_fits, pack_linears, packing
from gpuwise.serve.engines.gpuwise.quant import QUANTIZED, gguf_blocks
from gpuwise.workloads.pretrained import spec_of
from gpuwise.workloads.serving import Limits

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WHY = "gpuwise's own continuous-batching engine"  # the engine line where nobody chose it (a run, `gpuwise chat`)


class GpuwiseBackend:
    """One loaded model (a base, with the LoRA adapters that share it), its tokenizer, and its engine."""

    def __init__(
        self, model, tok, limits: Limits, dtype: str, device: str, stats: EngineStats | None = None,
        weights: str = "auto", gguf: Path | None = None,
    ):  # fmt: skip
        self.tok, self.precision = tok, dtype
        self.weights = weights if weights in QUANTIZED else dtype
        torch_dtype = TORCH_DTYPES[dtype]
        self.model = model.to(device, torch_dtype).eval()
        free = free_memory(device)
        # on a CPU the weights are packed once for oneDNN (bf16, fp32; MKL for fp32 where oneDNN is missing)
        self.pack, self.pack_note = packing(device, torch_dtype), ""
        if self.pack == MKL:
            fits, self.pack_note = mkl_fits(self.model, usable_bytes(free, device))
            self.pack = self.pack if fits else None
        try:
            shipped = gguf_blocks(gguf) if gguf is not None and self.weights in QUANTIZED else None
            self.decoder, self.forward_note = fused_decoder(self.model, self.pack, self.weights, shipped)
        except NotQuantizable as e:
            raise GpuwiseError(str(e)) from None
        if self.weights in QUANTIZED:
            gc.collect()  # the plain weights just dropped: what is free now sizes the KV cache
            release_freed_memory()
            free = free_memory(device)
        if self.decoder is not None:
            self.packed, self.packed_bytes = self.decoder.packed()
        else:
            self.packed, self.packed_bytes = pack_linears(self.model, self.pack) if self.pack else (0, 0)
        # the prefix cache, full, comes out of the same memory as the running sequences' cache
        self.serving: ServingPlan = plan_server(
            model.config,
            torch_dtype.itemsize,
            limits.max_seqs,
            limits.max_model_len,
            limits.prefix_cache_tokens,
            free,
            device,
            separate_prefix=True,
        )
        self.engine = Engine(
            self.model,
            tok,
            max_seqs=self.serving.slots,
            kv_budget_tokens=self.serving.kv_budget,
            max_queue=limits.max_queue,
            context=self.serving.context,
            stats=stats,
            decoder=self.decoder,
            prefix_tokens=self.serving.prefix_tokens,
        )

    @property
    def context(self) -> int:
        return self.serving.context

    def close(self) -> None:
        self.engine.close()

    def plan(self) -> str:
        """What `gpuwise plan` counts for this model here, and so how many sequences the engine admits."""
        precision = "bf16" if self.precision == "fp16" else self.precision  # the planner's 2-byte name
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        spec = spec_of(base)
        if self.weights in QUANTIZED:
            weights = served_weight_bytes(spec, self.weights)
        else:
            weights = weight_bytes(spec, PlanRequest(task="inference", batch=1, seq=1, gen=0, precision=precision))
        plan = self.serving
        prefix = self.engine.prefixes
        held = self.decoder.held_bytes() if self.decoder is not None else None
        label = f"{self.weights} weights, {precision} KV" if self.weights in QUANTIZED else precision
        return (
            f"plan ({label}, gpuwise plan's formulas): weights {weights / 1e9:.2f} GB"
            + (f" (held: {held / 1e9:.3f} GB, measured)" if held is not None else "")
            + ", KV cache "
            f"{plan.kv_bytes_per_token / 1024:.1f} KiB per token ({BYTES[precision]} bytes x 2 x layers x KV heads x "
            f"head dim); budget {plan.kv_budget:,} tokens ({plan.source}) in {plan.kv_blocks:,} blocks of {KV_BLOCK}, "
            f"{plan.kv_budget * plan.kv_bytes_per_token / 1e9:.2f} GB at most, resident as blocks are held: "
            f"up to {plan.slots} sequences at once, "
            f"{plan.at_full_context:,} of them at the full context of {plan.context:,}"
            + f"; forward: {self.forward_note}"
            + (
                f"; prefix cache {prefix.tokens:,} prompt tokens "
                f"({prefix.tokens * plan.kv_bytes_per_token / 1e6:.0f} MB at most)"
                if prefix
                else ""
            )
            + self._packing()
        )

    def _packing(self) -> str:
        if not self.packed:
            return f"; not packed: {self.pack_note}" if self.pack_note else ""
        held = {ONEDNN: "tied weights held twice", MKL: "packed copies beside the plain weights"}
        extra = f" (+{self.packed_bytes / 1e6:.0f} MB: {held[self.pack or '']})" if self.packed_bytes else ""
        return f"; {self.packed} weight matrices packed for {self.pack}{extra}"


def gpuwise_backends(
    groups: list, limits: Limits, dtype: str, device: str, weights: str = "auto", gguf: Path | None = None
) -> list:
    """[(GpuwiseBackend, [(model id, adapter)])] for (model, tokenizer, [(model id, adapter)]) groups: an adapter
    name picks a LoRA adapter loaded into that (peft) model, None the base itself. The adapters of one base share
    its weights and its running batch: each row of a step runs its own adapter (peft's mixed-adapter batches),
    as vLLM serves LoRA modules."""
    return [
        (GpuwiseBackend(model, tok, limits, dtype, device, weights=weights, gguf=gguf), names)
        for model, tok, names in groups
    ]
