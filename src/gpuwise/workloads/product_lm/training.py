"""product-lm's training: the run built from the config (data, model, defaults), its steps, its held-out
score in bits per byte, and the samples it writes before and after."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpuwise.errors import GpuwiseError
from gpuwise.workloads.base import Training
from gpuwise.workloads.pretrained import SCRATCH, fake_tensors, quiet_transformers, spec_of
from gpuwise.workloads.product_lm.data import Sample, as_text, encode, load_texts, pack, sample_prompts
from gpuwise.workloads.product_lm.model import adapt, load_base, load_tokenizer, merge, plan_base
from gpuwise.workloads.product_lm.recipe import ProductLMRecipe


def build(cfg, run_dir: Path, recipe: ProductLMRecipe, planning: bool = False) -> Training:
    """The run a resolved config (base and method set) describes; the config is only read. `planning`: its
    model on fake tensors, from the base's config (`gpuwise launch`: no weights are downloaded or loaded)."""
    quiet_transformers()
    if cfg.merge and cfg.method == "full":
        raise GpuwiseError("--merge folds a LoRA/QLoRA adapter into its base: it needs --method lora or qlora")
    train_samples, test_samples, source = load_texts(cfg.data, cfg.seed)
    if cfg.data is None:
        test_samples = test_samples[: recipe.eval_texts]
    tok = load_tokenizer(cfg, [text for _, text in train_samples], recipe)
    blocks, labels = pack(train_samples, tok, cfg.block_size)
    run_dir.mkdir(parents=True, exist_ok=True)
    if planning:  # built on the meta device (peft's adapters too), then made fake tensors one step can run on
        with torch.device("meta"):
            base = plan_base(cfg, tok, recipe)
            model = fake_tensors(adapt(base, cfg, recipe))
    else:
        base = load_base(cfg, tok, run_dir, recipe)
        model = adapt(base, cfg, recipe)
    spec = spec_of(base, "product-lm")
    context = min(getattr(base.config, "max_position_embeddings", 512), recipe.eval_context)
    steps = FineTune(
        tok, blocks, labels, test_samples, sample_prompts(tok), context, cfg.method, cfg.merge, cfg.seed, recipe
    )
    chat = as_text(train_samples[0], tok) != train_samples[0][1]
    info = {
        "data": source + (", as chats (the user asks for a review, the model writes it)" if chat else ""),
        "train_texts": len(train_samples),
        "test_texts": len(test_samples),
        "train_tokens": int(blocks.numel()),
        "trained_on_tokens": int((labels != -100).sum()),  # the rest is chat template and request
        **describe_model(cfg, spec, model),
    }
    return Training(
        "product-lm",
        model,
        len(blocks),
        steps.make_batch,
        steps.loss,
        steps.evaluate,
        steps.save,
        defaults=defaults(cfg, recipe, len(blocks)),
        baseline={},
        tokens_per_sample=cfg.block_size,
        model_spec=spec,
        info=info,
        eval_before=True,
    )


def describe_model(cfg, spec, model) -> dict[str, Any]:
    """The summary's lines on the base, the method and how much of the model trains."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    size = f"{spec.params / 1e6:.1f} M parameters"
    scratch = f"small Llama from a config ({size}), BPE tokenizer trained here"
    return {
        "base": scratch if cfg.base == SCRATCH else f"{cfg.base} ({size})",
        "method": cfg.method,
        "trainable_params": trainable,
        "total_params": total,
        "trainable_share": trainable / total,
    }


def defaults(cfg, recipe: ProductLMRecipe, blocks: int) -> dict[str, Any]:
    """epochs, batch_size and lr where the flags leave them: one epoch for scratch; for a pretrained base,
    the recipe's steps at the batch size the run will take."""
    scratch = cfg.base == SCRATCH
    lr = recipe.lr(scratch, cfg.method)
    if scratch:
        return {"epochs": 1, "batch_size": recipe.scratch_batch_size, "lr": lr}
    batch = cfg.batch_size or recipe.batch_size
    return {"epochs": recipe.default_steps * batch / blocks, "batch_size": recipe.batch_size, "lr": lr}


@dataclass(frozen=True)
class FineTune:
    """A run's steps, scoring and saving, whose bound methods `Training` takes: what `build` loaded, read
    and never changed."""

    tok: Any
    blocks: torch.Tensor  # [blocks, block_size] token ids
    labels: torch.Tensor  # the same, context at -100
    test: list[Sample]
    prompts: list[str]  # continued before and after, as samples of what the model writes
    context: int  # tokens of a held-out text scored at most
    method: str
    merge: bool
    seed: int
    recipe: ProductLMRecipe

    def make_batch(self, indices, epoch: int) -> dict:
        rows = list(indices)
        return {"input_ids": self.blocks[rows], "labels": self.labels[rows]}

    def loss(self, model, batch: dict):
        return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.float()

    @torch.no_grad()
    def evaluate(self, model, device) -> dict:
        model.eval()
        nats, tokens, n_bytes = score_texts(model, self.tok, self.test, device, self.context)
        model.train()
        raw = model.module if hasattr(model, "module") else model
        r = self.recipe
        samples = generate(raw, self.tok, self.prompts, r.sample_tokens, device, r.top_p, r.temperature, self.seed)
        return {
            "bits_per_byte": nats / math.log(2) / n_bytes,
            "perplexity": math.exp(nats / tokens),
            "eval_tokens": tokens,
            "samples": samples,
        }

    def save(self, model, run_dir: Path) -> list[str]:
        target = run_dir / ("model" if self.method == "full" else "adapter")
        model.save_pretrained(str(target))
        self.tok.save_pretrained(str(target))
        if self.merge:
            return [target.name + "/", merge(target, run_dir / "model", self.tok)]
        return [target.name + "/"]


@torch.no_grad()
def generate(
    model, tok, prompts, max_tokens: int, device, top_p: float, temperature: float, seed: int = 0, batch: int = 16
) -> list[str]:
    """Each prompt continued by sampling (top-p, temperature), `batch` prompts at a time: decoding is bound
    by reading the weights once per step (QLoRA also dequantizes them each step), so two prompts cost about
    what one does. Left-padded, as a decoder-only model must be to continue every row from its last token."""
    model.eval()
    torch.manual_seed(seed)
    side, pad = tok.padding_side, tok.pad_token
    tok.padding_side = "left"
    if tok.pad_token is None:  # scratch and most chat tokenizers have none; its positions are masked out
        tok.pad_token = tok.eos_token
    out = []
    try:
        for start in range(0, len(prompts), batch):
            inputs = tok(list(prompts[start : start + batch]), return_tensors="pt", padding=True).to(device)
            gen = model.generate(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                max_new_tokens=max_tokens,
                do_sample=True,
                top_p=top_p,
                temperature=temperature,
                pad_token_id=tok.pad_token_id,
            )
            width = inputs["input_ids"].shape[1]
            out += [
                tok.decode(ids[width - int(mask.sum()) :], skip_special_tokens=True)
                for ids, mask in zip(gen, inputs["attention_mask"], strict=True)
            ]
    finally:
        tok.padding_side, tok.pad_token = side, pad
    model.train()
    return out


@torch.no_grad()
def score_texts(model, tok, samples: list[Sample], device, context: int, batch: int = 8) -> tuple[float, int, int]:
    """(nats, tokens, bytes) of the held-out texts the model writes: for a chat, the assistant's answer given
    the request (the request's tokens are not scored, nor its bytes counted); for plain text, every token
    after the first. Bits per byte, nats / ln 2 / bytes, compare across tokenizers; perplexity does not."""
    rows = []
    for sample in samples:
        full, start = encode(sample, tok)
        full = full[:context]
        rows.append((full, min(max(start, 1), len(full) - 1)))  # the first token has nothing to be predicted from
    rows.sort(key=lambda r: len(r[0]))  # batches of like lengths: little padding
    nats, tokens, n_bytes = 0.0, 0, 0
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        for r, (row, _) in enumerate(chunk):
            ids[r, : len(row)] = torch.tensor(row)
        # Padded on the right and attention is causal: no real token sees a pad, so no mask is needed, and
        # without one torch takes its fused causal attention (a mask sends it down a slower path).
        logits = model(input_ids=ids.to(device)).logits
        targets = ids.to(device)
        for r, (row, start) in enumerate(chunk):
            # the scored tokens are start .. len(row) - 1, predicted at positions start - 1 .. len(row) - 2;
            # row by row, the log-softmax covers only these (over the batch, 8 x 1024 x 49k fp32 logits are
            # 1.6 GB, and every copy of them as much again)
            scored = logits[r, start - 1 : len(row) - 1].float()
            nats += float(torch.nn.functional.cross_entropy(scored, targets[r, start : len(row)], reduction="sum"))
            tokens += len(row) - start
            n_bytes += len(tok.decode(row[start:], skip_special_tokens=True).encode("utf-8"))
    return nats, tokens, max(n_bytes, 1)
