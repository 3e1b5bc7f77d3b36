"""The continuous-batching engine on a tiny Llama (fp32, random weights, built from a config): greedy output
equals transformers' own `generate`, alone, inside a full batch and when requests join mid-way, through
transformers' forward and through the fused decoder (serve/engines/gpuwise/decoder.py); finished and
cancelled sequences give their KV blocks back; the waiting queue is bounded."""

import threading
import time

import pytest
import torch

from gpuwise.serve.engines.base import Params, QueueFull, Sequence, ShuttingDown
from gpuwise.serve.engines.gpuwise.engine import Engine
from gpuwise.serve.engines.gpuwise.kvcache import CacheFull, PagedCache, PrefixCache


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpuwise.workloads.product_lm import train_tokenizer

    words = [
        "the", "coffee", "tea", "dog", "food", "is",
        "great", "good", "bad", "tasty", "fresh", "my", "cat", "loves", "this", "and", "it",
        "was", "not",
    ]
    rng = torch.Generator().manual_seed(0)
    draws = [torch.randint(0, len(words), (12,), generator=rng) for _ in range(200)]
    texts = [" ".join(words[int(i)] for i in row) for row in draws]
    tok = train_tokenizer(texts, vocab=300)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(config).eval()
    return model, tok, texts


class Client:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if "finish" in event:
            self.done.set()

    @property
    def end(self) -> dict:
        return self.events[-1]


def submit(engine, tok, prompt: str, max_tokens: int = 24, **params) -> tuple[Sequence, Client]:
    client = Client()
    params = Params(max_tokens, temperature=0.0, **params)
    seq = Sequence(tok(prompt)["input_ids"], params, client, time.monotonic() + 60)
    engine.submit(seq)
    return seq, client


def reference(model, tok, prompt: str, max_tokens: int = 24) -> list[int]:
    """transformers' greedy `generate`, up to (not including) the end-of-text token."""
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
    return out[: out.index(tok.eos_token_id)] if tok.eos_token_id in out else out


BLOCK = 4  # the tests' KV blocks: small, so that the tiny model's short prompts span several and share some


def engine(model, tok, **kw) -> Engine:
    defaults = {"max_seqs": 8, "kv_budget_tokens": 8 * 256, "max_queue": 16, "context": 256, "block": BLOCK}
    return Engine(model, tok, **(defaults | kw))


@pytest.mark.parametrize(
    ("fused", "prefix"),
    [(False, 0), (False, 1000), (True, 1000), ("packed", 1000)],
    ids=["transformers-forward", "transformers-forward-prefix-cache", "fused-decoder-prefix-cache",
         "fused-decoder-packed-prefix-cache"],
)
def test_greedy_equals_generate_alone_in_a_full_batch_and_when_joining_midway(tiny, fused, prefix):
    """With a prefix cache every prompt after the first pass is found in it, its whole blocks but the one of its
    last token. Packed:
    the fused decoder's fp32 products packed as `gpuwise serve` packs them (serve/engines/gpuwise/packed.py:
    oneDNN, or MKL where oneDNN is missing); its decode steps' attention by serve/engines/gpuwise/attention.py's
    kernel where it builds."""
    from gpuwise.serve.engines.base import EngineStats
    from gpuwise.serve.engines.gpuwise.decoder import FusedDecoder
    from gpuwise.serve.engines.gpuwise.packed import packing

    if fused == "packed" and packing("cpu", torch.float32) is None:
        pytest.skip("this PyTorch build packs no fp32 product")

    model, tok, texts = tiny
    prompts = [" ".join(t.split()[: 2 + i]) for i, t in enumerate(texts[:8])]  # 2 to 9 words: ragged
    expected = [reference(model, tok, q) for q in prompts]
    reused = []
    stats = EngineStats(on_prefill=lambda tokens, hits: reused.append(hits))
    decoder = FusedDecoder(model, pack=packing("cpu", torch.float32) if fused == "packed" else None) if fused else None
    e = engine(model, tok, decoder=decoder, prefix_tokens=prefix, stats=stats)
    try:
        alone = []
        for q in prompts:
            seq, c = submit(e, tok, q)
            assert c.done.wait(30)
            alone.append(seq.out)
        assert alone == expected
        together = [submit(e, tok, q) for q in prompts]  # all eight share every decode step
        for _, c in together:
            assert c.done.wait(30)
        assert [s.out for s, _ in together] == expected
        if prefix:
            lengths = [len(tok(q)["input_ids"]) for q in prompts]
            # the second pass: every whole block before the last token's
            assert sum(reused[8:]) == sum((n - 1) // BLOCK * BLOCK for n in lengths) > 0
        first = [submit(e, tok, q, max_tokens=24) for q in prompts[:4]]
        while len(first[0][0].out) < 5:  # the next four join while the first are mid-answer
            time.sleep(0.001)
        later = [submit(e, tok, q) for q in prompts[4:]]
        for _, c in first + later:
            assert c.done.wait(30)
        assert [s.out for s, _ in first + later] == expected
        assert all(c.end["finish"] in ("stop", "length") for _, c in first + later)
        streamed = "".join(ev.get("text", "") for ev in later[0][1].events)
        assert streamed == tok.decode(expected[4], skip_special_tokens=True)
    finally:
        e.close()
    assert not e.running and not e.waiting
    # every block back but the prefix cache's, each of those held once
    held = [b for _, blocks in e.prefixes.entries.values() for b in blocks] if e.prefixes else []
    assert e.cache.in_use == len(held) == len(set(held)) and all(e.cache.refs[b] == 1 for b in held)


def test_a_prompt_reuses_what_it_shares_with_an_earlier_one_and_answers_as_alone(tiny):
    from gpuwise.serve.engines.base import EngineStats

    model, tok, texts = tiny
    first = texts[3]
    second = " ".join(first.split()[:6] + texts[4].split()[:5])  # six words in common, then others
    a, b = tok(first)["input_ids"], tok(second)["input_ids"]
    common = next(i for i in range(min(len(a), len(b))) if a[i] != b[i])
    reused = []
    e = engine(model, tok, prefix_tokens=1000, stats=EngineStats(on_prefill=lambda n, hits: reused.append(hits)))
    try:
        for q in (first, second):
            seq, c = submit(e, tok, q)
            assert c.done.wait(30)
            assert seq.out == reference(model, tok, q)
    finally:
        e.close()
    assert reused == [0, common // BLOCK * BLOCK] and common >= 6 and reused[1] >= BLOCK


def test_a_prompt_found_whole_prefills_beside_a_new_one_near_the_end_of_the_context(tiny):
    """A row that runs one token beside a row that runs many is padded by many: the padding stays within the
    model's context however long the prompt is."""
    model, tok, texts = tiny
    long = " ".join(texts[6].split() + texts[7].split())  # 24 words
    short = " ".join(texts[8].split()[:10])
    n = len(tok(long)["input_ids"])
    e = engine(model, tok, prefix_tokens=1000, context=n + 4)
    try:
        seq, c = submit(e, tok, long, max_tokens=4)
        assert c.done.wait(30)
        with e.cv:  # both wait for the engine's next turn: one prefill, the long one found whole but a token
            again = [submit(e, tok, q, max_tokens=4) for q in (long, short)]
        for _, c in again:
            assert c.done.wait(30) and c.end["finish"] in ("stop", "length"), c.end
    finally:
        e.close()
    assert [s.out for s, _ in again] == [reference(model, tok, q, 4) for q in (long, short)]


def test_a_failed_forward_fails_its_requests_and_the_engine_serves_the_next(tiny):
    model, tok, texts = tiny
    fail = [False] * 100 + [True]  # popped from the end: the first forward (a prefill) fails, the rest run

    def decoder(*args):
        if fail.pop():
            raise RuntimeError("out of memory (planted)")
        return e.model(input_ids=args[0], position_ids=args[1], attention_mask=args[2], past_key_values=args[3],
                       use_cache=True, logits_to_keep=1).logits[:, -1].float()

    e = engine(model, tok, decoder=decoder)
    try:
        with e.cv:  # two rows in the failed pass: both fail, and both give their blocks back
            failed = [submit(e, tok, q, max_tokens=4) for q in texts[:2]]
        for _, c in failed:
            assert c.done.wait(30) and c.end["finish"] == "error" and "planted" in c.end["error"]
        assert e.cache.in_use == 0
        seq, c = submit(e, tok, texts[1], max_tokens=4)
        assert c.done.wait(30) and c.end["finish"] in ("stop", "length")
        assert seq.out == reference(model, tok, texts[1], 4)
    finally:
        e.close()


def test_the_prefix_cache_shares_whole_blocks_keeps_adapters_apart_and_its_bound(tiny):
    model, _, _ = tiny
    pool = PagedCache(model.config, blocks=8, dtype=torch.float32, device="cpu", block=2)
    prefixes = PrefixCache(tokens=6, cache=pool)
    seq = pool.allocate([], 7)  # a prompt of 7 tokens: 4 blocks, the last part-filled
    prefixes.put("a", [1, 2, 3, 4, 5, 6, 7], seq)
    assert prefixes.held == 6 and [pool.refs[b] for b in seq] == [2, 2, 2, 1]  # its 3 whole blocks, shared
    assert prefixes.longest("a", [1, 2, 3, 9]) == (2, ("a", (1, 2, 3, 4, 5, 6, 7)))  # 3 in common: one block
    assert prefixes.longest("b", [1, 2, 3, 9]) == (0, None)  # another adapter's keys are other keys
    assert prefixes.longest("a", [1, 2, 3, 4, 5])[0] == 4  # the last token always runs: its logits are the answer
    taken = prefixes.take(("a", (1, 2, 3, 4, 5, 6, 7)), 4)
    assert taken == seq[:2] and pool.refs[seq[0]] == 3  # shared again, nothing copied
    pool.free(seq)  # the first sequence ends: its blocks stay where others hold them
    assert [pool.refs[b] for b in taken] == [2, 2] and pool.in_use == 3
    other = pool.allocate([], 4)
    prefixes.put("a", [8, 9, 10, 11], other)  # 6 + 4 tokens > 6: the least recently used goes
    assert prefixes.longest("a", [1, 2, 3, 9]) == (0, None) and prefixes.held == 4
    pool.free(taken)
    pool.free(other)
    assert pool.in_use == 2  # the prefix cache's two blocks of [8, 9, 10, 11], nothing else


def test_cancelled_and_finished_sequences_free_their_rows(tiny):
    model, tok, texts = tiny
    e = engine(model, tok, max_seqs=2)
    try:
        long, c_long = submit(e, tok, texts[0], max_tokens=200, stop=[])
        short, c_short = submit(e, tok, texts[1], max_tokens=2)
        assert c_short.done.wait(30) and c_short.end["finish"] in ("length", "stop")
        waiting, c_wait = submit(e, tok, texts[2], max_tokens=3)  # takes the row the short one left
        assert c_wait.done.wait(30)
        long.cancel()
        assert c_long.done.wait(5) and c_long.end["finish"] == "cancelled"
        assert c_wait.end["completion_tokens"] == len(waiting.out)
    finally:
        e.close()


def test_the_waiting_queue_is_bounded(tiny):
    model, tok, texts = tiny
    e = engine(model, tok, max_seqs=1, max_queue=2)
    try:
        held = [submit(e, tok, texts[0], max_tokens=200)]
        while not e.running:
            time.sleep(0.001)
        held += [submit(e, tok, texts[i], max_tokens=200) for i in (1, 2)]  # one runs, two wait
        with pytest.raises(QueueFull):
            submit(e, tok, texts[3])
        for seq, _ in held:
            seq.cancel()
    finally:
        e.close()
    with pytest.raises(ShuttingDown):  # a 503, not a 429: coming back later will not help
        submit(e, tok, texts[0])


def test_stop_strings_end_the_answer_before_them(tiny):
    model, tok, texts = tiny
    full = tok.decode(reference(model, tok, texts[3]), skip_special_tokens=True)
    # three whole characters past the start (the random model's output is mostly half ones)
    stop = next(full[i : i + 3] for i in range(3, len(full) - 3) if "\ufffd" not in full[i : i + 3])
    assert len(stop) == 3 and full.index(stop) >= 3
    e = engine(model, tok)
    try:
        seq, c = submit(e, tok, texts[3], stop=[stop])
        assert c.done.wait(30)
    finally:
        e.close()
    streamed = "".join(ev.get("text", "") for ev in c.events)
    assert streamed == full[: full.index(stop)] and c.end["finish"] == "stop"


def test_the_paged_cache_takes_the_lowest_free_block_and_refuses_past_its_pool(tiny):
    model, _, _ = tiny
    pool = PagedCache(model.config, blocks=4, dtype=torch.float32, device="cpu", block=3)
    a = pool.allocate([], 4)  # 4 positions: 2 blocks of 3
    b = pool.allocate([], 3)
    assert (a, b, pool.in_use) == ([0, 1], [2], 3)
    pool.free(a)
    assert a == [] and pool.allocate(b, 7) == [2, 0, 1] and pool.peak == 3  # the lowest first: pages stay few
    with pytest.raises(CacheFull, match="4 blocks of 3 tokens are all held"):
        pool.allocate(b, 16)
    # the rows' positions through their tables: a row's position p is in block table[p // 3] at p % 3
    table = pool.tables([[2, 0], [3]])
    assert table.tolist() == [[2, 0], [3, 3]]  # a short table padded with its own last block
    pos = torch.tensor([[0, 4], [2, 1]])
    assert pool.slots(table, pos).tolist() == [[6, 1], [11, 10]]
    # transformers' Cache contract: written at those slots, read back as [n, kv_heads, length, head_dim]
    pool.bind(table, pos, 5)
    k = torch.randn(2, 2, 2, 16)
    keys, _ = pool.update(k, k, 1)
    flat, _ = pool.flat(1)
    assert torch.equal(flat[6], k[0, :, 0]) and torch.equal(flat[10], k[1, :, 1])
    assert keys.shape == (2, 2, 5, 16) and torch.equal(keys[0, :, 4], k[0, :, 1])
    with pytest.raises(ValueError, match="reads 7 positions, its tables hold 6"):
        pool.bind(table, pos, 7)


def test_a_long_prompt_among_short_ones_holds_its_tokens_not_rows_of_the_longest():
    """One 6,000-token prompt among 31 short chats, all decoding at once: the cache holds blocks for about the
    tokens there are (within 10 %), where a row per sequence as long as the longest held 32 x 6,000; and what
    is resident of the cache's pool is what those blocks take."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpuwise.serve.engines.gpuwise.kvcache import resident_bytes

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    model = LlamaForCausalLM(config).eval()

    class Tok:  # ids in, ids out: the engine needs only these of a tokenizer
        eos_token_id = pad_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (6000,), generator=g).tolist()]
    short = torch.randint(40, 200, (31,), generator=g)
    prompts += [torch.randint(0, 128, (int(n),), generator=g).tolist() for n in short]
    e = Engine(model, Tok(), max_seqs=32, kv_budget_tokens=32 * 6100, max_queue=32, context=8192)
    seen, step = [], e._step

    def watched():  # inside the engine's thread: the blocks held and the tokens each sequence holds, one pass
        if len(e.running) == 32:
            seen.append((e.cache.in_use, sum(s.length for s in e.running)))
        step()

    e._step = watched
    seqs, clients = [], []
    try:
        with e.cv:  # each answers until the long prompt has joined the short ones decoding
            for p in prompts:
                clients.append(Client())
                params = Params(4000, temperature=0.0, ignore_eos=True)
                seqs.append(Sequence(p, params, clients[-1], time.monotonic() + 600))
                e.submit(seqs[-1])
        deadline = time.monotonic() + 300
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        for s in seqs:
            s.cancel()
        for c in clients:
            assert c.done.wait(60) and c.end["finish"] in ("cancelled", "length")
    finally:
        e.close()
    assert seen, "the 32 never decoded together"
    blocks, tokens = seen[-1]
    held = blocks * e.cache.block
    assert tokens <= held <= 1.1 * tokens, (held, tokens)  # a block a sequence at most beyond its tokens
    assert held < 0.1 * 32 * 6000  # a row per sequence as long as the longest: 32 x 6,000
    per_block = 2 * e.cache.keys[0, 0].numel() * e.cache.keys.element_size() * config.num_hidden_layers
    resident = resident_bytes(e.cache.keys) + resident_bytes(e.cache.values)
    pages = 2 * config.num_hidden_layers * 4096  # a part-filled page at the end of each layer's blocks
    assert e.cache.peak * per_block <= resident <= e.cache.peak * per_block + pages, (resident, e.cache.peak)
    assert e.cache.in_use == 0


def test_argmax_by_blocks_is_torch_argmax_ties_and_nans_included():
    from gpuwise.serve.engines.gpuwise.engine import argmax_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1024, generator=g)
    x[1, 300] = x[1, 700] = x[1].max() + 1  # a tie across blocks: the first
    x[2, 130] = x[2, 131] = x[2].max() + 1  # a tie within a block
    x[3, 900] = float("nan")  # a nan wins, as in torch.argmax
    x[4, 5] = x[4, 1000] = float("nan")
    x[5] = 0.0  # all equal: index 0
    assert argmax_rows(x).tolist() == x.argmax(-1).tolist() == [int(x[0].argmax()), 300, 130, 900, 5, 0]
    odd = torch.randn(3, 1000, generator=g)  # not whole blocks: torch's own
    assert argmax_rows(odd).tolist() == odd.argmax(-1).tolist()


def chunked(model, tok, units: int, **kw) -> Engine:
    """An engine whose prefill passes cost at most `units` token-equivalents: long prompts run in many chunks."""
    e = engine(model, tok, **kw)
    e.MAX_CHUNK = e.PROBE_CHUNK = units
    e.MIN_CHUNK = e.MIN_CHUNK_WITH_DECODE = 1
    return e


def widths(e: Engine) -> list[int]:
    """The width of every forward pass the engine runs from now on (a decode step's is 1)."""
    seen, forward = [], e._forward

    def counted(ids, *args):
        seen.append(ids.shape[1])
        return forward(ids, *args)

    e._forward = counted
    return seen


@pytest.mark.parametrize("fused", [False, True], ids=["transformers-forward", "fused-decoder"])
def test_chunked_prefill_answers_as_one_pass_whatever_the_order_rows_and_cancellations(tiny, fused):
    """Prompts of 3 to 60 tokens prefilled 5 token-equivalents a pass, in 3 rows: completions in every row order
    (a short prompt behind a long one, every row in use), a prefill
    cancelled mid-way, and prompts joining while others decode: each answer is transformers' greedy one."""
    from gpuwise.serve.engines.gpuwise.decoder import FusedDecoder

    model, tok, texts = tiny
    words = " ".join(texts[:6]).split()
    prompts = [" ".join(words[:n]) for n in (2, 50, 40, 3, 30, 5, 2)]
    expected = [reference(model, tok, q, 8) for q in prompts]
    e = chunked(model, tok, 5, max_seqs=3, decoder=FusedDecoder(model, pack=None) if fused else None)
    seen = widths(e)
    both = []  # passes that ran a decode step and a chunk together (the fused decoder's run)
    if fused:
        run = e.decoder.run
        e.decoder.run = lambda parts, cache: both.append([p.ids.shape for p in parts]) or run(parts, cache)
    try:
        with e.cv:  # three start together in every row; the short one finishes first
            first = [submit(e, tok, q, max_tokens=8) for q in prompts[:3]]
        cancelled, c_cancelled = submit(e, tok, " ".join(words[:60]), max_tokens=8)
        while cancelled.done == 0:
            time.sleep(0.0005)
        cancelled.cancel()  # mid-prefill: its blocks go back, the others' keys stay where they are
        rest = [submit(e, tok, q, max_tokens=8) for q in prompts[3:]]
        for _, c in first + rest:
            assert c.done.wait(30)
        assert c_cancelled.done.wait(5) and c_cancelled.end["finish"] == "cancelled"
    finally:
        e.close()
    assert [s.out for s, _ in first + rest] == expected
    assert max(seen + [w for parts in both for _, w in parts]) <= 5  # chunks of at most 5 tokens
    assert both if fused else seen.count(1)  # decode steps between the chunks, or with them
    assert not e.running and not e.prefilling and e.cache.in_use == 0


def test_a_long_prefill_lets_a_later_short_prompt_answer_first_and_its_timeout_holds(tiny):
    model, tok, texts = tiny
    long = " ".join(" ".join(texts[:20]).split()[:150])
    assert 150 <= len(tok(long)["input_ids"]) < 250
    e = chunked(model, tok, 8, context=256)
    forward = e._forward

    def slow(*args):  # 10 ms a pass: 150 tokens in chunks of at most 8 take 0.25 s or more
        time.sleep(0.01)
        return forward(*args)

    e._forward = slow
    try:
        seq, c_long = submit(e, tok, long, max_tokens=4)
        while seq.done == 0:
            time.sleep(0.0005)
        short, c_short = submit(e, tok, texts[1], max_tokens=2)
        assert c_short.done.wait(30) and c_long.done.wait(30)
        # the short answer ended while the long prompt still prefilled: 10 of its passes (10 ms each at least,
        # the sleep above) came after, on any host
        assert short.t_last < seq.t_last - 10 * 0.01
        assert seq.out == reference(model, tok, long, 4)

        # A deadline half-way through what the same prompt took just now: it falls mid-prefill, fast host or slow.
        assert seq.t_last is not None
        half = (seq.t_last - seq.t_submit) / 2
        late = Sequence(tok(long)["input_ids"], Params(4, temperature=0.0), c := Client(), time.monotonic() + half)
        e.submit(late)
        assert c.done.wait(30) and c.end["finish"] == "timeout" and 0 < late.done < len(late.prompt)
        again, c_again = submit(e, tok, texts[2], max_tokens=3)  # the engine goes on
        assert c_again.done.wait(30) and again.out == reference(model, tok, texts[2], 3)
    finally:
        e.close()


def test_chunks_follow_the_measured_decode_step_and_the_attention_crossover(tiny):
    from transformers import AutoConfig

    from gpuwise.serve.engines.gpuwise.engine import attention_crossover

    model, tok, _ = tiny
    e = engine(model, tok)
    try:
        assert e._chunk_budget() == e.PROBE_CHUNK  # nothing timed yet
        e.last_pass, e.decode_s = (300, 0.05), 0.04
        assert e._chunk_budget() == 600  # nobody decoding: toward solo_chunk_s (0.5 s), at most twice as much
        e.running.append(object())  # type: ignore[arg-type]
        assert e._chunk_budget() == pytest.approx(300 * 1.5 * 0.04 / 0.05)  # toward 1.5 decode steps
        e.last_pass = (300, 5.0)
        assert e._chunk_budget() == 150  # at most halved a pass
        e.prefilling.append(Sequence(list(range(100)), Params(1), lambda _: None, time.monotonic() + 9))
        assert e._width(0)[0] == e.MIN_CHUNK  # whatever the budget, a row runs MIN_CHUNK tokens at least
        e.running.clear()
        e.prefilling.clear()
    finally:
        e.close()
    # SmolLM2-135M: per layer 576 x (9 + 2 x 3) x 64 + 576 x 576 + 3 x 576 x 1536 weights over 2 x 576
    smol = AutoConfig.for_model("llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                num_attention_heads=9, num_key_value_heads=3)
    assert attention_crossover(smol) == pytest.approx((576 * 15 * 64 + 576 * 576 + 3 * 576 * 1536) / 1152)
