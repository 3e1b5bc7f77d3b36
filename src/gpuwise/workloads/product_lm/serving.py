"""A finished product-lm run loaded back: for `predict` (prompts continued) and `serve` (the OpenAI API)."""

from __future__ import annotations

from pathlib import Path

from gpuwise.errors import GpuwiseError
from gpuwise.workloads.pretrained import SCRATCH, quiet_transformers, resolve_base
from gpuwise.workloads.product_lm.recipe import ProductLMRecipe
from gpuwise.workloads.product_lm.training import generate


def load_trained(run_dir: Path, cfg):
    """(model, tokenizer) of a finished run: model/ after full fine-tuning, else base + adapter/."""
    quiet_transformers()
    if cfg.method != "full" and cfg.base not in (None, SCRATCH):
        resolve_base(cfg.base)  # the adapter names its base's converted directory: converted again if gone
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.method == "full":
        source = run_dir / "model"
        # safetensors only: a pytorch_model.bin planted beside it is a pickle, and is never read
        model = AutoModelForCausalLM.from_pretrained(str(source), use_safetensors=True)
    else:
        from peft import AutoPeftModelForCausalLM

        source = run_dir / "adapter"
        model = AutoPeftModelForCausalLM.from_pretrained(str(source))
    return model, AutoTokenizer.from_pretrained(str(source))


def predict(run_dir: Path, cfg, inputs: list[str], recipe: ProductLMRecipe, max_tokens: int = 40) -> list[dict]:
    """Each prompt continued by the run's model, sampled as the recipe says; refused past its context."""
    model, tok = load_trained(run_dir, cfg)
    context = getattr(model.config, "max_position_embeddings", None)
    longest = max(len(tok(p)["input_ids"]) for p in inputs)
    if context and longest + max_tokens > context:
        raise GpuwiseError(f"a prompt of {longest} tokens + --max-tokens {max_tokens} exceeds the context of {context}")
    texts = generate(model, tok, inputs, max_tokens, "cpu", recipe.top_p, recipe.temperature, seed=cfg.seed)
    return [{"prompt": p, "text": t} for p, t in zip(inputs, texts, strict=True)]
