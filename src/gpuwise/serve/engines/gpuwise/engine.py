"""Continuous batching for a causal LM: requests join and leave the running batch at token boundaries.

One engine thread owns the model. Each turn of its loop it
1. drops the sequences whose client left or whose time is up (their slot is free at once),
2. admits waiting requests while slots and the KV budget allow: they start prefilling,
3. runs one decode step for every sequence whose prompt is in the cache (one token each) and the next chunk
   of every prompt still prefilling (left-padded, so each row's last token is the last column), in one
   forward pass where the decoder takes both (decoder.py: its weights read once), else in two (the
   chunk's size below),
4. samples, detokenizes, checks end-of-text, stop strings and max_tokens, and hands each client its
   new text (thread-safe: the client's callback puts it on its event loop's queue).

Chunked prefill (Sarathi-Serve, Agrawal et al. OSDI 2024; vLLM's chunked prefill), so that a long prompt does
not hold every running stream for its whole length. A chunk is sized by time, not by a token count, so the
rule holds on any device: while others decode it adds about `chunk_ratio` times the recent decode steps'
time; with nobody decoding it takes about `solo_chunk_s` (a newcomer's wait, and the granularity of the
request timeout). Its cost is counted in token-equivalents, `tokens x (1 + context / crossover)`, and each
pass's is steered from the last pass's time (at most 2x up or down a pass), not predicted from FLOPs, which
miss a pass's fixed weight reads and a CPU's slow attention (docs/serving.md, "One long prompt stalls no one").

Why not transformers' own continuous batching (`generate_batch`): this engine is not behind it at 32 streams
(docs/benchmarks.md), and it also runs one LoRA adapter per row and admits by the KV budget.

The KV cache is paged (`PagedCache`): each sequence holds blocks of KV_BLOCK tokens as it grows and gives them
back as it ends, and recent prompts' blocks are shared with the prompts that start like them (`PrefixCache`).
The forward is transformers' own, given that cache, per-row positions and a 4-D mask, so any model transformers
loads (Llama, Qwen2, Mistral, Gemma...) runs unchanged;
or, for the Llama family and its LoRA adapters, the same forward fused by hand over the same cache
(decoder.py), which makes a third of the tensor-op calls per step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import inspect
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpuwise.plan.serving import KV_BLOCK, kv_shape
from gpuwise.serve.engines.base import GREEDY_BELOW, EngineStats, QueueFull, Sequence, ShuttingDown
from gpuwise.serve.engines.gpuwise.decoder import Part
from gpuwise.serve.engines.gpuwise.detokenize import IncrementalText
from gpuwise.serve.engines.gpuwise.kvcache import PagedCache, PrefixCache, additive_mask

log = logging.getLogger("gpuwise.serve")


@dataclass
class Rows:
    """A group of rows for one forward pass: whose they are (in row order), ids and positions [n, q], the
    boolean mask [n, 1, q, length], their block tables [n, w], the prompt tokens each row runs (a chunk), and the
    chunk's cost in token-equivalents."""

    seqs: list
    ids: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor
    table: torch.Tensor
    runs: list[int]
    cost: float


class Engine:
    """The model, its tokenizer and the loop that keeps its batch full. `submit` is thread-safe.

    The KV cache's pool holds the budget's blocks, one more a sequence (its last block is part-filled) and the
    prefix cache's: admission by the budget then never finds it full. A sequence's keys never move: it joins
    the decoding rows, or leaves, by its block table alone."""

    # A prefill chunk runs at least MIN_CHUNK tokens a row, so that a long prompt moves however busy the
    # engine. A pass of its own reads every weight, as a decode step does, so a small one costs nearly as much:
    # 32 there. Run with a decode step (a decoder with `run`), a chunk adds mostly its attention: 16 there.
    # At most MAX_CHUNK token-equivalents (a bound on one pass's activations); the first pass PROBE_CHUNK.
    # The figures behind each: docs/serving.md.
    MIN_CHUNK, MIN_CHUNK_WITH_DECODE, MAX_CHUNK, PROBE_CHUNK = 32, 16, 8192, 512

    def __init__(
        self,
        model,
        tok,
        *,
        max_seqs: int,
        kv_budget_tokens: int,
        max_queue: int,
        context: int,
        stats: EngineStats | None = None,
        decoder: Callable[..., torch.Tensor] | None = None,
        prefix_tokens: int = 0,
        chunk_ratio: float = 1.5,
        solo_chunk_s: float = 0.5,
        block: int = KV_BLOCK,
    ):
        self.model, self.tok, self.decoder = model, tok, decoder
        self.device = next(model.parameters()).device
        self.dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        self.max_seqs, self.kv_budget, self.max_queue, self.context = max_seqs, kv_budget_tokens, max_queue, context
        self.stats = stats or EngineStats()
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = eos if isinstance(eos, list) else [eos]
        self.eos = {int(t) for t in [*eos, tok.eos_token_id] if t is not None}
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(self.eos), 0)
        blocks = -(-kv_budget_tokens // block) + max_seqs + -(-max(0, prefix_tokens) // block)
        self.cache = PagedCache(model.config, blocks, self.dtype, self.device, block)
        self.prefixes = PrefixCache(prefix_tokens, self.cache) if prefix_tokens > 0 else None
        # transformers 5 names the cache argument `cache`; earlier releases `past_key_values`
        params = inspect.signature(type(self._base_model()).forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.peft = hasattr(model, "peft_config")
        self.chunk_ratio, self.solo_chunk_s = chunk_ratio, solo_chunk_s
        self.crossover = attention_crossover(model.config)
        self.decode_s: float | None = None  # a decode step's time, smoothed
        self.last_pass: tuple[float, float] | None = None  # the latest prefill pass: (cost, seconds)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefilling: list[Sequence] = []
        self.cv = threading.Condition()
        self.closed = False
        self.generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        self.thread = threading.Thread(target=self._loop, name="gpuwise-engine", daemon=True)
        self.thread.start()

    def _base_model(self):
        m = self.model
        return m.get_base_model() if hasattr(m, "get_base_model") else m

    # --- the client side (any thread) ----------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        with self.cv:
            if self.closed:
                raise ShuttingDown("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already (the bound)")
            if seq.params.seed is not None:  # the request's own sampler, so that a seed gives the same answer
                seq.generator = torch.Generator().manual_seed(seq.params.seed)
            self.waiting.append(seq)
            self.stats.waiting = len(self.waiting)
            self.cv.notify()

    def cancel(self, seq: Sequence) -> None:
        seq.cancel()  # the engine thread frees its slot at its next step

    def health(self) -> str | None:
        return None if self.thread.is_alive() or self.closed else "gpuwise's engine thread has stopped"

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify()
        self.thread.join(timeout=5)

    # --- the engine thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cv:
                if not self.closed and not self.waiting and not self.running and not self.prefilling:
                    release_freed_memory()  # idle: what the last passes' activations took goes back to the OS
                while not self.closed and not self.waiting and not self.running and not self.prefilling:
                    self.cv.wait()
                if self.closed:
                    break
                self._drop_waiting()
                admitted = self._admit()
            try:
                with torch.inference_mode():
                    self._drop_running()
                    self._start(admitted)
                    self._step()
            except Exception as e:  # noqa: BLE001 - a failed pass fails its requests, not the server
                log.exception("generation failed")
                with torch.inference_mode():
                    for s in list(self.running):
                        self._end(s, "error", error=e)
                    for s in list(self.prefilling):
                        self._leave(s, "error", error=e)
            held = self.running + self.prefilling
            self.stats.running, self.stats.kv_tokens = len(held), sum(s.reserved for s in held)
            self.stats.kv_held = self.cache.in_use * self.cache.block
        for s in self.running + self.prefilling + list(self.waiting):
            s.sink({"finish": "error", "error": "the server shut down"})

    def _expired(self, s: Sequence) -> bool:
        return s.cancelled.is_set() or time.monotonic() > s.deadline

    def _drop_waiting(self) -> None:
        for s in [s for s in self.waiting if self._expired(s)]:
            self.waiting.remove(s)
            s.sink({"finish": "cancelled" if s.cancelled.is_set() else "timeout"})

    def _drop_running(self) -> None:
        for s in [s for s in self.running if self._expired(s)]:
            self._end(s, "cancelled" if s.cancelled.is_set() else "timeout")
        for s in [s for s in self.prefilling if self._expired(s)]:
            self._leave(s, "cancelled" if s.cancelled.is_set() else "timeout")

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        held = self.running + self.prefilling
        used = sum(s.reserved for s in held)
        while self.waiting and len(held) + len(admitted) < self.max_seqs:
            s = self.waiting[0]
            if used + s.reserved > self.kv_budget and (held or admitted):
                break  # it waits for room; alone it always runs (the budget was checked at submit)
            self.waiting.popleft()
            used += s.reserved
            admitted.append(s)
        self.stats.waiting = len(self.waiting)
        return admitted

    def _start(self, new: list[Sequence]) -> None:
        """Start each admitted sequence prefilling, its block table beginning with the prefix cache's blocks of the
        prompt's start where it holds them (shared, nothing copied)."""
        for s in new:
            self.prefilling.append(s)
            n, key = self.prefixes.longest(s.adapter, s.prompt) if self.prefixes else (0, None)
            if self.prefixes is not None and key is not None:
                s.blocks = self.prefixes.take(key, n)
            s.done = s.reused = n

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, table: torch.Tensor, adapters: list
    ) -> torch.Tensor:
        """Logits of the last column of each row, [rows, vocab], in fp32."""
        length = mask.shape[-1]
        self.cache.bind(table, pos, length)
        bias = additive_mask(mask, self.dtype).to(self.device)  # may attend: stored position j <= the query's own
        if self.decoder is not None:  # decoder.py: the same forward, fused
            return self.decoder(ids.to(self.device), pos.to(self.device), bias, self.cache, adapters)
        kwargs: dict[str, Any] = {self.cache_arg: self.cache}
        if self.peft:  # one adapter per row (peft's mixed-adapter batch); "__base__": the base alone
            kwargs["adapter_names"] = [a or "__base__" for a in adapters]
        out = self.model(
            input_ids=ids.to(self.device),
            position_ids=pos.to(self.device),
            attention_mask=bias,
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        )
        return out.logits[:, -1].float()

    def _chunk_budget(self) -> float:
        """Token-equivalents the next prefill pass may cost (see the module's docstring)."""
        if self.last_pass is None:
            return self.PROBE_CHUNK
        cost, seconds = self.last_pass
        target = self.chunk_ratio * self.decode_s if self.running and self.decode_s else self.solo_chunk_s
        return min(self.MAX_CHUNK, cost * min(2.0, max(0.5, target / max(seconds, 1e-6))))

    def _width(self, budget: float) -> tuple[int, float]:
        """The most prompt tokens each prefilling row may run this pass (every row is padded to it), and
        what the pass then costs."""
        left = [len(s.prompt) - s.done for s in self.prefilling]
        rows = len(left)

        def cost(w: int) -> float:
            reach = max(s.done + min(n, w) for s, n in zip(self.prefilling, left, strict=True))
            return rows * w * (1 + reach / self.crossover)

        hi = max(left)
        lo = min(self.MIN_CHUNK_WITH_DECODE if self.running and hasattr(self.decoder, "run") else self.MIN_CHUNK, hi)
        if cost(hi) <= budget or lo == hi:
            return hi, cost(hi)
        while lo < hi:  # the widest within the budget; at least MIN_CHUNK tokens each
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid - 1)
        return lo, cost(lo)

    def _step(self) -> None:
        """One decode step for the decoding rows and the next chunk of every prefilling prompt: in one pass
        where the decoder takes several groups of rows (decoder.py's `run`: the weights are read once for
        both), else one pass each."""
        decode = self._decode_rows() if self.running else None
        chunk = self._chunk() if self.prefilling else None
        t0 = time.perf_counter()
        if decode is not None and chunk is not None and hasattr(self.decoder, "run"):
            decoded, prefilled = self._forward_parts([decode, chunk])
            seconds = time.perf_counter() - t0
            # what the chunk added to a decode step: the quantity steered toward chunk_ratio decode steps
            self.last_pass = (chunk.cost, max(seconds - (self.decode_s or 0.0), 1e-6))
            self._advance(decode.seqs, decoded)
            self._prefilled(chunk, prefilled)
            return
        if decode is not None:
            self._advance(decode.seqs, self._forward_parts([decode])[0])
            spent = time.perf_counter() - t0
            self.decode_s = spent if self.decode_s is None else 0.7 * self.decode_s + 0.3 * spent
        if chunk is not None:
            t1 = time.perf_counter()
            logits = self._forward_parts([chunk])[0]
            self.last_pass = (chunk.cost, time.perf_counter() - t1)
            self._prefilled(chunk, logits)

    def _decode_rows(self) -> Rows:
        """The decoding sequences' next token each, a block taken where a sequence's last one is full."""
        rows = self.running
        for s in rows:
            self.cache.allocate(s.blocks, s.length)
        pos = torch.tensor([[s.length - 1] for s in rows])
        width = max(s.length for s in rows)
        mask = torch.arange(width).view(1, 1, 1, width) <= pos.view(-1, 1, 1, 1)
        table = self.cache.tables([s.blocks for s in rows])
        return Rows(list(rows), torch.tensor([[s.out[-1]] for s in rows]), pos, mask, table, [1] * len(rows), 0.0)

    def _chunk(self) -> Rows:
        """The next chunk of every prefilling prompt, each left-padded to the pass's width, the blocks it writes
        taken."""
        width, cost = self._width(self._chunk_budget())
        rows = len(self.prefilling)
        seqs = list(self.prefilling)
        ids = torch.full((rows, width), self.pad, dtype=torch.long)
        pos = torch.empty((rows, width), dtype=torch.long)
        runs = []
        for i, s in enumerate(seqs):
            n = min(width, len(s.prompt) - s.done)
            ids[i, width - n :] = torch.tensor(s.prompt[s.done : s.done + n])
            pos[i, width - n :] = torch.arange(s.done, s.done + n)
            # the padding is stored just past the chunk (every pad at one position, inside the context: a prompt
            # is shorter than it), where the mask hides it and the next chunk or the first decode step overwrites it
            pos[i, : width - n] = s.done + n
            runs.append(n)
            self.cache.allocate(s.blocks, s.done + n + (n < width))
        length = int(pos.max()) + 1
        mask = torch.arange(length).view(1, 1, 1, length) <= pos.unsqueeze(1).unsqueeze(-1)
        return Rows(seqs, ids, pos, mask, self.cache.tables([s.blocks for s in seqs]), runs, cost)

    def _forward_parts(self, parts: list[Rows]) -> list[torch.Tensor]:
        """Logits of the last column of each row of each group, [rows, vocab] in fp32: one pass."""
        if len(parts) == 1:
            part = parts[0]
            return [self._forward(part.ids, part.pos, part.mask, part.table, [s.adapter for s in part.seqs])]
        return self.decoder.run(  # type: ignore[union-attr]
            [
                Part(
                    part.ids.to(self.device),
                    part.pos.to(self.device),
                    additive_mask(part.mask, self.dtype).to(self.device),
                    part.table.to(self.device),
                    part.mask.shape[-1],
                    [s.adapter for s in part.seqs],
                )
                for part in parts
            ],
            self.cache,
        )

    def _prefilled(self, chunk: Rows, logits: torch.Tensor) -> None:
        """After a chunk's pass: prompts now whole in the cache join the decoding rows with their first token."""
        ready, ready_logits = [], []
        for i, (s, n) in enumerate(zip(chunk.seqs, chunk.runs, strict=True)):
            s.done += n
            if s.done == len(s.prompt):
                ready.append(s)
                ready_logits.append(i)
        for s in ready:
            self._join(s)
        if ready:
            self._advance(ready, logits[ready_logits])

    def _join(self, s: Sequence) -> None:
        """A sequence whose prompt is all in the cache starts decoding; the prefix cache shares its prompt's
        full blocks."""
        self.prefilling.remove(s)
        self.running.append(s)
        if self.prefixes is not None:
            self.prefixes.put(s.adapter, s.prompt, s.blocks)
        self.stats.on_prefill(len(s.prompt), s.reused)

    def _leave(self, s: Sequence, finish: str, error: BaseException | None = None) -> None:
        """Take a prefilling sequence out: its blocks go back (those the prefix cache shares stay there)."""
        self.prefilling.remove(s)
        self.cache.free(s.blocks)
        self._finished(s, finish, error)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int | Exception]:
        """A token for each row, or the error that row's sampling raised: it fails that request alone."""
        chosen: list[int | Exception] = list(argmax_rows(logits).tolist())
        for i, s in enumerate(seqs):
            p = s.params
            if p.temperature < GREEDY_BELOW:
                continue
            try:
                probs = torch.softmax(logits[i] / p.temperature, -1)
                if p.top_p < 1:
                    sorted_p, order = probs.sort(descending=True)
                    keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # the smallest set whose mass reaches top_p
                    keep[0] = True  # the likeliest, always: a top_p of 1e-320 is 0 in float32 and kept none
                    probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
                chosen[i] = int(torch.multinomial(probs, 1, generator=s.generator or self.generator))
            except RuntimeError as e:  # e.g. a row of nan logits: multinomial refuses it
                chosen[i] = e
        return chosen

    def _advance(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        now = time.perf_counter()
        for s, token in zip(seqs, self._sample(seqs, logits), strict=True):
            if isinstance(token, Exception):
                log.error("sampling failed for one request: %r", token)
                self._end(s, "error", error=token)
                continue
            if s.t_last is None:
                s.t_first = now
                self.stats.on_first_token(now - s.t_submit)
            else:
                self.stats.on_token(now - s.t_last)
            s.t_last = now
            if token in self.eos and not s.params.ignore_eos:
                self._end(s, "stop")
                continue
            s.out.append(token)
            if s.detok is None:
                s.detok = IncrementalText(self.tok)
            before = len(s.detok.text)
            text = s.detok.add(token)  # what may be sent: no half character at its end
            whole = s.detok.whole() if s.params.stop else text
            finish = None
            # a stop string ends where the text grew: one that ended before would have stopped the sequence
            found = [i for x in s.params.stop if (i := whole.find(x, max(0, before - max(len(x), 1) + 1))) >= 0]
            if found:
                text, finish = whole[: min(found)], "stop"
            elif len(s.out) >= s.params.max_tokens or s.length >= self.context:
                text, finish = (whole if s.params.stop else s.detok.whole()), "length"
            if finish is None:
                # hold back what may yet become a stop string
                hold = max((len(x) - 1 for x in s.params.stop), default=0)
                safe = len(text) - hold
                if safe > len(s.sent):
                    s.sink({"text": text[len(s.sent) : safe]})
                    s.sent = text[:safe]
            else:
                if len(text) > len(s.sent):
                    s.sink({"text": text[len(s.sent) :]})
                    s.sent = text
                self._end(s, finish)

    def _end(self, s: Sequence, finish: str, error: BaseException | None = None) -> None:
        """Take a running sequence out: its blocks go back (those the prefix cache shares stay there)."""
        self.running.remove(s)
        self.cache.free(s.blocks)
        self._finished(s, finish, error)

    def _finished(self, s: Sequence, finish: str, error: BaseException | None = None) -> None:
        s.finish = finish
        self.stats.on_finish(s)
        event: dict[str, Any] = {"finish": finish, "prompt_tokens": len(s.prompt), "completion_tokens": len(s.out)}
        if error is not None:
            event["error"] = repr(error)
        s.sink(event)


@functools.cache
def _malloc_trim():
    libc = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    except OSError:
        return None


def release_freed_memory() -> None:
    """Hand the memory freed in the C heap back to the OS (glibc's malloc_trim; nothing elsewhere). A prefill's
    activations and a load's dropped weights are freed into glibc's heap, which keeps them: a server that had
    taken one long prompt stayed 0.2-0.4 GB above its weights and KV for good (benchmarks/serve_memory.py)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def attention_crossover(config) -> float:
    """The context at which one token's attention costs as much as its pass through the layer's weights:
    per layer, a token's matmuls take 2 x weights FLOPs, its attention 4 x heads x head dim per position
    attended (QK^T and PV). Weights as a Llama-shaped layer holds them (q, k, v, o; a gated MLP)."""
    layers, kv_heads, head_dim = kv_shape(config)
    heads, hidden = config.num_attention_heads, config.hidden_size
    inner = getattr(config, "intermediate_size", None) or 4 * hidden
    weights = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inner
    return max(1.0, weights / (2 * heads * head_dim))


def argmax_rows(logits: torch.Tensor, block: int = 128) -> torch.Tensor:
    """`logits.argmax(-1)` for [rows, vocab], the same index (the first of equal maxima, a nan first of all),
    by blocks, because a CPU's argmax reduction over a long row is an order of magnitude slower than its amax
    (docs/benchmarks.md): each block's max, the first block holding the row's max, the first index of that max
    within it."""
    rows, vocab = logits.shape
    if vocab % block or vocab < 4 * block:
        return logits.argmax(-1)
    blocks = logits.view(rows, vocab // block, block)
    which = blocks.amax(-1).argmax(-1)
    within = blocks[torch.arange(rows, device=logits.device), which].argmax(-1)
    return which * block + within
