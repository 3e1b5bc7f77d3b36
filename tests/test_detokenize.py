"""The engine's text of a growing output (detokenize.IncrementalText) is the whole output's decode at every token:
on SmolLM2's byte-level BPE and on a Llama-style SentencePiece tokenizer (which drops a text's leading space),
for text with multi-byte characters split across tokens, spaces before punctuation, special tokens and random
ids; and it decodes a window of a few ids, not the whole output again."""

import functools
import json
import random

import pytest

from gpuwise.serve.engines.gpuwise.detokenize import IncrementalText

TEXT = (
    "Hello , world ! Café crème, naïve façade. 東京の珈琲は美味しい 🍵☕️🇯🇵 — tea & coffee...\n"
    "  two spaces, a tab\there; it's 3.14 % of $5 (really?) «quoted» 👨‍👩‍👧 end."
)


@functools.cache
def smollm2():
    from transformers import AutoTokenizer

    from gpuwise.workloads.pretrained import resolve_base

    return AutoTokenizer.from_pretrained(resolve_base("smollm2-135m-instruct"))


def sentencepiece():
    """A Llama-style tokenizer (Metaspace: a word's leading space is its first piece's "▁", dropped at a text's
    start; bytes fallback for what its vocabulary lacks), trained here on a few lines."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["Hello world, coffee and tea. " * 20, "the cat loves fresh tea " * 20], trainer)
    spec = json.loads(tok.to_str())  # the 256 byte pieces in the model's vocabulary, as Llama's (not special)
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["smollm2", "sentencepiece"])
def tok(request):
    return smollm2() if request.param == "smollm2" else sentencepiece()


def follow(tok, ids: list[int], window: int | None = 24) -> None:
    """At every id the text only grows, and wherever the whole decode ends in a whole character it is that decode;
    the ids decoded again are at most `window` (a byte-fallback tokenizer shows a run of byte ids as U+FFFD until
    the whole run is UTF-8: its window holds the run, here the family emoji's 18 bytes)."""
    inc = IncrementalText(tok)
    text = ""
    for n, token in enumerate(ids, 1):
        grown = inc.add(token)
        whole = tok.decode(ids[:n], skip_special_tokens=True)
        assert grown.startswith(text), (n, text, grown)
        assert grown == whole or whole.endswith("\ufffd"), (n, grown, whole)
        assert window is None or len(inc.ids) - inc.prefix <= window
        text = grown
    assert inc.whole() == tok.decode(ids, skip_special_tokens=True)


def test_the_text_grown_a_token_at_a_time_is_the_whole_decode(tok):
    follow(tok, tok(TEXT, add_special_tokens=False)["input_ids"])
    # special tokens in the middle, which the decode skips
    ids = tok("tea and coffee", add_special_tokens=False)["input_ids"]
    follow(tok, [*ids, tok.eos_token_id, *ids, tok.eos_token_id])


def test_any_ids_a_model_may_sample_give_the_whole_decode():
    """Half characters that never complete among them. (On a byte-fallback tokenizer a run of byte ids that is
    not UTF-8 is all U+FFFD in the whole decode, characters it held before included, so that what was streamed of
    it stays what it was: as in vLLM's detokenizer, and in this engine's before.)"""
    tok = smollm2()
    rng = random.Random(0)
    for _ in range(5):
        follow(tok, [rng.randrange(len(tok)) for _ in range(200)], window=None)


def test_each_token_decodes_a_window_not_the_output():
    """The work a token costs does not grow with the output: the ids decoded a token at 2,000 tokens out are
    as many as at 20 (a count, not a time, so that it holds on any machine)."""
    tok = smollm2()
    decoded: list[int] = []

    class Counting:
        def decode(self, ids, **kw):
            decoded.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok(TEXT * 30, add_special_tokens=False)["input_ids"][:2000]
    inc = IncrementalText(Counting())
    costs = []
    for token in ids:
        decoded.clear()
        inc.add(token)
        costs.append(sum(decoded))
    assert len(ids) == 2000 and max(costs[1000:]) <= max(costs[:100]) + 8
    assert inc.text == tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
