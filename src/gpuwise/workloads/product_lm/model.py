"""product-lm's model: the base (scratch, a named base, a GGUF file, a directory or a hub id) and its
tokenizer, the LoRA / QLoRA adapter around it, and the merge of an adapter into its base."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.hardware.devices import bf16_native
from gpuwise.workloads.pretrained import SCRATCH, resolve_base
from gpuwise.workloads.product_lm.data import train_tokenizer
from gpuwise.workloads.product_lm.recipe import ProductLMRecipe


def load_tokenizer(cfg, texts: list[str], recipe: ProductLMRecipe):
    """The base's tokenizer, checked against the model it is for; for scratch, one trained on `texts`."""
    if cfg.base == SCRATCH:
        return train_tokenizer(texts, recipe.scratch_vocab)
    from transformers import AutoConfig, AutoTokenizer

    source = resolve_base(cfg.base)  # hashes a GGUF file: once here; its errors are one line already
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except Exception as e:  # noqa: BLE001 - a broken config.json raises anything from TypeError to KeyError
        raise GpuwiseError(f"--base {cfg.base}: cannot load its tokenizer ({first_line(e)})") from None
    if tok.eos_token_id is None:
        raise GpuwiseError(f"--base {cfg.base}: its tokenizer has no end-of-text token")
    # A tokenizer from another model indexes past the embedding: an IndexError mid-step, after the run began.
    embedded = getattr(AutoConfig.from_pretrained(source), "vocab_size", None)
    if embedded is not None and len(tok) > embedded:
        raise GpuwiseError(
            f"--base {cfg.base}: its tokenizer has {len(tok)} tokens but the model embeds {embedded}: "
            "the tokenizer belongs to another model"
        )
    tok.pad_token = tok.pad_token or tok.eos_token
    return tok


def load_base(cfg, tok, run_dir: Path, recipe: ProductLMRecipe):
    """The model --base names, quantized to NF4 for --method qlora; for scratch, the recipe's small Llama."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if cfg.base == SCRATCH:
        model = scratch_model(cfg, tok, recipe)
        if cfg.method == "full":
            return model
        source = str(save_scratch(model, tok, run_dir))
    else:
        source = resolve_base(cfg.base)
    kwargs = {}
    if cfg.method == "qlora":
        compute = torch.bfloat16 if bf16_native() else torch.float32
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute
        )
    try:
        return AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except Exception as e:  # noqa: BLE001 - a broken config.json raises anything from TypeError to KeyError
        raise GpuwiseError(f"--base {source}: cannot load a causal LM ({first_line(e)})") from None


def plan_base(cfg, tok, recipe: ProductLMRecipe):
    """The model `load_base` loads, with its shapes and dtypes and no weights, built from its config: call it
    on the meta device (`gpuwise launch` plans a job on it). For --method qlora its linear layers are marked
    with the bytes bitsandbytes stores them in (NF4: half a byte a weight), which the memory plan counts."""
    if cfg.base == SCRATCH:
        return scratch_model(cfg, tok, recipe)
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_base(cfg.base)))
    except Exception as e:  # noqa: BLE001 - a broken config.json raises anything from TypeError to KeyError
        raise GpuwiseError(f"--base {cfg.base}: cannot build a causal LM from its config ({first_line(e)})") from None
    if cfg.method == "qlora":
        head = model.get_output_embeddings()
        for module in model.modules():  # as transformers quantizes: every linear layer but the output layer
            if isinstance(module, torch.nn.Linear) and module is not head:
                module.weight.requires_grad_(False)
                module.weight.stored_bytes = (module.weight.numel() + 1) // 2  # type: ignore[attr-defined]
    return model


def scratch_model(cfg, tok, recipe: ProductLMRecipe):
    """A fresh small Llama sized to the tokenizer, with the recipe's shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tok),
        max_position_embeddings=max(512, cfg.block_size),
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        **recipe.scratch_model,
    )
    return LlamaForCausalLM(config)


def save_scratch(model, tok, run_dir: Path) -> Path:
    """RUN/base: an adapter needs its base on disk (to reload it), and 4-bit quantization goes through
    from_pretrained, so the fresh base is saved once and loaded like any other.
    Under torchrun the first process writes it (to a temp name, then renamed: a crash leaves no
    half-written base) and the others wait; transformers saves from that process only anyway."""
    saved = run_dir / "base"
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not saved.exists() and (not distributed or torch.distributed.get_rank() == 0):
        tmp = run_dir / ".base-tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.rename(tmp, saved)
    if distributed:
        torch.distributed.barrier()
    return saved


def keep_4bit_trainable(model) -> None:
    """bitsandbytes repacks a Linear4bit's weights for its CPU inference kernel the first time it runs in
    eval mode without gradients (our perplexity-before evaluation), and from then on calls that kernel,
    which has no backward: gradients stop flowing through the frozen base to the earlier adapters.
    Turning the repacking off keeps the differentiable dequantize-and-matmul path (a regression test
    compares gradients before and after an evaluation). It also takes a base of any shape: the repacking
    asserts that every layer's output width is a multiple of 32 (bitsandbytes 0.50), the general path pads.
    Only CPUs with AVX512-BF16 repack; the test pretends to have one."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def adapt(model, cfg, recipe: ProductLMRecipe):
    """The model to train: the base itself for --method full, else a LoRA adapter on every linear layer
    (over the NF4 base, prepared for k-bit training, for qlora)."""
    if cfg.method == "full":
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if cfg.method == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        keep_4bit_trainable(model)
    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=recipe.lora_alpha_per_rank * cfg.lora_rank,
        lora_dropout=recipe.lora_dropout,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def merge(adapter_dir: Path, target: Path, tok) -> str:
    """Fold the adapter into an unquantized copy of its base (QLoRA's NF4 base is reloaded in full
    precision: merging into 4-bit weights would round the update away)."""
    from peft import AutoPeftModelForCausalLM

    merged = AutoPeftModelForCausalLM.from_pretrained(str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(target))
    tok.save_pretrained(str(target))
    return target.name + "/"
