"""The levers of product-lm: what a run trains for and how it is scored, in one frozen object.

The defaults are what `gpuwise train product-lm` runs; docs/quality.md and docs/train.md give the
figures they were chosen by. A variant is `ProductLM(dataclasses.replace(RECIPE, default_steps=120))`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

DEFAULT_BASE = "smollm2-135m-instruct"


def _small_llama() -> Mapping[str, Any]:
    return MappingProxyType(
        dict(
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=True,
        )
    )


@dataclass(frozen=True)
class ProductLMRecipe:
    """How product-lm trains, by default and per method. Read by the workload, never changed by it."""

    # The base when --base is not given (a named base, a GGUF file or a directory, as --base takes).
    base: str = DEFAULT_BASE
    # A pretrained base: the default run is this many steps at this batch size (--epochs, --max-steps and
    # --batch-size override them): a run of minutes on a CPU (docs/train.md).
    default_steps: int = 60
    batch_size: int = 8
    # Held-out reviews scored before and after (the first of the built-in test split; your data: all of its
    # held-out tenth): enough to compare, few enough to score in minutes on a CPU.
    eval_texts: int = 100
    # Learning rates on a pretrained base: every weight at an adapter's rate wrecks the model.
    lr_full: float = 1e-4
    lr_adapter: float = 2e-3
    # The scratch Llama: one epoch over the data, its own batch and rates.
    scratch_batch_size: int = 16
    scratch_lr_full: float = 3e-3
    scratch_lr_adapter: float = 1e-3
    scratch_vocab: int = 4096  # its byte-level BPE, trained on the training texts
    scratch_model: Mapping[str, Any] = field(default_factory=_small_llama)  # LlamaConfig's fields
    # LoRA (and QLoRA): alpha = this x --lora-rank, on every linear layer.
    lora_alpha_per_rank: int = 2
    lora_dropout: float = 0.0
    # Scoring reads at most this many tokens of a held-out text; the samples before and after are this long.
    eval_context: int = 1024
    sample_tokens: int = 40
    # Sampling for the samples and for `predict`.
    top_p: float = 0.9
    temperature: float = 0.8

    def lr(self, scratch: bool, method: str) -> float:
        """The default learning rate of a base (pretrained or scratch) trained by a method."""
        if scratch:
            return self.scratch_lr_full if method == "full" else self.scratch_lr_adapter
        return self.lr_full if method == "full" else self.lr_adapter


RECIPE = ProductLMRecipe()
